"""The lru probe (probes/lru.bpf.c + toolkit/record/probes/lru.py): classic LRU placement per expert (unit tier)."""

from __future__ import annotations

from common.lru_probe import *  # noqa: F401,F403


def test_c_field_and_histogram_indices_match_python():
    """F_* index struct lru_counts' fields in order; H_* the histogram names."""
    f = _defines("F_")
    assert [n.lower() for n, _ in f] == list(FIELDS)
    assert [i for _, i in f] == list(range(len(FIELDS)))
    assert int(re.search(r"#define N_FIELDS (\d+)", SRC).group(1)) == len(FIELDS)
    h = _defines("H_")
    assert [n.lower() for n, _ in h] == list(HISTOGRAMS) and [i for _, i in h] == list(range(len(HISTOGRAMS)))
    assert int(re.search(r"#define N_HIST (\d+)", SRC).group(1)) == len(HISTOGRAMS)
    assert int(re.search(r"#define HIST_SLOTS (\d+)", SRC).group(1)) == HIST_SLOTS


def test_declaration():
    groups = {g.name: g for g in SPEC.attach}
    assert set(groups) == {"add", "delete", "insertion", "activate"}
    assert groups["activate"].knob == "HAVE_ACTIVATE" and not groups["activate"].required
    assert all(groups[g].required for g in ("add", "delete", "insertion"))
    assert groups["insertion"].candidates[0].fields == ("pfn", "lru", "flags")
    assert SPEC.enrichment and set(SPEC.tables()) == {"lru", "lru_dwell_histogram"}
    from moetrace.record.probes import recorder_class

    assert recorder_class("lru") is lrurec.LruRecorder


def test_anon_flag_from_the_format_file():
    assert anon_flag_from_format(INSERTION_FMT) == 0x2
    assert anon_flag_from_format(INSERTION_FMT.replace("0x0002u", "0x0004u")) == 0x4
    assert anon_flag_from_format('print fmt: "pfn=0x%lx", REC->pfn') is None
    assert anon_flag_from_format(None) is None


def test_knobs_from_plan_and_pool():
    k = lru_knobs({"HAVE_ORDER": 1, "HAVE_ACTIVATE": 0, "MOE_BYTES_TP": 2}, _pmap(96, 256), mem_pages=10 ** 7,
                  ncpus=2, anon_flag=2)
    assert set(k) == {x.name for x in SPEC.knobs}
    assert (k["POOL_DEV"], k["N_EXPERTS"], k["PPE"], k["HAVE_ACTIVATE"]) == ((8 << 20) | 1, 96, 256, 0)
    # one join entry per folio: at most the pool's pages, plus the LRU hash's per-CPU slack
    assert k["MAX_PFNS"] == 96 * 256 + 2 * 256 + 1024 and k["MAX_INODES"] == 96 + 16
    # never more than memory holds
    assert lru_knobs(None, _pmap(10 ** 6, 256), mem_pages=1000, ncpus=1)["MAX_PFNS"] == 1000 + 256 + 1024
    # and never more than the recorder's cap (224 MiB of preallocated entries)
    assert lru_knobs(None, _pmap(10 ** 6, 256), mem_pages=10 ** 9, ncpus=1)["MAX_PFNS"] == lrurec.MAX_PFNS_CAP
    # no pool: the declaration's defaults (every page unattributed)
    k0 = lru_knobs()
    assert k0 == {x.name: x.default for x in SPEC.knobs}


