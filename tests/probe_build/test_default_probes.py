"""Acceptance 3: every probe in record's default set attaches on this kernel or is listed by (probe-build tier)."""

from __future__ import annotations

from common.default_probes import *  # noqa: F401,F403


@pytest.mark.probe_build
def test_percpu_sums_by_batch_equal_per_entry_sums(live):
    """Map.percpu_sums reads a per-CPU array in one BPF_MAP_LOOKUP_BATCH (reclaim's timeline has
    ~100k entries: per-entry lookups took 0.3 s here, ~14 s under the lab's TCG); its sums equal the
    kernel's own per-entry, per-CPU values, with a different value on every CPU."""
    import ctypes

    import numpy as np

    from common.backends import loaded_object
    from moetrace.kernel.libbpf import lib, possible_cpus

    spec = PROBES["reclaim"]
    knobs = {k: int(v) for k, v in spec.knob_values(MOE_BUCKET_NS=10**8, MOE_MAX_BUCKETS=1000).items()}
    with loaded_object(spec, knobs, ()) as o:
        t = o.map("timeline")
        n, ncpu = t.max_entries, possible_cpus()
        assert n >= 20000
        for i in range(0, n, 37):
            v = (ctypes.c_uint64 * ncpu)(*[i * 10 + c + 1 for c in range(ncpu)])
            assert lib().bpf_map_update_elem(t.fd, ctypes.byref(ctypes.c_uint32(i)), v, 0) == 0
        want = np.zeros(n, np.int64)
        buf = (ctypes.c_uint64 * ncpu)()
        for i in range(n):
            assert lib().bpf_map_lookup_elem(t.fd, ctypes.byref(ctypes.c_uint32(i)), buf) == 0
            want[i] = sum(buf)
        got = t.percpu_sums()
        assert got.dtype == np.int64 and got.tolist() == want.tolist()
        for start, k in ((0, 1), (37, 1), (36, 75), (1000, 20000 - 1000), (n - 1, 1)):  # windows (the timeline's)
            assert t.percpu_sums(start, k).tolist() == want[start:start + k].tolist(), (start, k)
        assert got[37] == sum(370 + c + 1 for c in range(ncpu)) and got[1] == 0


@pytest.mark.probe_build
def test_read_array_reads_a_prefix_and_the_epoch_mark(live):
    """read_array(n=k) reads the first k entries (the pagecache probe's epoch arrays, ~100 MB in
    all, as far as the counts reached: its `epoch_hi` global) and returns the whole array."""
    import numpy as np

    from common.backends import loaded_object
    from moetrace.kernel.bpf import read_array
    from moetrace.record.probes.pagecache import EXPERT_COUNTS_DTYPE

    spec = PROBES["pagecache"]
    knobs = {k: int(v) for k, v in spec.knob_values(MOE_N_EXPERTS=7, MOE_EPOCHS=100).items()}
    with loaded_object(spec, knobs, ()) as o:
        t = o.map("epoch_counts")
        assert len(t) == 100 * 10  # 7 experts + unattributed, shared, non_expert
        for i in (0, 5, 39, 40, 999):
            v = np.zeros(1, EXPERT_COUNTS_DTYPE)
            v["added_pages"] = i + 1
            assert lib_update(t.fd, i, v.tobytes()) == 0
        full = read_array(t, EXPERT_COUNTS_DTYPE)
        part = read_array(t, EXPERT_COUNTS_DTYPE, n=40)
        assert len(part) == len(full) == 1000
        assert part[:40].tolist() == full[:40].tolist() and part["added_pages"][39] == 40
        assert not part[40:]["added_pages"].any() and full["added_pages"][999] == 1000
        assert o.load_u32("epoch_hi") == 0  # nothing counted yet
        o.store_u32("epoch_hi", 12)
        assert o.load_u32("epoch_hi") == 12


def lib_update(fd: int, key: int, value: bytes) -> int:
    import ctypes

    from moetrace.kernel.libbpf import lib

    buf = ctypes.create_string_buffer(value, len(value))
    return lib().bpf_map_update_elem(fd, ctypes.byref(ctypes.c_uint32(key)), buf, 0)
