"""The JSON documents' one reader and one writer each (moetrace.run.metadata, declared in
moetrace.run.documents), no kernel: what they write they read back, and what they refuse they
refuse naming the file and the key."""

from __future__ import annotations

import json

import pytest

from common.reports import DATA
from moetrace.errors import InputError
from moetrace.run import documents as D
from moetrace.run import metadata as M


def test_the_golden_documents_read_back_as_declared():
    cell = M.read_cell(DATA / "pinned")
    assert cell["retained"] in (True, False) and cell["schema"] == D.CELL_SCHEMA
    assert M.read_replay(DATA / "pinned" / "replay" / "replay.json")["schema"] == D.REPLAY_SCHEMA
    assert set(M.read_snapshot(DATA / "pinned" / "snapshots" / "pre.json")) >= {"label", "vmstat", "meminfo"}
    assert "pre" in M.read_snapshots(DATA / "run" / "snapshots.json")


def test_what_is_written_reads_back(tmp_path):
    cell: D.Cell = {"schema": D.CELL_SCHEMA, "complete": False, "capacity_bytes": 1 << 20, "mechanism": "cgroup",
                    "mode": "pagecache", "retained": False, "reasons": ["error: x"]}
    M.write_cell(tmp_path / "c" / "cell.json", cell)
    assert M.read_cell(tmp_path / "c") == cell
    ran: D.Ran = {"name": "16MiB-r0", "host": "h", "job_id": "1", "started_at": 1.0, "ended_at": None,
                  "outcome": "running"}
    M.write_ran(tmp_path / "r.ran.json", ran)
    assert M.read_ran(tmp_path / "r.ran.json") == ran
    lab: D.Lab = {"schema": D.LAB_SCHEMA, "kernel": "6.12", "status": "ok", "exit_status": 0}
    M.write_lab(tmp_path / "lab" / "lab.json", lab)
    assert M.read_lab(tmp_path / "lab") == lab
    row: D.MatrixRow = {"cell": {"name": "cgroup-16MiB-r0", "dir": "cells/a/b"}, "lab": {}, "retained": False,
                        "reasons": ["gave up"], "result": None}
    M.write_matrix_row(tmp_path / "done.json", row)
    assert M.read_matrix_row(tmp_path / "done.json") == row


@pytest.mark.parametrize("doc,needle", [
    ([1, 2], "holds a JSON list, not an object"),
    ({"schema": "moetrace.cell/2", "complete": True}, "moetrace.cell schema version 2 is newer"),
    ({"schema": "moetrace.run/1"}, "not a moetrace.cell document"),
    ({"schema": "moetrace.cell/1", "complete": True, "capacity_bytes": 1, "mechanism": "cgroup", "mode": "mmap",
      "retained": True}, "lacks the key 'reasons'"),
    ({"schema": "moetrace.cell/1", "complete": True, "capacity_bytes": 1, "mechanism": "cgroup", "mode": "mmap",
      "retained": True, "reasons": [], "amplification": "high"}, "key 'amplification' must be a finite number"),
])
def test_a_bad_cell_json_is_refused_naming_the_file_and_the_key(tmp_path, doc, needle):
    p = tmp_path / "cell.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=needle) as ei:
        M.read_cell(p)
    assert ei.value.path == str(p)


def test_required_keys_are_checked_below_the_top(tmp_path):
    p = tmp_path / "done.json"
    p.write_text(json.dumps({"cell": {}, "lab": {}, "retained": True, "reasons": [], "result": None}))
    assert M.read_matrix_row(p)["cell"] == {}
    p.write_text(json.dumps({"schema": D.SWEEP_SCHEMA, "digest": "x", "spec": {}, "cells": [{"name": "a"}]}))
    assert M.read_sweep_meta(p)["cells"][0]["name"] == "a"
    p.write_text(json.dumps({"schema": D.SWEEP_SCHEMA, "digest": "x", "cells": []}))
    with pytest.raises(InputError, match="lacks the key 'spec'"):
        M.read_sweep_meta(p)


def test_every_document_has_a_reader_and_its_schema_constant():
    assert {"cell.json", "replay.json", "snapshots.json", "sweep.json", "lab.json", "matrix.json",
            "done.json"} <= set(M.READERS)
    for name, schema in (("cell", D.CELL_SCHEMA), ("replay", D.REPLAY_SCHEMA), ("sweep", D.SWEEP_SCHEMA),
                         ("job", D.JOB_SCHEMA), ("lab", D.LAB_SCHEMA), ("matrix", D.MATRIX_SCHEMA)):
        assert schema == f"moetrace.{name}/1"
    from moetrace.capacity.jobs import JOB_SCHEMA
    from moetrace.replay.harness import REPLAY_SCHEMA

    assert JOB_SCHEMA is D.JOB_SCHEMA and REPLAY_SCHEMA is D.REPLAY_SCHEMA


def test_the_writers_build_what_is_declared(tmp_path, monkeypatch):
    """The dicts the writers build from their dataclasses hold declared keys only, every one."""
    from moetrace.capacity.sweep import sweep_doc
    from moetrace.lab import matrix as Mx
    from moetrace.run.documents import key_paths, undeclared

    (tmp_path / "spec.toml").write_text('kernels = ["6.1"]\nmechanisms = ["cgroup", "balloon:0.81"]\n'
                                        'capacities = ["192MiB"]\nplan = "plan.bin"\npool = "/var/tmp/pool"\n'
                                        'kernel_modules = {"6.1" = "/var/tmp/mods"}\n')
    spec = Mx.load_spec(tmp_path / "spec.toml")
    cell = spec.cells()[0]
    assert set(cell.as_dict()) == set(D.MatrixCellDoc.__annotations__) - {"settings", "dims"}  # no dimensions
    assert not undeclared(spec.canonical(), D.MatrixSpecDoc)
    with open(tmp_path / "spec.toml", "a") as fh:  # every dimension (issue 34)
        fh.write('cpus = [1, 2]\nreaders = 4\nbite_fraction = 0.26\nwindow = ["8min", 3]\npool_layout = "layer"\n'
                 'read_ahead_kb = 1024\nmin_ttl_ms = 0\nswap = "64MiB"\nthp = "off"\ntcg_thread = "multi"\n'
                 'stream_events = true\n')
    dspec = Mx.load_spec(tmp_path / "spec.toml")
    assert set(dspec.cells()[0].as_dict()) == set(D.MatrixCellDoc.__annotations__)
    assert set(dspec.canonical()) == set(D.MatrixSpecDoc.__annotations__) - {"readers", "min_free_kbytes"}
    assert not undeclared(dspec.canonical(), D.MatrixSpecDoc)
    assert not undeclared(Mx.MatrixJob(cell, str(tmp_path)).as_dict(), D.Job)
    from moetrace.capacity.cell import CellSpec
    from moetrace.capacity.jobs import CellJob

    cs = CellSpec(plan="p", pool="q", capacity_bytes=1 << 20)
    job = CellJob("1MiB-r0", "1MiB", 0, 0, cs, str(tmp_path), None, None)
    assert not undeclared(job.as_dict(), D.Job)
    assert set(job.as_dict()["spec"]) == {p for p in key_paths(D.JobSpec)}
    monkeypatch.setattr("moetrace.capacity.cell.plan_key", lambda *a: "key")  # no plan file here
    assert not undeclared(sweep_doc({"1MiB": cs}, [("1MiB", 1 << 20)], 1, 1), D.SweepSpec)
