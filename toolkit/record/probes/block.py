"""Block-layer truth per expert: load the block probe, stream read bios, attribute their
bytes to experts through FIEMAP extents (:mod:`moetrace.kernel.extents`).

::

    idx = pool_extents(open_pool(DIR))
    with BlockRecorder(idx) as rec:
        ...                       # the workload
    res = rec.result              # BlockResult (also returned by rec.close())
    res.per_expert                # expert_id, layer, expert, device_read_bytes, bios

The kernel side (probes/block.bpf.c, compiled once and loaded by libbpf) counts read bytes and bios of one disk (the pool's,
tracepoint dev ``(major << 20) | minor``) and streams (sector, nr_sector) per bio through
one ring buffer, counting records it could not reserve; user space splits each bio's
bytes over the extents it overlaps. Latency (block_rq_issue -> block_rq_complete, requeued
requests re-timed from their last issue) is a log2 histogram kept in the kernel.

Which tracepoint counts bytes (block_io_start or block_bio_queue) is decided by
:func:`moetrace.record.spec.resolve` on the ``block`` declaration: asked of the kernel,
never of its version; the CO-RE object holds both programs and loads the chosen one.
Only tracepoint arguments are read.
"""

from __future__ import annotations

import ctypes as ct
import mmap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from moetrace.lazyimport import pandas as pd

from moetrace.record.spec import AttachCandidate, Knob, ProbeSpec, Struct, group, tp_cand
from moetrace.run.tables import EXPERTS_BLOCK, named_tables
from moetrace.errors import ProbeError
from moetrace.kernel.extents import SECTOR, ExpertExtents

from moetrace.record.probe import EngineProbe, log2_bounds, schema_doc

# -- the declaration: attach candidates, knobs, stats slots, ring record (the C agrees:
# tests/unit/test_block_probe.py, tests/probe_build/test_core_objects.py)

_BIO_FIELDS = ("dev", "sector", "nr_sector", "rwbs")

#: probes/block.bpf.c. Reads only tracepoint arguments; bios attributed to experts
#: in user space (FIEMAP extents, moetrace.kernel.extents).
BLOCK = ProbeSpec(
    name="block",
    recorder="BlockProbe",
    order=50,
    user_knobs=False,
    experts=True,
    description="device read bytes per expert via FIEMAP extents (one ring record per bio); request "
                "latency issue -> complete net of requeues, per device",
    attach=(
        group("bytes",
           tp_cand("block:block_bio_queue", fields=_BIO_FIELDS, sets=(("MOE_BYTES_TP", 2),),
               note="every kernel; every bio once with its full size, before merging (matched /proc/diskstats "
                    "in 60 of 60 measured runs)"),
           tp_cand("block:block_io_start", fields=_BIO_FIELDS, sets=(("MOE_BYTES_TP", 1),),
               note="added in 6.5; fires once per request with its first bio's size and misses bios merged "
                    "later (-4.3 % vs diskstats on buffered pool-file reads in 17 of 30 runs): fallback only")),
        group("rq_issue", tp_cand("block:block_rq_issue", fields=_BIO_FIELDS,
                           note="over-counts by requeues: net with rq_requeue")),
        group("rq_complete", tp_cand("block:block_rq_complete", fields=("dev", "sector", "rwbs"),
                              note="IRQ context: can lose events to BPF recursion protection; latency only")),
        group("rq_requeue", tp_cand("block:block_rq_requeue", fields=_BIO_FIELDS)),
    ),
    knobs=(
        Knob("MOE_DEV", 0, "tracepoint dev of the pool's disk, (major << 20) | minor; 0: every device"),
        Knob("MOE_BYTES_TP", 2, "1: bytes at block_io_start, 2: at block_bio_queue (set from the attach plan)"),
        Knob("MOE_RINGBUF_PAGES", 64, "ring buffer size in pages (power of two)"),
        Knob("MOE_STREAM_BIOS", 1, "1: one ring record per read bio (needed to attribute to experts)"),
        Knob("MOE_MAX_INFLIGHT", 65536, "(dev, sector) -> issue time entries for latency"),
    ),
    table="experts",
    schema=EXPERTS_BLOCK,
    more_tables=named_tables("block_latency", "block_device"),
    stats=("read_bytes", "read_bios", "ring_lost", "issues", "issue_bytes", "requeues", "requeue_bytes",
           "completes", "complete_matched", "inflight_full", "latency_ns"),
    structs=(Struct("bio_event", (("sector", "u64"), ("nr_sector", "u32"), ("flags", "u32"))),),
    map_sizes=lambda k: _map_sizes(k),
)

