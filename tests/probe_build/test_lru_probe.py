"""The lru probe (probes/lru.bpf.c + toolkit/record/probes/lru.py): classic LRU
placement per expert (probe-build tier)."""

from __future__ import annotations

from common.backends import *  # noqa: F401,F403
from common.lru_probe import *  # noqa: F401,F403


@pytest.mark.probe_build
@pytest.mark.parametrize("knobs", KNOB_SETS, ids=["files-1MiB", "pool-4KiB", "no-activate", "no-pool"])
def test_lru_loads_attaches_and_detaches(live, knobs):
    """Each knob set the recorder uses, : the tracepoints its groups name, the maps
    sized from the knobs (4 KiB extents: 514 expert pieces per order-9 folio, the verifier's
    hardest case), no program left after close()."""
    from moetrace.kernel.bpf import prog_id_exists, prog_info

    full = {k: int(v) for k, v in SPEC.knob_values(**knobs).items()}
    probe = load_first(SPEC, full)
    try:
        tps = set(probe.tracepoints)
        assert {"filemap:mm_filemap_add_to_page_cache", "filemap:mm_filemap_delete_from_page_cache",
                "pagemap:mm_lru_insertion"} <= tps
        assert ("pagemap:mm_lru_activate" in tps) == bool(full["MOE_HAVE_ACTIVATE"])
        assert len(probe.table("counts")) == full["MOE_N_EXPERTS"] + 1
        assert len(probe.table("hist")) == len(HISTOGRAMS) * HIST_SLOTS
        assert len(probe.table("stats")) == len(SPEC.stats)
        ids = [prog_info(fd)["id"] for fd in probe.prog_fds().values()]
        assert len(ids) == len(tps) and all(prog_id_exists(i) for i in ids)
    finally:
        probe.close()
    print(f"\nlru {knobs}: load+attach {probe.load_attach_s:.3f} s")
    assert not any(prog_id_exists(i) for i in ids), "programs still loaded after close()"


@pytest.mark.probe_build
def test_drain_lru_batches(live):
    ok, why = lrurec.drain_lru_batches()
    assert ok, why
