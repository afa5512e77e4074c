"""Hit-path cost: what serving already-resident expert bytes costs, and where the time goes.

Pure functions of a run's tables (the reads and stacks probes). A read call is
*hit-only* when no page was added to the page cache while it was in flight, *miss*
when at least one was, *error* when it failed (probes/reads.bpf.c). The reads probe cannot
tell a call that waited on another thread's I/O for a page already being read from a
hit-only call that found the page ready: such a call adds no page and is counted
hit-only, with its latency (the tail of the hit-only distribution shows it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

KIB = 1024
CLASSES = ("hit_only", "miss", "error")

#: where a sampled kernel stack spends its time, by the deepest frame that matches (first
#: match in this order wins at equal depth). Names from mm/filemap.c, lib/iov_iter.c,
#: mm/vmscan.c, mm/readahead.c, block/ (the kernel's function names; `_[k]` stripped).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reclaim in the reader", ("shrink_", "try_to_free_mem_cgroup_pages", "try_to_free_pages",
                               "do_try_to_free_pages", "mem_cgroup_handle_over_high", "reclaim_", "evict_folios",
                               "lru_gen_", "isolate_lru_folios", "isolate_folios")),
    ("page-cache lookup", ("filemap_get_read_batch", "find_get_", "filemap_get_entry", "xas_", "xa_load",
                           "__filemap_get_folio", "page_cache_next_miss", "folio_try_get")),
    ("copy to user", ("copy_page_to_iter", "copy_folio_to_iter", "_copy_to_iter", "copy_user", "rep_movs",
                      "copy_to_user", "memcpy")),
    ("readahead / I/O submission", ("page_cache_ra_", "ondemand_readahead", "page_cache_sync_ra",
                                    "page_cache_async_ra", "read_pages", "submit_bio", "ext4_mpage_readpages",
                                    "blk_", "filemap_add_folio", "__filemap_add_folio", "folio_alloc",
                                    "alloc_pages", "__alloc_pages", "filemap_alloc_folio")),
    ("waiting on a page", ("folio_wait_bit", "folio_wait_locked", "__folio_lock", "io_schedule",
                           "filemap_update_page", "wait_on_page")),
    ("read path (other)", ("filemap_read", "filemap_get_pages", "vfs_read", "do_preadv", "vfs_readv",
                           "ksys_pread64", "__x64_sys_pread64", "do_iter_readv_writev", "ext4_file_read_iter",
                           "generic_file_read_iter")),
    ("page fault (mmap)", ("filemap_fault", "handle_mm_fault", "exc_page_fault", "filemap_map_pages",
                           "do_fault", "do_read_fault")),
    ("syscall entry / exit", ("entry_SYSCALL", "do_syscall_64", "syscall_exit", "exit_to_user_mode")),
)


def _frame(name: str) -> str:
    return name[:-4] if name.endswith("_[k]") else name


def categorize(stack: str) -> str:
    """The category of one folded stack (root first): the deepest frame that matches."""
    frames = stack.split(";")
    for f in reversed(frames):
        if not f.endswith("_[k]"):
            continue
        name = _frame(f)
        for cat, pats in CATEGORIES:
            if any(name.startswith(p) or p in name for p in pats):
                return cat
    return "user space" if not any(f.endswith("_[k]") for f in frames) else "kernel (other)"


def compute_stack_breakdown(stacks: pd.DataFrame, who: str | None = "command") -> pd.DataFrame:
    """Shares of sampled time by category (:data:`CATEGORIES`): ``category``,
    ``samples``, ``share``. ``who``: the stacks table's ``who`` to keep ('replay' — the
    replay's threads — or 'kswapd'; None keeps all)."""
    st = stacks
    if who is not None and "who" in st:
        st = st[st["who"] == who]
    if st.empty:
        return pd.DataFrame({"category": pd.Series(dtype="string"), "samples": pd.Series(dtype="int64"),
                             "share": pd.Series(dtype="float64")})
    cats = st["stack"].map(categorize)
    g = st.groupby(cats)["samples"].sum().sort_values(ascending=False)
    out = pd.DataFrame({"category": g.index.astype("string"), "samples": g.to_numpy(np.int64)})
    out["share"] = out["samples"] / out["samples"].sum()
    return out


