"""The ``lru`` probe's recorder: classic LRU placement of the pool's pages, per expert.

probes/lru.bpf.c (CO-RE, compiled once) joins
the LRU tracepoints to expert pages on the pfn: a page-cache add
(``filemap:mm_filemap_add_to_page_cache``: pfn, inode, index, folio order) opens a
pfn -> (expert, first page, folio pages, add time) entry; ``pagemap:mm_lru_insertion``
(pfn, list, flags) and ``pagemap:mm_lru_activate`` (pfn) find it; the page-cache delete
closes it. Per expert (plus one unattributed slot: pool-filesystem pages of no expert)
the kernel counts, in pages:

* ``added_pages`` (the join's entries), ``inserted_pages`` by list (inactive / active /
  unevictable / other file list at insertion), ``activated_pages``;
* ``evicted_pages`` (every deletion, by inode and index), ``evicted_joined_pages``
  (deletions of pages added during the recording), ``evicted_activated_pages``;
* dwell sums: LRU insertion -> eviction (``dwell_ns_sum`` / ``dwell_count``) and
  insertion -> activation; pool-wide log2 histograms of both and of add -> insertion
  (the time a new folio waits in the per-CPU lru_add batch).

Pages are counted consistently: the add carries the folio order (pages = 1 << order);
insertion and activation fire once per folio without a size and are charged with the
joined folio's pages; a folio spanning experts is split (each expert charged its own
pages, dwell sums page-weighted). Nothing is streamed: no event can be lost to a ring;
BPF recursion misses are read per program and written as the lost count.

Folios wait in per-CPU batches before they reach a list (lru_add) or move to the active
list (lru_activate); both tracepoints fire when a batch drains. At close the recorder
drains every CPU's batches (``migrate_pages(2)`` of the recorder itself from its memory
nodes to the same nodes: the kernel runs ``lru_cache_disable()``, which drains all, and
moves nothing) so that folios still batched are counted; the manifest says whether it
worked. ``PGACTIVATE`` in /proc/vmstat is counted exactly where mm_lru_activate fires
(lru_activate(), nr_pages) and also by reclaim's own activations (shrink_folio_list),
which fire no tracepoint: pool activations <= the pgactivate delta, machine-wide.

MGLRU: with MGLRU on, folio_mark_accessed never activates and the list at insertion does
not describe generations; the recorder says so in a note (the mglru probe covers it).
"""

from __future__ import annotations

import ctypes
import os
import re
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
from moetrace.lazyimport import pandas as pd

from moetrace.record.spec import FOLIO_ORDER, Knob, ProbeSpec, Struct, named_tp, group
from moetrace.run.tables import TABLES, named_tables
from moetrace.errors import ProbeError
from moetrace.kernel.syscalls import SYS_MIGRATE_PAGES, libc
from moetrace.record.probe import ProbeRecorder, log2_bounds

# -- the declaration: attach candidates, knobs, tables (probes/lru.bpf.c and probes/lru.bpf.c agree:
# tests/probe_build/test_core_objects.py)

_LRU_FOLIO = ("pfn", "i_ino", "index", "s_dev")


