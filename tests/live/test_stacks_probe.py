"""The stacks probe (probes/stacks.bpf.c + toolkit/record/probes/stacks.py + toolkit/kernel/symbolize.py) (live tier)."""

from __future__ import annotations

from common.stacks_probe import *  # noqa: F401,F403


def test_live_record_replay_default_rate(live, pool, tmp_path):
    """Default knobs (99 Hz): cold pass then 59 hot passes."""
    run = tmp_path / "run"
    doc, cpu = _record_replay(pool, run, passes=60)
    summ, st = doc["summaries"]["stacks"], doc["stats"]["stacks"]
    assert doc["attach_plan"]["stacks"]["recorded"] is True and doc["knobs"]["stacks"]["MOE_SAMPLE_HZ"] == 99
    assert summ["sample_hz"] == 99 and summ["kallsyms"]["available"] is True
    _check_rate(doc, cpu, 99)
    df = pd.read_parquet(run / "stacks.parquet")
    folded = (run / "stacks.folded").read_text().splitlines()
    # three views of one count: the kernel's stat, the table, the folded file
    assert st["samples"] == int(df["samples"].sum()) == sum(int(ln.rsplit(" ", 1)[1]) for ln in folded) > 0
    assert summ["command_samples"] + summ["kswapd_samples"] == st["samples"]
    assert set(df["who"]) <= {"command", "kswapd"} and summ["kswapd_pids"] == stacksrec.find_kswapd()
    assert all(ln.rsplit(" ", 1)[1].isdigit() and ";" in ln for ln in folded)
    # the replay's hot passes are pread copies out of the page cache
    fr = _frames(df[df["who"] == "command"])
    assert fr.get("filemap_read_[k]", 0) > 0, sorted(fr, key=fr.get)[-30:]
    assert fr.get("copy_page_to_iter_[k]", 0) + fr.get("_copy_to_iter_[k]", 0) > 0
    assert any(f.split("`")[0].startswith(("python3", "libpython")) for f in fr if not f.endswith("_[k]")), fr
    # kernel-mode samples carry both sides; user-mode ones no kernel frames
    assert (df.loc[df["kernel_stack"] == "ok", "kernel_frames"] > 0).all()
    assert (df.loc[df["kernel_stack"] != "ok", "kernel_frames"] == 0).all()
    assert (df["kernel_stack"] == "ok").any() and (df["kernel_stack"] == "none").any()
    assert doc["lost"]["stacks"]["lost_events"] == 0 and st["keys_full"] == 0
    assert doc["tables"]["stacks"]["samples"]["dtype"] == "int64"
    assert find_kernel_addresses(run) == []
    for p in [run, *run.rglob("*")]:
        assert rundir.is_private(p), p


def test_live_cold_pass_shows_readahead_at_999hz(live, pool, tmp_path):
    """MOE_SAMPLE_HZ=999 through the environment; one cold pass: readahead shows up."""
    run = tmp_path / "run"
    doc, cpu = _record_replay(pool, run, passes=1, env_knobs="MOE_SAMPLE_HZ=999")
    assert doc["knobs"]["stacks"]["MOE_SAMPLE_HZ"] == 999
    _check_rate(doc, cpu, 999)
    df = pd.read_parquet(run / "stacks.parquet")
    fr = _frames(df[df["who"] == "command"])
    ra = {f: fr.get(f + "_[k]", 0) for f in ("page_cache_ra_order", "page_cache_ra_unbounded", "filemap_add_folio",
                                              "filemap_get_pages")}
    assert fr.get("filemap_read_[k]", 0) > 0 and sum(ra.values()) > 0, ra
    assert find_kernel_addresses(run) == []