def hist_quantile(lo: np.ndarray, hi: np.ndarray, counts: np.ndarray, q: float) -> float | None:
    """Quantile of a log2-bucketed histogram, interpolated geometrically inside the bucket
    (None when empty). Exact to within the bucket, a factor of 2."""
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.sum()
    if n <= 0:
        return None
    order = np.argsort(lo)
    lo, hi, counts = np.asarray(lo, np.float64)[order], np.asarray(hi, np.float64)[order], counts[order]
    cum = np.cumsum(counts)
    target = q * n
    i = int(np.searchsorted(cum, target, side="left"))
    i = min(i, len(counts) - 1)
    before = cum[i] - counts[i]
    frac = (target - before) / counts[i] if counts[i] else 0.0
    a = max(lo[i], 1.0)
    return float(a * (hi[i] / a) ** frac)


def compute_latency_quantiles(lat: pd.DataFrame, quantiles=(0.5, 0.9, 0.99)) -> pd.DataFrame:
    """From reads_latency (scope, class, lo_ns, hi_ns, calls): one row per (scope, class):
    ``calls`` and ``p50_ns``, ``p90_ns``, ``p99_ns`` (log2-bucket interpolation)."""
    rows = []
    for (scope, cls), g in lat.groupby(["scope", "class"], sort=True):
        r: dict[str, Any] = {"scope": scope, "class": cls, "calls": int(g["calls"].sum())}
        for q in quantiles:
            r[f"p{round(q * 100)}_ns"] = hist_quantile(g["lo_ns"].to_numpy(), g["hi_ns"].to_numpy(),
                                                     g["calls"].to_numpy(), q)
        rows.append(r)
    df = pd.DataFrame(rows, columns=["scope", "class", "calls", *(f"p{round(q * 100)}_ns" for q in quantiles)])
    for q in quantiles:
        c = f"p{round(q * 100)}_ns"
        if c in df:
            df[c] = df[c].astype("Float64")
    return df


def compute_hitpath_experts(reads: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, expert): calls by class, bytes, mean latency per class and
    ``hit_only_ns_per_kib`` (hit-only latency / hit-only KiB); NA where an expert had no
    call of that class."""
    e = reads[reads["kind"] == "expert"].sort_values("expert_id").reset_index(drop=True)
    out = e[["layer", "expert", "expert_id", "calls", "bytes", "hit_only_calls", "hit_only_bytes", "miss_calls",
             "miss_bytes", "error_calls"]].copy()
    for cls in ("hit_only", "miss"):
        n = e[f"{cls}_calls"].astype("Float64")
        out[f"{cls}_latency_ns_mean"] = (e[f"{cls}_latency_ns_sum"].astype("Float64") / n.where(n > 0))
    kib = e["hit_only_bytes"].astype("Float64") / KIB
    out["hit_only_ns_per_kib"] = (e["hit_only_latency_ns_sum"].astype("Float64") / kib.where(kib > 0))
    kib = e["miss_bytes"].astype("Float64") / KIB
    out["miss_ns_per_kib"] = (e["miss_latency_ns_sum"].astype("Float64") / kib.where(kib > 0))
    return out


def compute_hitpath_layers(reads: pd.DataFrame) -> pd.DataFrame:
    """compute_hitpath_experts summed per layer, rates from the sums."""
    e = reads[reads["kind"] == "expert"]
    cols = ["calls", "bytes", "hit_only_calls", "hit_only_bytes", "hit_only_latency_ns_sum", "miss_calls",
            "miss_bytes", "miss_latency_ns_sum", "error_calls"]
    g = e.groupby("layer")[cols].sum().reset_index()
    kib = g["hit_only_bytes"].astype("Float64") / KIB
    g["hit_only_ns_per_kib"] = g["hit_only_latency_ns_sum"].astype("Float64") / kib.where(kib > 0)
    kib = g["miss_bytes"].astype("Float64") / KIB
    g["miss_ns_per_kib"] = g["miss_latency_ns_sum"].astype("Float64") / kib.where(kib > 0)
    return g


def compute_hitpath_summary(reads: pd.DataFrame) -> dict[str, Any]:
    """Pool totals: calls and bytes by class, ns/KiB of hit-only and miss calls."""
    e = reads[reads["kind"] == "expert"]
    s = {c: int(e[c].sum()) for c in ("calls", "bytes", "hit_only_calls", "hit_only_bytes", "miss_calls",
                                      "miss_bytes", "error_calls", "hit_only_latency_ns_sum", "miss_latency_ns_sum")}
    s["hit_only_ns_per_kib"] = (s["hit_only_latency_ns_sum"] / (s["hit_only_bytes"] / KIB)
                                if s["hit_only_bytes"] else None)
    s["miss_ns_per_kib"] = s["miss_latency_ns_sum"] / (s["miss_bytes"] / KIB) if s["miss_bytes"] else None
    s["hit_only_call_share"] = s["hit_only_calls"] / s["calls"] if s["calls"] else None
    return s
