"""What the tests of docs/run-directory.md share: the doc's parser and the check of a real run,
cell or sweep directory against it.

The doc's shape (stated at its top): a `## ` heading per directory kind whose table lists the
directory's entries (first cell: the backticked path, `<...>` one path component, a trailing
`/` a subdirectory); a `### ` heading per specified file (the backticked file name) whose table
lists its columns (Parquet) or keys (JSON, dotted), the backticked name in the first cell.

JSON documents are checked key by key at every level against their declarations
(moetrace.run.documents): an object's keys are rows of their own (`plan.n_layers`; `<probe>` for a
key of a free-form map, arrays of objects transparent: `attach_plan.<probe>.entries.status`) or
named in backticks in the meaning of the object's row. Below a free-form map of values (per-probe
counters, /proc files) anything goes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "run-directory.md"
#: directory kind -> its `## ` heading in the doc
KINDS = {"run": "Run directory", "cell": "Cell directory", "sweep": "Sweep directory", "lab": "Lab directory",
         "matrix": "Matrix directory", "sampler": "Sampler directory"}
#: subdirectories that are directories of another kind: (kind, entry) -> the kind inside
NESTED = {("cell", "run/"): "run", ("cell", "watch/"): "run", ("sweep", "cells/<C>-r<i>/"): "cell",
          ("lab", "cell/"): "cell", ("matrix", "cells/<condition>/<cell>/"): "lab",
          ("lab", "sampler/"): "sampler"}
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|")
#: a backticked name in a meaning cell that is a key (lowercase identifier); other code spans are values
_KEY = re.compile(r"`([a-z_][a-z0-9_]*)`")


@dataclass
class RunDirectoryDoc:
    #: directory kind -> the entry paths its layout table lists
    layouts: dict[str, list[str]] = field(default_factory=dict)
    #: specified file (its `### ` heading, e.g. "experts.parquet", "snapshots/<label>.json") ->
    #: the column or key names its table lists
    sections: dict[str, set[str]] = field(default_factory=dict)
    #: specified file -> its rows: name (``<...>`` as ``*``) -> the meaning (the row's last cell)
    rows: dict[str, dict[str, str]] = field(default_factory=dict)
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
        hits = [name for name in self.sections if _pattern(name).fullmatch(rel) or _pattern(name).fullmatch(base)]
        return max(hits, key=len) if hits else None  # jobs/<C>-r<i>.ran.json before jobs/<C>-r<i>.json


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
                    doc.rows.setdefault(section, {})
            continue
        m = _ROW.match(line)
        if m is None:
            continue
        rest = [c.strip() for c in line.strip().strip("|").split("|")][1:]
        if section is not None:
            doc.sections[section].add(m.group(1))
            doc.rows[section][re.sub(r"<[^>]+>", "*", m.group(1))] = line.strip().strip("|").split("|")[-1]
            doc.cells.setdefault(section, {})[m.group(1)] = rest
        elif kind is not None:
            doc.layouts[kind].append(m.group(1))
            doc.writers[kind][m.group(1)] = rest[0] if rest else ""
    return doc


def load() -> RunDirectoryDoc:
    return parse(DOC.read_text())


# -- JSON documents, key by key --------------------------------------------------------------------

def doc_paths(td: type) -> dict[str, object]:
    """A declaration's key paths as the doc writes them (arrays of objects transparent)."""
    from moetrace.run.documents import key_paths

    return {p.replace("[]", ""): t for p, t in key_paths(td).items()}


def _is_object(t) -> bool:
    """A declared value that has declared keys below it (a TypedDict, or a map or array of them)."""
    import typing

    from moetrace.run import documents as D

    t, see = D.unwrap(t)
    if see is not None:
        return False
    if D.is_declaration(t):
        return True
    args = typing.get_args(t)
    return typing.get_origin(t) in (dict, list) and bool(args) and _is_object(args[-1])


def _owner(path: str) -> tuple[str, str]:
    """(the row that names the key at ``path`` in its meaning, the key): ``a.*.b`` -> (``a``, ``b``)."""
    parent, _, key = path.rpartition(".")
    while parent.endswith(".*"):
        parent = parent[:-2]
    return parent, key


