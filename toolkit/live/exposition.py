"""``moetrace watch``'s metrics in the Prometheus text exposition format (prometheus_client):
served over HTTP (``--prometheus HOST:PORT``) and / or written for node_exporter's textfile
collector (``--textfile DIR``).

Names follow node_exporter's conventions (base units, ``_total`` for counters). Counters of the
probes count from watch's attach; the scope's kernel counters (scan, steal, refaults, PSI) are
the kernel's own since boot (as node_exporter exports vmstat), so ``rate()`` works on both.
Per-expert series exist for the top experts by re-added pages only (``top``, default 20): the
cardinality is bounded, whatever the pool's size.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from moetrace.errors import UsageError
from moetrace.live.alarms import ALARMS
from moetrace.live.interval import Reading
from moetrace.run.evictors import EVICTORS

TEXTFILE_NAME = "moetrace.prom"


class Exposition:
    """The latest reading and interval, rendered as metrics at each scrape."""

    def __init__(self, n_experts: int, n_per_layer: int, top: int = 20):
        from prometheus_client import CollectorRegistry

        self.n, self.e, self.top = n_experts, max(n_per_layer, 1), top
        self.lock = threading.Lock()
        self.cur: Reading | None = None
        self.fig: dict[str, Any] | None = None
        self.intervals = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.server = self.thread = None
        self.textfile: Path | None = None
        self.port: int | None = None

    def update(self, cur: Reading, fig: dict[str, Any]) -> None:
        with self.lock:
            self.cur, self.fig = cur, fig
            self.intervals += 1

    # -- the collector (prometheus_client calls collect() at every scrape) --------------------
    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily as C
        from prometheus_client.core import GaugeMetricFamily as G

        with self.lock:
            cur, fig, k = self.cur, self.fig, self.intervals
        if cur is None:
            return
        yield C("moetrace_watch_intervals", "Intervals watch has read", value=k)
        yield from self._pool(cur, C)
        yield from self._scope(cur.scope, fig or {}, C, G)
        al = G("moetrace_alarm", "1 while the alarm is raised (judged every interval)", labels=["name"])
        for name in ALARMS:
            on = ((fig or {}).get("alarms") or {}).get(name, {}).get("on")
            if on is not None:
                al.add_metric([name], float(on))
        yield al

    def _pool(self, cur: Reading, C):
        n = self.n
        pc, blk = cur.pagecache, cur.block
        if pc is not None:
            yield C("moetrace_pool_added_pages", "Pool pages added to the page cache (misses)",
                    value=int(pc["added_pages"][:n].sum()))
            yield C("moetrace_pool_readded_pages", "Pool pages added again after their eviction (re-reads)",
                    value=int(pc["re_added_pages"][:n].sum()))
            ev = C("moetrace_pool_evicted_pages", "Pool pages evicted from the page cache, by evictor class",
                   labels=["evictor"])
            for i, name in enumerate(EVICTORS):
                ev.add_metric([name], int(pc["evicted_by"][:n, i].sum()))
            yield ev
            yield C("moetrace_followed_read_bytes", "Bytes read by the followed processes' read calls",
                    value=int(cur.extra.get("requested_bytes", pc["read_bytes"])))
            yield from self._experts(pc["re_added_pages"][:n], C)
        if blk is not None:
            yield C("moetrace_pool_device_read_bytes", "Bytes read from the device for pool experts",
                    value=int(blk["device_read_bytes"][:n].sum()))
        if "miss_bytes" in cur.extra:
            yield C("moetrace_pool_computed_miss_bytes", "Bytes an LRU of the pool's resident size would have "
                    "missed over the observed expert accesses", value=int(cur.extra["miss_bytes"]))
            yield C("moetrace_expert_accesses", "Expert read calls observed", value=int(cur.extra["accesses"]))

    def _experts(self, re_added: np.ndarray, C):
        fam = C("moetrace_expert_readded_pages", f"Pages re-added, per expert (the top {self.top} by re-added)",
                labels=["layer", "expert"])
        top = np.argsort(-re_added, kind="stable")[: self.top]
        for i in top:
            if re_added[i] > 0:
                fam.add_metric([str(int(i) // self.e), str(int(i) % self.e)], int(re_added[i]))
        yield fam

    def _scope(self, s: dict[str, Any], fig: dict[str, Any], C, G):
        yield C("moetrace_reclaim_scanned_pages", f"Pages scanned by reclaim (scope: {s.get('reclaim_scope')})",
                value=s["scanned_pages"])
        yield C("moetrace_reclaim_stolen_pages", f"Pages reclaimed (scope: {s.get('reclaim_scope')})",
                value=s["stolen_pages"])
        pool = fig.get("pool") or {}
        if pool.get("amplification") is not None:
            yield G("moetrace_pool_amplification_ratio", "Device bytes / computed misses in the last interval",
                    value=pool["amplification"])
        lat = G("moetrace_hit_only_read_latency_seconds", "Hit-only read-call latency in the last interval",
                labels=["quantile"])
        for q, k in (("0.5", "hit_only_p50_ns"), ("0.99", "hit_only_p99_ns")):
            if pool.get(k) is not None:
                lat.add_metric([q], pool[k] / 1e9)
        yield lat
        sts = (fig.get("reclaim") or {}).get("scan_to_steal")
        if sts is not None:
            yield G("moetrace_reclaim_scan_to_steal_ratio", "Pages scanned / reclaimed in the last interval", value=sts)
        yield C("moetrace_workingset_refault_file_pages", "File refaults (workingset_refault_file)",
                value=s["refault_file_pages"])
        for kind in ("some", "full"):
            if s.get(f"{kind}_us") is not None:
                yield C(f"moetrace_psi_memory_{kind}_stalled_seconds",
                        f"PSI memory {kind}: time stalled (scope: {s.get('psi_scope')})", value=s[f"{kind}_us"] / 1e6)
        if s.get("memory_bytes"):
            yield G("moetrace_locked_ratio", "Locked (unevictable) bytes / the scope's memory",
                    value=s["locked_bytes"] / s["memory_bytes"])

    # -- outputs ----------------------------------------------------------------------------------
    def serve(self, address: str) -> None:
        """Serve /metrics on HOST:PORT in a thread of this process."""
        from prometheus_client import start_http_server

        host, _, port = address.rpartition(":")
        if not port.isdigit() or not 0 <= int(port) < 65536:
            raise UsageError(f"--prometheus {address}: expected HOST:PORT, e.g. 127.0.0.1:9464")
        try:
            out = start_http_server(int(port), addr=host or "0.0.0.0", registry=self.registry)
        except OSError as e:
            raise UsageError(f"--prometheus {address}: cannot listen ({e.strerror or e})",
                             hint="pick a free port, or a local address of this host") from None
        if isinstance(out, tuple):
            self.server, self.thread = out
            self.port = self.server.server_port

    def write_textfile(self, directory: str) -> Path:
        """DIR/moetrace.prom, replaced atomically (node_exporter reads whole files only)."""
        from prometheus_client import write_to_textfile

        path = Path(directory) / TEXTFILE_NAME
        write_to_textfile(str(path), self.registry)
        os.chmod(path, 0o644)
        self.textfile = path
        return path

    def close(self) -> None:
        """Stop serving; remove the textfile (stale alarms must not outlive the watch)."""
        if self.textfile is not None:
            self.textfile.unlink(missing_ok=True)
            self.textfile = None
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
