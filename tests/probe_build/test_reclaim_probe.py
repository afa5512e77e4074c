"""The reclaim probe (probes/reclaim.c + toolkit/record/probes/reclaim.py) (probe-build tier)."""

from __future__ import annotations

from common.reclaim_probe import *  # noqa: F401,F403


@pytest.mark.probe_build
@pytest.mark.parametrize("bucket_ns", [0, 10**8], ids=["totals", "timeline"])
def test_reclaim_probe_compiles_loads_and_detaches(live, bucket_ns):
    t0 = time.perf_counter()
    rec = ReclaimRecorder(bucket_ns=bucket_ns, features=_mounted()).open()
    took = time.perf_counter() - t0
    try:
        ids = _prog_ids(rec)
        assert len(ids) == len(rec.attach) and all(_prog_exists(i) for i in ids)
        assert len(rec.bpf[b"totals"]) == len(KINDS) * len(FIELDS)
        assert len(rec.bpf[b"stats"]) == len(STATS)
        snap = rec.snapshot()
        assert list(snap.per_kind["kind"]) == list(KINDS)
    finally:
        res = rec.close()
    print(f"\nreclaim probe (bucket_ns={bucket_ns}): compile+load {rec.compile_s:.2f} s, "
          f"attach {rec.attach_s * 1e3:.1f} ms, open() {took:.2f} s; attached {sorted(rec.attach)}; "
          f"unavailable {rec.unavailable}")
    assert not any(_prog_exists(i) for i in ids), "programs still loaded after close()"
    assert res is not None and rec.close() is res
    assert set(res.summary()["kinds"]) == set(KINDS)


@pytest.mark.probe_build
def test_reclaim_probe_compiles_as_is(live):
    """No -D flags at all: every knob has a default (all events compiled in)."""
    bcc = __import__("bcc")
    b = bcc.BPF(src_file=str(reclaimrec.SOURCE).encode(), cflags=[f"-I{PROBES_DIR}", *reclaimrec.QUIET_CFLAGS])
    try:
        for fn, _knob in GROUPS.values():
            b.load_func(fn.encode(), bcc.BPF.TRACEPOINT)
    finally:
        b.cleanup()


@pytest.mark.probe_build
def test_reclaim_probe_minimal_build(live):
    """Every optional group compiled out: only memcg begin/end and shrink_inactive remain."""
    bcc = __import__("bcc")
    flags = reclaim_cflags({k: 0 for k in HAVE_KNOBS}) + [f"-I{PROBES_DIR}", *reclaimrec.QUIET_CFLAGS]
    b = bcc.BPF(src_file=str(reclaimrec.SOURCE).encode(), cflags=flags)
    try:
        for g, (fn, knob) in GROUPS.items():
            if knob is None:
                b.load_func(fn.encode(), bcc.BPF.TRACEPOINT)
            else:
                with pytest.raises(Exception):
                    b.load_func(fn.encode(), bcc.BPF.TRACEPOINT)
    finally:
        b.cleanup()


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
    assert rec.bpf is None and rec.result is not None
    assert not any(_prog_exists(i) for i in ids)