#: probes/lru.bpf.c. Reads only tracepoint arguments; joins LRU
#: events to expert pages on the pfn
#: (the page-cache add gives pfn -> (inode, index, order)); aggregated per expert in the kernel.
LRU = ProbeSpec(
    name="lru",
    recorder="LruRecorder",
    order=20,
    description="classic LRU per expert: list at LRU insertion, activations, dwell from insertion to "
                "activation / eviction (LRU events joined to pool pages on the pfn), in the kernel",
    attach=(
        group("add", named_tp("filemap:mm_filemap_add_to_page_cache", fields=_LRU_FOLIO, field_knobs=FOLIO_ORDER,
                          note="opens the join: pfn -> (expert, page, folio pages = 1 << order, add time)")),
        group("delete", named_tp("filemap:mm_filemap_delete_from_page_cache", fields=_LRU_FOLIO, field_knobs=FOLIO_ORDER,
                             note="closes the join: an eviction; dwell = now - LRU insertion time")),
        group("insertion", named_tp("pagemap:mm_lru_insertion", fields=("pfn", "lru", "flags"),
                                note="lru_add() moving a batched new folio onto its list (once per folio, no "
                                     "size: charged with the joined folio's pages); takes a folio since the folio "
                                     "conversion (5.16); the C file includes <linux/mmzone.h> for enum lru_list")),
        group("activate", named_tp("pagemap:mm_lru_activate", fields=("pfn",),
                               note="lru_activate(): the inactive -> active move PGACTIVATE counts (reclaim's "
                                    "activate_locked counts PGACTIVATE without it); folio-based since 5.16"),
           required=False, knob="HAVE_ACTIVATE"),
    ),
    knobs=(
        Knob("POOL_DEV", 0, "s_dev of the pool's filesystem, kernel encoding (major << 20) | minor; 0: every device"),
        Knob("N_EXPERTS", 0, "experts in the pool (counters have N_EXPERTS + 1 slots: the last is unattributed)"),
        Knob("PPE", 1, "pages per expert (the extent, in pages)"),
        Knob("HAVE_ORDER", 1, "1: the add/delete formats carry the folio order (set from the format files)"),
        Knob("HAVE_ACTIVATE", 1, "1: compile the mm_lru_activate program (activate group)"),
        Knob("MAX_FOLIO_PAGES", 512, "largest folio split into expert pieces in full; the rest is unprocessed"),
        Knob("MAX_INODES", 65536, "entries of the inode -> expert map"),
        Knob("MAX_PFNS", 65536, "pfn -> expert-page join entries (LRU hash; the recorder sizes it to the pool)"),
        Knob("MAX_UNATTR_PFNS", 16384, "pfn -> join entries of pool-device pages of no expert (LRU hash)"),
        Knob("ANON_FLAG", 2, "the anonymous bit of mm_lru_insertion's flags (PAGEMAP_ANONYMOUS, from the format)"),
    ),
    table="lru",
    schema=TABLES["lru"],
    more_tables=named_tables("lru_dwell_histogram"),
    stats=("add_events", "pool_dev_add_events", "insert_events", "insert_joined", "insert_repeated",
           "insert_anon_stale", "activate_events", "activate_joined", "activate_uninserted", "delete_events",
           "pool_dev_delete_events", "delete_joined", "delete_unjoined", "delete_stale", "add_stale",
           "unprocessed_pages", "join_update_failed"),
    structs=(
        Struct("ino_val", (("base", "u32"), ("n", "u32"))),
        Struct("lru_counts", tuple((f, "u64") for f in (
            "added", "inserted", "inserted_inactive", "inserted_active", "inserted_unevictable", "inserted_other",
            "activated", "activation_dwell_ns", "activation_dwell_count", "evicted", "evicted_joined",
            "evicted_activated", "dwell_ns", "dwell_count", "reinserted"))),
        Struct("pfn_val", (("add_ns", "u64"), ("insert_ns", "u64"), ("eid", "u32"), ("pstart", "u32"),
                           ("elast", "u32"), ("pages", "u32"), ("lru", "u32"), ("activations", "u32"))),
    ),
    map_sizes=lambda k: _map_sizes(k),
    enrichment=True,
)

SPEC = LRU
#: struct lru_counts fields, in F_* order (one counter slot per expert + unattributed)
FIELDS: tuple[str, ...] = tuple(f for f, _t in SPEC.struct("lru_counts").fields)
#: pool-wide histograms of probes/lru.bpf.c, in H_* order
HISTOGRAMS = ("insertion_to_eviction", "insertion_to_activation", "add_to_insertion")
HIST_SLOTS = 64
LRU_COUNTS_DTYPE = SPEC.struct("lru_counts").dtype()
U64 = np.dtype("<u8")
#: /proc/vmstat counters read around a recording (the activation and refault oracles)
VMSTAT_KEYS = ("pgactivate", "pgdeactivate", "pgrefill", "workingset_activate_file", "workingset_refault_file",
               "workingset_restore_file", "pgpgin")
