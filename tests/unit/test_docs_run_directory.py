"""docs/run-directory.md against the writers (no-kernel tier): every table and column the
recorder's probes, the replay, the cells and the sweeps declare is documented; every JSON
document's declaration (moetrace.run.documents) is documented key by key at every level and
every documented key is declared; every file, table and column of the golden run, cell and sweep
directories (tests/data/reports) is documented and every key of their JSON documents, at every
level, declared. tests/live/test_docs_run_directory.py does the same on a fresh recording."""

from __future__ import annotations

from pathlib import Path

import pytest

from common import docs_run_directory as D
from common.reports import DATA


@pytest.fixture(scope="module")
def doc() -> D.RunDirectoryDoc:
    return D.load()


def declared_tables() -> dict[str, list[str]]:
    """{table: columns} from every public declaration of what the writers write."""
    from moetrace.analyses.capacity_response import CAPACITY_COLUMNS
    from moetrace.capacity.sweep import CELL_COLUMNS
    from moetrace.record.probes import PROBES
    from moetrace.replay.harness import ITERATION_COLUMNS
    from moetrace.run import validate
    from moetrace.run.tables import TABLES

    out: dict[str, list[str]] = {}

    def add(table: str, cols) -> None:
        out.setdefault(table, [])
        out[table] += [c for c in cols if c not in out[table]]

    for spec in PROBES.values():
        for table, cols in spec.tables().items():
            add(table, [c.name for c in cols])
    for table, cols in TABLES.items():  # every run table's columns, declared once
        add(table, [c.name for c in cols])
    for table, cols in getattr(validate, "TABLE_SPEC", {}).items():  # the readers' checks (built from TABLES)
        add(table, list(cols))
    add("iterations", [name for name, _type in ITERATION_COLUMNS])
    add("results", CELL_COLUMNS)
    add("results", list(validate.RESULTS_COLUMNS))
    add("capacity", CAPACITY_COLUMNS)
    add("capacity", list(validate.CAPACITY_COLUMNS))
    return out


def test_the_doc_has_its_three_layouts_and_a_section_per_listed_table(doc):
    for kind in D.KINDS:
        assert doc.layouts[kind], f"docs/run-directory.md: no layout table under `## {D.KINDS[kind]}`"
    for kind, entries in doc.layouts.items():
        for e in entries:
            if e.endswith(".parquet"):
                assert doc.section_for(e) is not None, f"{kind} layout lists {e} but no `### ` section documents it"
    assert {"manifest.json", "cell.json", "replay.json", "snapshots.json"} <= set(doc.sections)


def test_every_declared_table_and_column_is_documented(doc):
    declared = declared_tables()
    assert {"experts", "epochs", "iterations", "results", "capacity", "lru_gen"} <= set(declared)
    missing = [f"{t}.{c}" for t, cols in sorted(declared.items()) for c in cols if c not in doc.columns(t)]
    assert not missing, ("columns the writers declare but docs/run-directory.md does not document "
                         f"(add a row under `### `<table>.parquet``): {missing}")


@pytest.mark.parametrize("name,kind", [("run", "run"), ("pinned", "cell"), ("sweep", "sweep")])
def test_the_golden_directories_are_documented(doc, name, kind):
    """Recorded by an older moetrace: the keys it no longer writes (RETIRED) are accepted there."""
    problems = D.check_directory(doc, DATA / name, kind, retired_ok=True)
    assert not problems, "\n".join(problems)


def test_every_declared_json_key_is_documented_and_every_documented_key_declared(doc):
    from moetrace.run.documents import DOCUMENTS

    missing = [s for s in DOCUMENTS if s not in doc.sections]
    assert not missing, f"JSON documents declared in moetrace.run.documents without a `### ` section: {missing}"
    problems = [p for section, td in DOCUMENTS.items() for p in D.json_section_problems(doc, section, td)]
    assert not problems, "\n".join(problems)


def test_retired_keys_are_neither_declared_nor_documented(doc):
    from moetrace.run.documents import DOCUMENTS, RETIRED

    for section, keys in RETIRED.items():
        decl = D.doc_paths(DOCUMENTS[section])
        for k in keys:
            assert k.replace("[]", "") not in decl, f"{section}: {k} is retired and declared"
            assert k.replace("*", "<probe>").replace("[]", "") not in doc.sections[section], k


def _declared(key: str, decl: dict) -> bool:
    """``key`` (a validate spec path, ``*`` any key) is a declared path, or lies below a free-form map."""
    parts = key.split(".")
    for path in decl:
        d = path.split(".")
        if len(d) <= len(parts) and all(a == b or "*" in (a, b) for a, b in zip(d, parts)):
            if len(d) == len(parts) or D.free_form(path + ".*", decl):
                return True
    return False


def test_the_readers_checks_name_declared_keys():
    """Every key path the readers type-check (moetrace.run.validate) is a declared one."""
    from moetrace.run import documents as Dm
    from moetrace.run import validate as V

    for spec, td in ((V.MANIFEST_SPEC, Dm.Manifest), (V.CELL_SPEC, Dm.Cell), (V.REPLAY_SPEC, Dm.ReplaySummary),
                     (V.SNAPSHOT_SPEC, Dm.Snapshot), (V.SNAPSHOTS_SPEC, Dm.Snapshots)):
        decl = {p.replace("[]", ""): t for p, t in Dm.key_paths(td, follow_see=True).items()}
        retired = {p for ps in Dm.RETIRED.values() for p in ps}
        bad = [k for k in spec if k not in retired and not _declared(k, decl)]
        assert not bad, f"{td.__name__}: the readers check undeclared keys {bad}"