def test_tables_from_kernel_arrays():
    n = 4
    counts = np.zeros((n + 1, len(FIELDS)), np.int64)
    F = {f: i for i, f in enumerate(FIELDS)}
    counts[:n, F["added"]] = 256
    counts[:n, F["inserted"]] = 256
    counts[:n, F["inserted_inactive"]] = 250
    counts[:n, F["inserted_active"]] = 6
    counts[1, F["activated"]] = 10
    counts[1, F["activation_dwell_ns"]] = 10 * 5000
    counts[1, F["activation_dwell_count"]] = 10
    counts[2, F["evicted"]] = 100
    counts[2, F["evicted_joined"]] = 100
    counts[2, F["dwell_ns"]] = 100 * 3000
    counts[2, F["dwell_count"]] = 100
    counts[n, F["added"]] = 7  # unattributed
    hist = np.zeros((len(HISTOGRAMS), HIST_SLOTS), np.int64)
    hist[0, 12] = 100  # insertion_to_eviction: 3000 ns is in [2048, 4096)
    hist[1, 13] = 10
    hist[2, 1] = 5
    df, h = lru_tables(counts, hist, n, experts_per_layer=2)
    assert list(df.columns) == [c.name for c in SPEC.schema]
    assert list(df["kind"]) == ["expert"] * n + ["unattributed"]
    assert list(df["layer"][:n]) == [0, 0, 1, 1] and list(df["expert"][:n]) == [0, 1, 0, 1]
    u = df.iloc[n]
    assert pd.isna(u["layer"]) and pd.isna(u["expert_id"]) and u["added_pages"] == 7
    assert df.loc[2, "dwell_ns_mean"] == 3000.0 and pd.isna(df.loc[0, "dwell_ns_mean"])  # NA, not 0
    assert df.loc[1, "activation_dwell_ns_mean"] == 5000.0
    assert str(df["dwell_ns_mean"].dtype) == "Float64" and str(df["added_pages"].dtype) == "Int64"
    assert list(h["kind"]) == ["insertion_to_eviction", "insertion_to_activation", "add_to_insertion"]
    assert list(h["lo_ns"]) == [2048, 4096, 0] and list(h["hi_ns"]) == [4096, 8192, 2]
    assert list(h.columns) == [c.name for c in SPEC.tables()["lru_dwell_histogram"]]
    # without the activate program: activation columns NA (unknown), never 0
    df2, h2 = lru_tables(counts, hist, n, 2, have_activate=False)
    for c in ("activated_pages", "activation_dwell_ns_sum", "activation_dwell_count", "activation_dwell_ns_mean",
              "evicted_activated_pages"):
        assert df2[c].isna().all(), c
    assert "insertion_to_activation" not in set(h2["kind"])
    s = lrurec.summarize(df, h, {"pgactivate": 12, "workingset_activate_file": 0})
    assert s["experts"]["activated_pages"] == 10 and s["unattributed"]["added_pages"] == 7
    assert s["vmstat_check"]["activated_within_pgactivate"] is True
    assert s["histogram_pages"]["insertion_to_eviction"] == 100
    assert lrurec.summarize(df2, h2, None)["experts"]["activated_pages"] is None


def test_memory_node_list(tmp_path):
    d = tmp_path / "sys/devices/system/node"
    d.mkdir(parents=True)
    (d / "has_memory").write_text("0-1,3\n")
    assert lrurec._memory_nodes(tmp_path) == [0, 1, 3]
    assert lrurec._memory_nodes(tmp_path / "none") is None
    ok, why = lrurec.drain_lru_batches(tmp_path / "none")
    assert not ok and "CONFIG_NUMA" in why


def test_one_piece_loop_and_map_sizes():
    """probes/lru.bpf.c: the piece split is one bpf_loop over a staged per-CPU charge; the map
    sizes come from the knobs."""
    assert SRC.count("bpf_loop(") == 1 and "MOE_PERCPU_ARRAY(scratch, struct charge_ctx)" in SRC
    k = {x.name: x.default for x in SPEC.knobs} | {"N_EXPERTS": 23, "MAX_PFNS": 8192}
    assert SPEC.map_sizes(k) == {"inodes": 65536, "pfns": 8192, "upfns": 16384, "counts": 24,
                                 "hist": len(HISTOGRAMS) * HIST_SLOTS, "stats": len(SPEC.stats)}
