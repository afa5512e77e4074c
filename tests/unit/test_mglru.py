"""The mglru probe: the lru_gen parser (moetrace.kernel.lru_gen), the sampler (moetrace.record.probes.mglru), (unit tier)."""

from __future__ import annotations

from common.mglru import *  # noqa: F401,F403


@pytest.mark.parametrize("name,want", [("6.1_lru_gen.txt", REAL_61), ("6.12_lru_gen.txt", REAL_612)])
def test_short_format_of_both_kernels(name, want):
    s = lru_gen.read(FIX / name)
    assert _gens(s) == want
    assert not s.full and s.tiers == [] and s.walk == []
    assert all(not g["anon_evicted"] and not g["file_evicted"] for g in s.generations)
    assert [g["gen"] for g in s.generations] == [w[2] % 4 for w in want]


@pytest.mark.parametrize("version", ["6.1", "6.12"])
def test_full_format_of_both_kernels(version):
    s = lru_gen.read(FIX / f"{version}_lru_gen_full.txt")
    short = REAL_61[2:] if version == "6.1" else REAL_612  # the /moe memcg, the same generations
    assert s.full
    assert _gens(s, 0) == short
    assert [g[2] for g in _gens(s, 1)] == [w[2] for w in short]  # node 1: same seqs, empty
    assert all(g[4] == g[5] == 0 for g in _gens(s, 1))
    # 'x' after a count: that type's generation is already evicted (seq < min_seq[type])
    first = s.generations[0]
    assert first["file_evicted"] and not first["anon_evicted"]
    assert not any(g["anon_evicted"] or g["file_evicted"] for g in s.generations[1:4])
    # 4 generations x 4 tiers x 2 types x 2 nodes
    assert len(s.tiers) == 64
    max_seq, min_seq = short[-1][2], short[0][2]
    t = pd.DataFrame(s.tiers)
    at_max = t[(t["seq"] == max_seq) & (t["node"] == 0)]
    assert at_max["avg_total_pages"].tolist() == [1500, 1500, 3000, 3000, 4500, 4500, 6000, 6000]
    assert at_max["refaulted_pages"].isna().all()
    hist = t[(t["seq"] == min_seq) & (t["type"] == "anon") & (t["node"] == 0)]
    assert hist["evicted_pages"].tolist() == [4000, 3100, 2200, 1300]
    assert hist["protected_pages"].tolist() == [0, 11, 22, 33]
    blank = t[(t["seq"] == max_seq - 1) & (t["node"] == 0)]
    assert blank[list(lru_gen.TIER_COLUMNS)].isna().all().all()
    # the walk line: kept at max_seq only; 6.1 has six counters (L O Y N F A), 6.12 four (T Y F A)
    assert [(w["node"], w["seq"]) for w in s.walk] == [(0, max_seq), (1, max_seq)]
    w = s.walk[0]
    if version == "6.1":
        assert [w[c] for c in lru_gen.WALK_COLUMNS] == [118532, 96310, 22222, 3410, 512, 2061]
    else:
        assert [w[c] for c in lru_gen.WALK_COLUMNS] == [84220, None, 19004, None, 377, 1950]


def test_fixture_headers_say_where_the_format_comes_from():
    for p in FIX.glob("*.txt"):
        head = p.read_text().splitlines()[0]
        assert head.startswith("# ") and ("lru_gen" in head), p
        assert 'README.md, "Kernel lab"' in p.read_text().split("memcg", 1)[0], p


def test_memcg_ids_wide_paths_with_spaces_and_no_memcg():
    text = ("memcg 123456789 /a b/c\n node     0\n          4       10          1           2 \n"
            "memcg     0 \n node     0\n          1        5          0           0 \n"
            " node     1\n          1        5          7           8 \n")
    s = lru_gen.parse(text)
    assert [(g["memcg_id"], g["memcg_path"], g["node"]) for g in s.generations] == \
        [(123456789, "/a b/c", 0), (0, "", 0), (0, "", 1)]


@pytest.mark.parametrize("text,line,what", BAD, ids=[b[2] for b in BAD])
def test_garbage_is_an_input_error_with_its_line(text, line, what):
    with pytest.raises(InputError, match=what) as ei:
        lru_gen.parse(text, "/sys/kernel/debug/lru_gen")
    assert ei.value.line == line and ei.value.path == "/sys/kernel/debug/lru_gen"
    assert str(ei.value.message).startswith(f"/sys/kernel/debug/lru_gen: line {line}:")


def test_truncated_full_read_is_refused():
    text = (FIX / "6.12_lru_gen_full.txt").read_text()
    cut = text[: text.rindex("          8        356")] + "          8        356          0       18973 \n"
    with pytest.raises(InputError, match="truncated"):
        lru_gen.parse(cut, "lru_gen_full")


