"""Per-iteration counters: the replay announces each iteration over MOETRACE_PHASE_FD and the
pagecache probe counts into that iteration's epoch (moetrace.epochs).

No-kernel tier: the phase server's negotiation and epoch bookkeeping over a real socket
pair. Live tier: a cold warm-up pass then two measured passes of a 23 x 1 MiB pool: every
added page lands in the first warm-up iteration, none in the measured ones, and the epochs
sum to the totals exactly.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys

import pytest

from moetrace import rundir
from moetrace.epochs import PhaseClient, PhaseServer, channel, epochs_for

N, MIB = 23, 1 << 20
PAGES = MIB // mmap.PAGESIZE
RECORD = [sys.executable, "-c", "from moetrace.cli.record import record; record.main(prog_name='moetrace record')"]
REPLAY = [sys.executable, "-m", "moetrace.cli.replay"]
from conftest import io_lock as _io_lock  # noqa: E402


def _serve(n_epochs, script):
    sets: list[int] = []
    sock, fd = channel()
    srv = PhaseServer(sock, sets.append, n_epochs).start()
    cli = PhaseClient(fd)
    script(cli)
    cli.close()
    srv._thread.join(timeout=5)
    srv.stop()
    return srv, cli, sets


def _replay_like(w, p, n):
    def run(cli):
        cli.hello(w, p, n)
        for ph, reps in (("warmup", w), ("measured", p)):
            for r in range(reps):
                for i in range(n):
                    cli.iteration(ph, r, i)
        cli.done()
    return run


def test_phase_server_one_epoch_per_iteration():
    srv, cli, sets = _serve(64, _replay_like(1, 2, 3))
    assert cli.mode == "iteration" and srv.mode == "iteration" and not srv.errors
    assert sets == list(range(1, 11))  # 9 iterations + after, epoch 0 is setup
    ph = [(e.phase, e.repeat, e.iteration) for e in srv.epochs]
    assert ph[0] == ("setup", None, None) and ph[-1] == ("after", None, None)
    assert ph[1:4] == [("warmup", 0, 0), ("warmup", 0, 1), ("warmup", 0, 2)]
    assert ph[4] == ("measured", 0, 0) and ph[9] == ("measured", 1, 2)
    assert all(e.end_ns is not None and e.end_ns >= e.start_ns for e in srv.epochs)


def test_phase_server_falls_back_to_passes_then_phases():
    srv, cli, sets = _serve(8, _replay_like(1, 3, 100))  # 400 iterations do not fit, 4 passes do
    assert cli.mode == "pass"
    assert [(e.phase, e.repeat) for e in srv.epochs] == [("setup", None), ("warmup", 0), ("measured", 0),
                                                         ("measured", 1), ("measured", 2), ("after", None)]
    assert srv.messages == 1 + 4 + 1  # hello, one line per pass, done: not one per iteration
    srv, cli, _ = _serve(4, _replay_like(2, 5, 10))
    assert cli.mode == "phase"
    assert [e.phase for e in srv.epochs] == ["setup", "warmup", "measured", "after"]


def test_epochs_are_bounded_by_the_slot_budget():
    assert epochs_for(24) == 4096
    assert epochs_for(92 * 896 + 1) == (1 << 20) // (92 * 896 + 1)
    assert epochs_for(10_000_000) == 4


def test_silent_recorder_turns_the_channel_off_not_the_replay(monkeypatch):
    a, fd = channel()
    monkeypatch.setattr(PhaseClient, "TIMEOUT_S", 0.2)
    cli = PhaseClient(fd)
    cli.hello(1, 1, 1)  # nobody answers
    assert cli.mode is None and cli.error
    cli.iteration("warmup", 0, 0)  # no-ops from now on
    cli.done()
    cli.close()
    a.close()


def test_replay_without_the_env_has_no_channel(monkeypatch):
    monkeypatch.delenv("MOETRACE_PHASE_FD", raising=False)
    assert PhaseClient.from_env() is None
    monkeypatch.setenv("MOETRACE_PHASE_FD", "not-a-number")
    assert PhaseClient.from_env() is None


# ---------------------------------------------------------------------------
# live


def _moetrace(*args):
    r = subprocess.run([sys.executable, "-c", "from moetrace.cli import main; main()", *args],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_cold_warmup_then_measured_hits_per_iteration(live, tmp_path):
    pytest.importorskip("bcc")
    pool, plan = tmp_path / "pool", tmp_path / "plan.bin"
    _moetrace("pool", "create", str(pool), "--layers", "1", "--experts", str(N), "--k", str(N),
              "--expert-bytes", "1MiB", "--layout", "files")
    from moetrace.trace import write_jsonl

    write_jsonl([(s, 0, list(range(N))) for s in range(3)], tmp_path / "t.jsonl")
    _moetrace("plan", "compile", str(tmp_path / "t.jsonl"), "--layers", "1", "--experts", str(N), "--k", str(N),
              "--expert-bytes", "1MiB", "-o", str(plan))
    replay = [*REPLAY, str(plan), "--pool", str(pool), "--warmup", "1", "--passes", "2", "--threads", "2"]
    with _io_lock():
        os.sync()
        for p in sorted(pool.glob("**/*.bin")):
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        r = subprocess.run([*RECORD, "--out", str(tmp_path / "run"), "--probes", "pagecache", "--", *replay],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc, tables = rundir.load_run(tmp_path / "run")
    assert doc["epochs"]["mode"] == "iteration" and doc["epochs"]["errors"] == []
    meta, ee, ex = tables["epochs"], tables["expert_epochs"], tables["experts"]
    assert list(meta["phase"]) == ["setup"] + ["warmup"] * 3 + ["measured"] * 6 + ["after"]
    assert list(meta["iteration"].iloc[1:10]) == [0, 1, 2] * 3
    assert not meta["folded"].any()
    e = ee[ee["kind"] == "expert"]
    # every page of the cold pool was added during the first warm-up iteration, once per expert
    first = e[e["epoch"] == 1].sort_values("expert_id")
    assert list(first["expert_id"]) == list(range(N)) and list(first["added_pages"]) == [PAGES] * N
    assert int(e[e["epoch"] > 1]["added_pages"].sum()) == 0
    by = doc["epochs"]["by_phase"]
    assert by["warmup"]["added_pages"] == N * PAGES and by["measured"]["added_pages"] == 0
    # the epochs sum to the probe's totals, per expert and column (nothing counted outside an epoch)
    tot = ex[ex["kind"] == "expert"].set_index("expert_id")
    s = e.groupby("expert_id")[["added_pages", "evicted_pages", "re_added_pages"]].sum()
    for c in s.columns:
        assert s[c].reindex(tot.index, fill_value=0).tolist() == tot[c].astype(int).tolist(), c
    # the replay timed each iteration after its epoch began
    rs = json.loads((tmp_path / "run" / "replay" / "replay.json").read_text())
    assert rs["epochs"] == {"mode": "iteration", "error": None}
    import pandas as pd

    log = pd.read_parquet(tmp_path / "run" / "replay" / "iterations.parquet")
    starts = meta["start_ns"].iloc[1:10].astype("int64").tolist()
    assert all(a <= b for a, b in zip(starts, log["start_ns"].tolist())), (starts, log["start_ns"].tolist())
