"""Per-iteration counters: the replay writes each iteration's epoch into the pagecache probe's
epoch_now map (MOETRACE_EPOCH_MAP_FD) and the probe counts into it (moetrace.run.epochs).

No-kernel tier: the mode rule and the epoch bookkeeping (map writes recorded, or refused by
an fd that is no map). Live tier: a cold warm-up pass then two measured passes of a 23 x 1 MiB pool: every
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

from moetrace.run import directory as rundir
from moetrace.replay.epochs import EpochWriter
from moetrace.run.epochs import epoch_mode, epochs_for, epochs_from_replay

N, MIB = 23, 1 << 20
PAGES = MIB // mmap.PAGESIZE
RECORD = [sys.executable, "-c", "from moetrace.cli.record import record; record.main(prog_name='moetrace record')"]
REPLAY = [sys.executable, "-m", "moetrace.cli.replay"]
from conftest import io_lock as _io_lock  # noqa: E402


class _Recorded(EpochWriter):
    """An EpochWriter whose map writes are recorded instead of made (no kernel)."""

    def __init__(self, n_epochs):
        super().__init__(-1, n_epochs)
        self.writes: list[int] = []

    def _write(self, e):
        self.writes.append(e)
        return True


def _replay_like(w, p, n, slots):
    wr = _Recorded(slots)
    wr.start(w, p, n)
    for ph, reps in (("warmup", w), ("measured", p)):
        for r in range(reps):
            for i in range(n):
                wr.iteration(ph, r, i)
    wr.done()
    return wr


def test_one_epoch_per_iteration_when_they_fit():
    wr = _replay_like(1, 2, 3, 64)
    assert wr.mode == "iteration" and wr.error is None
    assert wr.writes == list(range(1, 11))  # 9 iterations + after; epoch 0 (setup) is the map's initial 0
    ph = [(e[1], e[2], e[3]) for e in wr.assigned]
    assert ph[0] == ("setup", None, None) and ph[-1] == ("after", None, None)
    assert ph[1:4] == [("warmup", 0, 0), ("warmup", 0, 1), ("warmup", 0, 2)]
    assert ph[4] == ("measured", 0, 0) and ph[9] == ("measured", 1, 2)
    eps = epochs_from_replay({"epochs": wr.summary()}, 5, 10 ** 18)
    assert eps[0].start_ns == 5 and all(a.end_ns == b.start_ns for a, b in zip(eps, eps[1:]))
    assert eps[-1].end_ns == 10 ** 18 and [e.epoch for e in eps] == list(range(11))


def test_falls_back_to_passes_then_phases():
    wr = _replay_like(1, 3, 100, 8)  # 400 iterations do not fit, 4 passes do
    assert wr.mode == "pass"
    assert [(e[1], e[2]) for e in wr.assigned] == [("setup", None), ("warmup", 0), ("measured", 0),
                                                   ("measured", 1), ("measured", 2), ("after", None)]
    assert len(wr.writes) == 5  # one write per pass and one at the end, not one per iteration
    wr = _replay_like(2, 5, 10, 4)
    assert wr.mode == "phase" and [e[1] for e in wr.assigned] == ["setup", "warmup", "measured", "after"]
    assert epoch_mode(4, 2, 5, 10) == "phase" and epoch_mode(9, 2, 5, 10) == "pass"


def test_epochs_are_bounded_by_the_slot_budget():
    assert epochs_for(24) == 4096
    assert epochs_for(92 * 896 + 1) == (1 << 20) // (92 * 896 + 1)
    assert epochs_for(10_000_000) == 4


def test_a_failing_map_write_turns_the_writer_off_not_the_replay():
    r, w = os.pipe()  # an fd that is not a BPF map
    wr = EpochWriter(r, 16)
    wr.start(1, 1, 2)
    wr.iteration("warmup", 0, 0)
    assert wr.error and "BPF_MAP_UPDATE_ELEM" in wr.error
    wr.iteration("warmup", 0, 1)  # no-ops from now on
    wr.done()
    assert [e[1] for e in wr.assigned] == ["setup"]
    os.close(r)
    os.close(w)


def test_replay_without_the_env_has_no_writer(monkeypatch):
    monkeypatch.delenv("MOETRACE_EPOCH_MAP_FD", raising=False)
    assert EpochWriter.from_env() is None
    monkeypatch.setenv("MOETRACE_EPOCH_MAP_FD", "not-a-number")
    monkeypatch.setenv("MOETRACE_EPOCHS", "8")
    assert EpochWriter.from_env() is None


# ---------------------------------------------------------------------------
# live


def _moetrace(*args):
    r = subprocess.run([sys.executable, "-c", "from moetrace.cli import main; main()", *args],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_cold_warmup_then_measured_hits_per_iteration(live, tmp_path):
    pool, plan = tmp_path / "pool", tmp_path / "plan.bin"
    _moetrace("pool", "create", str(pool), "--layers", "1", "--experts", str(N), "--k", str(N),
              "--expert-bytes", "1MiB", "--layout", "files")
    from moetrace.inputs.trace import write_jsonl

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
    assert rs["epochs"]["mode"] == "iteration" and rs["epochs"]["error"] is None
    import pandas as pd

    log = pd.read_parquet(tmp_path / "run" / "replay" / "iterations.parquet")
    starts = meta["start_ns"].iloc[1:10].astype("int64").tolist()
    assert all(a <= b for a, b in zip(starts, log["start_ns"].tolist())), (starts, log["start_ns"].tolist())