SPEC = BLOCK
SOURCE = SPEC.source_path
#: stats slots of the block probe's C, in order (a test checks the two agree)
STATS = SPEC.stats
HIST_SLOTS = 64
#: struct bio_event of the block probe's C
BIO_EVENT_DTYPE = SPEC.struct("bio_event").dtype()
#: bytes candidates -> their MOE_BYTES_TP value (from the declaration's ``sets``)
BYTES_TP = {c.target: dict(c.sets)["MOE_BYTES_TP"] for c in SPEC.group("bytes").candidates}
_FLUSH_RECORDS = 1 << 20  # attribute buffered records once this many have arrived


def _map_sizes(k: dict[str, int]) -> dict[str, int]:
    """The CO-RE object's map sizes from its knobs (probes/block.bpf.c names the maps). A ring
    nobody reads is one page."""
    pages = int(k["MOE_RINGBUF_PAGES"]) if k["MOE_STREAM_BIOS"] else 1
    return {"stats": len(STATS), "lat_hist": HIST_SLOTS, "inflight": int(k["MOE_MAX_INFLIGHT"]),
            "bios": mmap.PAGESIZE * pages}


@dataclass
class BlockResult:
    """What one recording saw on the pool's disk.

    per_expert: expert_id, layer, expert, device_read_bytes, bios (bios touching the
    expert; a bio spanning two experts counts for both). kernel_read_bytes/bios: the
    in-kernel totals of the bytes tracepoint; streamed_bytes/streamed_bios: the records that
    reached user space (kernel_bios = streamed_bios + lost_events); unattributed_bytes:
    streamed bytes no expert extent covers. latency: slot, lo_ns, hi_ns, requests.
    recursion_misses: per attached program, runs the kernel skipped (IRQ-context
    completions while another BPF program ran). inflight_left: issue entries never
    completed (missed completions or still in flight at close)."""

    per_expert: pd.DataFrame
    unattributed_bytes: int
    kernel_read_bytes: int
    kernel_bios: int
    streamed_bytes: int
    streamed_bios: int
    lost_events: int
    latency: pd.DataFrame
    stats: dict[str, int]
    recursion_misses: dict[str, int]
    inflight_left: int
    attach: dict[str, str]
    dev: int
    start_s: float
    duration_s: float
    knobs: dict[str, int] = field(default_factory=dict)
    load_s: float = 0.0
    attach_s: float = 0.0
    #: False when no extent index was given: nothing could be attributed (count only)
    index_used: bool = True

    @property
    def attributed_bytes(self) -> int:
        return int(self.per_expert["device_read_bytes"].sum())

    def summary(self) -> dict[str, Any]:
        """Scalars for a run manifest / --json."""
        return {"dev": self.dev, "kernel_read_bytes": self.kernel_read_bytes, "kernel_bios": self.kernel_bios,
                "attributed_bytes": self.attributed_bytes, "unattributed_bytes": self.unattributed_bytes,
                "streamed_bytes": self.streamed_bytes, "streamed_bios": self.streamed_bios,
                "lost_events": self.lost_events,
                "recursion_misses": dict(self.recursion_misses), "inflight_left": self.inflight_left,
                "stats": dict(self.stats), "attach": dict(self.attach), "knobs": dict(self.knobs),
                "load_s": self.load_s, "attach_s": self.attach_s, "index_used": self.index_used,
                "start_s": self.start_s,
                "duration_s": self.duration_s}


from moetrace.kernel.bpf import entry_count, prog_fdinfo, recursion_misses  # noqa: E402,F401  (prog_fdinfo re-exported)


