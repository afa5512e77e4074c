"""The reclaim probe (probes/reclaim.bpf.c + toolkit/record/probes/reclaim.py) (probe-build tier)."""

from __future__ import annotations

from common.reclaim_probe import *  # noqa: F401,F403


@pytest.mark.probe_build
@pytest.mark.parametrize("bucket_ns", [0, 10**8], ids=["totals", "timeline"])
def test_reclaim_probe_loads_and_detaches(live, bucket_ns):
    t0 = time.perf_counter()
    rec = ReclaimRecorder(bucket_ns=bucket_ns, features=_mounted()).open()
    took = time.perf_counter() - t0
    try:
        ids = _prog_ids(rec)
        assert len(ids) == len(rec.attach) and all(_prog_exists(i) for i in ids)
        assert len(rec.probe.table("totals")) == len(KINDS) * len(FIELDS)
        assert len(rec.probe.table("stats")) == len(STATS)
        snap = rec.snapshot()
        assert list(snap.per_kind["kind"]) == list(KINDS)
    finally:
        res = rec.close()
    print(f"\nreclaim probe (bucket_ns={bucket_ns}): load {rec.load_s:.3f} s, "
          f"attach {rec.attach_s * 1e3:.1f} ms, open() {took:.2f} s; attached {sorted(rec.attach)}; "
          f"unavailable {rec.unavailable}")
    assert not any(_prog_exists(i) for i in ids), "programs still loaded after close()"
    assert res is not None and rec.close() is res
    assert set(res.summary()["kinds"]) == set(KINDS)


@pytest.mark.probe_build
def test_reclaim_core_object_loads_the_required_groups_alone(live):
    """Every optional group left out (as the plan does where its tracepoints are missing): the
    CO-RE object loads only memcg begin/end and shrink_inactive; the rest is never relocated."""
    from moetrace.kernel.bpf import load_core

    spec = PROBES["reclaim"]
    _mounted()
    knobs = {k: int(v) for k, v in spec.knob_values(**{k: 0 for k in HAVE_KNOBS}).items()}
    attach = [(g.candidates[0].fn_name, "tracepoint", g.candidates[0].target) for g in spec.attach if g.required]
    probe = load_core("reclaim", knobs, attach, spec.map_sizes(knobs), gated=True)
    try:
        assert set(probe.prog_fds()) == {fn for fn, _k, _t in attach}
    finally:
        probe.close()


@pytest.mark.probe_build
def test_attach_resolved_from_declaration(live):
    attached, missing, have = resolve_attach()
    for g in PROBES["reclaim"].attach:
        if g.required:
            assert attached[g.name] == g.candidates[0].target
    assert set(attached) | set(missing) == set(GROUPS)


@pytest.mark.probe_build
def test_detaches_on_exception(live):
    with pytest.raises(RuntimeError, match="boom"):
        with ReclaimRecorder(features=_mounted()) as rec:
            ids = _prog_ids(rec)
            raise RuntimeError("boom")
    assert rec.probe is None and rec.result is not None
    assert not any(_prog_exists(i) for i in ids)
