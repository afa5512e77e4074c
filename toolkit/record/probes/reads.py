"""The ``reads`` probe: every read call of the recorded command, timed, classed and
attributed to experts.

probes/reads.bpf.c (CO-RE, compiled once)
times each ``pread64`` / ``preadv`` / ``preadv2`` / ``read`` of the followed
processes (enter -> exit) and counts the page-cache pages added by the calling task while
the call is in flight (``filemap:mm_filemap_add_to_page_cache``). A call is

``hit_only``  no page added: served entirely from the page cache (the hit path),
``miss``      at least one page added (the pages of the call's file are ``added_pages``,
              those outside the call's byte range ``beyond_pages`` = readahead ahead of
              the request, pages of other inodes ``other_added_pages``),
``error``     ret < 0.

"hit-only" means *this* call added no page, not that it did not wait: a call whose pages
another thread's call (or its readahead) added and is still reading waits for that I/O.
Measured on a pool file read by 4 threads with readahead on: one cold call added 2048
pages (8 MiB, six neighbouring extents, ``beyond_pages``), and the neighbours' first-pass
calls were hit-only but took 1.5-4 ms instead of ~0.2 ms - the latency histogram shows it.
Readahead also makes the per-expert ``added_pages`` charge the *calling* expert, where the
pagecache probe charges the page's own expert (totals agree).

In the kernel (counters only, nothing to lose): per class the calls, bytes, requested
bytes, pages and latency sum and a log2 latency histogram (scope ``all`` of
reads_latency.parquet); and per *fd identity* (tgid, fd, gen, epoch) - and per extent of
the file when ``MOE_EXTENT`` splits a pool file - the same counters plus a latency
histogram. ``gen`` counts close() of the fd number in that process and ``epoch`` the
process's close_range() / exec events, so a reused fd number is a new identity.

Attribution: the identity's first counted call reads the fd's inode from the task's fd table
in the kernel (``current->files->fdt->fd[fd]->f_inode``, CO-RE relocated: the call just used
the fd, so it is open), so an fd opened, read and closed between two looks of user space is
attributed like any other (``resolved_by`` ``fd``); if that read fails (another thread closed
the fd meanwhile: ``fd_inode_unread``), the first page added during one of its calls tells
(``add``). The kernel also pushes every new identity, with that inode, into a small ring:
:meth:`ReadsRecorder.poll` reads ``/proc/<tgid>/fd/<fd>``'s path at once and keeps it when the
fd still shows that inode (the ``path`` column is for people; attribution needs only the
inode). The inode maps to experts through the pool map (``ctx.pmap.inodes``: one expert per
file, or for the pool file ``base + pos // extent_bytes``).

What stays unattributed (rows of reads.parquet with kind ``unattributed``):
``other_files`` (fds of files outside the pool: Python's imports, the plan, pipes),
``unresolved_fd`` (neither the fd table nor an added page told the inode: an fd closed by
another thread during the call, its calls all page-cache hits), ``no_position``
(read() of the pool file: the file position is not a syscall argument), ``pool_tail``
(past the pool file's last extent), ``bad_fd`` (calls that failed with EBADF: no open
file, kept apart in the kernel so that they do not merge with the fd number's next open
file), ``fd_map_full`` (MOE_MAX_FDS identities exceeded).
A call is attributed by its start position: a call spanning two extents of the pool file
counts for the first. dup2()/dup3() onto an open fd are not seen as closes. io_uring and
mmap reads are not read calls (pages they add show up in ``pages_added_outside_calls``
for the followed tasks).

Oracle (tests/*/test_reads_probe.py): the replay's own log: a psync (``--mode pagecache``)
replay's bytes equal the bytes of the calls attributed to experts, and its expert reads x
calls per expert (``ceil(read_len / read_size)``) their calls, exactly; cold, every call of
the first pass is a miss with 256 pages per 1 MiB expert; the added pages equal the
pagecache probe's.
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from moetrace.lazyimport import pandas as pd

from moetrace.record.spec import Knob, ProbeSpec, Struct, tp_cand, group
from moetrace.run.tables import TABLES, named_tables
from moetrace.errors import MoetraceError, ProbeError
from moetrace.kernel.syscalls import kernel_dev
from moetrace.record.poolmap import PAGE, PoolMap
from moetrace.record.probe import ProbeRecorder, RecordContext, log2_bounds
from moetrace.record.spec import AttachPlan

# -- the declaration: attach candidates, knobs, tables (probes/reads.bpf.c and probes/reads.bpf.c agree:
# tests/probe_build/test_core_objects.py)

_READ_SYSCALLS = ("pread64", "preadv", "preadv2", "read")
#: read syscall -> (enter fields, group knob): pread64 is required, the others optional
_READ_ENTER = {"pread64": (("fd", "pos", "count"), None), "preadv": (("fd", "vec", "vlen", "pos_l"), "MOE_HAVE_PREADV"),
               "preadv2": (("fd", "vec", "vlen", "pos_l"), "MOE_HAVE_PREADV2"),
               "read": (("fd", "count"), "MOE_HAVE_READ")}


#: probes/reads.bpf.c. Reads only tracepoint + syscall arguments
#: and the caller's iovec array (user memory); fd -> inode -> expert is resolved in user space
#: (moetrace.record.probes.reads).
READS = ProbeSpec(
    name="reads",
    recorder="ReadsRecorder",
    order=60,
    description="per read call of the followed processes: latency, bytes, pages added during the call -> "
                "hit-only / miss / error, aggregated per class and per fd identity in the kernel, attributed "
                "to experts in user space (/proc/<tgid>/fd + the first added page's inode)",
    attach=tuple(
        g for sc in _READ_SYSCALLS for g in (
            group(f"{sc}_enter", tp_cand(f"syscalls:sys_enter_{sc}", fields=_READ_ENTER[sc][0],
                                      note="fd, file position and requested bytes of the call"
                                           + (" (bytes summed from the user iovec array; pos_h is ignored by "
                                              "64-bit kernels)" if "vec" in _READ_ENTER[sc][0] else "")
                                           + (" (no position: pool-file reads stay unattributed)"
                                              if sc == "read" else "")
                                           + (" (since 4.6; Python's os.preadv, the replay's read call, "
                                              "issues preadv2)" if sc == "preadv2" else "")),
               required=sc == "pread64", knob=_READ_ENTER[sc][1]),
            group(f"{sc}_exit", tp_cand(f"syscalls:sys_exit_{sc}", fields=("ret",),
                                     note="ret: bytes read or -errno; the call's latency ends here"),
               required=sc == "pread64", knob=_READ_ENTER[sc][1]))
    ) + (
        group("add", tp_cand("filemap:mm_filemap_add_to_page_cache", fields=("i_ino", "index", "s_dev"),
                          field_knobs=(("order", "MOE_HAVE_ORDER"),),
                          note="a folio added while the task has a read call in flight: the call missed; "
                               "pages = 1 << order (large folios), the first add tells the call's inode")),
        group("close", tp_cand("syscalls:sys_enter_close", fields=("fd",),
                            note="a closed fd number starts a new fd identity (gen + 1)"),
           required=False, knob="MOE_TRACK_CLOSE"),
        group("close_range", tp_cand("syscalls:sys_enter_close_range",
                                  note="close_range (5.9+): a new epoch for every fd of the process"),
           required=False, knob="MOE_TRACK_CLOSE_RANGE"),
        group("exec", tp_cand("sched:sched_process_exec",
                           note="exec closes O_CLOEXEC fds without close(): a new epoch"),
           required=False, knob="MOE_TRACK_EXEC"),
        group("newtask", tp_cand("task:task_newtask", fields=("pid", "clone_flags"),
                              note="follow the command's child processes (threads share the tgid)"),
           required=False, knob="MOE_FOLLOW_FORKS"),
    ),
    knobs=(
        Knob("MOE_HAVE_PREADV", 1, "1: load sys_enter/exit_preadv (set from the attach plan)"),
        Knob("MOE_HAVE_PREADV2", 1, "1: load sys_enter/exit_preadv2 (set from the attach plan)"),
        Knob("MOE_HAVE_READ", 1, "1: load sys_enter/exit_read (set from the attach plan)"),
        Knob("MOE_TRACK_CLOSE", 1, "1: close() starts a new fd identity (close group)"),
        Knob("MOE_TRACK_CLOSE_RANGE", 1, "1: close_range() starts a new epoch (close_range group)"),
        Knob("MOE_TRACK_EXEC", 1, "1: exec starts a new epoch (exec group)"),
        Knob("MOE_FOLLOW_FORKS", 1, "1: a followed tgid's new processes are followed too (newtask group)"),
        Knob("MOE_HAVE_ORDER", 1, "1: the add format carries the folio order (set from the format file)"),
        Knob("MOE_EXTENT", 0, "bytes per aggregated extent of a file: the pool file's extent (per-expert "
                              "split by call position); 0: no split (files layout)"),
        Knob("MOE_PAGE_SHIFT", 12, "log2 of the page size (the call's page range for beyond_pages)"),
        Knob("MOE_MAX_IOV", 16, "iovec entries of a preadv summed into its requested bytes"),
        Knob("MOE_MAX_TASKS", 4096, "tid -> call in flight entries"),
        Knob("MOE_MAX_TGIDS", 1024, "followed processes"),
        Knob("MOE_MAX_FDS", 16384, "retired (fd identity, extent) aggregates (counters + latency histogram, "
                                   "~0.6 KiB each); raised for a pool file's extents; overflow lands in one slot"),
        Knob("MOE_MAX_FDGEN", 8192, "(tgid, fd) -> current identity entries (its generation, and its counters "
                                    "in the files layout; ~0.6 KiB each)"),
        Knob("MOE_STREAM", 0, "1: one ring record per call (read_calls table)"),
        Knob("MOE_RINGBUF_PAGES", 256, "ring buffer size in pages (power of two) when streaming"),
        Knob("MOE_IDENT_RING_PAGES", 16, "size of the always-on ring of new fd identities (user space stats "
                                         "/proc/<tgid>/fd/<fd> while it is open)"),
    ),
    table="reads",
    schema=TABLES["reads"],
    more_tables=named_tables("reads_latency", "reads_files", "read_calls", "read_calls_intervals"),
    stats=("calls_pread64", "calls_preadv", "calls_preadv2", "calls_read", "nested_enters", "inflight_full",
           "exit_without_enter", "add_events_in_calls", "pages_added_outside_calls", "fd_map_full",
           "ring_drops", "tgid_full", "iov_truncated", "iov_read_errors", "closes",
           "epoch_bumps", "fdgen_full", "ident_drops", "retire_failed", "fd_inode_unread"),
    structs=(
        Struct("class_counts", tuple((f, "u64") for f in ("calls", "bytes", "requested_bytes", "added_pages",
                                                           "beyond_pages", "other_pages", "latency_ns"))),
        Struct("fd_key", (("tgid", "u32"), ("fd", "u32"), ("gen", "u32"), ("epoch", "u32"), ("chunk", "u64"))),
        Struct("fd_counts", tuple((f, "u64") for f in (
            "calls", "bytes", "requested_bytes", "hit_calls", "hit_bytes", "hit_latency_ns", "miss_calls",
            "miss_bytes", "miss_latency_ns", "error_calls", "error_latency_ns", "added_pages", "beyond_pages",
            "other_pages", "ino", "dev", "ino_by"))),
        Struct("ident", (*((f, "u32") for f in ("tgid", "fd", "gen", "epoch")), ("ino", "u64"), ("dev", "u64"))),
        Struct("inflight", (("start_ns", "u64"), ("pos", "u64"), ("count", "u64"), ("ino", "u64"), ("added", "u64"),
                            ("beyond", "u64"), ("other", "u64"), ("fd", "u32"), ("gen", "u32"), ("epoch", "u32"),
                            ("sc", "u32"), ("dev", "u32"), ("pad", "u32"))),
        Struct("read_call", (("ts_ns", "u64"), ("pos", "u64"), ("count", "u64"), ("ret", "s64"),
                             ("latency_ns", "u64"), ("ino", "u64"), ("tid", "u32"), ("tgid", "u32"), ("fd", "u32"),
                             ("gen", "u32"), ("epoch", "u32"), ("syscall", "u32"), ("added_pages", "u32"),
                             ("beyond_pages", "u32"), ("other_pages", "u32"), ("dev", "u32"))),
    ),
    map_sizes=lambda k: _map_sizes(k),
)

SPEC = READS
#: syscalls of probes/reads.bpf.c, in SC_* order
SYSCALLS = ("pread64", "preadv", "preadv2", "read")
#: call classes, in CLASS_* order
CLASSES = ("hit_only", "miss", "error")
#: log2 latency slots of probes/reads.bpf.c (HIST_SLOTS): the last one also holds longer calls
HIST_SLOTS = 40
NOPOS = (1 << 64) - 1
#: unattributed sources, in the order of their rows in reads.parquet
UNATTRIBUTED = ("other_files", "unresolved_fd", "no_position", "pool_tail", "bad_fd", "fd_map_full")
CLASS_FIELDS = tuple(f for f, _t in SPEC.struct("class_counts").fields)
FD_FIELDS = tuple(f for f, _t in SPEC.struct("fd_counts").fields)
READ_CALL_DTYPE = SPEC.struct("read_call").dtype()
CLASS_COUNTS_DTYPE = SPEC.struct("class_counts").dtype()
FD_KEY_DTYPE = SPEC.struct("fd_key").dtype()
INFLIGHT_DTYPE = SPEC.struct("inflight").dtype()
#: struct fd_agg (the counters and a u32 per class x log2 slot) and struct live (an fd number's
#: generation, epoch and current aggregate): nested, so built here from the declared fd_counts
#: (tests/probe_build/test_reads_probe.py holds both to the object's BTF)
FD_AGG_DTYPE = np.dtype([("c", SPEC.struct("fd_counts").dtype()), ("hist", "<u4", (len(CLASSES) * HIST_SLOTS,))],
                        align=True)
LIVE_DTYPE = np.dtype([("gen", "<u4"), ("epoch", "<u4"), ("a", FD_AGG_DTYPE)], align=True)
U32, U64 = np.dtype("<u4"), np.dtype("<u8")
STAT = {name: i for i, name in enumerate(SPEC.stats)}
IDENT_DTYPE = SPEC.struct("ident").dtype()
#: seconds between two drains of the idents ring (the kernel submits without a wake-up): the
#: path of an fd open at least this long is read
IDENT_DRAIN_S = 0.05
#: ``struct fd_counts`` ino_by: where the identity's inode came from
INO_BY = {1: "fd", 2: "add"}
PAGE = os.sysconf("SC_PAGE_SIZE")

Ident = tuple[int, int, int, int]  # (tgid, fd, gen, epoch)


# ---------------------------------------------------------------------------
# the BPF maps and knobs


def _map_sizes(k: dict[str, int]) -> dict[str, int]:
    """The CO-RE object's map sizes from its knobs (probes/reads.bpf.c names the maps); a ring
    is a power-of-two number of pages (the `calls` ring takes one page when nothing streams)."""
    return {"tgids": int(k["MOE_MAX_TGIDS"]), "inflight": int(k["MOE_MAX_TASKS"]), "fdgen": int(k["MOE_MAX_FDGEN"]),
            "fds": int(k["MOE_MAX_FDS"]), "fd_overflow": 2, "zeros": 1, "classes": len(CLASSES),
            "hist": len(CLASSES) * HIST_SLOTS, "stats": len(SPEC.stats),
            "idents": PAGE * int(k["MOE_IDENT_RING_PAGES"]),
            "calls": PAGE * (int(k["MOE_RINGBUF_PAGES"]) if k["MOE_STREAM"] else 1)}


def reads_knobs(plan: AttachPlan, pool: PoolMap | None, stream: bool, **over: int) -> dict[str, int]:
    """The knobs of the reads probe: the attach plan's (group and field knobs), the pool's
    extent split, the page size and the stream switch; ``over`` wins."""
    k: dict[str, int] = dict(plan.knobs)
    k["MOE_EXTENT"] = pool.extent_bytes if pool is not None and pool.split else 0
    if k["MOE_EXTENT"]:  # one `fds` entry per (fd identity, extent): room for each thread's fd
        need = 4 * pool.n_total + 4096
        k["MOE_MAX_FDS"] = max(int(SPEC.knob_values()["MOE_MAX_FDS"]), 1 << (need - 1).bit_length())
    k["MOE_PAGE_SHIFT"] = PAGE.bit_length() - 1
    k["MOE_STREAM"] = int(bool(stream))
    k.update(over)
    return {n: int(v) for n, v in SPEC.knob_values(**k).items()}


# ---------------------------------------------------------------------------
# fd identity -> inode


@dataclass
class Resolution:
    ino: int
    dev: int  # kernel encoding
    path: str | None
    by: str  # "fd" (the task's fd table, in the kernel) | "add" (the first added page)


@dataclass
class FdPaths:
    """The paths of the fd identities the kernel announces (the idents ring), read from
    ``<proc>/<tgid>/fd/<fd>`` while the fd is open.

    The kernel announces each new identity with the inode it read from the task's fd table;
    a readlink is kept only when a stat of the link after it shows that inode (the fd was not
    closed and reused meanwhile). Paths are for people: attribution needs only the inode."""

    proc: str = "/proc"
    paths: dict[Ident, str] = field(default_factory=dict)
    announced: int = 0
    stale: int = 0  # closed, or reused for another file, before the look
    unread: int = 0  # announced without an inode (the kernel could not read the fd table)

    def look(self, tgid: int, fd: int, gen: int, epoch: int, ino: int, dev: int) -> bool:
        """Read one announced identity's path now; True when kept."""
        self.announced += 1
        if not ino:
            self.unread += 1
            return False
        link = f"{self.proc}/{tgid}/fd/{fd}"
        try:
            path = os.readlink(link)
            st = os.stat(link)
        except OSError:
            self.stale += 1
            return False
        if (st.st_ino, kernel_dev(st.st_dev)) != (ino, dev):
            self.stale += 1
            return False
        self.paths[(tgid, fd, gen, epoch)] = path
        return True


