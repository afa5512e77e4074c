"""Per-iteration counters: the replay writes each iteration's epoch into the pagecache probe's (live tier)."""

from __future__ import annotations

from common.record_epochs import *  # noqa: F401,F403
from common import read_run


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
    doc, tables = read_run(tmp_path / "run")
    assert doc["epochs"]["mode"] == "iteration" and doc["epochs"]["errors"] == []
    meta, ee, ex = tables["epochs"], tables["expert_epochs"], tables["experts"]
    assert list(meta["phase"]) == ["setup"] + ["warmup"] * 3 + ["measured"] * 6 + ["after"]
    assert list(meta["iteration"].iloc[1:10]) == [0, 1, 2] * 3
    assert not meta["folded"].any()
    e = ee[ee["kind"] == "expert"]
    # every page of the cold pool was added during the first warm-up iteration, once per expert
    first = e[e["epoch"] == 1].sort_values("expert_id")
    assert list(first["expert_id"]) == list(range(N))
    assert list(first["added_pages"] - first["re_added_pages"]) == [PAGES] * N
    # later epochs add only pages evicted before them (this machine's DAMON pageout): exact per
    # page; nothing at all when no page was evicted
    later = e[e["epoch"] > 1]
    evicted = int(e["evicted_pages"].sum())
    assert int(later["added_pages"].sum()) == int(later["re_added_pages"].sum()) <= evicted
    if evicted == 0:
        assert int(later["added_pages"].sum()) == 0
    by = doc["epochs"]["by_phase"]
    assert by["warmup"]["added_pages"] - by["warmup"]["re_added_pages"] == N * PAGES
    assert by["measured"]["added_pages"] == by["measured"]["re_added_pages"]
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
