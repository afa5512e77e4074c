"""Live: a capacity sweep's cells as jobs on a real single-node Slurm cluster (scripts/slurm-local.sh:
Debian's slurmctld + slurmd + munge on this machine) and as local subprocesses (issue 22).

Acceptance 1: a 4-cell sweep through ``--executor slurm`` merges into results of the same
structure as ``--executor local`` (columns, cells, files in each cell directory), every cell
retained, each cell's host this machine, the seeded order kept on the node. Acceptance 2: a
job scancel-ed while its cell runs is resubmitted, once, alone; the report is complete; running
the sweep again runs nothing; a cell made unretained runs alone.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from moetrace.capacity.scope import find_memory_controller
from common.slurm import local_slurm
from conftest import io_lock, moetrace_cli

ROOT = Path(__file__).resolve().parents[2]
GEO = ["--layers", "4", "--experts", "16", "--k", "2"]
CAPS = "8MiB,4MiB"  # x 2 repeats = 4 cells; the pool is 16 MiB


@pytest.fixture(scope="module")
def inputs(live, tmp_path_factory):
    d = tmp_path_factory.mktemp("slurmsweep")
    moetrace_cli("pool", "create", d / "pool", *GEO, "--expert-bytes", "256KiB")
    moetrace_cli("trace", "synth", *GEO, "--steps", "40", "--seed", "3", "-o", d / "t.jsonl")
    moetrace_cli("plan", "compile", d / "t.jsonl", *GEO, "--expert-bytes", "256KiB", "-o", d / "plan.bin")
    with io_lock():
        yield d
    mount = find_memory_controller().mount
    assert not [n for n in os.listdir(mount) if n.startswith("moetrace-sweep")], "a cell scope was left behind"


@pytest.fixture(scope="module")
def cluster(inputs):
    with local_slurm() as env:
        yield env


def test_the_example_brings_its_own_cluster_and_leaves_nothing(inputs, tmp_path):
    """examples/sweep_slurm.sh without SLURM_CONF: up, the sweep as Slurm jobs, the report, down.
    (First in the file: the module's cluster is not up yet.)"""
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    env["MOETRACE_SLURM_DIR"] = f"/run/moetrace-slurm-example.{os.getpid()}"
    r = subprocess.run(["bash", str(ROOT / "examples" / "sweep_slurm.sh"), str(tmp_path / "x")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = pd.read_parquet(tmp_path / "x" / "sweep" / "results.parquet")
    assert len(res) == 4 and res["retained"].all() and (tmp_path / "x" / "report" / "report.html").is_file()
    assert {e["executor"] for e in attempts(tmp_path / "x" / "sweep") if e["event"] == "submitted"} == {"slurm"}
    assert not Path(env["MOETRACE_SLURM_DIR"]).exists() and not (tmp_path / "x" / "pool").exists()


def sweep_args(d: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-c", "from moetrace.cli import main; main()", "sweep", "--plan", str(d / "plan.bin"),
            "--pool", str(d / "pool"), "--capacities", CAPS, "--repeats", "2", "--passes", "3", "--out", str(out),
            "--json", *extra]


def run_sweep(d: Path, out: Path, env: dict[str, str] | None, *extra: str) -> dict:
    r = subprocess.run(sweep_args(d, out, *extra), capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # a Slurm sweep without a terminal says each cell as it ends; a local one stays quiet
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("moetrace sweep: cell ")]
    if "slurm" in extra:
        assert len(said) == len(doc["submitted"]) and all(" done (job " in ln for ln in said), r.stderr
    else:
        assert said == [], r.stderr
    return doc


def attempts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "jobs" / "attempts.jsonl").read_text().splitlines()]


def cell_files(out: Path, name: str) -> set[str]:
    base = out / "cells" / name
    return {str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()}


def test_slurm_sweep_equals_local_in_structure(inputs, cluster, tmp_path):
    local = run_sweep(inputs, tmp_path / "local", None, "--executor", "local")
    slurm = run_sweep(inputs, tmp_path / "slurm", cluster, "--executor", "slurm", "--slurm-time", "10")
    assert local["retained"] == slurm["retained"] == 4 and local["failed"] == slurm["failed"] == {}
    assert local["ran"] == slurm["ran"] == slurm["submitted"]  # the seeded order, each job once
    a = pd.read_parquet(tmp_path / "local" / "results.parquet")
    b = pd.read_parquet(tmp_path / "slurm" / "results.parquet")
    assert list(a.columns) == list(b.columns) and dict(a.dtypes) == dict(b.dtypes)
    assert a[["capacity", "repeat", "order"]].equals(b[["capacity", "repeat", "order"]])
    assert b["retained"].all() and (b["host"] == socket.gethostname()).all()
    # one node, exclusive jobs: the cells started on it in the order they were submitted in
    assert list(b["host_order"]) == list(b["order"]) == [0, 1, 2, 3]
    for name in slurm["ran"]:
        assert cell_files(tmp_path / "local", name) == cell_files(tmp_path / "slurm", name), name
        ran = json.loads((tmp_path / "slurm" / "jobs" / f"{name}.ran.json").read_text())
        assert ran["outcome"] == "retained" and ran["job_id"] != str(os.getpid())
    ev = attempts(tmp_path / "slurm")
    assert [e["event"] for e in ev].count("submitted") == 4 and all(e.get("executor") in (None, "slurm") for e in ev)
    assert json.loads((tmp_path / "slurm" / "sweep.json").read_text())["digest"] == \
        json.loads((tmp_path / "local" / "sweep.json").read_text())["digest"]


EARLY = ("clean", "drop caches", "scope", "warmup", "measured")


def wait_running(out: Path, env: dict[str, str], after: int, timeout_s: float = 120) -> tuple[str, str]:
    """(cell name, job id) of the first job that runs after ``after`` jobs ran before it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            subs = [e for e in attempts(out) if e["event"] == "submitted"]
        except OSError:
            subs = []
        if len(subs) > after:
            name, jid = subs[after]["name"], subs[after]["job_id"]
            st = subprocess.run(["squeue", "-h", "-o", "%T", "-j", jid], capture_output=True, text=True, env=env)
            phase = out / "jobs" / f"{name}.phase"
            # in its cell, not past it: a SIGTERM once run_cell returned ends no cell (the job completes)
            if st.stdout.strip() == "RUNNING" and phase.exists() and phase.read_text().strip() in EARLY:
                return name, jid
        time.sleep(0.05)
    raise AssertionError("no job came to run")


def drive(args: list[str], env: dict[str, str] | None, act) -> tuple[int, str, str, object]:
    """Run a sweep, ``act(proc)`` while it runs; its exit status, stdout, stderr and act's value."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        got = act(proc)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, stdout, stderr, got


def test_scancel_resubmits_only_that_cell(inputs, cluster, tmp_path):
    out = tmp_path / "s"

    def cancel_the_second(proc):
        name, jid = wait_running(out, cluster, after=1)
        subprocess.run(["scancel", jid], check=True, env=cluster)
        return name, jid
    rc, stdout, stderr, (name, jid) = drive(sweep_args(inputs, out, "--executor", "slurm", "--slurm-time", "10"),
                                            cluster, cancel_the_second)
    assert rc == 0, stderr
    res = json.loads(stdout)
    why = f"{name} (job {jid}): {stderr}\n{res}\n{attempts(out)}"
    assert res["retained"] == 4 and res["failed"] == {}, why
    assert sorted(res["submitted"]) == sorted([*res["ran"], name]), why  # the cancelled cell again, nothing else
    assert f"cell {name}: job {jid} failed" in stderr and "resubmitting" in stderr, why
    ev = [e for e in attempts(out) if e["name"] == name]
    assert [e["event"] for e in ev] == ["submitted", "failed", "submitted", "done"], why
    assert ev[0]["job_id"] == jid and ev[2]["job_id"] != jid and ev[1]["error"]
    # the report of the merged sweep is complete: every cell retained in its tables
    rep = moetrace_cli("report", out, "--out", tmp_path / "rep", "--no-cell-reports", "--json")
    doc = json.loads(rep.stdout)
    assert [(r["cells"], r["retained"]) for r in doc["summary"]["table2"]] == [(2, 2), (2, 2)]
    assert "(4 cells retained)" in doc["findings"][0], doc["findings"][0]
    table = pd.read_parquet(out / "results.parquet")
    assert len(table) == 4 and table["retained"].all()
    # the same sweep into its directory again: everything retained, nothing submitted
    again = run_sweep(inputs, out, cluster, "--executor", "slurm", "--slurm-time", "10")
    assert again["ran"] == [] and again["submitted"] == [] and again["retained"] == 4
    # a cell no longer retained (its cell.json says so): the re-submission runs it alone
    cj = out / "cells" / res["ran"][0] / "cell.json"
    doc = json.loads(cj.read_text())
    doc["retained"] = False
    cj.write_text(json.dumps(doc))
    third = run_sweep(inputs, out, cluster, "--executor", "slurm", "--slurm-time", "10")
    assert third["ran"] == third["submitted"] == [res["ran"][0]] and third["retained"] == 4


def wait_phase(out: Path, phases: tuple[str, ...], timeout_s: float = 120) -> str:
    """The name of the first cell whose job reached one of ``phases``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in (out / "jobs").glob("*.phase") if (out / "jobs").exists() else []:
            try:
                if p.read_text().strip() in phases:
                    return p.name.removesuffix(".phase")
            except OSError:
                pass
        time.sleep(0.02)
    raise AssertionError(f"no job reached {phases}")


def scopes_left() -> list[str]:
    return [n for n in os.listdir(find_memory_controller().mount) if n.startswith("moetrace-sweep")]


@pytest.mark.parametrize("executor", ["local", "slurm"])
def test_ctrl_c_cancels_the_running_job_which_cleans_up_then_a_rerun_finishes(inputs, cluster, tmp_path, executor):
    import signal

    out = tmp_path / "s"
    extra = ["--executor", executor] + (["--slurm-time", "10"] if executor == "slurm" else [])
    env = cluster if executor == "slurm" else None

    def interrupt(proc):
        name = wait_phase(out, ("warmup", "measured"))
        os.kill(proc.pid, signal.SIGINT)  # the driver alone: it must stop its job itself
        return name
    rc, _, stderr, name = drive(sweep_args(inputs, out, *extra), env, interrupt)
    assert rc == 130, stderr
    assert "interrupted by SIGINT" in stderr
    ev = attempts(out)
    job = [e for e in ev if e["name"] == name and e["event"] == "submitted"][-1]["job_id"]
    assert [e["event"] for e in ev if e["name"] == name][-1] == "cancelled"
    ran = json.loads((out / "jobs" / f"{name}.ran.json").read_text())
    assert ran["outcome"] == "interrupted by SIGTERM" and ran["ended_at"] is not None  # it cleaned up
    assert scopes_left() == []
    if executor == "local":
        assert not Path(f"/proc/{job}").exists() or "Z" in Path(f"/proc/{job}/stat").read_text().split()[2]
    else:
        st = subprocess.run(["squeue", "-h", "--states=all", "-o", "%T", "-j", job], capture_output=True,
                            text=True, env=cluster).stdout.split()
        assert st == ["CANCELLED"], st
        live = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=cluster).stdout
        assert live.strip() == "", f"jobs still queued or running: {live}"
    assert (out / "results.csv").is_file()
    # run again: the interrupted cell and the ones never run complete the sweep
    res = run_sweep(inputs, out, env, *extra)
    assert name in res["ran"] and res["retained"] == 4
