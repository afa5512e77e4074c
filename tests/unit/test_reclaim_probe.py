"""The reclaim probe (probes/reclaim.bpf.c + toolkit/record/probes/reclaim.py) (unit tier)."""

from __future__ import annotations

from common.reclaim_probe import *  # noqa: F401,F403


def test_slots_match_the_declaration():
    """The C file: kinds, per-kind fields, timeline fields and histogram slots in the declaration's
    order (STAT_*: every probe's, test_probe_build.py)."""
    for prefix, names, count in (("KIND_", KINDS, "N_KINDS"), ("F_", FIELDS, "N_FIELDS"),
                                 ("T_", TIMELINE_FIELDS, "N_TL")):
        d = _defines(prefix, SRC)
        assert [i for _, i in d] == list(range(len(d))), prefix
        assert [n.lower() for n, _ in d] == list(names), prefix
        assert int(re.search(r"#define %s (\d+)" % count, SRC).group(1)) == len(names)
    assert int(re.search(r"#define HIST_SLOTS (\d+)", SRC).group(1)) == reclaimrec.HIST_SLOTS


def test_core_source_matches_the_declaration():
    """probes/reclaim.bpf.c: one program per group, in the section of its tracepoint, and a
    read-only global per knob (the plan, not the preprocessor, leaves groups out)."""
    spec = PROBES["reclaim"]
    assert {g.name for g in spec.attach} == set(GROUPS)
    for g in spec.attach:
        fn, knob = GROUPS[g.name]
        assert knob is None or (not g.required and g.knob == knob), g.name  # only optional groups go
        for c in g.candidates:
            assert c.fn_name == fn, (g.name, c.fn_name)
            cat, ev = c.target.split(":")
            assert re.search(r'^SEC\("tracepoint/%s/%s"\)\nint %s\(' % (cat, ev, fn), SRC, re.M), c
    for k in spec.knobs:
        assert re.search(r"^const volatile u(32|64) %s = " % k.name.lower(), SRC, re.M), k.name
    assert "{" + "{" not in SRC and "%s" not in SRC and "#if" not in SRC  # globals, no -D


def test_map_sizes_follow_the_knobs():
    k = {kn: int(v) for kn, v in PROBES["reclaim"].knob_values().items()}
    assert PROBES["reclaim"].map_sizes(k)["timeline"] == 1  # no buckets: one placeholder slot
    k["MOE_BUCKET_NS"] = 10**8
    sizes = PROBES["reclaim"].map_sizes(k)
    assert sizes["timeline"] == k["MOE_MAX_BUCKETS"] * len(KINDS) * len(TIMELINE_FIELDS)
    assert sizes["totals"] == len(KINDS) * len(FIELDS) and sizes["active"] == sizes["task_ctx"] == k["MOE_MAX_TASKS"]


def test_knobs_are_checked():
    assert reclaim_knobs({"MOE_HAVE_KSWAPD": 0}, bucket_ns=10**8, t0_ns=5) == {
        "MOE_HAVE_DIRECT": 1, "MOE_HAVE_KSWAPD": 0, "MOE_HAVE_SHRINK_ACTIVE": 1, "MOE_HAVE_ISOLATE": 1,
        "MOE_CTX_WRITE": 1, "MOE_MAX_TASKS": 16384, "MOE_BUCKET_NS": 100000000, "MOE_MAX_BUCKETS": 4096, "MOE_T0_NS": 5}
    with pytest.raises(ValueError):
        reclaim_knobs({"MOE_HAVE_NOPE": 1})
    with pytest.raises(ValueError):
        reclaim_knobs(bucket_ns=-1)
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
            return probespec.AttachPlan(s.name, entries)
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
