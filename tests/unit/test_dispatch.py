"""Cells as jobs (issue 22), no kernel: the job spec's round trip, the merge of cell directories
(two hosts, finished out of order), the dispatcher's one resubmission, --slurm-* parsing and
--stage-pool's copy checked by the manifest checksum."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetrace.capacity.cell import CellSpec
from moetrace.capacity.dispatch import ATTEMPTS, Submitted, dispatch
from moetrace.capacity.jobs import CellJob, job_from_dict, read_job, spec_from_dict
from moetrace.errors import InputError, UsageError


@given(capacity=st.integers(1, 1 << 44), mechanism=st.sampled_from(["cgroup", "balloon", "machine"]),
       mode=st.sampled_from(["pagecache", "mmap", "direct"]), threads=st.integers(1, 64),
       warmup=st.integers(0, 3), passes=st.integers(1, 5), prefetch=st.sampled_from(["none", "fadvise", "pread"]),
       record=st.booleans(), timeout=st.floats(1, 1e5), name=st.text("abc-_0", min_size=1, max_size=12))
@settings(max_examples=60, deadline=None)
def test_spec_round_trip(capacity, mechanism, mode, threads, warmup, passes, prefetch, record, timeout, name):
    spec = CellSpec(plan="/p/plan.bin", pool="/p/pool", capacity_bytes=capacity, mechanism=mechanism, mode=mode,
                    threads=threads, warmup=warmup, passes=passes, prefetch=prefetch, record=record,
                    stream_events=record, timeout_s=timeout, name=name)
    job = CellJob("1GiB-r2", "1GiB", 2, 5, spec, "/s", "/s/miss_curve.npz", "/local/stage")
    back = job_from_dict(json.loads(json.dumps(job.as_dict())), "job.json")
    assert back == job and back.spec == spec and back.job_path == Path("/s/jobs/1GiB-r2.json")


def test_spec_round_trip_through_a_file(tmp_path):
    spec = CellSpec(plan="/p/plan.bin", pool="/p/pool", capacity_bytes=3 << 20, mode="hybrid", arena_fraction=0.25,
                    headroom_bytes=1 << 30, freq_table="oracle", outside_evictions="reject", watch=False)
    job = CellJob("3MiB-r0", "3MiB", 0, 0, spec, str(tmp_path))
    job.job_path.parent.mkdir(parents=True)
    job.job_path.write_text(json.dumps(job.as_dict()))
    assert read_job(job.job_path) == job


@pytest.mark.parametrize("edit,msg", [
    (lambda d: d["spec"].update(capacity=1), "unknown cell spec keys: capacity"),
    (lambda d: d["spec"].pop("pool"), "the cell spec has no 'pool'"),
    (lambda d: d["spec"].update(threads="8"), "spec key 'threads' must be an integer"),
    (lambda d: d["spec"].update(capacity_bytes=True), "spec key 'capacity_bytes' must be an integer"),
    (lambda d: d.update(schema="moetrace.job/9"), "not a moetrace job"),
    (lambda d: d.update(order="3"), "job key 'order' must be a int"),
    (lambda d: d.update(spec=[1]), "'spec' must be an object"),
])
def test_a_damaged_job_file_is_refused_with_its_path(tmp_path, edit, msg):
    job = CellJob("1MiB-r0", "1MiB", 0, 0, CellSpec(plan="/p", pool="/q", capacity_bytes=1 << 20), str(tmp_path))
    doc = job.as_dict()
    edit(doc)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError) as e:
        read_job(path)
    assert msg in e.value.format_message() and str(path) in e.value.format_message()


def test_contradictory_spec_is_a_usage_error():
    d = {"plan": "/p", "pool": "/q", "capacity_bytes": 1 << 20, "stream_events": True, "record": False}
    with pytest.raises(UsageError, match="--stream-events"):
        spec_from_dict(d, "job.json")


# -- the merge -------------------------------------------------------------------------------------

CAPS = [("64MiB", 64 << 20), ("32MiB", 32 << 20)]


def prepared(tmp_path, monkeypatch, out="s"):
    import moetrace.capacity.cell as cellmod
    from moetrace.capacity.sweep import prepare_sweep

    monkeypatch.setattr(cellmod, "ensure_miss_curve", lambda path, *a: Path(path))
    plan = tmp_path / "plan.bin"
    plan.write_bytes(b"plan")
    specs = {label: CellSpec(plan=str(plan), pool=str(tmp_path / "pool"), capacity_bytes=c) for label, c in CAPS}
    return prepare_sweep(tmp_path / out, specs, CAPS, 3, 7)


def finish(job: CellJob, host: str, started: float) -> None:
    """What a job leaves: its cell.json (retained, on ``host``) and ran.json."""
    job.cell_dir.mkdir(parents=True, exist_ok=True)
    (job.cell_dir / "cell.json").write_text(json.dumps({
        "schema": "moetrace.cell/1", "complete": True,
        "retained": True, "reasons": [], "capacity_bytes": job.spec.capacity_bytes, "mechanism": "cgroup",
        "mode": "pagecache", "device_bytes_per_iteration": 1000 + job.order, "host": {"name": host}}))
    (Path(job.out) / "jobs" / f"{job.name}.ran.json").write_text(json.dumps(
        {"name": job.name, "host": host, "started_at": started}))


def test_merge_two_hosts_out_of_order(tmp_path, monkeypatch):
    from moetrace.capacity.sweep import merged_rows
    from moetrace.reports.sweep import write_results

    jobs = prepared(tmp_path, monkeypatch)
    assert [j.order for j in jobs] == list(range(6)) and len({j.name for j in jobs}) == 6
    # hosts a and b took alternate cells; they finished (and started) in another order than submitted
    starts = {j.name: 100.0 - j.order if j.order % 2 else 50.0 + j.order for j in jobs}
    for j in random.Random(3).sample(jobs, len(jobs)):
        finish(j, "a" if j.order % 2 else "b", starts[j.name])
    rows = merged_rows(tmp_path / "s")
    assert [r["order"] for r in rows] == list(range(6))
    assert [r["host"] for r in rows] == ["b", "a", "b", "a", "b", "a"]
    # host a ran its cells in reverse (start 99, 97, 95 for orders 1, 3, 5), host b in order
    assert [r["host_order"] for r in rows] == [0, 2, 1, 1, 2, 0]
    # another sweep directory, the same cells written in another order: the same tables
    jobs2 = prepared(tmp_path, monkeypatch, "s2")
    for j in sorted(jobs2, key=lambda j: -j.order):
        finish(j, "a" if j.order % 2 else "b", starts[j.name])
    t1 = write_results(merged_rows(tmp_path / "s"), tmp_path / "s", plot=False)["table"]
    t2 = write_results(merged_rows(tmp_path / "s2"), tmp_path / "s2", plot=False)["table"]
    assert t1.equals(t2) and list(t1["host"]) == ["a", "a", "b", "b"]
    import pandas as pd

    r1, r2 = pd.read_parquet(tmp_path / "s" / "results.parquet"), pd.read_parquet(tmp_path / "s2" / "results.parquet")
    assert r1.drop(columns="cell_dir").equals(r2.drop(columns="cell_dir"))


def test_a_cell_not_yet_run_is_left_out_and_a_sweep_dir_holds_one_sweep(tmp_path, monkeypatch):
    from moetrace.capacity.sweep import merged_rows, prepare_sweep

    jobs = prepared(tmp_path, monkeypatch)
    finish(jobs[2], "a", 1.0)
    assert [r["order"] for r in merged_rows(tmp_path / "s")] == [2]
    assert [j.finished() for j in prepared(tmp_path, monkeypatch)] == [False, False, True, False, False, False]
    other = {label: CellSpec(plan=str(tmp_path / "plan.bin"), pool=str(tmp_path / "pool"), capacity_bytes=c,
                             passes=2) for label, c in CAPS}
    with pytest.raises(UsageError, match="holds another sweep .differs in: cells"):
        prepare_sweep(tmp_path / "s", other, CAPS, 3, 7)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "results.csv").write_text("")
    with pytest.raises(UsageError, match="not empty and holds no sweep.json"):
        prepare_sweep(tmp_path / "x", other, CAPS, 3, 7)


# -- the dispatcher ---------------------------------------------------------------------------------

class ScriptedExecutor:
    """Jobs whose outcome is scripted per (cell, attempt): True done, False failed."""

    name, serial = "scripted", False

    def __init__(self, outcome):
        self.outcome, self.submitted = outcome, []

    def submit(self, job, attempt):
        self.submitted.append((job.name, attempt))
        return Submitted(job, attempt, f"{job.name}.{attempt}", f"/logs/{job.name}.{attempt}", None, "pending")

    def poll(self, subs):
        for s in subs:
            ok = self.outcome(s.job.name, s.attempt)
            s.state, s.error = ("done", None) if ok else ("failed", "exit status 1: boom")

    def cancel(self, subs):
        pass

    def wait(self, subs, timeout_s):
        pass


def test_a_failed_job_is_resubmitted_once_then_given_up(tmp_path, monkeypatch):
    jobs = prepared(tmp_path, monkeypatch)
    bad, flaky = jobs[1].name, jobs[4].name
    ex = ScriptedExecutor(lambda name, attempt: name != bad and not (name == flaky and attempt == 1))
    events, ended = [], []
    res = dispatch(jobs, ex, on_event=events.append, on_end=lambda sub: ended.append((sub.job.name, sub.state)),
                   poll_s=0)
    # on_end: once per cell, when it is done or given up (not for the attempt that is resubmitted)
    assert sorted(ended) == sorted((j.name, "failed" if j.name == bad else "done") for j in jobs)
    assert ATTEMPTS == 2
    assert sorted(ex.submitted) == sorted([(j.name, 1) for j in jobs] + [(bad, 2), (flaky, 2)])
    assert sorted(res.done) == sorted(j.name for j in jobs if j.name != bad) and list(res.failed) == [bad]
    assert f"cell {flaky}: job {flaky}.1 failed (exit status 1: boom); log /logs/{flaky}.1; resubmitting" in events
    doc = json.loads((jobs[1].cell_dir / "cell.json").read_text())
    assert doc["retained"] is False and doc["reasons"] == [
        f"job failed 2 times, the last: exit status 1: boom (log: /logs/{bad}.2)"]
    lines = [json.loads(x) for x in (tmp_path / "s" / "jobs" / "attempts.jsonl").read_text().splitlines()]
    assert [e["event"] for e in lines if e["name"] == flaky] == ["submitted", "failed", "submitted", "done"]


# -- options ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,mins", [(None, 70), ("90", 90), ("1:30:00", 90), ("2-00:00:00", 2880),
                                       ("0:10:30", 11), ("45:00", 45)])
def test_slurm_time(text, mins):
    from moetrace.cli.common import slurm_time_minutes

    assert slurm_time_minutes(text, 3600.0) == mins


def test_slurm_options_need_the_slurm_executor():
    from moetrace.cli.common import slurm_params

    with pytest.raises(UsageError, match="apply to --executor slurm"):
        slurm_params("p", None, True, (), 60.0, "local")
    with pytest.raises(UsageError, match="is not KEY=VALUE"):
        slurm_params(None, None, True, ("constraint",), 60.0, "slurm")
    p = slurm_params("nvme", "1:00:00", True, ("--constraint=ssd",), 60.0, "slurm")
    assert p == {"partition": "nvme", "time_min": 60, "exclusive": True, "extra": {"constraint": "ssd"}}


def test_stage_pool_copies_checks_and_reuses(tmp_path):
    from moetrace.capacity.jobs import stage_pool
    from moetrace.inputs.geometry import Geometry
    from moetrace.inputs.pool import create_pool, open_pool

    src = tmp_path / "pool"
    create_pool(src, Geometry(2, 4, 2, 64 << 10))
    dest = stage_pool(src, tmp_path / "local")
    assert open_pool(dest).manifest == open_pool(src).manifest
    assert (dest / open_pool(src).files[0]).read_bytes() == (src / open_pool(src).files[0]).read_bytes()
    mtime = (dest / "pool.json").stat().st_mtime_ns
    assert stage_pool(src, tmp_path / "local") == dest and (dest / "pool.json").stat().st_mtime_ns == mtime
    # a damaged copy (a file cut short) is copied again
    victim = dest / open_pool(src).files[-1]
    victim.write_bytes(b"x")
    assert stage_pool(src, tmp_path / "local") == dest and victim.stat().st_size == 64 << 10
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == [dest.name]


def test_a_refused_submission_cancels_what_was_submitted(tmp_path, monkeypatch):
    jobs = prepared(tmp_path, monkeypatch)

    class Refusing(ScriptedExecutor):
        cancelled: list = []

        def submit(self, job, attempt):
            if len(self.submitted) == 2:
                raise UsageError("sbatch refused the job")
            return super().submit(job, attempt)

        def poll(self, subs):  # everything stays queued
            pass

        def cancel(self, subs):
            self.cancelled.extend(s.job.name for s in subs)

    ex = Refusing(lambda *a: True)
    with pytest.raises(UsageError, match="sbatch refused"):
        dispatch(jobs, ex, poll_s=0)
    assert ex.cancelled == [jobs[0].name, jobs[1].name]
    lines = [json.loads(x) for x in (tmp_path / "s" / "jobs" / "attempts.jsonl").read_text().splitlines()]
    assert [e["event"] for e in lines] == ["submitted", "submitted", "cancelled", "cancelled"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallow, as Python reports it
def test_a_signal_swallowed_in_an_at_fork_callback_is_raised_at_the_next_step():
    """CI: a scancel's SIGTERM arrived while the cell forked its replay; Python ran the handler in
    logging's at-fork callback, printed "Exception ignored" and the cell ran on to 'retained'."""
    import os
    import signal

    from moetrace.capacity.cell import check_interrupted, interrupt_handlers
    from moetrace.errors import CellInterrupted

    armed = [True]

    def after_fork_in_parent():
        if armed:
            armed.clear()
            signal.raise_signal(signal.SIGTERM)

    os.register_at_fork(after_in_parent=after_fork_in_parent)
    with interrupt_handlers():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        assert not armed  # the handler ran, its CellInterrupted went nowhere
        with pytest.raises(CellInterrupted, match="SIGTERM"):
            check_interrupted()
    check_interrupted()  # the block is over: nothing pending