def test_the_cell_inputs_are_the_cellspec():
    from dataclasses import fields

    from moetrace.capacity.cell import CellSpec
    from moetrace.run.documents import CellInputs, JobSpec, SweepCellsSpec

    spec = {f.name for f in fields(CellSpec)}
    assert set(CellInputs.__annotations__) == spec - {"replay_argv"}
    assert set(D.doc_paths(JobSpec)) == spec
    assert set(D.doc_paths(SweepCellsSpec)) == spec - {"capacity_bytes", "name", "python"} | {"plan_key"}


def test_the_json_check_sees_nested_keys(doc):
    """Below the top: a key no declaration has is reported, in a golden directory too; a retired
    one only where the directory may be old."""
    import json
    import shutil

    from moetrace.run.documents import Manifest

    src = DATA / "run"
    problems = D.check_directory(doc, src, "run")
    assert any("`kernel.headers` is not declared" in p for p in problems), problems
    tmp = Path(__import__("tempfile").mkdtemp())
    try:
        d = tmp / "run"
        shutil.copytree(src, d)
        m = json.loads((d / "manifest.json").read_text())
        m["attach_plan"]["block"]["entries"][0]["candidate"]["novel"] = 1
        m["interval"]["surprise_ns"] = 2
        (d / "manifest.json").write_text(json.dumps(m))
        problems = D.check_directory(doc, d, "run", retired_ok=True)
        assert problems == ["manifest.json: `attach_plan.*.entries[].candidate.novel` is not declared for "
                            "`manifest.json` (moetrace.run.documents)",
                            "manifest.json: `interval.surprise_ns` is not declared for `manifest.json` "
                            "(moetrace.run.documents)"], problems
    finally:
        shutil.rmtree(tmp)
    parsed = D.parse(D.DOC.read_text().replace("`armed_done_ns`, ", "")
                     .replace("| `clock` | object |", "| `clock.offset_ns` | int | invented |\n| `clock` | object |"))
    problems = D.json_section_problems(parsed, "manifest.json", Manifest)
    assert problems == ["manifest.json: `interval.armed_done_ns` is declared but not documented",
                        "manifest.json: `clock.offset_ns` is documented but not declared (no writer writes it)"], problems


def test_the_check_sees_what_is_not_documented(doc, tmp_path):
    """The check itself: an undocumented file, table, column and manifest key are each reported."""
    import json

    import pandas as pd

    (tmp_path / "replay").mkdir()
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": "moetrace.run/1", "surprise": 1}))
    pd.DataFrame({"kind": ["expert"], "novel_pages": [1]}).to_parquet(tmp_path / "experts.parquet")
    pd.DataFrame({"x": [1]}).to_parquet(tmp_path / "mystery.parquet")
    (tmp_path / "replay" / "notes.txt").write_text("")
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "report.html").write_text("")  # outside the contract: not reported
    problems = D.check_directory(doc, tmp_path, "run")
    assert problems == ["experts.parquet: `novel_pages` is not in the section `experts.parquet`",
                        "manifest.json: `surprise` is not declared for `manifest.json` (moetrace.run.documents)",
                        "mystery.parquet: not listed in the `## Run directory` layout",
                        "replay/notes.txt: not listed in the `## Run directory` layout"], problems


def _probe_tables() -> dict[str, tuple[str, list]]:
    """{table: (probe, columns)} of every table a probe's declaration names."""
    from moetrace.record.probes import PROBES

    return {t: (name, list(cols)) for name, spec in PROBES.items() for t, cols in spec.tables().items()}


def test_each_probe_table_agrees_with_its_declaration_column_by_column(doc):
    """A ProbeSpec's tables, their declared columns and docs/run-directory.md agree both ways: the
    same columns (none documented that no declaration writes), the same dtype and unit, and the run
    layout names the probe as the table's writer. Tables the recorder merges from two probes
    (experts) are checked by the test above and the golden run."""
    from moetrace.run.tables import TABLES

    problems = []
    for table, (probe, cols) in sorted(_probe_tables().items()):
        if table in TABLES and len(TABLES[table]) != len(cols):
            continue  # experts: pagecache + block columns, merged by the recorder
        section = f"{table}.parquet"
        if section not in doc.sections:
            problems.append(f"{table} ({probe}): no `### `{section}`` section")
            continue
        declared = {c.name: c for c in cols}
        extra = sorted(doc.columns(table) - set(declared))
        if extra:
            problems.append(f"{table}: documented but not declared by {probe}: {extra}")
        for c in cols:
            row = doc.cells[section].get(c.name)
            if row is None:
                problems.append(f"{table}.{c.name}: declared by {probe}, not documented")
                continue
            unit = c.unit or "-"
            if row[:2] != [c.dtype, unit]:
                problems.append(f"{table}.{c.name}: docs say dtype {row[0]!r} unit {row[1]!r}, "
                                f"{probe} declares {c.dtype!r} {unit!r}")
        writer = doc.writers["run"].get(section, "")
        if probe not in writer:
            problems.append(f"{section}: the run layout says it is written by {writer!r}, not {probe}")
    assert not problems, "docs/run-directory.md and the probes' declarations disagree:\n" + "\n".join(problems)


def test_the_agreement_check_sees_a_disagreement(doc):
    """The check above, on a doc with one unit changed and one column added: both reported."""
    text = D.DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `dwell_ns_sum` |"))
    bad = D.parse(text.replace(row, row.replace("| ns |", "| ms |") + "\n| `ghost_pages` | Int64 | pages | - |"))
    cols = bad.cells["lru.parquet"]
    assert cols["dwell_ns_sum"][1] == "ms" and "ghost_pages" in bad.columns("lru")
