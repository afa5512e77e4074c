"""The probe registry (no kernel): every probe is one module of moetrace.record.probes whose
ProbeSpec is the only declaration; the default set, the recorded / derived-knob / experts
probes, the recorder classes, `record --help` and the readers' table checks all follow it."""

from __future__ import annotations

import pkgutil
from pathlib import Path

import pandas as pd
import pytest

import moetrace.record.probes as registry
from moetrace.errors import InputError
from moetrace.record.probe import ProbeRecorder, schema_doc

ROOT = Path(__file__).resolve().parents[2]


def test_every_module_of_the_package_is_a_probe_found_without_a_list():
    mods = {m.name for m in pkgutil.iter_modules(registry.__path__) if not m.name.startswith("_")}
    assert set(registry.PROBES) == mods
    assert list(registry.PROBES) == [s.name for s in sorted(registry.PROBES.values(), key=lambda s: (s.order, s.name))]
    for name, spec in registry.PROBES.items():
        assert spec.source_path == ROOT / "probes" / f"{name}.bpf.c"
        assert spec.source_path.exists(), name
        cls = registry.recorder_class(name)
        assert issubclass(cls, ProbeRecorder) and cls.name == name and cls.spec is spec


def test_the_name_tuples_are_derived_from_the_specs():
    from moetrace.record import recorder

    P = registry.PROBES
    assert registry.DEFAULT_PROBES == tuple(n for n, s in P.items() if s.default)
    assert recorder.DEFAULT_RECORD == registry.DEFAULT_PROBES
    assert registry.DERIVED_KNOBS == tuple(n for n, s in P.items() if not s.user_knobs)
    assert registry.EXPERTS_PROBES == ("pagecache", "block")
    assert {n for n, s in P.items() if s.required} >= {"pagecache", "reclaim", "block", "reads"}
    with pytest.raises(Exception, match="no recorder"):
        registry.recorder_class("nope")


def test_record_help_agrees_with_the_specs():
    """`record --help` is static text (the CLI imports no probe module to print it): it names the
    default set in order, the required probes of the default set, and the probes --knob applies to."""
    from moetrace.cli.record import record

    helps = {p.name: " ".join(p.help.split()) for p in record.params if getattr(p, "help", None)}
    P = registry.PROBES
    assert f"default: {', '.join(registry.DEFAULT_PROBES)};" in helps["probes"]
    required = [n for n in registry.DEFAULT_PROBES if P[n].required]
    assert f"an error for {', '.join(required)} under" in helps["probes"]
    knobs = [n for n in registry.DEFAULT_PROBES if P[n].user_knobs and P[n].knobs]
    assert f"of {', '.join(knobs[:-1])} or {knobs[-1]}," in helps["knob_items"]


def test_the_spec_docstring_and_architecture_count_no_registry_list():
    arch = (ROOT / "docs" / "architecture.md").read_text()
    assert "(the registry)" not in arch and "3 files, plus its tests" in arch
    assert not hasattr(__import__("moetrace.record.probe", fromlist=["x"]), "RECORDERS")
    assert not hasattr(__import__("moetrace.record.spec", fromlist=["x"]), "COMMON_KNOBS")


def _manifest(checks: dict[str, str]) -> dict:
    return {"tables": {"novel": {c: {"dtype": "int64", "unit": "", "doc": "", "check": k} for c, k in checks.items()}}}


def test_a_probe_table_is_checked_by_the_checks_its_manifest_carries():
    """run/ never imports record/: a table declared in a probe's module is checked by what the recorder
    wrote from its declaration into the manifest's `tables` section (schema_doc)."""
    from moetrace.run.validate import check_table

    spec = registry.PROBES["lru"]
    doc = schema_doc(spec, "lru_dwell_histogram")
    assert doc["lo_ns"]["check"] == "n" and "check" not in doc["slot"]
    good = pd.DataFrame({"kind": ["x"], "t_ns": [1]})
    check_table("novel", good, "novel.parquet", _manifest({"kind": "s", "t_ns": "n"}))
    with pytest.raises(InputError, match="lacks column 'nr'"):
        check_table("novel", good, "novel.parquet", _manifest({"kind": "s", "nr": "n"}))
    with pytest.raises(InputError, match="column 'kind' has type"):
        check_table("novel", good.assign(kind=[1.5]), "novel.parquet", _manifest({"kind": "s"}))
    with pytest.raises(InputError, match="not a column check"):
        check_table("novel", good, "novel.parquet", _manifest({"kind": "z"}))
    check_table("novel", good.assign(kind=[1.5]), "novel.parquet", None)  # an older manifest: unchecked
    rows = pd.DataFrame({"kind": ["expert"] * 2, "layer": [0, 0], "expert": [1, 1], "expert_id": [1, 1]})
    with pytest.raises(InputError, match="repeats the key"):  # a per-expert table: one row per expert
        check_table("novel", rows, "novel.parquet", _manifest({c: "s" if c == "kind" else "i" for c in rows}))


def _readme_probe_rows() -> dict[str, list[str]]:
    """{probe: the tables its row names} of README.md's probe table (| probe | tables | ...)."""
    import re

    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| probe | tables |"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        probe, tables = (c.strip() for c in line.strip("|").split("|")[:2])
        rows[probe] = [t.strip() for t in re.sub(r"\([^)]*\)", "", tables).split(",") if t.strip()]
    return rows


def test_the_readme_probe_table_agrees_with_the_registry_and_the_run_layout():
    """README.md's probe table: a row per default probe (others may have one), each a declared probe,
    each table it names in docs/run-directory.md's run layout as written by that probe."""
    from common import docs_run_directory as D

    rows = _readme_probe_rows()
    writers = D.load().writers["run"]
    assert set(registry.DEFAULT_PROBES) <= set(rows) <= set(registry.PROBES), sorted(rows)
    for probe, tables in rows.items():
        for t in tables:
            entry = t if "." in t else f"{t}.parquet"
            assert probe in writers.get(entry, ""), (probe, t, writers.get(entry))
