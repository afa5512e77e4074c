"""The reclaim probe (probes/reclaim.c + toolkit/record/probes/reclaim.py) (unit tier)."""

from __future__ import annotations

from common.reclaim_probe import *  # noqa: F401,F403


def test_declaration_matches_c_source():
    for prefix, names, count in (("KIND_", KINDS, "N_KINDS"), ("F_", FIELDS, "N_FIELDS"),
                                 ("STAT_", STATS, "N_STATS"), ("T_", TIMELINE_FIELDS, "N_TL")):
        d = _defines(prefix)
        assert [i for _, i in d] == list(range(len(d))), prefix
        assert [n.lower() for n, _ in d] == list(names), prefix
        assert int(re.search(r"#define %s (\d+)" % count, SRC).group(1)) == len(names)
    assert int(re.search(r"#define HIST_SLOTS (\d+)", SRC).group(1)) == reclaimrec.HIST_SLOTS
    spec = PROBES["reclaim"]
    assert {g.name for g in spec.attach} == set(GROUPS)
    for g in spec.attach:
        fn, knob = GROUPS[g.name]
        assert knob is None or not g.required, g.name  # only optional groups are compiled out
        for c in g.candidates:
            assert c.fn_name == fn, (g.name, c.fn_name)
            assert re.search(r"^int %s\(struct tracepoint__%s \*args\)" % (fn, c.target.replace(":", "__")),
                             SRC, re.M), c
    # every function behind a knob sits inside that knob's #if
    for fn, knob in GROUPS.values():
        if knob is not None:
            block = re.search(r"#if %s\n(.*?)#endif" % knob, SRC, re.S).group(1)
            assert f"int {fn}(" in block, fn
    # every knob (declared or set by reclaimrec) has a default: compilable as is
    knobs = {k.name for k in spec.knobs} | {f[2:].split("=")[0] for f in reclaim_cflags()}
    for k in knobs:
        assert f"#ifndef {k}\n#define {k} " in SRC, k
    assert "{" + "{" not in SRC and "%s" not in SRC  # -D only, no templates


def test_cflags_are_checked():
    assert reclaim_cflags({"MOE_HAVE_KSWAPD": 0}, bucket_ns=10**8, t0_ns=5) == [
        "-DMOE_HAVE_DIRECT=1", "-DMOE_HAVE_KSWAPD=0", "-DMOE_HAVE_SHRINK_ACTIVE=1", "-DMOE_HAVE_ISOLATE=1",
        "-DMOE_CTX_WRITE=1", "-DMOE_MAX_TASKS=16384", "-DMOE_BUCKET_NS=100000000", "-DMOE_MAX_BUCKETS=4096", "-DMOE_T0_NS=5"]
    with pytest.raises(ValueError):
        reclaim_cflags({"MOE_HAVE_NOPE": 1})
    with pytest.raises(ValueError):
        reclaim_cflags(bucket_ns=-1)
    with pytest.raises(ValueError):
        ReclaimRecorder(max_buckets=0)


def test_unavailable_optional_groups_are_compiled_out(monkeypatch):
    """kswapd_sleep missing: both kswapd groups go (a wake without sleep only leaves
    windows open); a missing required group is an error naming it."""
    from moetrace.record import spec as probespec

    spec = PROBES["reclaim"]

    def fake_resolve(missing):
        def _r(s, feats=None):
            entries = []
            for g in s.attach:
                if g.name in missing:
                    entries.append(probespec.PlanEntry(g.name, g.required, "unavailable", None, "no format file"))
                else:
                    entries.append(probespec.PlanEntry(g.name, g.required, "attached", g.candidates[0]))
            return probespec.AttachPlan(s.name, entries, s.needs, "mismatched")
        return _r

    monkeypatch.setattr(probespec, "resolve", fake_resolve({"kswapd_sleep", "isolate"}))
    attached, missing, have = resolve_attach()
    assert have == {"MOE_HAVE_DIRECT": 1, "MOE_HAVE_KSWAPD": 0, "MOE_HAVE_SHRINK_ACTIVE": 1, "MOE_HAVE_ISOLATE": 0,
                    "MOE_CTX_WRITE": 1}
    assert "kswapd_wake" not in attached and missing["kswapd_wake"].startswith("compiled out")
    assert missing["kswapd_sleep"] == "no format file"
    assert attached["shrink_inactive"] == spec.group("shrink_inactive").candidates[0].target
    monkeypatch.setattr(probespec, "resolve", fake_resolve({"memcg_end"}))
    with pytest.raises(reclaimrec.ProbeError, match="memcg_end"):
        resolve_attach()


def test_vmstat_reader(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/vmstat").write_text("nr_free_pages 5\npgscan_file 10\npgsteal_file 7\npgscan_anon 1\n")
    a = read_vmstat(tmp_path)
    assert a == {"pgscan_file": 10, "pgsteal_file": 7, "pgscan_anon": 1}
    assert vmstat_delta(a, {"pgscan_file": 15, "pgsteal_file": 9, "pgscan_anon": 1}) == {
        "pgscan_file": 5, "pgsteal_file": 2, "pgscan_anon": 0}