#: per-CPU LRU batch slack of the BPF LRU hash (entries parked in per-CPU free lists) + margin
_LRU_SLACK_PER_CPU = 256
#: most join entries the recorder asks for: 112 bytes each (preallocated), 2 Mi entries = 224 MiB
#: of kernel memory, one per cached folio (8 GiB of order-0 pages); beyond it the LRU hash forgets
#: the least recently touched pages, whose later eviction is counted in ``delete_unjoined``
MAX_PFNS_CAP = 1 << 21
PAGE = os.sysconf("SC_PAGE_SIZE")
#: the mm_lru_insertion print format's anonymous test (``REC->flags & 0x0002u ? "a" : "f"``)
_ANON_RE = re.compile(r"REC->flags\s*&\s*(0x[0-9a-fA-F]+)u?\s*\)?\s*\?\s*\"a\"")


# -- knobs ------------------------------------------------------------------------------------

def _map_sizes(k: dict[str, int]) -> dict[str, int]:
    """The CO-RE object's map sizes from its knobs (probes/lru.bpf.c names the maps)."""
    return {"inodes": int(k["MAX_INODES"]), "pfns": int(k["MAX_PFNS"]), "upfns": int(k["MAX_UNATTR_PFNS"]),
            "counts": int(k["N_EXPERTS"]) + 1, "hist": len(HISTOGRAMS) * HIST_SLOTS, "stats": len(SPEC.stats)}


def anon_flag_from_format(text: str | None) -> int | None:
    """The anonymous bit of mm_lru_insertion's ``flags`` from its format file's print
    format (``... REC->flags & 0x0002u ? "a" : "f" ...``), or None when not found."""
    if not text:
        return None
    m = _ANON_RE.search(text)
    return int(m.group(1), 16) if m else None


def _mem_total_pages(root: str | os.PathLike = "/") -> int | None:
    from moetrace.kernel.procfs import read_meminfo

    try:
        return read_meminfo(root)["MemTotal_bytes"] // PAGE
    except (OSError, ValueError, KeyError):
        return None


def lru_knobs(plan_knobs: dict[str, int] | None = None, pmap=None, mem_pages: int | None = None,
              ncpus: int | None = None, anon_flag: int | None = None) -> dict[str, int]:
    """Every knob of the lru probe: the declaration's defaults, then what the attach plan
    decided (HAVE_ORDER, HAVE_ACTIVATE), then the pool's (POOL_DEV, N_EXPERTS, PPE,
    MAX_INODES) and the join map's size: one entry per folio, so at most the pool's pages,
    and never more than the machine's memory holds, plus the BPF LRU hash's per-CPU slack
    (it may evict before it is full), never above :data:`MAX_PFNS_CAP`."""
    over: dict[str, int] = {k: int(v) for k, v in (plan_knobs or {}).items() if k in {k.name for k in SPEC.knobs}}
    if pmap is not None:
        pool_pages = int(pmap.n_total) * int(pmap.pages_per_expert)
        want = pool_pages if mem_pages is None else min(pool_pages, int(mem_pages))
        slack = _LRU_SLACK_PER_CPU * int(ncpus or os.cpu_count() or 1) + 1024
        over.update(POOL_DEV=int(pmap.dev), N_EXPERTS=int(pmap.n_total), PPE=int(pmap.pages_per_expert),
                    MAX_INODES=max(16, len(pmap.inodes) + 16), MAX_PFNS=min(max(want + slack, 1024), MAX_PFNS_CAP))
    if anon_flag is not None:
        over["ANON_FLAG"] = int(anon_flag)
    return {k: int(v) for k, v in SPEC.knob_values(**over).items()}


# -- draining the per-CPU LRU batches ----------------------------------------------------------

def _memory_nodes(root: str | os.PathLike = "/") -> list[int] | None:
    """Node ids with memory, from /sys/devices/system/node/has_memory ("0", "0-1,3")."""
    from moetrace.kernel.perf import id_list

    try:
        return id_list((Path(root) / "sys/devices/system/node/has_memory").read_text())
    except OSError:
        return None