def test_frames_have_the_declared_columns_and_birth_times():
    s = lru_gen.read(FIX / "6.12_lru_gen.txt")
    df = lru_gen.generations_frame([(0, 5_000_000_000, s), (1, 6_000_000_000, s)])
    assert set(c.name for c in SPEC.schema) == set(df.columns)
    row = df.iloc[0]
    assert row["birth_ns"] == 5_000_000_000 - 10600 * 1_000_000
    assert len(df) == 8 and df["sample"].tolist() == [0] * 4 + [1] * 4
    for c in SPEC.schema:
        assert str(df[c.name].dtype) == c.dtype, (c.name, df[c.name].dtype)
    full = lru_gen.read(FIX / "6.1_lru_gen_full.txt")
    tiers = lru_gen.tiers_frame([(0, 1, full)])
    walk = lru_gen.walk_frame([(0, 1, full)])
    for name, df2 in (("lru_gen_tiers", tiers), ("lru_gen_walk", walk)):
        cols = SPEC.tables()[name]
        assert list(df2.columns) == [c.name for c in cols]
        for c in cols:
            assert str(df2[c.name].dtype) == c.dtype, (name, c.name, df2[c.name].dtype)
    empty = lru_gen.generations_frame([])
    assert empty.empty and set(empty.columns) == set(df.columns)


def _aged(text: str, k: int) -> str:
    """The lru_gen text with every generation k sequence numbers older (MGLRU aged k times)."""
    out = []
    for ln in text.splitlines():
        f = ln.split()
        if len(f) == 4 and not ln.startswith(("#", "memcg", " node")):
            ln = ln.replace(f" {f[0]} ", f" {int(f[0]) + k} ", 1)
        out.append(ln)
    return "\n".join(out) + "\n"


def test_sampler_reads_at_open_while_polling_and_at_close(tmp_path):
    from moetrace.run import directory as rundir
    from moetrace.record.probes.mglru import MglruRecorder

    root = tmp_path / "root"
    # one kernel throughout (6.12, as the fake tree's release says): /moe's generations 5..8 at
    # open, then MGLRU ages: max_seq grows 8 -> 10 -> 13 -> 28 between samples
    base = (FIX / "6.12_lru_gen.txt").read_text()
    dbg = _tree(root, text=base)
    ctx, _f = _ctx(root)
    plan = ctx.plan
    # MGLRU and its debugfs file: the sampler attaches; the kprobes are unavailable (a fake tree has none)
    assert plan.entry("lru_gen").attached and plan.status == "degraded"
    assert all(v == 0 for k, v in plan.knobs.items() if k.startswith("MOE_HAVE_"))
    rec = MglruRecorder(ctx, period_ms=40)
    assert rec.needs_poll
    rec.open()
    assert rec.probe is None and rec.path == dbg / "lru_gen"  # no BPF without kprobe groups
    assert len(rec.samples) == 1
    texts = [_aged(base, 2), "memcg     1 /\n node     0\n      garbage\n", _aged(base, 5)]
    for text in texts:
        (dbg / "lru_gen").write_text(text)
        n = len(rec.samples) + len(rec.failed)
        t0 = time.monotonic()
        while len(rec.samples) + len(rec.failed) == n:
            rec.poll(100)
            assert time.monotonic() - t0 < 5, "no sample within 5 s of a 40 ms period"
    (dbg / "lru_gen").write_text(_aged(base, 20))
    rec.close()
    assert rec.collected and rec.closed
    assert len(rec.samples) == 4 and len(rec.failed) == 1  # open, +2, (garbage), +5, close (+20)
    assert "line 3" in rec.failed[0]["error"]
    times = [t for _i, t, _s in rec.samples]
    assert times == sorted(times) and all(b - a >= 40_000_000 for a, b in zip(times, times[1:-1]))
    run = rundir.create_run_dir(tmp_path / "run")
    manifest: dict = {}
    rec.write(run, manifest)
    df = pd.read_parquet(run / "lru_gen.parquet")
    assert df["sample"].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert df.loc[df["sample"] == 3, "seq"].tolist() == [25, 26, 27, 28]
    assert list(df.columns) == [c.name for c in SPEC.schema]
    assert df.loc[df["sample"] == 1, "nr_file_pages"].tolist() == [r[5] for r in REAL_612]
    assert (df["birth_ns"] == df["time_ns"] - df["age_ms"] * 1_000_000).all()
    assert manifest["lost"]["mglru"]["failed_samples"] == 1
    assert manifest["tables"]["lru_gen"] == {c.name: {"dtype": c.dtype, "unit": c.unit, "doc": c.doc}
                                             for c in SPEC.schema}
    summ = manifest["summaries"]["mglru"]
    assert summ["samples"] == 4 and summ["rows"] == 16 and summ["period_ms"] == 40
    m = summ["lruvecs"]["2:0"]
    assert m["max_seq_first"] == 8 and m["max_seq_last"] == 28 and m["last_seen_sample"] == 3
    # every generation born counts (max_seq's delta), also the ones born and evicted between two
    # samples (14..24 were never seen); the samples saw 9 of the 20
    assert m["generations_born"] == 20 and m["generations_seen"] == 9
    assert list(summ["lruvecs"]) == ["2:0"]
    assert not (run / "lru_gen_tiers.parquet").exists()
    rec.close()  # idempotent


