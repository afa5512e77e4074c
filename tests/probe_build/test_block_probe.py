"""The block probe (probes/block.bpf.c + toolkit/record/probes/block.py) (probe-build tier)."""

from __future__ import annotations

from common.block_probe import *  # noqa: F401,F403


def _ids(rec) -> list[int]:
    return [blockattr.prog_fdinfo(fd)["prog_id"] for fd in rec.probe.prog_fds().values()]


@pytest.mark.probe_build
@pytest.mark.parametrize("bytes_tp", list(BYTES_TP))
def test_block_probe_loads_and_detaches(live, bytes_tp):
    if bytes_tp not in _bytes_tps():
        pytest.skip(f"no tracepoint {bytes_tp} on this kernel")
    dev = block_device_of("/tmp").tp_dev if os.path.exists("/tmp") else 0
    t0 = time.perf_counter()
    rec = BlockRecorder(dev=dev, bytes_tp=bytes_tp).open()
    took = time.perf_counter() - t0
    try:
        ids = _ids(rec)
        assert len(ids) == 4 and all(_prog_exists(i) for i in ids)
        assert len(rec.probe.table("stats")) == len(STATS)
        assert sorted(rec.probe.tracepoints) == sorted(rec.attach.values())
    finally:
        res = rec.close()
    print(f"\nblock probe ({bytes_tp}): load {rec.load_s:.3f} s, attach {rec.attach_s * 1e3:.1f} ms, "
          f"open() {took:.2f} s")
    assert not any(_prog_exists(i) for i in ids), "programs still loaded after close()"
    assert res is not None and res.lost_events == 0


@pytest.mark.probe_build
def test_attach_resolved_from_declaration(live):
    plan = resolve_attach()
    assert plan["bytes"] in BYTES_TP
    assert plan["bytes"] == _bytes_tps()[0]  # the first available candidate wins
    assert plan["rq_issue"] == "block:block_rq_issue"


@pytest.mark.probe_build
def test_detaches_on_exception(live):
    with pytest.raises(RuntimeError, match="boom"):
        with BlockRecorder(dev=0) as rec:
            ids = _ids(rec)
            raise RuntimeError("boom")
    assert rec.probe is None and rec.result is not None
    assert not any(_prog_exists(i) for i in ids)