# ---------------------------------------------------------------------------
# what the kernel collected -> tables (pure: no kernel needed)


def fd_frames(keys: np.ndarray, aggs: np.ndarray) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(fds, fd_hist) of :class:`Collected` from the identities ``keys`` (FD_KEY_DTYPE: tgid, fd,
    gen, epoch, chunk) and their ``struct fd_agg`` values ``aggs`` (FD_AGG_DTYPE: ``c`` counters,
    ``hist`` calls per class x log2 slot)."""
    ident = {c: keys[c].astype(np.int64) for c in ("tgid", "fd", "gen", "epoch")}
    fds = pd.DataFrame({**ident, "chunk": keys["chunk"].astype("uint64"),
                        **{f: aggs["c"][f].astype(np.int64) for f in FD_FIELDS}},
                       columns=["tgid", "fd", "gen", "epoch", "chunk", *FD_FIELDS])
    h = aggs["hist"].astype(np.int64)  # (identities, classes x slots)
    row, i = np.nonzero(h)
    fd_hist = pd.DataFrame({**{c: v[row] for c, v in ident.items()}, "cls": i // HIST_SLOTS, "slot": i % HIST_SLOTS,
                            "calls": h[row, i]}, columns=["tgid", "fd", "gen", "epoch", "cls", "slot", "calls"])
    return fds, fd_hist


def percpu_totals(table, dtype: np.dtype) -> np.ndarray:
    """A per-CPU array map of ``dtype`` (u64 fields) summed over CPUs, one record per index (either
    loader's table: the kernel copies each value, 8-byte aligned, once per possible CPU)."""
    from moetrace.kernel.bpf import read_array
    from moetrace.kernel.libbpf import possible_cpus

    ncpu = possible_cpus()
    raw = read_array(table, np.dtype((dtype, (ncpu,))), value_size=dtype.itemsize * ncpu)
    out = np.zeros(len(raw), dtype)
    for f in dtype.names:
        out[f] = raw[f].sum(axis=1)
    return out


@dataclass
class Collected:
    """The kernel's aggregates of one recording, read back at close.

    classes: {class: {CLASS_FIELDS}}; hist: (3, 64) calls per class and log2 slot;
    fds: one row per (tgid, fd, gen, epoch, chunk) with FD_FIELDS; fd_hist: tgid, fd,
    gen, epoch, cls, slot, calls; overflow: FD_FIELDS of the calls that found the fd map
    full; stats: the STAT_* slots; stream: the raw read_call records (None: no stream)."""

    classes: dict[str, dict[str, int]]
    hist: np.ndarray
    fds: pd.DataFrame
    fd_hist: pd.DataFrame
    overflow: dict[str, int]
    stats: dict[str, int]
    bad_fd: dict[str, int] = field(default_factory=dict)
    inflight_left: int = 0
    stream: bytes | None = None
    intervals: list = field(default_factory=list)


def _ident_inodes(fds: pd.DataFrame, paths: dict[Ident, str]) -> dict[Ident, Resolution]:
    """Every identity's inode as the kernel kept it (``ino_by``: its fd table, else its first
    added page; the extents of one identity share it), with its path when one was read."""
    out: dict[Ident, Resolution] = {}
    if not len(fds):
        return out
    known = fds[fds["ino_by"] != 0].sort_values("ino_by", kind="stable")
    for r in known.drop_duplicates(["tgid", "fd", "gen", "epoch"]).itertuples(index=False):
        ident = (int(r.tgid), int(r.fd), int(r.gen), int(r.epoch))
        out[ident] = Resolution(int(r.ino), int(r.dev), paths.get(ident), INO_BY.get(int(r.ino_by), "add"))
    return out


def files_table(col: Collected, inos: dict[Ident, Resolution], pool: PoolMap | None,
                extent: int) -> pd.DataFrame:
    """reads_files: one row per (fd identity, extent) with its inode, path, source and
    expert (``inos``: :func:`_ident_inodes`)."""
    fds = col.fds
    rows = []
    for r in fds.itertuples(index=False):
        ident = (int(r.tgid), int(r.fd), int(r.gen), int(r.epoch))
        res = inos.get(ident)
        chunk = None if int(r.chunk) == NOPOS else int(r.chunk)
        pos = None if chunk is None else chunk * extent
        if res is None:
            source, eid = "unresolved_fd", None
        elif pool is None:
            source, eid = "other_files", None
        else:
            source, eid = pool.locate(res.ino, res.dev, pos)
        rows.append({
            "tgid": ident[0], "fd": ident[1], "gen": ident[2], "epoch": ident[3], "extent": chunk,
            "ino": None if res is None else res.ino, "dev": None if res is None else res.dev,
            "path": None if res is None else res.path, "resolved_by": None if res is None else res.by,
            "source": source, "expert_id": eid,
            "calls": int(r.calls), "bytes": int(r.bytes), "hit_only_calls": int(r.hit_calls),
            "miss_calls": int(r.miss_calls), "error_calls": int(r.error_calls),
            "added_pages": int(r.added_pages),
            "latency_ns_sum": int(r.hit_latency_ns) + int(r.miss_latency_ns) + int(r.error_latency_ns),
            # kept for the per-expert sums, not written
            "_requested_bytes": int(r.requested_bytes), "_hit_bytes": int(r.hit_bytes),
            "_hit_latency_ns": int(r.hit_latency_ns), "_miss_bytes": int(r.miss_bytes),
            "_miss_latency_ns": int(r.miss_latency_ns), "_error_latency_ns": int(r.error_latency_ns),
            "_beyond_pages": int(r.beyond_pages), "_other_pages": int(r.other_pages),
        })
    cols = [c.name for c in SPEC.tables()["reads_files"]]
    df = pd.DataFrame(rows, columns=cols + [c for c in (rows[0] if rows else {}) if c.startswith("_")])
    types = {c.name: c.dtype for c in SPEC.tables()["reads_files"]}
    for c, t in types.items():
        df[c] = df[c].astype(t)
    return df


_SUMS = {  # reads.parquet column -> reads_files column
    "calls": "calls", "bytes": "bytes", "requested_bytes": "_requested_bytes",
    "hit_only_calls": "hit_only_calls", "hit_only_bytes": "_hit_bytes", "hit_only_latency_ns_sum": "_hit_latency_ns",
    "miss_calls": "miss_calls", "miss_bytes": "_miss_bytes", "miss_latency_ns_sum": "_miss_latency_ns",
    "error_calls": "error_calls", "error_latency_ns_sum": "_error_latency_ns", "latency_ns_sum": "latency_ns_sum",
    "added_pages": "added_pages", "beyond_pages": "_beyond_pages", "other_added_pages": "_other_pages",
}
_OVERFLOW = {  # reads.parquet column -> fd_counts field
    "calls": "calls", "bytes": "bytes", "requested_bytes": "requested_bytes", "hit_only_calls": "hit_calls",
    "hit_only_bytes": "hit_bytes", "hit_only_latency_ns_sum": "hit_latency_ns", "miss_calls": "miss_calls",
    "miss_bytes": "miss_bytes", "miss_latency_ns_sum": "miss_latency_ns", "error_calls": "error_calls",
    "error_latency_ns_sum": "error_latency_ns", "added_pages": "added_pages", "beyond_pages": "beyond_pages",
    "other_added_pages": "other_pages",
}


def experts_table(files: pd.DataFrame, overflow: dict[str, int], pool: PoolMap | None,
                  bad_fd: dict[str, int] | None = None) -> pd.DataFrame:
    """reads.parquet: one row per expert (expert_id order), then one per unattributed source
    (``overflow``: the calls that found the per-fd map full; ``bad_fd``: calls that failed
    with EBADF, counted apart in the kernel)."""
    n = pool.n_total if pool is not None else 0
    E = pool.n_experts if pool is not None else 1
    out = {c: np.zeros(n + len(UNATTRIBUTED), np.int64) for c in _SUMS}
    idents = np.zeros(n + len(UNATTRIBUTED), np.int64)
    row_of = {s: n + i for i, s in enumerate(UNATTRIBUTED)}
    if len(files):
        f = files.copy()
        f["_row"] = [int(e) if s == "expert" else row_of[s]
                     for s, e in zip(f["source"], f["expert_id"].fillna(-1).astype("int64"))]
        g = f.groupby("_row")
        for c, src in _SUMS.items():
            s = g[src].sum()
            out[c][s.index.to_numpy()] = s.to_numpy(np.int64)
        ids = f.drop_duplicates(["_row", "tgid", "fd", "gen", "epoch"]).groupby("_row").size()
        idents[ids.index.to_numpy()] = ids.to_numpy()
    for source, counts in (("fd_map_full", overflow), ("bad_fd", bad_fd or {})):
        for c, src in _OVERFLOW.items():
            out[c][row_of[source]] += int(counts.get(src, 0))
    eid = np.arange(n, dtype=np.int64)
    na = [pd.NA] * len(UNATTRIBUTED)
    df = pd.DataFrame({
        "kind": pd.array(["expert"] * n + ["unattributed"] * len(UNATTRIBUTED), dtype="string"),
        "source": pd.array(["expert"] * n + list(UNATTRIBUTED), dtype="string"),
        "layer": pd.array(list(eid // E) + na, dtype="Int32"),
        "expert": pd.array(list(eid % E) + na, dtype="Int32"),
        "expert_id": pd.array(list(eid) + na, dtype="Int64"),
    })
    for c in _SUMS:
        df[c] = pd.array(out[c], dtype="Int64")
    fi = pd.array(idents, dtype="Int64")
    for source in ("fd_map_full", "bad_fd"):
        fi[row_of[source]] = pd.NA  # counted without their identities
    df["fd_identities"] = fi
    hb = df["hit_only_bytes"].astype("float64")
    df["hit_only_ns_per_kib"] = (df["hit_only_latency_ns_sum"].astype("float64") / (hb / 1024.0)).where(hb > 0)
    df["hit_only_ns_per_kib"] = df["hit_only_ns_per_kib"].astype("float64")
    return df[[c.name for c in SPEC.schema]]


def latency_table(col: Collected, pool_idents: set[Ident]) -> pd.DataFrame:
    """reads_latency: per scope (all / pool / not_pool) and class, the nonzero log2 slots.

    ``all`` is the kernel's per-class histogram (every followed call); ``pool`` sums the
    per-identity histograms of the fds resolved to a pool file; ``not_pool`` = all - pool
    (calls missing from the per-identity histograms, if any, land there)."""
    allh = np.asarray(col.hist, np.int64).reshape(len(CLASSES), HIST_SLOTS)
    pool = np.zeros_like(allh)
    fh = col.fd_hist
    if len(fh):
        keys = list(zip(fh["tgid"].astype(int), fh["fd"].astype(int), fh["gen"].astype(int), fh["epoch"].astype(int)))
        m = np.array([k in pool_idents for k in keys], bool)
        if m.any():
            np.add.at(pool, (fh["cls"].to_numpy(np.int64)[m], fh["slot"].to_numpy(np.int64)[m]),
                      fh["calls"].to_numpy(np.int64)[m])
    parts = []
    for scope, h in (("all", allh), ("pool", pool), ("not_pool", allh - pool)):
        ci, sl = np.nonzero(h)
        lo, hi = log2_bounds(sl)
        parts.append(pd.DataFrame({
            "scope": pd.array([scope] * len(ci), dtype="string"),
            "class": pd.array([CLASSES[i] for i in ci], dtype="string"),
            "slot": sl.astype("int32"), "lo_ns": lo, "hi_ns": hi, "calls": h[ci, sl].astype("int64")}))
    df = pd.concat(parts, ignore_index=True)
    return df[[c.name for c in SPEC.tables()["reads_latency"]]]


def locate_many(pool: PoolMap | None, ino: np.ndarray, dev: np.ndarray, known: np.ndarray, pos: np.ndarray,
                has_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized :meth:`PoolMap.locate`: (source strings, expert_id or -1) per row.

    ``known``: the row's inode is known; ``has_pos``: its position is (``pos`` in bytes)."""
    source = np.full(len(ino), "unresolved_fd", object)
    source[known] = "other_files"
    eid, where = _locate(pool, ino, dev, known, pos, has_pos)
    for name, m in where.items():
        source[m] = name
    return source, eid


def _locate(pool: PoolMap | None, ino: np.ndarray, dev: np.ndarray, known: np.ndarray, pos: np.ndarray,
            has_pos: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(expert_id or -1 per row, {source: rows} for the pool's rows): numbers only."""
    n = len(ino)
    eid = np.full(n, -1, np.int64)
    if pool is None or not pool.inodes or n == 0:
        return eid, {}
    keys, vals = pool.table
    i = np.clip(np.searchsorted(keys, ino.astype(np.uint64)), 0, len(keys) - 1)
    hit = known & (keys[i] == ino.astype(np.uint64)) & (dev.astype(np.int64) == pool.dev)
    base, cnt = vals[i, 0], vals[i, 1]
    single = hit & (cnt <= 1)
    eid[single] = base[single]
    multi = hit & (cnt > 1)
    if pool.kind == "model":  # by the page's run: experts' pages, else the file's other pages
        page = np.where(has_pos, pos.astype(np.uint64) // np.uint64(PAGE), 0).astype(np.int64)
        slot = pool.classify(ino.astype(np.int64), page)
        off, cnt = slot - base, np.full(n, pool.n_total, np.int64)
    else:
        off = np.where(has_pos, pos.astype(np.uint64) // np.uint64(max(pool.extent_bytes, 1)), 0).astype(np.int64)
    ok = multi & has_pos & (off < cnt)
    eid[ok] = base[ok] + off[ok]
    return eid, {"expert": single | ok, "no_position": multi & ~has_pos, "pool_tail": multi & has_pos & (off >= cnt)}


def _resolved(ev: np.ndarray, inos: dict[Ident, Resolution]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each call's (inode, dev, known): its identity's resolution, else the call's own inode."""
    n = len(ev)
    r_ino, r_dev, have = np.zeros(n, np.uint64), np.zeros(n, np.int64), np.zeros(n, bool)
    if inos and n:
        # identities are few, calls many: factorize (tgid, fd) and (gen, epoch) as exact 64-bit
        # keys, then their pair (a structured sort is ~10x slower)
        k1 = (ev["tgid"].astype(np.uint64) << np.uint64(32)) | ev["fd"].astype(np.uint64)
        k2 = (ev["gen"].astype(np.uint64) << np.uint64(32)) | ev["epoch"].astype(np.uint64)
        u1, i1 = np.unique(k1, return_inverse=True)
        u2, i2 = np.unique(k2, return_inverse=True)
        first, inv = np.unique(i1.astype(np.int64) * len(u2) + i2, return_index=True, return_inverse=True)[1:]
        res = [inos.get((int(ev["tgid"][j]), int(ev["fd"][j]), int(ev["gen"][j]), int(ev["epoch"][j])))
               for j in first]
        r_ino = np.array([r.ino if r else 0 for r in res], np.uint64)[inv]
        r_dev = np.array([r.dev if r else 0 for r in res], np.int64)[inv]
        have = np.array([r is not None for r in res], bool)[inv]
    own = ev["ino"].astype(np.uint64)
    return (np.where(have, r_ino, own), np.where(have, r_dev, ev["dev"].astype(np.int64)), have | (own != 0))


def call_experts(raw: bytes, inos: dict[Ident, Resolution], pool: PoolMap | None) -> dict[str, np.ndarray]:
    """The stream's calls as arrays (``moetrace watch``: no table per interval): ts_ns,
    expert_id (-1: none), ret, latency_ns, hit_only."""
    ev = np.frombuffer(raw, READ_CALL_DTYPE) if raw else np.zeros(0, READ_CALL_DTYPE)
    ino, dev, known = _resolved(ev, inos)
    pos = ev["pos"].astype(np.uint64)
    eids, _where = _locate(pool, ino, dev, known, pos, pos < np.uint64(1 << 63))
    ret = ev["ret"].astype(np.int64)
    hit = (ret >= 0) & (ev["added_pages"].astype(np.int64) + ev["other_pages"].astype(np.int64) == 0)
    return {"ts_ns": ev["ts_ns"].astype(np.int64), "expert_id": eids, "ret": ret,
            "latency_ns": ev["latency_ns"].astype(np.int64), "hit_only": hit}


def calls_table(raw: bytes, inos: dict[Ident, Resolution], pool: PoolMap | None) -> pd.DataFrame:
    """read_calls: the stream, one row per call, attributed like reads.parquet (by identity,
    and for the pool file by the call's own position; an identity never resolved uses the
    call's own first added page)."""
    ev = np.frombuffer(raw, READ_CALL_DTYPE) if raw else np.zeros(0, READ_CALL_DTYPE)
    ret = ev["ret"].astype(np.int64)
    added = ev["added_pages"].astype(np.int64)
    other = ev["other_pages"].astype(np.int64)
    cls = np.where(ret < 0, 2, np.where(added + other > 0, 1, 0))
    pos = ev["pos"].astype(np.uint64)
    sc = ev["syscall"].astype(np.int64)
    has_pos = pos < np.uint64(1 << 63)  # NOPOS (read()) and preadv2's -1 (the file position)
    own = ev["ino"].astype(np.uint64)
    ino, dev, known = _resolved(ev, inos)
    source, eids = locate_many(pool, ino, dev, known, pos, has_pos)
    names = np.array(SYSCALLS + ("?",), object)
    out = pd.DataFrame({
        "ts_ns": ev["ts_ns"].astype(np.int64), "tid": ev["tid"].astype(np.int32), "tgid": ev["tgid"].astype(np.int32),
        "fd": ev["fd"].astype(np.int32), "gen": ev["gen"].astype(np.int32), "epoch": ev["epoch"].astype(np.int32),
        "syscall": pd.array(names[np.clip(sc, 0, len(SYSCALLS))], dtype="string"),
        "offset_bytes": pd.array(np.where(has_pos, pos, 0).astype(np.int64), dtype="Int64"),
        "count_bytes": ev["count"].astype(np.int64), "ret": ret, "latency_ns": ev["latency_ns"].astype(np.int64),
        "added_pages": added, "beyond_pages": ev["beyond_pages"].astype(np.int64), "other_added_pages": other,
        "ino": pd.array(own, dtype="UInt64"),
        "class": pd.array(np.array(CLASSES, object)[cls], dtype="string"),
        "expert_id": pd.array(eids, dtype="Int64"),
        "source": pd.array(source, dtype="string"),
    })
    out.loc[~has_pos, "offset_bytes"] = pd.NA
    out.loc[own == 0, "ino"] = pd.NA
    out.loc[eids < 0, "expert_id"] = pd.NA
    return out[[c.name for c in SPEC.tables()["read_calls"]]]


def replay_oracle(log_dir: Path | None) -> dict[str, Any] | None:
    """What the replay's own log says its read calls were (replay.json): bytes, expert
    reads, calls per expert, and whether the probe's expert calls must equal them exactly
    (``comparable``: ``--mode pagecache`` without pread prefetching). None without a log."""
    if log_dir is None:
        return None
    p = Path(log_dir) / "replay.json"
    try:
        doc = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    ph = doc.get("phases") or {}
    reads = sum(int(v.get("reads") or 0) for v in ph.values())
    byts = sum(int(v.get("bytes") or 0) for v in ph.values())
    hits = sum(int(v.get("arena_hits") or 0) for v in ph.values())
    per_call = doc.get("read_bytes_per_call")
    read_len = doc.get("read_len_bytes")
    cpe = -(-int(read_len) // int(per_call)) if per_call and read_len else None
    mode = doc.get("mode")
    comparable = mode == "pagecache" and doc.get("prefetch") != "pread" and hits == 0 and cpe is not None
    why = None if comparable else (f"mode {mode}, prefetch {doc.get('prefetch')}, arena hits {hits}: the replay's "
                                   "accesses are not all read calls of one size")
    return {"mode": mode, "reads": reads, "bytes": byts, "arena_hits": hits, "calls_per_expert": cpe,
            "expected_calls": reads * cpe if comparable else None, "expected_bytes": byts if comparable else None,
            "comparable": comparable, "why_not": why, "complete": doc.get("complete")}


# ---------------------------------------------------------------------------
# the recorder


class ReadsRecorder(ProbeRecorder):
    """``moetrace record --probes reads``: see the module docstring."""

    name = "reads"
    spec = SPEC
    error = ProbeError
    needs_poll = True

    def __init__(self, ctx: RecordContext):
        super().__init__(ctx)
        self.pool = ctx.pmap
        self.stream = None  # moetrace.kernel.bpf.EventStream of read_call records
        #: identity -> its inode as the kernel announced it (idents ring), when streaming
        self.announced: dict[Ident, Resolution] = {}
        self.paths: FdPaths | None = None
        self.col: Collected | None = None
        self._misses: dict[str, int | None] = {}
        self._root_pids: list[int] = []
        self._t_open = 0.0

    # -- lifecycle --------------------------------------------------------------------------
    def open(self) -> "ReadsRecorder":
        plan = self.require_plan()
        self.knobs = self.with_user_knobs(reads_knobs(plan, self.pool, self.ctx.stream))
        self.load_planned(self.knobs)
        if not self.knobs["MOE_HAVE_PREADV2"]:
            self.ctx.notes.append("reads: preadv2 is not attached: Python's os.preadv (the replay's read call) "
                                  "issues preadv2, so the replay's reads are not seen")
        self.paths = FdPaths()
        self._idents = self.probe.ring_reader("idents", IDENT_DTYPE.itemsize)
        if self.ctx.stream:
            from moetrace.kernel.bpf import EventStream

            stats = self.probe.table("stats")
            slot = STAT["ring_drops"]
            self.stream = EventStream(self.probe, "calls", READ_CALL_DTYPE.itemsize,
                                      kernel_lost=lambda: int(stats.percpu_sums()[slot]),
                                      max_records=self.ctx.stream_max_records)
        self._t_open = time.monotonic()
        return self

    def _drain_idents(self) -> None:
        """The identities announced since the last drain: read each fd's path (still open?)."""
        recs = np.frombuffer(self._idents.read(), IDENT_DTYPE)
        for r in recs.tolist():
            self.paths.look(*r)
            if self.stream is not None and r[4]:  # the stream's calls are attributed by identity
                self.announced[tuple(r[:4])] = Resolution(int(r[4]), int(r[5]), None, "fd")

    def follow(self, pid: int) -> None:
        self.probe.put("tgids", struct.pack("<I", pid), struct.pack("<I", 0))  # followed, epoch 0
        self._root_pids.append(pid)

    def poll(self, timeout_ms: int = 0) -> None:
        if self.probe is None or self.probe.closed:
            return
        # drain every IDENT_DRAIN_S until the deadline, waiting on the command's pidfd (its end
        # returns at once); the stream is read in place after each drain
        t_end = time.monotonic() + max(timeout_ms, 0) / 1000
        while True:
            self._drain_idents()
            if self.stream is not None:
                self.stream.poll(0)
            left = t_end - time.monotonic()
            if left <= 0.001 or self.wait_command(min(left, IDENT_DRAIN_S)):
                break

    def take_calls(self) -> tuple[dict[str, np.ndarray], int]:
        """The read calls streamed since the last take (``moetrace watch``; needs ctx.stream),
        attributed to experts by their identity's announced inode (else the call's own) and
        position, and the calls lost meanwhile (ring full, or over max_records)."""
        if self.stream is None:
            raise MoetraceError("reads: take_calls needs the stream (RecordContext.stream=True)")
        self._drain_idents()
        raw, lost_k, lost_u = self.stream.take()
        return call_experts(raw, self.announced, self.pool), lost_k + lost_u

    def close(self) -> None:
        """Drain the rings, read the kernel's aggregates (``collected``), detach. Idempotent."""
        if self.closed or self.probe is None or self.probe.closed or self.paths is None:
            self.abort()
            return
        try:
            self._drain_idents()
            if self.stream is not None:
                self.stream.finish()
            self._misses = self.recursion_misses()
            self.col = self._collect()
            self.collected = True
        finally:
            self.probe.close()
            self.closed = True

    # -- reading the kernel's side ----------------------------------------------------------
    def _collect(self) -> Collected:
        from moetrace.kernel.bpf import read_array

        t, p = self.probe.table, self.probe
        cls = percpu_totals(t("classes"), CLASS_COUNTS_DTYPE)
        classes = {name: {f: int(cls[i][f]) for f in CLASS_FIELDS} for i, name in enumerate(CLASSES)}
        hist = t("hist").percpu_sums()
        stats = dict(zip(SPEC.stats, t("stats").percpu_sums().tolist()))
        # identities: the retired ones and the per-extent / read() ones (`fds`), and each fd
        # number's current one with its counters (`fdgen`, files layout: chunk 0)
        keys, aggs = p.items("fds", FD_KEY_DTYPE, FD_AGG_DTYPE)
        gk, live = p.items("fdgen", U64, LIVE_DTYPE)
        cur = live["a"]["c"]["calls"] > 0
        now = np.zeros(int(cur.sum()), FD_KEY_DTYPE)
        now["tgid"], now["fd"] = gk[cur] >> np.uint64(32), gk[cur] & np.uint64(0xFFFFFFFF)
        now["gen"], now["epoch"] = live["gen"][cur], live["epoch"][cur]
        fds, fd_hist = fd_frames(np.concatenate([keys, now]), np.concatenate([aggs, live["a"][cur]]))
        ov = read_array(t("fd_overflow"), FD_AGG_DTYPE)["c"]
        overflow = {f: int(ov[0][f]) for f in FD_FIELDS}
        bad_fd = {f: int(ov[1][f]) for f in FD_FIELDS}
        inflight_left = int((p.items("inflight", U32, INFLIGHT_DTYPE)[1]["start_ns"] != 0).sum())  # idle at 0
        raw = self.stream.records() if self.stream is not None else None
        intervals = list(self.stream.intervals) if self.stream is not None else []
        return Collected(classes, hist.reshape(len(CLASSES), HIST_SLOTS), fds, fd_hist, overflow, stats,
                         bad_fd, inflight_left, raw, intervals)

    # -- the run directory ------------------------------------------------------------------
    def tables(self) -> tuple[dict[str, pd.DataFrame], dict[str, Any]]:
        """({table: DataFrame}, summary) of what was collected."""
        if self.col is None:
            raise MoetraceError("reads: nothing collected (close() was not called or failed)")
        fp = self.paths or FdPaths()
        return build(self.col, fp.paths, self.pool, self.knobs.get("MOE_EXTENT", 0), self.ctx.log_dir,
                     {"idents_announced": fp.announced, "paths_stale": fp.stale,
                      "inode_unread": self.col.stats["fd_inode_unread"]})

    def write(self, run_dir: Path, manifest: dict[str, Any]) -> None:
        tables, summary = self.tables()
        self.write_tables(run_dir, manifest, tables)
        plan = self.ctx.plan
        summary["attach"] = {e.group: e.candidate.target for e in plan.attached}
        summary["unavailable"] = {e.group: e.reason for e in plan.entries if not e.attached}
        summary["knobs"] = dict(self.knobs)
        summary["load_attach_s"] = self.load_attach_s
        st = self.col.stats
        misses = self._misses
        self.write_sections(manifest, st, {
            "counters_recursion_misses": misses,
            "counters_lost_events": sum(v for v in misses.values() if v) if misses else None,
            "inflight_full_calls": st["inflight_full"], "exit_without_enter": st["exit_without_enter"],
            "fd_map_full_calls": st["fd_map_full"], "retire_failed": st["retire_failed"],
            "ident_drops": st["ident_drops"], "calls_in_flight_at_close": self.col.inflight_left,
            "stream": None if self.stream is None else {
                "records": self.stream.kept, "lost_kernel": self.stream.lost_kernel,
                "lost_user": self.stream.lost_user, "intervals": len(self.stream.intervals)},
            "note": "per-class and per-fd counters are aggregated in the kernel; calls missing from them are "
                    "counted here (inflight_full; fd_map_full lands in the fd_map_full row; retire_failed: a "
                    "closed identity whose counters landed in the fd_map_full row, its histogram in not_pool)",
        }, summary)


def build(col: Collected, paths: dict[Ident, str], pool: PoolMap | None, extent: int,
          log_dir: Path | None = None, extra: dict[str, Any] | None = None
          ) -> tuple[dict[str, pd.DataFrame], dict[str, Any]]:
    """Every table of the reads probe and its manifest summary from what was collected
    (``paths``: :attr:`FdPaths.paths`)."""
    inos = _ident_inodes(col.fds, paths)
    files = files_table(col, inos, pool, extent)
    experts = experts_table(files, col.overflow, pool, col.bad_fd)
    pool_idents = set()
    if pool is not None:
        pool_idents = {i for i, r in inos.items() if r.ino in pool.inodes and r.dev == pool.dev}
    tables = {"reads": experts, "reads_latency": latency_table(col, pool_idents),
              "reads_files": files[[c.name for c in SPEC.tables()["reads_files"]]]}
    if col.stream is not None:
        tables["read_calls"] = calls_table(col.stream, inos, pool)
        tables["read_calls_intervals"] = pd.DataFrame(
            [{"start_ns": i.start_ns, "end_ns": i.end_ns, "records": i.records, "lost_kernel_records": i.lost_kernel,
              "lost_user_records": i.lost_user} for i in col.intervals],
            columns=[c.name for c in SPEC.tables()["read_calls_intervals"]]).astype("int64")
    e = experts[experts["kind"] == "expert"]
    u = experts[experts["kind"] == "unattributed"].set_index("source")

    def tot(df, c):
        return int(df[c].sum())

    classes = {}
    for name, v in col.classes.items():
        classes[name] = dict(v, latency_ns_mean=(v["latency_ns"] / v["calls"]) if v["calls"] else None)
    hb = tot(e, "hit_only_bytes")
    idents = files.drop_duplicates(["tgid", "fd", "gen", "epoch"]) if len(files) else files
    oracle = replay_oracle(log_dir)
    if oracle is not None:
        oracle["probe_expert_calls"] = tot(e, "calls")
        oracle["probe_expert_bytes"] = tot(e, "bytes")
        oracle["calls_match"] = None if oracle["expected_calls"] is None else \
            oracle["expected_calls"] == oracle["probe_expert_calls"]
        oracle["bytes_match"] = None if oracle["expected_bytes"] is None else \
            oracle["expected_bytes"] == oracle["probe_expert_bytes"]
    summary = {
        "classes": classes,
        "experts": {"calls": tot(e, "calls"), "bytes": tot(e, "bytes"), "hit_only_calls": tot(e, "hit_only_calls"),
                    "miss_calls": tot(e, "miss_calls"), "error_calls": tot(e, "error_calls"),
                    "added_pages": tot(e, "added_pages"), "beyond_pages": tot(e, "beyond_pages"),
                    "hit_only_ns_per_kib": (tot(e, "hit_only_latency_ns_sum") / (hb / 1024)) if hb else None},
        "unattributed": {s: {"calls": int(u.loc[s, "calls"]), "bytes": int(u.loc[s, "bytes"]),
                             "added_pages": int(u.loc[s, "added_pages"])} for s in UNATTRIBUTED},
        "fd_identities": {"total": int(len(idents)),
                          "resolved_fd": int((idents["resolved_by"] == "fd").sum()) if len(idents) else 0,
                          "resolved_add": int((idents["resolved_by"] == "add").sum()) if len(idents) else 0,
                          "unresolved": int(idents["resolved_by"].isna().sum()) if len(idents) else 0,
                          "with_path": int(idents["path"].notna().sum()) if len(idents) else 0,
                          **(extra or {})},
        "calls_by_syscall": {sc: col.stats[f"calls_{sc}"] for sc in SYSCALLS},
        "pages_added_outside_calls": col.stats["pages_added_outside_calls"],
        "calls_in_flight_at_close": col.inflight_left,
        "extent_bytes": extent,
        "replay_check": oracle,
    }
    return tables, summary