def test_sampler_full_format_writes_tiers_and_walk(tmp_path):
    from moetrace.run import directory as rundir
    from moetrace.record.probes.mglru import MglruRecorder

    root = tmp_path / "root"
    dbg = _tree(root)
    ctx, _f = _ctx(root)
    rec = MglruRecorder(ctx, period_ms=10_000, full=True)
    rec.open()
    assert rec.path == dbg / "lru_gen_full"
    rec.poll(0)  # not due: no sample, no wait
    assert len(rec.samples) == 1
    rec.close()
    run = rundir.create_run_dir(tmp_path / "run")
    manifest: dict = {}
    rec.write(run, manifest)
    assert len(pd.read_parquet(run / "lru_gen_tiers.parquet")) == 2 * 64
    w = pd.read_parquet(run / "lru_gen_walk.parquet")
    assert w["leaf_old"].tolist() == [96310, 0, 96310, 0]  # 6.1's LOYNFA; 2 samples x 2 nodes
    assert {"lru_gen", "lru_gen_tiers", "lru_gen_walk"} <= set(manifest["tables"])


def test_no_mglru_or_no_debugfs_is_no_with_the_reason(tmp_path):
    from moetrace.record.probes.mglru import ProbeError, MglruRecorder

    _tree(tmp_path / "a", mglru=False)
    ctx, feats = _ctx(tmp_path / "a")
    assert feats.mglru is None
    assert ctx.plan.status == "no"
    assert ctx.plan.reason == "required lru_gen unavailable: MGLRU not built (no /sys/kernel/mm/lru_gen)"
    with pytest.raises(ProbeError, match="MGLRU not built"):
        MglruRecorder(ctx).open()
    _tree(tmp_path / "b", debugfs=False)
    ctx, feats = _ctx(tmp_path / "b")
    assert ctx.plan.status == "no" and "debugfs not mounted" in ctx.plan.reason
    rec = MglruRecorder(ctx)
    with pytest.raises(ProbeError, match="debugfs not mounted"):
        rec.open()
    rec.close()
    assert not rec.collected  # nothing to write
    # MGLRU, debugfs, but the file unreadable garbage at open: refused with the parser's line
    _tree(tmp_path / "c", text="memcg 1 /\n node 0\n 1 2 3\n")
    ctx, _ = _ctx(tmp_path / "c")
    with pytest.raises(ProbeError, match="line 3"):
        MglruRecorder(ctx).open()


def test_knobs_and_declaration():
    from moetrace.record.probes.mglru import KPROBE_KNOBS, ProbeError, MglruRecorder

    assert SPEC.default is True and SPEC.enrichment is True  # in the default set; missing only warns
    assert [g.name for g in SPEC.attach if g.required] == ["lru_gen"]
    assert len(KPROBE_KNOBS) == 8 and all(SPEC.knob_values()[k] == 0 for k in KPROBE_KNOBS)
    assert SPEC.knob_values()["MOE_LRU_GEN_PERIOD_MS"] == 1000
    from moetrace.record.probe import RecordContext

    class _Plan:  # just what the constructor reads
        knobs: dict = {}

    with pytest.raises(ProbeError, match="> 0"):
        MglruRecorder(RecordContext(features=None, plan=_Plan()), period_ms=0)


def test_eviction_records_map_to_experts_through_the_pool_map():
    """(inode, page index) -> expert_id: a one-expert file is its expert, a multi-expert file
    divides by pages per expert, an inode outside the pool is -1 (and dropped from the table)."""
    import numpy as np

    from moetrace.record.poolmap import PAGE, PoolMap

    pm = PoolMap(inodes={50: (3, 1), 10: (0, 3), 70: (9, 1)}, dev=0, extent_bytes=256 * PAGE, n_total=11,
                 n_experts=11)
    assert (pm.pages_per_expert, pm.words_per_expert) == (256, 4)
    got = pm.expert_ids(np.array([10, 10, 10, 50, 70, 99, 5]), np.array([0, 256, 700, 12, 0, 0, 0]))
    assert got.tolist() == [0, 1, 2, 3, 9, -1, -1]
    assert PoolMap({}, 0, 256 * PAGE, 0, 0).expert_ids(np.array([1]), np.array([0])).tolist() == [-1]
