"""``record --probes mglru``: MGLRU generations over time, and (where kprobes exist) aging.

The main part needs no BPF: a sampler of ``<debugfs>/lru_gen`` (``lru_gen_full`` with
``MOE_LRU_GEN_FULL=1``), read once at open, every ``MOE_LRU_GEN_PERIOD_MS`` while the
command runs (in :meth:`MglruRecorder.poll`) and once at close, parsed by
:mod:`moetrace.kernel.lru_gen` into one row per (sample, memcg, node, generation): its seq, age,
birth time and anon / file pages (``lru_gen.parquet``). A generation born during the
recording shows up as a new seq; its birth_ns is when aging created it.

The kprobes of probes/mglru.bpf.c (aging attempts as ring records, eviction / isolation /
look-around / workingset counters, the generation a promoted folio leaves) are compiled
only for the groups the attach plan has (kprobes exist only in the lab kernels); where
none is available no BPF is loaded at all.

Where the kernel has no MGLRU (``/sys/kernel/mm/lru_gen`` absent) the ``lru_gen`` group
is unavailable and the probe is "no": ``record`` skips it with that reason in the
manifest (the probe is an enrichment probe), and :meth:`MglruRecorder.open` refuses.
A sample that cannot be read or parsed is counted (``lost["mglru"]``) with its error, and
the recording goes on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from moetrace.lazyimport import pandas as pd

from moetrace.record.spec import AttachCandidate, AttachGroup, Knob, ProbeSpec, Struct, group, kp_cand, fn_cands
from moetrace.run.tables import TABLES, named_tables
from moetrace.kernel import lru_gen
from moetrace.errors import InputError, ProbeError
from moetrace.record.probe import ProbeRecorder

# -- the declaration: attach candidates, knobs, tables (probes/mglru.bpf.c agrees: tests/probe_build/test_core_objects.py)

def _mglru_kp(name: str, knob: str, *cands: AttachCandidate) -> AttachGroup:
    return group(name, *cands, required=False, knob=knob)


#: probes/mglru.bpf.c (kprobes, lab only) + the lru_gen sampler (moetrace.record.probes.mglru, moetrace.kernel.lru_gen).
MGLRU = ProbeSpec(
    name="mglru",
    recorder="MglruRecorder",
    order=80,
    description="MGLRU generations over time from <debugfs>/lru_gen (a sampler, no BPF: birth times, ages, "
                "sizes per memcg / node / generation); where kprobes exist, aging attempts (a ring record "
                "each), eviction / isolation / look-around / workingset counts and the generation a "
                "promoted folio leaves",
    attach=(
        group("lru_gen", AttachCandidate("debugfs", "lru_gen", "",
                                      "Python sampler of <debugfs>/lru_gen (MOE_LRU_GEN_FULL=1: lru_gen_full): "
                                      "wherever MGLRU is built, no BPF")),
        _mglru_kp("evict_folios", "MOE_HAVE_EVICT_FOLIOS",
                  *fn_cands("evict_folios", note="6.1: (lruvec, sc, swappiness, bool *need_swapping); 6.12 drops "
                                                 "need_swapping; only counted")),
        _mglru_kp("isolate_folios", "MOE_HAVE_ISOLATE_FOLIOS", *fn_cands("isolate_folios", note="only counted")),
        _mglru_kp("should_run_aging", "MOE_HAVE_SHOULD_RUN_AGING",
                  *fn_cands("should_run_aging", note="6.1 only: gone by 6.12 (inlined)")),
        _mglru_kp("inc_max_seq", "MOE_HAVE_INC_MAX_SEQ",
                  *fn_cands("try_to_inc_max_seq", note="6.1: (lruvec, max_seq, sc, can_swap, force_scan); 6.12: "
                                                      "(lruvec, seq, can_swap, force_scan): the 2nd is the seq "
                                                      "either way"),
                  *fn_cands("inc_max_seq", note="the aging step itself; 6.8+ returns bool and takes seq (not read)"),
                  kp_cand("inc_max_seq.constprop.0", note="6.12 has only a compiler clone (no BTF: kprobe only); "
                                                          "arguments not read")),
        _mglru_kp("folio_inc_gen", "MOE_HAVE_FOLIO_INC_GEN",
                  *fn_cands("folio_inc_gen", note="per-folio generation: reads folio->flags at the build's "
                                                  "LRU_GEN_PGOFF (derived from the kernel's config and BTF)")),
        _mglru_kp("look_around", "MOE_HAVE_LOOK_AROUND", *fn_cands("lru_gen_look_around", note="6.12 returns bool")),
        _mglru_kp("workingset_eviction", "MOE_HAVE_WS_EVICTION", *fn_cands("workingset_eviction")),
        _mglru_kp("workingset_refault", "MOE_HAVE_WS_REFAULT", *fn_cands("workingset_refault")),
    ),
    knobs=(
        Knob("MOE_HAVE_EVICT_FOLIOS", 0, "1: compile the evict_folios kprobe (set from the attach plan)"),
        Knob("MOE_HAVE_ISOLATE_FOLIOS", 0, "1: compile the isolate_folios kprobe"),
        Knob("MOE_HAVE_SHOULD_RUN_AGING", 0, "1: compile the should_run_aging kprobe"),
        Knob("MOE_HAVE_INC_MAX_SEQ", 0, "1: compile the aging kprobes (+ the aging ring)"),
        Knob("MOE_HAVE_FOLIO_INC_GEN", 0, "1: load the folio_inc_gen hook"),
        Knob("MOE_HAVE_LOOK_AROUND", 0, "1: compile the lru_gen_look_around kprobe"),
        Knob("MOE_HAVE_WS_EVICTION", 0, "1: compile the workingset_eviction kprobe"),
        Knob("MOE_HAVE_WS_REFAULT", 0, "1: compile the workingset_refault kprobe"),
        Knob("MOE_RINGBUF_PAGES", 16, "aging ring size in pages (power of two)"),
        Knob("MOE_LRU_GEN_PERIOD_MS", 1000, "lru_gen sampling period (the Python sampler; also one sample at "
                                            "open and one at close)"),
        Knob("MOE_LRU_GEN_FULL", 0, "1: sample lru_gen_full (adds the tier and walk tables)"),
        Knob("MOE_EVICT_EVENTS", 1, "1: a ring record per evicted pool folio with its memcg's min_seq (the "
                                    "generation evicted), where workingset_eviction attaches, a pool is named and "
                                    "the kernel's BTF gives the offsets; 0: off"),
        Knob("MOE_EVICT_RINGBUF_PAGES", 4096, "eviction ring size in pages (power of two; 16 MiB holds ~350k "
                                             "records: the TCG guest drains it slowly)"),
        Knob("MOE_POOL_DEV", 0, "derived: the pool's s_dev, kernel encoding (the eviction records' filter)"),
        Knob("MOE_LRU_GEN_PGOFF", -1, "derived: the build's LRU_GEN_PGOFF (folio_inc_gen's generation field), from "
                                      "the kernel's config and BTF; -1: unknown (folio_inc_gen not loaded)"),
    ),
    table="lru_gen",
    schema=TABLES["lru_gen"],
    more_tables=named_tables("lru_gen_tiers", "lru_gen_walk", "mglru_aging", "mglru_inc_gen", "mglru_evictions"),
    stats=("evict_folios", "isolate_folios", "should_run_aging", "inc_max_seq", "folio_inc_gen", "look_around",
           "workingset_eviction", "workingset_refault", "ring_lost", "evict_lost", "evict_pool"),
    structs=(Struct("aging_event", (("ts_ns", "u64"), ("seq", "u64"), ("tgid", "u32"), ("kind", "u32"))),
             Struct("evict_event", (("ts_ns", "u64"), ("ino", "u64"), ("index", "u64"), ("min_seq", "u64"),
                                    ("memcg_id", "u32"), ("tgid", "u32")))),
    enrichment=True,
    map_sizes=lambda k: {"stats": 11, "inc_gen_from": 5, "aging": 4096 * int(k["MOE_RINGBUF_PAGES"]),
                         "evictions": 4096 * int(k["MOE_EVICT_RINGBUF_PAGES"]) if k["MOE_EVICT_EVENTS"] else 4096},
)

SPEC = MGLRU
STATS = SPEC.stats
AGING_DTYPE = SPEC.struct("aging_event").dtype()
EVICT_DTYPE = SPEC.struct("evict_event").dtype()
def lru_gen_layout(release: str | None = None) -> tuple[int | None, str]:
    """(LRU_GEN_PGOFF of the running kernel, "") or (None, why not): from its config
    (/boot/config-R, /proc/config.gz) and two enumerators of its BTF (the layout is a build
    macro, in neither BTF nor the object)."""
    import platform

    from moetrace.kernel.kconfig import config_text, lru_gen_pgoff, parse_config
    from moetrace.kernel.libbpf import vmlinux_enum_value

    release = release or platform.release()
    text, _src = config_text(release)
    if text is None:
        return None, f"no kernel config for {release} (/boot/config-{release} or /proc/config.gz)"
    nr, zones = vmlinux_enum_value("pageflags", "__NR_PAGEFLAGS"), vmlinux_enum_value("zone_type", "__MAX_NR_ZONES")
    if nr is None or zones is None:
        return None, "the kernel's BTF lacks __NR_PAGEFLAGS / __MAX_NR_ZONES"
    return lru_gen_pgoff(parse_config(text), nr, zones)


#: aging record kinds of probes/mglru.bpf.c, in AGING_* order
AGING_KINDS = ("try_to_inc_max_seq", "inc_max_seq", "inc_max_seq.constprop.0")
SEQ_UNKNOWN = (1 << 64) - 1
#: kprobe group knobs (MOE_HAVE_*), from the declaration
KPROBE_KNOBS = tuple(dict.fromkeys(g.knob for g in SPEC.attach if g.knob is not None))


class MglruRecorder(ProbeRecorder):
    """The lru_gen sampler (+ the kprobes of probes/mglru.bpf.c where the plan has them).

    period_ms / full override the ``MOE_LRU_GEN_PERIOD_MS`` / ``MOE_LRU_GEN_FULL`` knobs
    (tests use a short period). ``clock`` returns CLOCK_MONOTONIC ns (tests may pass
    their own)."""

    name = "mglru"
    spec = SPEC
    error = ProbeError
    needs_poll = True

    def __init__(self, ctx, period_ms: int | None = None, full: bool | None = None, clock=time.monotonic_ns):
        super().__init__(ctx)
        over: dict[str, int] = {k: int(v) for k, v in ctx.plan.knobs.items() if k in {x.name for x in SPEC.knobs}}
        over = self.with_user_knobs(over)
        if period_ms is not None:
            over["MOE_LRU_GEN_PERIOD_MS"] = int(period_ms)
        if full is not None:
            over["MOE_LRU_GEN_FULL"] = int(bool(full))
        self.knobs = {k: int(v) for k, v in SPEC.knob_values(**over).items()}
        if self.knobs["MOE_LRU_GEN_PERIOD_MS"] <= 0:
            raise ProbeError("MOE_LRU_GEN_PERIOD_MS must be > 0")
        self.period_ns = self.knobs["MOE_LRU_GEN_PERIOD_MS"] * 1_000_000
        self.full = bool(self.knobs["MOE_LRU_GEN_FULL"])
        self.clock = clock
        self.path: Path | None = None
        self.samples: list[tuple[int, int, lru_gen.LruGenSample]] = []
        self.failed: list[dict[str, Any]] = []
        self.read_ns_total = 0
        self._next_ns = 0
        self._n = 0
        self.stream = None
        self.kprobes: dict[str, str] = {}
        self.stats: dict[str, int] = {}
        self.inc_gen: list[int] = []
        self.aging_raw = b""
        self.evict_stream = None
        self.evict_raw = b""
        self.evict_why_not = ""

    # -- lifecycle ------------------------------------------------------------------------
    def open(self) -> "MglruRecorder":
        plan = self.ctx.plan
        e = plan.entry("lru_gen")
        if not e.attached:
            raise ProbeError(f"mglru probe cannot sample lru_gen: {e.reason}",
                                  hint="MGLRU needs CONFIG_LRU_GEN (see `moetrace doctor`); debugfs must be "
                                       "mounted: mount -t debugfs none /sys/kernel/debug")
        dbg = getattr(self.ctx.features, "debugfs", None)
        if dbg is None:
            raise ProbeError("debugfs is not mounted (the lru_gen sampler reads it)",
                                  hint="mount -t debugfs none /sys/kernel/debug")
        self.path = Path(dbg) / ("lru_gen_full" if self.full else "lru_gen")
        if any(self.knobs[k] for k in KPROBE_KNOBS):
            self._open_bpf()
        self._sample()
        if not self.samples:
            err = self.failed[0]["error"] if self.failed else "no sample"
            self.abort()
            raise ProbeError(f"cannot sample {self.path}: {err}")
        return self

    def _open_bpf(self) -> None:
        from moetrace.kernel.bpf import EventStream

        self._plan_evictions()
        self._plan_inc_gen()
        try:
            self.load_planned(self.knobs)
        except ProbeError:
            self.probe = None
            raise
        if self.knobs["MOE_HAVE_INC_MAX_SEQ"]:
            self.stream = EventStream(self.probe, "aging", AGING_DTYPE.itemsize, kernel_lost=self.stat_reader("ring_lost"),
                                      max_records=min(self.ctx.stream_max_records, 1_000_000))
        if self.knobs["MOE_EVICT_EVENTS"]:
            self.evict_stream = EventStream(self.probe, "evictions", EVICT_DTYPE.itemsize,
                                            kernel_lost=self.stat_reader("evict_lost"),
                                            max_records=self.ctx.stream_max_records)

    def _plan_evictions(self) -> None:
        """MOE_EVICT_EVENTS stays 1 only with workingset_eviction attached and a pool named (the
        fields are read through CO-RE relocations: no offsets to find); otherwise 0, and why."""
        k = self.knobs
        why = ("off (--knob mglru.MOE_EVICT_EVENTS=0)" if not k["MOE_EVICT_EVENTS"] else
               "workingset_eviction is not attached" if not k["MOE_HAVE_WS_EVICTION"] else
               "no pool named" if self.ctx.pmap is None else "")
        if why:
            k["MOE_EVICT_EVENTS"] = 0
            self.evict_why_not = why
            return
        k["MOE_POOL_DEV"] = int(self.ctx.pmap.dev)

    def _plan_inc_gen(self) -> None:
        """folio_inc_gen needs the build's LRU_GEN_PGOFF: derived, or the group is not loaded (with why)."""
        k = self.knobs
        if not k["MOE_HAVE_FOLIO_INC_GEN"] or k["MOE_LRU_GEN_PGOFF"] >= 0:
            return
        pgoff, why = lru_gen_layout()
        if pgoff is None:
            k["MOE_HAVE_FOLIO_INC_GEN"] = 0
            self.compiled_out["folio_inc_gen"] = f"the generation field's position is unknown: {why}"
            self.ctx.notes.append(f"mglru: folio_inc_gen not loaded: {why}")
            return
        k["MOE_LRU_GEN_PGOFF"] = pgoff

    def _sample(self) -> None:
        """Read and parse the file once; a failure is counted, never raised."""
        t0 = self.clock()
        self._next_ns = t0 + self.period_ns
        try:
            text = self.path.read_text()
            t1 = self.clock()
            s = lru_gen.parse(text, str(self.path))
        except (OSError, InputError) as e:
            msg = e.message if isinstance(e, InputError) else f"{type(e).__name__}: {e}"
            self.failed.append({"time_ns": t0, "error": msg})
            return
        self.read_ns_total += t1 - t0
        self.samples.append((self._n, t0, s))
        self._n += 1

    def poll(self, timeout_ms: int = 0) -> None:
        """Sample when due; otherwise wait (the ring, or a sleep) until due or ``timeout_ms``."""
        if self.closed or self.path is None:
            return
        now = self.clock()
        wait_ms = max(0, min(int(timeout_ms), (self._next_ns - now + 999_999) // 1_000_000))
        if self.evict_stream is not None:
            self.evict_stream.poll(0)
        if self.stream is not None:
            self.stream.poll(wait_ms)
        elif wait_ms > 0:
            self.wait_command(wait_ms / 1000)
        if self.clock() >= self._next_ns:
            self._sample()

    def close(self) -> None:
        if self.closed:
            return
        if self.path is None:  # open() never got as far as the file
            self.abort()
            return
        self._sample()
        try:
            if self.probe is not None:
                from moetrace.kernel.bpf import read_array

                if self.stream is not None:
                    self.stream.finish()
                    self.aging_raw = self.stream.records()
                if self.evict_stream is not None:
                    self.evict_stream.finish()
                    self.evict_raw = self.evict_stream.records()
                self.stats = self.read_stats()
                if self.knobs["MOE_HAVE_FOLIO_INC_GEN"]:
                    self.inc_gen = read_array(self.probe.table("inc_gen_from"), np.uint64).astype(np.int64).tolist()
        finally:
            if self.probe is not None:
                self.probe.close()
            self.closed = True
        self.collected = True

    # -- tables ---------------------------------------------------------------------------
    def generations(self) -> pd.DataFrame:
        return lru_gen.generations_frame(self.samples)[[c.name for c in SPEC.schema]]

    def aging(self) -> pd.DataFrame:
        ev = np.frombuffer(self.aging_raw, AGING_DTYPE)
        return pd.DataFrame({
            "time_ns": ev["ts_ns"].astype(np.int64),
            "tgid": ev["tgid"].astype(np.int32),
            "kind": pd.array([AGING_KINDS[k] if k < len(AGING_KINDS) else f"kind{k}" for k in ev["kind"]],
                             dtype="string"),
            "seq": pd.array([pd.NA if s == SEQ_UNKNOWN else int(s) for s in ev["seq"]], dtype="Int64"),
        })

    def evictions(self) -> pd.DataFrame:
        """mglru_evictions: one row per evicted pool folio (inodes outside the pool dropped)."""
        ev = np.frombuffer(self.evict_raw, EVICT_DTYPE)
        pm = self.ctx.pmap
        ino, idx = ev["ino"].astype(np.int64), ev["index"].astype(np.int64)
        all_eid = pm.expert_ids(ino, idx)
        keep = all_eid >= 0
        eid = all_eid[keep]
        E = pm.n_experts
        seq = ev["min_seq"][keep]
        return pd.DataFrame({
            "time_ns": ev["ts_ns"][keep].astype(np.int64),
            "layer": (eid // E).astype(np.int32), "expert": (eid % E).astype(np.int32),
            "expert_id": eid.astype(np.int32), "ino": ino[keep], "page_index": idx[keep],
            "memcg_id": ev["memcg_id"][keep].astype(np.int64),
            "seq": pd.array([pd.NA if q == SEQ_UNKNOWN else int(q) for q in seq], dtype="Int64"),
            "tgid": ev["tgid"][keep].astype(np.int32),
        })

    def summary(self) -> dict[str, Any]:
        g = lru_gen.generations_frame(self.samples)
        per: dict[str, Any] = {}
        for (mid, nid), d in g.groupby(["memcg_id", "node"]):
            first, last = d[d["sample"] == d["sample"].min()], d[d["sample"] == d["sample"].max()]
            key = f"{int(mid)}:{int(nid)}"
            seen = sorted(set(d["seq"]) - set(first["seq"]))
            max_first, max_last = int(first["seq"].max()), int(last["seq"].max())
            # max_seq only ever grows by one per new generation: its delta counts every generation
            # born between the first and last sample, also those born and evicted between two samples
            per[key] = {"memcg_path": str(d["memcg_path"].iloc[0]), "first_seen_sample": int(d["sample"].min()),
                        "last_seen_sample": int(d["sample"].max()), "max_seq_first": max_first,
                        "max_seq_last": max_last, "generations_born": max_last - max_first,
                        "generations_seen": len(seen),
                        "file_pages_last": int(last["nr_file_pages"].sum()),
                        "anon_pages_last": int(last["nr_anon_pages"].sum())}
        return {"file": str(self.path) if self.path else None, "full": self.full,
                "period_ms": self.knobs["MOE_LRU_GEN_PERIOD_MS"], "samples": len(self.samples),
                "failed_samples": len(self.failed), "rows": int(len(g)),
                "read_ms_mean": (self.read_ns_total / len(self.samples) / 1e6) if self.samples else None,
                "lruvecs": per, "kprobes": dict(self.kprobes), "kprobe_counts": dict(self.stats),
                "eviction_records": ({"recorded": True, "records": len(self.evict_raw) // EVICT_DTYPE.itemsize,
                                      "fields": "CO-RE relocations against the running kernel's BTF"}
                                     if self.knobs["MOE_EVICT_EVENTS"] else
                                     {"recorded": False, "why_not": self.evict_why_not})}

    def write(self, run_dir: Path, manifest: dict[str, Any]) -> None:
        tables = {SPEC.table: self.generations()}
        if self.full:
            tables.update(lru_gen_tiers=lru_gen.tiers_frame(self.samples), lru_gen_walk=lru_gen.walk_frame(self.samples))
        if self.stream is not None:
            tables["mglru_aging"] = self.aging()
        if self.evict_stream is not None:
            tables["mglru_evictions"] = self.evictions()
        if self.inc_gen:
            tables["mglru_inc_gen"] = pd.DataFrame({
                "from_gen": pd.array([pd.NA] + list(range(len(self.inc_gen) - 1)), dtype="Int32"),
                "folios": np.asarray(self.inc_gen, np.int64)})
        self.write_tables(run_dir, manifest, tables)
        st = self.stream
        self.write_sections(manifest, self.stats, {
            "failed_samples": len(self.failed),
            "errors": self.failed[:5],
            "ring_lost_aging_events": int(st.lost_kernel) if st else 0,
            "user_lost_aging_events": int(st.lost_user) if st else 0,
            "ring_lost_eviction_records": int(self.evict_stream.lost_kernel) if self.evict_stream else 0,
            "user_lost_eviction_records": int(self.evict_stream.lost_user) if self.evict_stream else 0,
            "note": "a failed sample is missing from lru_gen.parquet (the rest of the recording is intact)",
        }, self.summary())


__all__ = ["MglruRecorder", "ProbeError", "AGING_KINDS"]