def drain_lru_batches(root: str | os.PathLike = "/") -> tuple[bool, str]:
    """Drain every CPU's LRU batches (lru_add, lru_activate, ...), so that folios still
    waiting in them reach their lists and fire their tracepoints now.

    How: ``migrate_pages(0, maxnode, nodes, nodes)`` of this process from its memory
    nodes to the same nodes. do_migrate_pages() starts with ``lru_cache_disable()``,
    which drains all CPUs' batches and waits, then finds no (source, destination) pair
    that differs and moves nothing. Returns (ok, what happened)."""
    nr = SYS_MIGRATE_PAGES.get(os.uname().machine)
    if nr is None:
        return False, f"migrate_pages: no syscall number for {os.uname().machine}"
    nodes = _memory_nodes(root)
    if not nodes:
        return False, "no NUMA node list (/sys/devices/system/node/has_memory): kernel without CONFIG_NUMA"
    words = max(16, max(nodes) // 64 + 1)
    mask = (ctypes.c_ulong * words)()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    t0 = time.perf_counter()
    r = libc.syscall(ctypes.c_long(nr), ctypes.c_int(0), ctypes.c_ulong(words * 64 + 1), ctypes.byref(mask),
                     ctypes.byref(mask))
    dt = time.perf_counter() - t0
    if r < 0:
        err = ctypes.get_errno()
        return False, f"migrate_pages failed: {os.strerror(err)} (errno {err})"
    return True, f"migrate_pages(self, nodes {nodes} -> same) drained the per-CPU LRU batches in {dt * 1e3:.1f} ms"


# -- tables -----------------------------------------------------------------------------------

def _ia(x, dtype: str = "Int64"):
    return pd.array(x, dtype=dtype)


def lru_tables(counts: np.ndarray, hist: np.ndarray, n_experts: int, experts_per_layer: int,
               have_activate: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(lru, lru_dwell_histogram) from the kernel's arrays.

    counts: (n_experts + 1, len(FIELDS)) int64, the last row unattributed; hist:
    (len(HISTOGRAMS), HIST_SLOTS) pages per log2 slot. Activation columns (and
    evicted_activated_pages, which needs them) are NA when the activate program was not
    compiled; means are NA without pages."""
    c = np.asarray(counts, dtype=np.int64).reshape(n_experts + 1, len(FIELDS))
    col = {f: c[:, i] for i, f in enumerate(FIELDS)}
    n = n_experts
    E = max(int(experts_per_layer), 1)
    eid = np.arange(n, dtype=np.int64)
    na = [pd.NA]

    def ints(x: np.ndarray, avail: bool = True):
        return _ia(x.tolist() if avail else [pd.NA] * (n + 1))

    def mean(s: np.ndarray, k: np.ndarray, avail: bool = True):
        if not avail:
            return _ia([pd.NA] * (n + 1), "Float64")
        with np.errstate(divide="ignore", invalid="ignore"):
            m = s / np.maximum(k, 1)
        return _ia([float(v) if kk > 0 else pd.NA for v, kk in zip(m, k)], "Float64")

    act = bool(have_activate)
    df = pd.DataFrame({
        "kind": _ia(["expert"] * n + ["unattributed"], "string"),
        "layer": _ia(list(eid // E) + na, "Int32"),
        "expert": _ia(list(eid % E) + na, "Int32"),
        "expert_id": _ia(list(eid) + na),
        "added_pages": ints(col["added"]),
        "inserted_pages": ints(col["inserted"]),
        "inserted_inactive_pages": ints(col["inserted_inactive"]),
        "inserted_active_pages": ints(col["inserted_active"]),
        "inserted_unevictable_pages": ints(col["inserted_unevictable"]),
        "inserted_other_pages": ints(col["inserted_other"]),
        "reinserted_pages": ints(col["reinserted"]),
        "activated_pages": ints(col["activated"], act),
        "activation_dwell_ns_sum": ints(col["activation_dwell_ns"], act),
        "activation_dwell_count": ints(col["activation_dwell_count"], act),
        "activation_dwell_ns_mean": mean(col["activation_dwell_ns"], col["activation_dwell_count"], act),
        "evicted_pages": ints(col["evicted"]),
        "evicted_joined_pages": ints(col["evicted_joined"]),
        "evicted_activated_pages": ints(col["evicted_activated"], act),
        "dwell_ns_sum": ints(col["dwell_ns"]),
        "dwell_count": ints(col["dwell_count"]),
        "dwell_ns_mean": mean(col["dwell_ns"], col["dwell_count"]),
    })
    df = df[[cc.name for cc in SPEC.schema]]

    h = np.asarray(hist, dtype=np.int64).reshape(len(HISTOGRAMS), HIST_SLOTS)
    if not act:
        h = h.copy()
        h[HISTOGRAMS.index("insertion_to_activation")] = 0
    ki, sl = np.nonzero(h)
    lo, hi = log2_bounds(sl)
    hdf = pd.DataFrame({
        "kind": _ia([HISTOGRAMS[i] for i in ki], "string"),
        "slot": sl.astype("int32"),
        "lo_ns": lo,
        "hi_ns": hi,
        "pages": h[ki, sl].astype("int64"),
    })
    hdf = hdf[[cc.name for cc in SPEC.tables()["lru_dwell_histogram"]]]
    return df, hdf


def summarize(df: pd.DataFrame, hdf: pd.DataFrame, vmstat: dict[str, int] | None) -> dict[str, Any]:
    """Totals over experts and the unattributed row, the histograms' page sums, and the
    checks against /proc/vmstat deltas (every number an int or None)."""
    e = df[df["kind"] == "expert"]
    u = df[df["kind"] == "unattributed"]

    def tot(frame: pd.DataFrame, c: str) -> int | None:
        s = frame[c]
        return None if s.isna().all() else int(s.fillna(0).sum())

    cols = [c.name for c in SPEC.schema if c.dtype == "Int64" and c.name != "expert_id"]
    experts = {c: tot(e, c) for c in cols}
    unattr = {c: tot(u, c) for c in cols}
    hist = {k: int(hdf.loc[hdf["kind"] == k, "pages"].sum()) for k in HISTOGRAMS}
    out: dict[str, Any] = {"experts": experts, "unattributed": unattr, "histogram_pages": hist}
    if vmstat is not None:
        act = experts.get("activated_pages")
        pga = vmstat.get("pgactivate")
        wsa = vmstat.get("workingset_activate_file")
        out["vmstat_delta"] = dict(vmstat)
        out["vmstat_check"] = {
            "experts_activated_pages": act, "vmstat_pgactivate": pga,
            "activated_within_pgactivate": None if act is None or pga is None else act <= pga,
            "activated_fraction_of_pgactivate": None if act is None or not pga else act / pga,
            "experts_inserted_active_pages": experts.get("inserted_active_pages"),
            "vmstat_workingset_activate_file": wsa,
        }
    return out


# -- the recorder -----------------------------------------------------------------------------

class LruRecorder(ProbeRecorder):
    """Attach the lru probe (either loader) for one recording; at close drain the LRU batches,
    read the in-kernel aggregates and detach; write ``lru`` and ``lru_dwell_histogram``.

    Attribution is by inode (the pool's inode -> expert map), not by task: every process's
    reads of the pool count (``follow`` is a no-op), as in the pagecache probe."""

    name = "lru"
    spec = SPEC
    error = ProbeError
    needs_poll = False
    vmstat_keys = VMSTAT_KEYS

    def __init__(self, ctx, drain: bool = True):
        super().__init__(ctx)
        self.drain = drain
        self.drained: tuple[bool, str] | None = None
        self.have_activate = True
        self.table: pd.DataFrame | None = None
        self.histogram: pd.DataFrame | None = None
        self.stats: dict[str, int] = {}
        self.misses: dict[str, int | None] = {}
        self.vmstat: dict[str, int] | None = None
        self._t_open = 0.0

    def _format_text(self) -> str | None:
        t = getattr(self.ctx.features, "tracefs", None)
        if t is None:
            return None
        try:
            return (Path(t) / "events/pagemap/mm_lru_insertion/format").read_text()
        except OSError:
            return None

    def open(self) -> "LruRecorder":
        """Compile with the plan's and the pool's knobs, load, attach, fill the inode map."""
        plan = self.ctx.plan
        if plan.status == "no":
            raise ProbeError(f"probe lru cannot attach: {plan.reason}",
                                hint="`moetrace doctor` lists what this kernel offers")
        anon = anon_flag_from_format(self._format_text())
        if anon is None:
            self.ctx.notes.append("lru: mm_lru_insertion's print format names no anonymous flag bit; "
                                  "using PAGEMAP_ANONYMOUS = 0x2")
        pmap = self.ctx.pmap
        self.knobs = self.with_user_knobs(lru_knobs(plan.knobs, pmap, _mem_total_pages(), os.cpu_count(), anon))
        self.have_activate = bool(self.knobs["HAVE_ACTIVATE"])
        if not self.have_activate:
            self.ctx.notes.append("lru: mm_lru_activate unavailable: activation columns are NA")
        if pmap is None:
            self.ctx.notes.append("lru: no pool: every page is unattributed (bounded join map)")
        mg = getattr(self.ctx.features, "mglru", None)
        if isinstance(mg, dict) and mg.get("on"):
            self.ctx.notes.append("lru: MGLRU is on: folios are not activated by access and the list at "
                                  "insertion does not describe generations (see the mglru probe)")
        self.load_planned(self.knobs)
        if pmap is not None:
            for ino, (base, n) in pmap.inodes.items():
                self.probe.put("inodes", struct.pack("<Q", ino), struct.pack("<II", base, n))
        self.mark_vmstat(0)
        self._t_open = time.monotonic()
        return self

    def settle(self) -> None:
        """Drain the per-CPU LRU batches while the probes still count (their insertions
        belong to the recording)."""
        if self.drain and self.drained is None and self.probe is not None and not self.probe.closed:
            self.drained = drain_lru_batches()

    def close(self) -> None:
        """Drain the LRU batches, read counters, histograms, stats and recursion misses,
        then detach (idempotent; safe after a failed open)."""
        from moetrace.kernel.bpf import read_array

        got: dict[str, Any] = {}

        def read() -> None:
            if self.drain and self.drained is None:
                self.drained = drain_lru_batches()
            self.vmstat = self.vmstat_delta()
            vals = read_array(self.probe.table("counts"), LRU_COUNTS_DTYPE)
            got["counts"] = np.stack([vals[f] for f in FIELDS], axis=1).astype(np.int64)
            got["hist"] = read_array(self.probe.table("hist"), U64).astype(np.int64)
            self.stats = self.read_stats()
            self.misses = self.recursion_misses()

        if not self.collect(read):
            return
        n = self.knobs["N_EXPERTS"]
        E = self.ctx.pmap.n_experts if self.ctx.pmap is not None else 1
        self.table, self.histogram = lru_tables(got["counts"], got["hist"].reshape(len(HISTOGRAMS), HIST_SLOTS), n, E,
                                                self.have_activate)
        self.collected = True

    def lost(self) -> dict[str, Any]:
        """The manifest's ``lost["lru"]``: recursion misses per program (events the kernel
        did not run the probe for) and pages the piece split could not place."""
        total = sum(v for v in self.misses.values() if v) if self.misses else 0
        return {"lost_events": total, "recursion_misses": dict(self.misses),
                "unprocessed_pages": self.stats.get("unprocessed_pages", 0),
                "join_update_failed": self.stats.get("join_update_failed", 0),
                "note": "aggregated in the kernel (no stream); a lost add leaves its page unjoined "
                        "(delete_unjoined), a lost insertion leaves its dwell unknown"}

    def summary(self) -> dict[str, Any]:
        s = summarize(self.table, self.histogram, self.vmstat) if self.table is not None else {}
        s.update({
            "drain": None if self.drained is None else {"ok": self.drained[0], "detail": self.drained[1]},
            "have_activate": self.have_activate, "knobs": dict(self.knobs),
            "join": {k: self.stats.get(k) for k in ("insert_joined", "insert_repeated", "insert_anon_stale",
                                                     "activate_joined", "activate_uninserted", "delete_joined",
                                                     "delete_unjoined", "delete_stale", "add_stale")},
            "pages_counted": "every count in pages: folio pages = 1 << order at the page-cache add; insertion "
                             "and activation charged with the joined folio's pages, split per expert",
        })
        return s

    def write(self, run_dir: Path, manifest: dict[str, Any]) -> None:
        """lru.parquet, lru_dwell_histogram.parquet and this probe's manifest sections."""
        self.write_tables(run_dir, manifest, {SPEC.table: self.table, "lru_dwell_histogram": self.histogram})
        self.write_sections(manifest, self.stats, self.lost(), self.summary())
        if self.drained is not None and not self.drained[0]:
            manifest.setdefault("notes", []).append(
                f"lru: the per-CPU LRU batches were not drained at close ({self.drained[1]}): folios still "
                f"batched are not counted as inserted/activated")
