"""A run as a timeline for Perfetto (ui.perfetto.dev opens it) or chrome://tracing:
Chrome trace-event JSON (``{"traceEvents": [...]}``), timestamps in microseconds from
the recording's first event (CLOCK_MONOTONIC, the clock of every moetrace table).

Tracks:
* replay / iterations — one slice per replay iteration (phase, repeat, iteration;
  bytes, reads, duration), and the warm-up and measured phases as enclosing slices;
* recorder — the probes' armed interval;
* counters — per iteration: pool pages added, evicted, re-added (the pagecache epochs);
  pages scanned and reclaimed per 100 ms by reclaimer (the reclaim probe's timeline);
  resident pool pages (from page_events, when streamed); locked bytes (mlock timeline);
  MGLRU oldest generation age and max_seq per memcg (lru_gen samples); aging events.

Block I/O is recorded as totals and histograms, not per event: it appears only through its
effects (pages added per iteration). The report writes the document as timeline.json.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from moetrace.errors import InputError

PID_REPLAY, PID_KERNEL, PID_RECORDER = 1, 2, 3
MAX_COUNTER_POINTS = 20_000


def _us(ns, t0: int) -> float:
    return (int(ns) - t0) / 1e3


def _origin(tables: Mapping[str, pd.DataFrame], meta: Mapping[str, Any]) -> int:
    cands = []
    it = tables.get("iterations")
    if it is not None and len(it):
        cands.append(int(it["start_ns"].min()))
    ep = tables.get("epochs")
    if ep is not None and len(ep) and ep["start_ns"].notna().any():
        cands.append(int(ep["start_ns"].dropna().min()))
    armed = (meta.get("interval") or {}).get("armed_ns")
    if armed:
        cands.append(int(armed))
    return min(cands) if cands else 0


def compute_timeline(tables: Mapping[str, pd.DataFrame], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The trace-event document of a run (see module doc)."""
    t0 = _origin(tables, meta)
    ev: list[dict[str, Any]] = []

    def meta_ev(pid: int, tid: int | None, name: str, value: str) -> None:
        e = {"ph": "M", "pid": pid, "name": name, "args": {"name": value}}
        if tid is not None:
            e["tid"] = tid
        ev.append(e)

    meta_ev(PID_REPLAY, None, "process_name", "replay")
    meta_ev(PID_REPLAY, 1, "thread_name", "phases")
    meta_ev(PID_REPLAY, 2, "thread_name", "iterations")
    meta_ev(PID_KERNEL, None, "process_name", "kernel (page cache, MGLRU, mlock)")
    meta_ev(PID_RECORDER, None, "process_name", "moetrace record")
    it = tables.get("iterations")
    if it is not None and len(it):
        for (phase, rep), g in it.groupby(["phase", "repeat"], sort=False):
            s, e = int(g["start_ns"].min()), int(g["end_ns"].max())
            ev.append({"ph": "X", "pid": PID_REPLAY, "tid": 1, "name": f"{phase} {int(rep)}", "cat": "phase",
                       "ts": _us(s, t0), "dur": (e - s) / 1e3, "args": {"iterations": len(g)}})
        for r in it.itertuples():
            ev.append({"ph": "X", "pid": PID_REPLAY, "tid": 2, "cat": "iteration",
                       "name": f"{r.phase} {int(r.repeat)}/{int(r.iteration)}", "ts": _us(r.start_ns, t0),
                       "dur": int(r.duration_ns) / 1e3,
                       "args": {"bytes": int(r.bytes), "reads": int(r.reads), "step": int(r.step)}})
    iv = meta.get("interval") or {}
    if iv.get("armed_ns") and iv.get("disarmed_ns"):
        ev.append({"ph": "X", "pid": PID_RECORDER, "tid": 1, "name": "probes armed", "cat": "recorder",
                   "ts": _us(iv["armed_ns"], t0), "dur": (int(iv["disarmed_ns"]) - int(iv["armed_ns"])) / 1e3})
    ep, ee = tables.get("epochs"), tables.get("expert_epochs")
    if ep is not None and ee is not None and len(ep):
        g = ee[ee["kind"] == "expert"].groupby("epoch")[["added_pages", "evicted_pages", "re_added_pages"]].sum()
        for r in ep.dropna(subset=["start_ns"]).itertuples():
            vals = g.loc[r.epoch] if r.epoch in g.index else None
            args = {c: (int(vals[c]) if vals is not None else 0)
                    for c in ("added_pages", "evicted_pages", "re_added_pages")}
            ev.append({"ph": "C", "pid": PID_KERNEL, "name": "pool pages per iteration", "ts": _us(r.start_ns, t0),
                       "args": args})
    if "page_events" in tables:
        for ts, pages in _resident_points(tables):
            ev.append({"ph": "C", "pid": PID_KERNEL, "name": "pool pages added - deleted (stream)",
                       "ts": _us(ts, t0), "args": {"pages": pages}})
    rt = tables.get("reclaim_timeline") if "reclaim_timeline" in tables else None
    if rt is not None and len(rt):
        from moetrace.analyses.reclaim import compute_reclaim_timeline

        for r in compute_reclaim_timeline(rt, meta).itertuples():
            ev.append({"ph": "C", "pid": PID_KERNEL, "name": f"reclaim ({r.who}) per 100 ms", "ts": _us(r.time_ns, t0),
                       "args": {"scanned_pages": int(r.scanned_pages), "reclaimed_pages": int(r.reclaimed_pages)}})
    ml = tables.get("mlock_timeline")
    if ml is not None and len(ml):
        for r in ml.itertuples():
            v = r.total_locked_bytes
            ev.append({"ph": "C", "pid": PID_KERNEL, "name": "locked bytes", "ts": _us(r.time_ns, t0),
                       "args": {"bytes": 0 if pd.isna(v) else int(v)}})
    lg = tables.get("lru_gen")
    if lg is not None and len(lg):
        from moetrace.analyses.age import compute_generations

        for r in compute_generations(lg).itertuples():
            name = f"MGLRU {r.memcg_path or '/'} node {r.node}"
            ev.append({"ph": "C", "pid": PID_KERNEL, "name": name, "ts": _us(r.time_ns, t0),
                       "args": {"oldest_age_ms": 0 if pd.isna(r.oldest_age_ms) else int(r.oldest_age_ms),
                                "max_seq": int(r.max_seq)}})
    ag = tables.get("mglru_aging")
    if ag is not None and len(ag):
        for r in ag.itertuples():
            ev.append({"ph": "i", "s": "p", "pid": PID_KERNEL, "tid": 1, "name": f"aging: {r.kind}",
                       "ts": _us(r.time_ns, t0), "args": {"tgid": int(r.tgid)}})
    ev.sort(key=lambda e: (e.get("ts", -1.0), e["ph"] != "M"))
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"source": "moetrace", "run": str(meta.get("run_path", "")),
                          "clock": "CLOCK_MONOTONIC", "origin_ns": t0}}