def block_knobs(dev: int, bytes_tp: int, ring_pages: int = 64, stream: bool = True,
                max_inflight: int = 65536) -> dict[str, int]:
    """The knobs of the block probe (every declared knob, in declaration order), validated."""
    if ring_pages <= 0 or ring_pages & (ring_pages - 1):
        raise ValueError(f"ring_pages must be a power of two, got {ring_pages}")
    if int(bytes_tp) not in BYTES_TP.values():
        raise ValueError(f"bytes_tp must be one of {sorted(BYTES_TP.values())}, got {bytes_tp}")
    return SPEC.knob_values(MOE_DEV=int(dev), MOE_BYTES_TP=int(bytes_tp), MOE_RINGBUF_PAGES=int(ring_pages),
                       MOE_STREAM_BIOS=int(bool(stream)), MOE_MAX_INFLIGHT=int(max_inflight))


def resolve_plan(features=None, plan=None):
    """(attached {group: candidate}, knobs the kernel decided) of the block declaration:
    ``plan`` (an :class:`~moetrace.record.spec.AttachPlan` already resolved, e.g. by the
    recorder) or :func:`moetrace.record.spec.resolve` on ``features``. Raises
    :class:`ProbeError` when a required group is unavailable."""
    from moetrace.record import spec as probespec

    if plan is None:
        plan = probespec.resolve(SPEC, features)
    out = {}
    for e in plan.entries:
        if e.attached:
            out[e.group] = e.candidate
        elif e.required:
            raise ProbeError(f"block probe: {e.group} unavailable: {e.reason}",
                                  hint="`moetrace doctor` lists every attach point")
    return out, dict(plan.knobs)


def resolve_attach(features=None) -> dict[str, str]:
    """{group: "category:event"} of the block declaration on this kernel; raises
    :class:`ProbeError` when a required group is unavailable."""
    return {g: c.target for g, c in resolve_plan(features)[0].items()}


