"""What the tests of docs/run-directory.md share: the doc's parser and the check of a real run,
cell or sweep directory against it.

The doc's shape (stated at its top): a `## ` heading per directory kind whose table lists the
directory's entries (first cell: the backticked path, `<...>` one path component, a trailing
`/` a subdirectory); a `### ` heading per specified file (the backticked file name) whose table
lists its columns (Parquet) or keys (JSON, dotted), the backticked name in the first cell.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "run-directory.md"
#: directory kind -> its `## ` heading in the doc
KINDS = {"run": "Run directory", "cell": "Cell directory", "sweep": "Sweep directory"}
#: subdirectories that are directories of another kind: (kind, entry) -> the kind inside
NESTED = {("cell", "run/"): "run", ("cell", "watch/"): "run", ("sweep", "cells/<C>-r<i>/"): "cell"}
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|")


@dataclass
class RunDirectoryDoc:
    #: directory kind -> the entry paths its layout table lists
    layouts: dict[str, list[str]] = field(default_factory=dict)
    #: specified file (its `### ` heading, e.g. "experts.parquet", "snapshots/<label>.json") ->
    #: the column or key names its table lists
    sections: dict[str, set[str]] = field(default_factory=dict)
    #: section -> {column or key: the row's other cells (dtype, unit, meaning for a table)}
    cells: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    #: directory kind -> {entry path: its "written by" cell}
    writers: dict[str, dict[str, str]] = field(default_factory=dict)

    def columns(self, table: str) -> set[str]:
        """The documented columns of a table (by name: ``experts``, ``iterations``)."""
        return self.sections.get(f"{table}.parquet", set())

    def section_for(self, rel: str) -> str | None:
        """The `### ` section that specifies the file at ``rel`` (matched on its path relative to
        its directory, or on its base name)."""
        base = rel.rsplit("/", 1)[-1]
        for name in self.sections:
            pat = _pattern(name)
            if pat.fullmatch(rel) or pat.fullmatch(base):
                return name
        return None


def _pattern(entry: str) -> re.Pattern:
    """An entry path as a regular expression: `<...>` is one path component."""
    parts = re.split(r"(<[^>]+>)", entry.rstrip("/"))
    return re.compile("".join("[^/]+" if p.startswith("<") else re.escape(p) for p in parts))


def parse(text: str) -> RunDirectoryDoc:
    doc = RunDirectoryDoc({k: [] for k in KINDS}, writers={k: {} for k in KINDS})
    by_heading = {v: k for k, v in KINDS.items()}
    kind = section = None
    for line in text.splitlines():
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            m = re.search(r"`([^`]+)`", line)
            if level == 2:
                kind, section = by_heading.get(line[3:].strip()), None
            else:
                section = m.group(1) if level == 3 and m else None
                if section is not None:
                    doc.sections.setdefault(section, set())
            continue
        m = _ROW.match(line)
        if m is None:
            continue
        rest = [c.strip() for c in line.strip().strip("|").split("|")][1:]
        if section is not None:
            doc.sections[section].add(m.group(1))
            doc.cells.setdefault(section, {})[m.group(1)] = rest
        elif kind is not None:
            doc.layouts[kind].append(m.group(1))
            doc.writers[kind][m.group(1)] = rest[0] if rest else ""
    return doc


def load() -> RunDirectoryDoc:
    return parse(DOC.read_text())


def _entry_of(doc: RunDirectoryDoc, kind: str, rel: str) -> str | None:
    """The layout entry of ``kind`` that covers ``rel``: an exact entry, or a subdirectory entry
    below which the layout lists nothing (its files are outside the contract, e.g. report/)."""
    entries = doc.layouts[kind]
    for e in entries:
        if not e.endswith("/") and _pattern(e).fullmatch(rel):
            return e
    for e in entries:
        if e.endswith("/") and not any(o != e and o.startswith(e) for o in entries):
            if re.match(_pattern(e).pattern + "/", rel):
                return e
    return None


def _file_problems(doc: RunDirectoryDoc, rel: str, path: Path) -> list[str]:
    """A specified file's columns (Parquet, CSV) or top-level keys (JSON) missing from its section."""
    import pyarrow.parquet as pq

    if path.suffix == ".csv":  # a CSV twin of a Parquet table: the same columns
        section = doc.section_for(rel[:-4] + ".parquet")
        names = path.read_text().splitlines()[0].split(",")
    elif path.suffix == ".parquet":
        section = doc.section_for(rel)
        names = pq.read_schema(path).names
    elif path.suffix == ".json":
        section = doc.section_for(rel)
        if section is None:
            return []  # a JSON file the contract does not specify key by key
        names = list(json.loads(path.read_text()))
    else:
        return []
    if section is None:
        return [f"{rel}: no `### ` section documents this table"]
    known = {n.split(".", 1)[0] for n in doc.sections[section]}
    return [f"{rel}: `{n}` is not in the section `{section}`" for n in names if n not in known]


def check_directory(doc: RunDirectoryDoc, top: Path, kind: str, where: str = "") -> list[str]:
    """Every file under ``top`` (a ``kind`` directory), its tables' columns and its JSON documents'
    top-level keys, against the doc: the problems found (empty: all documented)."""
    problems: list[str] = []
    nested = {entry: inner for (k, entry), inner in NESTED.items() if k == kind}
    for path in sorted(p for p in top.rglob("*") if p.is_file()):
        rel = path.relative_to(top).as_posix()
        if any(re.match(_pattern(e).pattern + "/", rel) for e in nested):
            continue  # checked below as a directory of its own kind
        entry = _entry_of(doc, kind, rel)
        if entry is None:
            problems.append(f"{where}{rel}: not listed in the `## {KINDS[kind]}` layout")
            continue
        if entry.endswith("/"):
            continue  # outside the contract (report/)
        problems += [where + p for p in _file_problems(doc, rel, path)]
    for entry, inner in nested.items():
        pat = _pattern(entry)
        for d in sorted(p for p in top.rglob("*") if p.is_dir()):
            rel = d.relative_to(top).as_posix()
            if pat.fullmatch(rel):
                problems += check_directory(doc, d, inner, f"{where}{rel}/")
    return problems