def _resident_points(tables) -> list[tuple[int, int]]:
    """(ts_ns, pages added - deleted so far) at most MAX_COUNTER_POINTS times, streamed from
    page_events.parquet in batches when the tables know the file (bounded memory)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if hasattr(tables, "path"):
        from moetrace.analyses.page_events import iter_batches

        path = tables.path("page_events")
        try:
            n = pq.ParquetFile(path).metadata.num_rows
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"cannot read the page events: {e}", path=str(path)) from None
        batches = iter_batches(path, ["ts_ns", "kind", "pages"], 1 << 20)
    else:
        t = pa.Table.from_pandas(tables["page_events"][["ts_ns", "kind", "pages"]], preserve_index=False)
        n = t.num_rows
        batches = t.to_batches()
    step = max(1, n // MAX_COUNTER_POINTS)
    out, carry, seen = [], 0, 0
    for b in batches:
        kind = b.column(1)
        if pa.types.is_dictionary(kind.type):
            kind = kind.cast(pa.string())
        sign = np.where(pc.equal(kind, "add").to_numpy(zero_copy_only=False), 1, -1)
        res = carry + np.cumsum(sign * b.column(2).to_numpy().astype(np.int64))
        ts = b.column(0).to_numpy().astype(np.int64)
        first = (-seen) % step
        for i in range(first, len(ts), step):
            out.append((int(ts[i]), int(res[i])))
        if len(res):
            carry = int(res[-1])
        seen += len(ts)
    return out