def free_form(path: str, decl: dict[str, object]) -> bool:
    """``path`` lies below a free-form map of values (its keys are names, not declared)."""
    parts = path.split(".")
    prefixes = [".".join(parts[:i + 1]) for i in range(len(parts)) if parts[i] == "*"]
    return any(p in decl and not _is_object(decl[p]) for p in prefixes)


def json_section_problems(doc: RunDirectoryDoc, section: str, td: type) -> list[str]:
    """Every key of the declaration ``td`` at every level is documented in ``section`` (a row, or
    named in its object's row), and every documented key (rows, and keys named in a row's
    meaning) is declared."""
    rows = doc.rows.get(section, {})
    decl = doc_paths(td)
    problems = []
    for path in decl:
        if path.endswith(".*") or path in rows:
            continue
        owner, key = _owner(path)
        if owner in rows and key in _KEY.findall(rows[owner]):
            continue
        if owner == "" or not free_form(path, decl):
            problems.append(f"{section}: `{path.replace('*', '<key>')}` is declared but not documented")
    for name, meaning in rows.items():
        if name not in decl and not free_form(name, decl):
            problems.append(f"{section}: `{name}` is documented but not declared (no writer writes it)")
            continue
        if free_form(name + ".*", decl) or not _is_object(decl.get(name)):
            continue  # a free-form map or a value: its backticked names are examples, not keys
        children = {_owner(p)[1] for p in decl if _owner(p)[0] == name}
        for key in _KEY.findall(meaning):
            if key not in children:
                problems.append(f"{section}: `{name}` names `{key}`, which is not one of its declared keys")
    return problems


def _json_problems(rel: str, section: str, docs: list, retired_ok: bool) -> list[str]:
    from moetrace.run.documents import DOCUMENTS, RETIRED, undeclared

    td = DOCUMENTS.get(section)
    if td is None:
        return []
    retired = RETIRED.get(section, frozenset()) if retired_ok else frozenset()
    bad = sorted({p for d in docs for p in undeclared(d, td) if p not in retired})
    return [f"{rel}: `{p}` is not declared for `{section}` (moetrace.run.documents)" for p in bad]


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


def _file_problems(doc: RunDirectoryDoc, rel: str, path: Path, retired_ok: bool) -> list[str]:
    """A specified file's columns (Parquet, CSV) missing from its section, or (JSON) its keys at
    every level that its declaration lacks (keys older versions wrote allowed with ``retired_ok``)."""
    import pyarrow.parquet as pq

    if path.suffix == ".csv":  # a CSV of its own (the sampler's), or the twin of a Parquet table
        section = doc.section_for(rel) or doc.section_for(rel[:-4] + ".parquet")
        names = path.read_text().splitlines()[0].split(",")
    elif path.suffix == ".parquet":
        section = doc.section_for(rel)
        names = pq.read_schema(path).names
    elif path.suffix in (".json", ".jsonl"):
        section = doc.section_for(rel)
        if section is None:
            return []  # a JSON file the contract does not specify key by key
        text = path.read_text()
        docs = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" \
            else [json.loads(text)]
        return _json_problems(rel, section, docs, retired_ok)
    else:
        return []
    if section is None:
        return [f"{rel}: no `### ` section documents this table"]
    known = [_pattern(n.split(".", 1)[0]) for n in doc.sections[section]]  # `allocstall_<zone>`: one name each
    return [f"{rel}: `{n}` is not in the section `{section}`" for n in names if not any(k.fullmatch(n) for k in known)]


def check_directory(doc: RunDirectoryDoc, top: Path, kind: str, where: str = "", retired_ok: bool = False) -> list[str]:
    """Every file under ``top`` (a ``kind`` directory), its tables' columns against the doc and its
    JSON documents' keys at every level against their declarations (which the doc documents key
    by key: :func:`json_section_problems`): the problems found (empty: all documented).
    ``retired_ok``: a directory an older moetrace wrote (the golden ones) may hold keys it no
    longer writes (moetrace.run.documents.RETIRED)."""
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
        problems += [where + p for p in _file_problems(doc, rel, path, retired_ok)]
    for entry, inner in nested.items():
        pat = _pattern(entry)
        for d in sorted(p for p in top.rglob("*") if p.is_dir()):
            rel = d.relative_to(top).as_posix()
            if pat.fullmatch(rel):
                problems += check_directory(doc, d, inner, f"{where}{rel}/", retired_ok)
    return problems