class BlockRecorder:
    """Load and attach the block probe, poll its ring in a thread, attribute bios to experts.

    index: the pool's :class:`ExpertExtents` (its device gives the disk to watch), or
    None to count only (every sector unattributed; ``dev`` then required, 0 = every disk).
    bytes_tp: force "block:block_io_start" / "block:block_bio_queue" (default: resolved
    from the probespec declaration, or taken from ``plan``, an already resolved
    :class:`~moetrace.record.spec.AttachPlan`). Use as a context manager: probes detach on
    exit, also on exceptions; :attr:`result` holds the :class:`BlockResult`."""

    def __init__(self, index: ExpertExtents | None = None, dev: int | None = None,
                 bytes_tp: str | None = None, ring_pages: int = 256, stream: bool = True,
                 features=None, plan=None, gated: bool = True,
                 arm_at_open: bool = True):
        if dev is None:
            if index is None or index.device is None:
                raise ValueError("BlockRecorder needs an index with a device, or dev=")
            dev = index.device.tp_dev
        self.index = index
        self.dev = int(dev)
        self.ring_pages = ring_pages
        self.stream = stream
        self.features = features
        #: loaded gated: counts only while armed. Standalone (arm_at_open) it is armed
        #: once attached and disarmed first thing in close(), so the ring and the counters cover
        #: the same interval (a bio between draining the ring and reading the counters would be
        #: in one and not the other); `moetrace record` arms it with every other probe.
        self.gated = gated
        self.arm_at_open = arm_at_open
        self._bytes_tp = bytes_tp
        self._plan = plan
        self.attach: dict[str, str] = {}
        self._fns: dict[str, str] = {}
        self.knobs: dict[str, int] = {}
        #: the loaded probe (moetrace.kernel.bpf.CoreProbe) while attached, else None
        self.probe = None
        self.result: BlockResult | None = None
        self.load_s = 0.0
        self.attach_s = 0.0
        self._chunks: list[bytes] = []
        self._nbuf = 0
        self._lock = threading.Lock()
        self._attributing = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poll_error: BaseException | None = None
        n = index.n_total if index is not None else 0
        self._by = np.zeros(n, dtype=np.int64)
        self._bios = np.zeros(n, dtype=np.int64)
        self._unattr = 0
        self._streamed = 0
        self._streamed_bios = 0
        self._t0 = 0.0

    # -- lifecycle ----------------------------------------------------------------------------
    def _candidates(self) -> dict:
        """{group: the AttachCandidate to attach}: resolved, or the bytes_tp the caller forced."""
        if self._bytes_tp is None:
            return resolve_plan(self.features, self._plan)[0]
        if self._bytes_tp not in BYTES_TP:
            raise ValueError(f"bytes_tp must be one of {sorted(BYTES_TP)}")
        return {g.name: (next(c for c in g.candidates if c.target == self._bytes_tp) if g.name == "bytes"
                         else g.candidates[0]) for g in SPEC.attach}

    def open(self) -> "BlockRecorder":
        """Load the CO-RE object, attach and start polling."""
        from moetrace.kernel.bpf import load_core

        if self.features is not None and self.features.tracefs is None:
            from moetrace.kernel.features import tracefs_path

            self.features.tracefs = tracefs_path(self.features.root)
        cands = self._candidates()
        self.attach = {g: c.target for g, c in cands.items()}
        self._fns = {g: c.fn_name for g, c in cands.items()}
        if self.attach["bytes"] not in BYTES_TP:
            raise ProbeError(f"block probe: bytes group resolved to {self.attach['bytes']}, which "
                                  f"the block probe's C does not implement (knows {sorted(BYTES_TP)})")
        # MOE_BYTES_TP comes from the chosen candidate's ``sets`` in the declaration
        self.knobs = block_knobs(self.dev, dict(cands["bytes"].sets)["MOE_BYTES_TP"], self.ring_pages, self.stream)
        self.probe = load_core("block", self.knobs, [(c.fn_name, c.kind, c.target) for c in cands.values()],
                               _map_sizes(self.knobs), gated=self.gated)
        try:
            if self.stream:
                self.probe.open_ring("bios", self._on_record)
        except Exception as e:
            self._cleanup()
            raise ProbeError(f"cannot open the block probe's ring: {e}") from None
        self.load_s, self.attach_s = self.probe.load_s, self.probe.attach_s
        self._t0 = time.time()
        if self.stream:
            self._thread = threading.Thread(target=self._poll_loop, name="moetrace-block-ring", daemon=True)
            self._thread.start()
        if self.gated and self.arm_at_open:
            self.probe.arm(True)
        return self

    def arm(self, on: bool = True) -> None:
        """Start / stop counting (a gated load)."""
        if self.probe is not None and self.gated:
            self.probe.arm(on)

    def __enter__(self) -> "BlockRecorder":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def _poll_loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.probe.ring_poll(100)
        except BaseException as e:  # surfaced by close()
            self._poll_error = e

    def _on_record(self, _ctx, data, size) -> int:
        self._chunks.append(ct.string_at(data, size))
        self._nbuf += 1
        if self._nbuf >= _FLUSH_RECORDS:
            self._flush()
        return 0

    def _flush(self) -> None:
        with self._attributing:  # the ring thread and live_totals() both flush
            with self._lock:
                chunks, self._chunks, self._nbuf = self._chunks, [], 0
            if not chunks:
                return
            rec = np.frombuffer(b"".join(chunks), dtype=BIO_EVENT_DTYPE)
            self._streamed += int(rec["nr_sector"].astype(np.int64).sum()) * SECTOR
            self._streamed_bios += len(rec)
            if self.index is None:
                self._unattr += int(rec["nr_sector"].astype(np.int64).sum()) * SECTOR
                return
            by, bios, un = self.index.attribute(rec["sector"], rec["nr_sector"])
            self._by += by
            self._bios += bios
            self._unattr += un

    def live_totals(self) -> dict[str, Any]:
        """Running totals while attached (``moetrace watch``): the bios the ring delivered so far,
        attributed (per expert device bytes and bios, unattributed bytes), and the kernel's own
        byte / bio / lost counts. A bio still in the ring counts at the next reading; once
        closed, the result's final totals."""
        r = self.result
        if self.probe is None and r is not None:
            return {"device_read_bytes": r.per_expert["device_read_bytes"].to_numpy(np.int64).copy(),
                    "bios": r.per_expert["bios"].to_numpy(np.int64).copy(), "unattributed_bytes": r.unattributed_bytes,
                    "kernel_read_bytes": r.kernel_read_bytes, "kernel_bios": r.kernel_bios,
                    "lost_events": r.lost_events}
        self._flush()
        st = dict(zip(STATS, self.probe.table("stats").percpu_sums().tolist()))
        with self._attributing:
            return {"device_read_bytes": self._by.copy(), "bios": self._bios.copy(),
                    "unattributed_bytes": int(self._unattr), "kernel_read_bytes": int(st["read_bytes"]),
                    "kernel_bios": int(st["read_bios"]), "lost_events": int(st["ring_lost"])}

    def _cleanup(self) -> None:
        """Detach (idempotent). The polling thread is stopped first: closing the probe frees the
        ring buffer that thread may be inside (ring_buffer__poll) at that moment."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if self.probe is not None:
            try:
                self.probe.close()
            finally:
                self.probe = None

    def close(self) -> BlockResult | None:
        """Stop polling, drain the ring, read the kernel's counters, detach. Idempotent."""
        if self.probe is None:
            return self.result
        try:
            if self.gated:
                self.probe.arm(False)  # nothing counts from here on: ring and counters agree
            self._stop.set()
            if self._thread is not None:
                self._thread.join(timeout=10)
            if self.stream:
                self.probe.ring_consume()
            self._flush()
            self.result = self._collect()
        finally:
            self._cleanup()
        if self._poll_error is not None:
            raise ProbeError(f"ring buffer polling failed: {self._poll_error}")
        return self.result

    # -- reading the kernel's side ------------------------------------------------------------
    def _collect(self) -> BlockResult:
        st = dict(zip(STATS, self.probe.table("stats").percpu_sums().tolist()))
        hist = self.probe.table("lat_hist").percpu_sums().tolist()[:HIST_SLOTS]
        inflight_left = entry_count(self.probe.table("inflight"))
        by_fn = recursion_misses(self.probe.prog_fds(), 0)
        misses = {g: by_fn[self._fns[g]] for g in self.attach if self._fns[g] in by_fn}
        slots = np.arange(HIST_SLOTS)
        lo, hi = log2_bounds(slots)  # the slot is moe_log2l(delta) (moetrace.bpf.h)
        lat = pd.DataFrame({"slot": slots, "lo_ns": lo, "hi_ns": hi,
                            "requests": np.array(hist, dtype=np.int64)})
        lat = lat[lat["requests"] > 0].reset_index(drop=True)
        n = len(self._by)
        ids = np.arange(n, dtype=np.int32)
        nexp = self.index.n_experts if self.index is not None and self.index.n_experts else max(n, 1)
        per = pd.DataFrame({"expert_id": ids, "layer": (ids // nexp).astype("int32"),
                            "expert": (ids % nexp).astype("int32"),
                            "device_read_bytes": self._by.copy(), "bios": self._bios.copy()})
        return BlockResult(per_expert=per, unattributed_bytes=int(self._unattr),
                           kernel_read_bytes=st["read_bytes"], kernel_bios=st["read_bios"],
                           streamed_bytes=int(self._streamed), streamed_bios=self._streamed_bios,
                           lost_events=st["ring_lost"], latency=lat,
                           stats=st, recursion_misses=misses, inflight_left=inflight_left,
                           attach=dict(self.attach), dev=self.dev, start_s=self._t0,
                           duration_s=time.time() - self._t0, knobs=dict(self.knobs),
                           load_s=self.load_s, attach_s=self.attach_s, index_used=self.index is not None)


# -- the probe interface (moetrace record) -----------------------------------------------------

class BlockProbe(EngineProbe):
    """The block probe in a recording: the pool's FIEMAP extents, :class:`BlockRecorder` (the
    BPF programs and their ring consumer), /proc/diskstats of the pool's disk over the armed
    interval, and the block_latency / block_device tables."""

    name = "block"
    spec = SPEC
    error = ProbeError

    def __init__(self, ctx):
        super().__init__(ctx)
        self.index = None
        self.disk: str | None = None
        self.pool_disk: dict[str, Any] | None = None

    def open(self) -> "BlockProbe":
        from moetrace.errors import InputError
        from moetrace.kernel.extents import model_extents, pool_extents

        self.require_plan()
        pmap = self.ctx.pmap
        if pmap is not None:
            try:
                self.index = pool_extents(pmap.pool) if pmap.kind == "pool" else model_extents(pmap)
            except InputError as e:
                raise ProbeError(f"the pool's extents cannot be mapped to a disk: {e.message}") from None
            self.disk = self.index.device.disk
            if self.index.problems:
                self.ctx.notes.append(f"block: {len(self.index.problems)} experts have extents whose device bytes "
                                      f"are unknowable (first: {next(iter(self.index.problems.items()))})")
        else:
            self.ctx.notes.append("block: no pool, device reads of every disk are counted, none attributed")
        idx = self.index
        self.engine = BlockRecorder(idx, dev=None if idx is not None else 0, stream=idx is not None,
                                    features=self.ctx.features, plan=self.ctx.plan, gated=self.ctx.gated,
                                    arm_at_open=not self.ctx.gated).open()
        self.probe = self.engine.probe  # the handle: prog_fds / prog_ids and the manifest's loader
        self.knobs = dict(self.engine.knobs)
        self.load_attach_s = self.engine.load_s + self.engine.attach_s
        if self.disk is not None:
            self.pool_disk = {"disk": self.disk}
        return self

    def describe(self, manifest: dict[str, Any]) -> None:
        if self.index is not None:
            d = self.index.device
            manifest["block_device"] = {"disk": self.disk, "tp_dev": d.tp_dev,
                                        "tp_dev_text": f"{d.disk_major}:{d.disk_minor}",
                                        "partition": d.fs_name if d.partitioned else None,
                                        "part_start_sector": d.part_start, "extents": len(self.index)}

    def arm(self, on: bool = True) -> None:
        """Counting and the pool disk's /proc/diskstats window start and stop together."""
        from moetrace.kernel.procfs import read_diskstats

        if self.engine is None:
            return
        if not on:
            self.engine.arm(False)
        if self.pool_disk is not None:
            self.pool_disk["pre" if on else "post"] = read_diskstats(device=self.disk)
        if on:
            self.engine.arm(True)
        self.armed = on

    def write(self, run_dir: Path, manifest: dict[str, Any]) -> None:
        """block_latency / block_device, the summary (device bytes vs diskstats) and lost counts."""
        from moetrace.run import directory as rd

        bres, pool_disk = self.result, self.pool_disk
        disk_delta = None
        if pool_disk is not None and "post" in pool_disk and "pre" in pool_disk:
            disk_delta = (pool_disk["post"]["sectors_read"] - pool_disk["pre"]["sectors_read"]) * 512
        name = self.disk if self.disk is not None else ("all" if bres.dev == 0 else None)
        lat = bres.latency.copy()
        lat.insert(0, "disk", pd.array([name] * len(lat), dtype="string"))
        lat.insert(0, "dev", np.full(len(lat), bres.dev, dtype=np.int64))
        lat["slot"] = lat["slot"].astype("int32")
        tables = manifest.setdefault("tables", {})
        rd.write_table(run_dir, "block_latency", lat[[c.name for c in SPEC.tables()["block_latency"]]])
        tables["block_latency"] = schema_doc(SPEC, "block_latency")
        st = bres.stats
        dev_row = pd.DataFrame({
            "dev": [bres.dev], "disk": pd.array([name], dtype="string"), "read_bytes": [st["read_bytes"]],
            "bios": [st["read_bios"]], "issues": [st["issues"]], "issue_bytes": [st["issue_bytes"]],
            "requeues": [st["requeues"]], "requeue_bytes": [st["requeue_bytes"]], "completes": [st["completes"]],
            "complete_matched": [st["complete_matched"]], "latency_ns_sum": [st["latency_ns"]],
            "diskstats_read_bytes": pd.array([disk_delta], dtype="Int64")})
        rd.write_table(run_dir, "block_device", dev_row)
        tables["block_device"] = schema_doc(SPEC, "block_device")
        summ = bres.summary()
        summ["diskstats_read_bytes"] = disk_delta
        summ["device_vs_diskstats_rel"] = (None if not disk_delta else
                                           (summ["attributed_bytes"] + summ["unattributed_bytes"] - disk_delta)
                                           / disk_delta)
        manifest.setdefault("summaries", {})["block"] = summ
        manifest.setdefault("stats", {})["block"] = dict(st)
        manifest.setdefault("lost", {})["block"] = {
            "ring_lost_bios": bres.lost_events, "recursion_misses": bres.recursion_misses,
            "inflight_left": bres.inflight_left, "inflight_full": st["inflight_full"],
            "note": "bytes are counted at the bytes tracepoint; recursion misses of rq_complete (IRQ context) "
                    "only lose latency samples"}
