"""docs/run-directory.md against the writers (no-kernel tier): every table and column the
recorder's probes, the replay, the cells and the sweeps declare is documented, and every file,
table, column and top-level JSON key of the golden run, cell and sweep directories
(tests/data/reports) is too. tests/live/test_docs_run_directory.py does the same on a fresh
recording."""

from __future__ import annotations

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
    problems = D.check_directory(doc, DATA / name, kind)
    assert not problems, "\n".join(problems)


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
                        "manifest.json: `surprise` is not in the section `manifest.json`",
                        "mystery.parquet: not listed in the `## Run directory` layout",
                        "replay/notes.txt: not listed in the `## Run directory` layout"], problems
