"""Probe declarations: attach candidates as data, resolved once against the kernel.

One probe = one C file (``probes/<name>.c``, configured only with ``-D`` cflags) + one
:class:`ProbeSpec` here (docs/style.md). A spec lists its logical attach points
(:class:`AttachGroup`), each an ordered list of :class:`AttachCandidate` (first available
wins), each citing the kernel change that made it necessary. :func:`resolve` asks a
:class:`moetrace.kernel.features.Features` (never a version number) and returns an
:class:`AttachPlan`: per group the candidate that will be attached, or "unavailable:
reason". Resolving never needs the C file to exist.

The registry :data:`PROBES` holds the design table's probes (docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from moetrace.kernel.features import Features

Kind = Literal["tracepoint", "raw_tracepoint", "kprobe", "kretprobe", "perf_event", "debugfs"]
Needs = Literal["tracepoint-args", "exact-headers"]
KINDS = ("tracepoint", "raw_tracepoint", "kprobe", "kretprobe", "perf_event", "debugfs")
from moetrace.probes import PROBES_DIR  # noqa: E402


@dataclass(frozen=True)
class AttachCandidate:
    """One way to attach.

    kind: tracepoint | raw_tracepoint (target "category:event"), kprobe | kretprobe
    (target a kallsyms symbol), perf_event (target "software:cpu-clock"), debugfs (target
    a file under debugfs read by a Python sampler, no BPF: fn_name "").
    fn_name: the C function in the probe's source (bcc naming is the C author's choice).
    needs: overrides the probe's ``needs`` for this candidate (a kprobe that reads a
    struct folio needs exact headers even in a tracepoint-args probe).
    fields: the tracepoint format fields the C code reads; a format file lacking one
    rejects the candidate. field_knobs: (field, knob) pairs: the knob is 1 when the
    chosen candidate's format has the field, else 0 (e.g. folio ``order``).
    sets: (knob, value) pairs set when this candidate is the one chosen (which of
    several implementations the C file compiles, e.g. block's ``MOE_BYTES_TP``)."""

    kind: Kind
    target: str
    fn_name: str
    note: str = ""
    needs: Needs | None = None
    fields: tuple[str, ...] = ()
    field_knobs: tuple[tuple[str, str], ...] = ()
    sets: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown attach kind {self.kind!r}")
        if self.kind in ("tracepoint", "raw_tracepoint") and ":" not in self.target:
            raise ValueError(f"tracepoint target must be category:event, got {self.target!r}")

    def describe(self) -> str:
        return f"{self.kind} {self.target}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "fn_name": self.fn_name, "note": self.note,
                "needs": self.needs, "fields": list(self.fields),
                "field_knobs": {f: k for f, k in self.field_knobs}, "sets": {k: v for k, v in self.sets}}


@dataclass(frozen=True)
class AttachGroup:
    """One logical attach point: ordered candidates, the first available wins.

    required: the probe cannot do its job without it (the probe is "no" when it is
    unavailable); an optional group only degrades the probe.
    knob: the ``-D`` knob that compiles the group in (optional groups only). Groups
    sharing a knob are compiled together: when one is unavailable the knob is 0 and
    the others are "unavailable: compiled out" (bcc attaches every program it compiles,
    so a plan never says "attached" for a program that is not there)."""

    name: str
    candidates: tuple[AttachCandidate, ...]
    required: bool = True
    note: str = ""
    knob: str | None = None

    def __post_init__(self) -> None:
        if self.knob is not None and self.required:
            raise ValueError(f"attach group {self.name}: a group behind a knob must be optional")


@dataclass(frozen=True)
class Column:
    """One column of a probe's output table; units also in the name (``_ns``, ``_pages``)."""

    name: str
    dtype: str
    unit: str = ""
    doc: str = ""


@dataclass(frozen=True)
class Struct:
    """A C struct the probe shares with Python (map values, ring records): field names and
    fixed-width types (u8..u64, s8..s64) in declaration order; a test checks the C file."""

    name: str
    fields: tuple[tuple[str, str], ...]

    def dtype(self):
        """The numpy dtype with C alignment (little-endian, as BPF on x86-64/arm64)."""
        import numpy as np

        conv = {"u": "<u", "s": "<i"}
        return np.dtype([(n, conv[t[0]] + str(int(t[1:]) // 8)) for n, t in self.fields], align=True)


@dataclass(frozen=True)
class Knob:
    """A ``-D`` cflag of the probe's C file, with its default."""

    name: str
    default: int | str
    help: str = ""


@dataclass(frozen=True)
class ProbeSpec:
    """A probe: its C source, attach groups, what it needs from headers, knobs, schema.

    needs: "tracepoint-args" (reads only tracepoint/syscall arguments and scalar
    registers: layout-safe with mismatched headers) or "exact-headers" (reads kernel
    structs). default: part of ``record``'s default set. enrichment: a missing
    enrichment probe warns; a missing non-enrichment probe is an error under
    ``--missing-probes error``. table: the run-directory table ``schema`` describes.
    stats: names of the C file's ``STAT_*`` slots in slot order. structs: C structs
    shared with Python (:class:`Struct`). more_tables: further run-directory tables
    the probe writes, as (name, columns) pairs."""

    name: str
    attach: tuple[AttachGroup, ...]
    needs: Needs = "tracepoint-args"
    knobs: tuple[Knob, ...] = ()
    schema: tuple[Column, ...] = ()
    description: str = ""
    default: bool = True
    enrichment: bool = False
    source: Path | None = None
    table: str = ""
    stats: tuple[str, ...] = ()
    structs: tuple[Struct, ...] = ()
    more_tables: tuple[tuple[str, tuple[Column, ...]], ...] = ()

    def tables(self) -> dict[str, tuple[Column, ...]]:
        """{run-directory table: its columns}: ``table``/``schema`` first, then ``more_tables``."""
        out = {self.table: self.schema} if self.table else {}
        out.update(dict(self.more_tables))
        return out

    @property
    def source_path(self) -> Path:
        """probes/<name>.c (it need not exist to resolve)."""
        return self.source if self.source is not None else PROBES_DIR / f"{self.name}.c"

    def knob_values(self, **overrides: int | str) -> dict[str, int | str]:
        """{knob: value} for every knob: defaults, then ``overrides`` by knob name."""
        names = {k.name for k in self.knobs}
        unknown = set(overrides) - names
        if unknown:
            raise ValueError(f"probe {self.name}: unknown knob(s) {sorted(unknown)}; knobs: {sorted(names)}")
        return {k.name: overrides.get(k.name, k.default) for k in self.knobs}

    def cflags(self, **overrides: int | str) -> list[str]:
        """``-DNAME=value`` for every knob (defaults, then ``overrides`` by knob name)."""
        return [f"-D{n}={v}" for n, v in self.knob_values(**overrides).items()]

    def struct(self, name: str) -> Struct:
        for st in self.structs:
            if st.name == name:
                return st
        raise KeyError(f"probe {self.name} declares no struct {name!r}")

    def group(self, name: str) -> AttachGroup:
        for g in self.attach:
            if g.name == name:
                return g
        raise KeyError(f"probe {self.name} has no attach group {name!r}")


# -- resolution -------------------------------------------------------------------------------

@dataclass
class PlanEntry:
    """One attach group resolved: status "attached" (the candidate to attach) or
    "unavailable" (reason); ``checked`` is False when a reason is "could not check"
    (e.g. tracefs unreadable without root). ``tried``: (candidate, reason) for every
    candidate that was rejected before the winner."""

    group: str
    required: bool
    status: Literal["attached", "unavailable"]
    candidate: AttachCandidate | None = None
    reason: str = ""
    checked: bool = True
    tried: list[tuple[AttachCandidate, str]] = field(default_factory=list)

    @property
    def attached(self) -> bool:
        return self.status == "attached"

    def __str__(self) -> str:
        if self.candidate is not None:
            return f"attached: {self.candidate.describe()}"
        return f"unavailable: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "required": self.required, "status": self.status,
                "candidate": self.candidate.to_dict() if self.candidate else None,
                "reason": self.reason, "checked": self.checked,
                "tried": [{"kind": c.kind, "target": c.target, "reason": r} for c, r in self.tried]}


@dataclass
class AttachPlan:
    """A probe resolved against one kernel.

    status: "yes" (every group attached), "degraded" (only optional groups missing),
    "no" (a required group unavailable, or the probe blocked as a whole: headers, BPF)."""

    probe: str
    entries: list[PlanEntry]
    needs: str
    headers: str
    blocked: str = ""
    knobs: dict[str, int] = field(default_factory=dict)

    @property
    def status(self) -> Literal["yes", "no", "degraded"]:
        if self.blocked or any(e.required and not e.attached for e in self.entries):
            return "no"
        if any(not e.attached for e in self.entries):
            return "degraded"
        return "yes"

    @property
    def reason(self) -> str:
        """One line: why the probe is "no"/"degraded" ("" when "yes")."""
        if self.blocked:
            return self.blocked
        bad = [e for e in self.entries if not e.attached]
        req = [e for e in bad if e.required]
        pick = req or bad
        if not pick:
            return ""
        head = "required" if req else "optional"
        return f"{head} {', '.join(e.group for e in pick)} unavailable: {pick[0].reason}" + (
            f" (+{len(pick) - 1} more)" if len(pick) > 1 else "")

    @property
    def attached(self) -> list[PlanEntry]:
        return [e for e in self.entries if e.attached]

    def entry(self, group: str) -> PlanEntry:
        for e in self.entries:
            if e.group == group:
                return e
        raise KeyError(f"plan of {self.probe} has no group {group!r}")

    def to_dict(self) -> dict[str, Any]:
        """For the run manifest and `doctor --json`."""
        return {"probe": self.probe, "status": self.status, "reason": self.reason, "needs": self.needs,
                "headers": self.headers, "blocked": self.blocked, "knobs": dict(self.knobs),
                "entries": [e.to_dict() for e in self.entries]}


def _not_checked(reason: str) -> bool:
    return reason.startswith("could not check")


def candidate_reason(cand: AttachCandidate, feats: "Features", needs: str) -> str | None:
    """None when ``cand`` can be attached on ``feats``' kernel, else why not.

    Order: infrastructure (tracefs, kprobes, perf, debugfs), then the target itself
    (format file, kallsyms), then headers (a candidate needing kernel structs with
    mismatched headers)."""
    need = cand.needs or needs
    r: str | None
    if cand.kind in ("tracepoint", "raw_tracepoint"):
        cat, ev = cand.target.split(":", 1)
        r = feats.tracepoint_reason(cat, ev)
    elif cand.kind in ("kprobe", "kretprobe"):
        r = feats.kprobes_reason() or feats.symbol_reason(cand.target)
    elif cand.kind == "perf_event":
        r = feats.perf_event_reason(cand.target)
    else:  # debugfs
        r = feats.debugfs_reason(cand.target)
    if r:
        return r
    if cand.fields and cand.kind in ("tracepoint", "raw_tracepoint"):
        cat, ev = cand.target.split(":", 1)
        fmt = feats.tracepoint_format(cat, ev)
        if fmt is not None:
            missing = [f for f in cand.fields if f not in fmt]
            if missing:
                return f"format of {cand.target} lacks {', '.join(missing)} (the probe reads them)"
    if need == "exact-headers" and cand.kind != "debugfs" and feats.headers != "exact":
        return f"headers {feats.headers}: {cand.describe()} reads kernel structs ({feats.headers_detail})"
    return None


def resolve(spec: ProbeSpec, feats: "Features | None" = None) -> AttachPlan:
    """Resolve every attach group of ``spec`` against ``feats`` (default: the live kernel)."""
    if feats is None:
        from moetrace.kernel.features import Features
        feats = Features()
    blocked = ""
    bpf_groups = any(c.kind != "debugfs" for g in spec.attach for c in g.candidates)
    if bpf_groups and feats.headers == "none":
        blocked = f"no kernel headers: bcc cannot compile ({feats.headers_detail})"
    elif bpf_groups:
        ok, detail = feats.bpf()
        if not ok:
            blocked = f"BPF unusable: {detail}"
    entries: list[PlanEntry] = []
    for g in spec.attach:
        tried: list[tuple[AttachCandidate, str]] = []
        chosen: AttachCandidate | None = None
        for c in g.candidates:
            r = candidate_reason(c, feats, spec.needs)
            if r is None and blocked and c.kind != "debugfs":
                r = blocked
            if r is None:
                chosen = c
                break
            tried.append((c, r))
        if chosen is not None:
            entries.append(PlanEntry(g.name, g.required, "attached", chosen, tried=tried))
        else:
            if len({r for _c, r in tried}) == 1:
                reason = tried[0][1]
            else:
                reason = "; ".join(f"{c.describe()}: {r}" for c, r in tried)
            checked = not any(_not_checked(r) for _c, r in tried)
            entries.append(PlanEntry(g.name, g.required, "unavailable", None, reason, checked, tried))
    if blocked and any(e.attached for e in entries):
        blocked = ""  # a BPF-free group (debugfs sampler) still runs: report per group instead
    return AttachPlan(spec.name, entries, spec.needs, feats.headers, blocked, _derive_knobs(spec, entries, feats))


def _derive_knobs(spec: ProbeSpec, entries: list[PlanEntry], feats: "Features") -> dict[str, int]:
    """Knobs the kernel decides: group knobs (1 only when every group of the knob is
    attached; the attached siblings of an unavailable one become "compiled out"), the
    chosen candidates' ``sets`` and field knobs (1 only when every chosen format has
    the field)."""
    knobs: dict[str, int] = {}
    by_group = {g.name: g for g in spec.attach}
    for g in spec.attach:
        if g.knob is not None:
            e = next(x for x in entries if x.group == g.name)
            knobs[g.knob] = min(knobs.get(g.knob, 1), int(e.attached))
    off = {k: [x.group for x in entries if by_group[x.group].knob == k and not x.attached]
           for k, v in knobs.items() if v == 0}
    for e in entries:
        k = by_group[e.group].knob
        if e.attached and k in off:
            e.tried.append((e.candidate, f"compiled out ({k}=0: {', '.join(off[k])} unavailable)"))
            e.status, e.reason, e.candidate = "unavailable", e.tried[-1][1], None
    for e in entries:
        if e.attached:
            knobs.update(dict(e.candidate.sets))
    for e in entries:
        c = e.candidate
        if not e.attached or not c.field_knobs or c.kind not in ("tracepoint", "raw_tracepoint"):
            continue
        cat, ev = c.target.split(":", 1)
        fmt = feats.tracepoint_format(cat, ev)
        if fmt is None:
            continue  # unreadable: the knob keeps its default
        for fld, knob in c.field_knobs:
            knobs[knob] = min(knobs.get(knob, 1), int(fld in fmt))
    return knobs


def resolve_all(feats: "Features | None" = None, names: list[str] | None = None) -> dict[str, AttachPlan]:
    """Resolve the named probes (default: every registered probe)."""
    if feats is None:
        from moetrace.kernel.features import Features
        feats = Features()
    return {n: resolve(PROBES[n], feats) for n in (names or list(PROBES))}


# -- the registry -----------------------------------------------------------------------------

def _tp(target: str, fn: str | None = None, note: str = "", needs: Needs | None = None,
        fields: tuple[str, ...] = (), sets: tuple[tuple[str, int], ...] = ()) -> AttachCandidate:
    return AttachCandidate("tracepoint", target, fn or "tp_" + target.split(":", 1)[1], note, needs,
                           fields=fields, sets=sets)


def _kp(sym: str, fn: str | None = None, note: str = "", needs: Needs | None = None,
        kind: Kind = "kprobe") -> AttachCandidate:
    fn = fn or ("kp_" if kind == "kprobe" else "kret_") + sym.replace(".", "_")
    return AttachCandidate(kind, sym, fn, note, needs)


def _g(name: str, *cands: AttachCandidate, required: bool = True, note: str = "",
       knob: str | None = None) -> AttachGroup:
    return AttachGroup(name, tuple(cands), required, note, knob)


_EXPERT_COLS = (Column("layer", "int32"), Column("expert", "int32"), Column("expert_id", "int32"))
_COMMON_KNOBS = (
    Knob("MOE_MAX_INODES", 65536, "entries of the inode -> expert map"),
    Knob("MOE_MAX_EXPERTS", 65536, "per-expert counter slots"),
)

def _bcc_tp(target: str, note: str = "", fields: tuple[str, ...] = (),
            field_knobs: tuple[tuple[str, str], ...] = ()) -> AttachCandidate:
    """A bcc ``TRACEPOINT_PROBE(category, event)``: bcc names it tracepoint__<cat>__<event>."""
    cat, ev = target.split(":", 1)
    return AttachCandidate("tracepoint", target, f"tracepoint__{cat}__{ev}", note, fields=fields,
                           field_knobs=field_knobs)


_FOLIO_FIELDS = ("i_ino", "index", "s_dev")
_ORDER = (("order", "HAVE_ORDER"),)
_READ_EXITS = ("pread64", "preadv", "preadv2", "read")
#: who deleted a pool page: probes/moetrace.h EVICTOR_*, in slot order
EVICTORS = ("kswapd", "direct", "memcg", "proactive", "damon", "fadvise", "truncate", "drop_caches", "other")
EVICTOR_DOCS = {
    "kswapd": "the kswapd kernel thread (global background reclaim)",
    "direct": "direct reclaim in an allocating task (global)",
    "memcg": "memcg limit / high reclaim in a charging task",
    "proactive": "memory.reclaim (memcg reclaim inside a write(2) of <= 64 bytes) or madvise(MADV_PAGEOUT)",
    "damon": "a kdamond thread (DAMOS pageout, DAMON_RECLAIM)",
    "fadvise": "fadvise64(2) of any process (POSIX_FADV_DONTNEED)",
    "truncate": "truncate, ftruncate, fallocate, unlink, unlinkat",
    "drop_caches": "a write(2) outside reclaim: drop_caches (or an O_DIRECT write invalidating cached pages)",
    "other": "any other context (inode eviction at the last close, umount, migration, ...)",
}
_CTX_INVALIDATE = ("fadvise64", "truncate", "ftruncate", "fallocate", "unlink", "unlinkat", "madvise")


def _evictor_cols() -> tuple[Column, ...]:
    return tuple(Column(f"evicted_by_{e}_pages", "Int64", "pages", f"pages deleted by {d}")
                 for e, d in EVICTOR_DOCS.items())


def _ctx_groups() -> tuple[AttachGroup, ...]:
    """The evictor-context groups of pagecache: syscall and reclaim-window entry/exit pairs."""
    out = [_g(f"ctx_{d}_write", _bcc_tp(f"syscalls:sys_{d}_write", fields=("count",) if d == "enter" else (),
                                        note="a write(2) in flight: drop_caches, or memory.reclaim when small"),
              required=False, knob="MOE_CTX_WRITE") for d in ("enter", "exit")]
    for sc in _CTX_INVALIDATE:
        for d in ("enter", "exit"):
            fields = ("behavior",) if (sc == "madvise" and d == "enter") else ()
            out.append(_g(f"ctx_{d}_{sc}", _bcc_tp(f"syscalls:sys_{d}_{sc}", fields=fields,
                                                    note="an invalidating syscall in flight (evictor class)"),
                          required=False, knob="MOE_CTX_INVALIDATE"))
    for w in ("direct", "memcg"):
        for d in ("begin", "end"):
            out.append(_g(f"ctx_{w}_{d}", _bcc_tp(f"vmscan:mm_vmscan_{w}_reclaim_{d}",
                                                   note=f"a {w} reclaim window open on the task (evictor class)"),
                          required=False, knob="MOE_CTX_RECLAIM"))
    return tuple(out)

#: probes/pagecache.c. Reads only tracepoint arguments (layout-safe with mismatched headers).
PAGECACHE = ProbeSpec(
    name="pagecache",
    description="per-expert added (miss) / evicted / re-added (exact, per page) pages in the kernel; "
                "requested pages from the replay's accounting, hits = requested - added",
    attach=(
        _g("add", _bcc_tp("filemap:mm_filemap_add_to_page_cache", fields=_FOLIO_FIELDS, field_knobs=_ORDER,
                          note="a folio added to the page cache: a miss (readahead included); stable "
                               "tracepoint (pfn, i_ino, index, s_dev); `order` since large folios "
                               "(6.x): pages = 1 << order, else one page per event")),
        _g("delete", _bcc_tp("filemap:mm_filemap_delete_from_page_cache", fields=_FOLIO_FIELDS,
                             field_knobs=_ORDER, note="a folio deleted from the page cache: an eviction "
                                                      "(or truncation); carries order like add")),
    ) + tuple(
        _g(f"exit_{sc}", _bcc_tp(f"syscalls:sys_exit_{sc}", fields=("ret",),
                                 note="read bytes of the followed processes (a cross-check of the replay's "
                                      "accounting; fd -> inode would need kernel structs)"),
           required=False, knob="TRACK_READS")
        for sc in _READ_EXITS
    ) + (
        _g("newtask", _bcc_tp("task:task_newtask", fields=("pid", "clone_flags"),
                              note="follow the command's child processes (threads share the tgid)"),
           required=False, knob="FOLLOW_FORKS"),
    ) + _ctx_groups(),
    knobs=(
        Knob("POOL_DEV", 0, "s_dev of the pool's filesystem, kernel encoding (major << 20) | minor; 0: every device"),
        Knob("N_EXPERTS", 0, "experts in the pool (counts has N_EXPERTS + 1 slots: the last is unattributed)"),
        Knob("PPE", 1, "pages per expert (the extent, in pages)"),
        Knob("WPE", 1, "64-bit bitmap words per expert = ceil(PPE / 64)"),
        Knob("HAVE_ORDER", 1, "1: the add/delete formats carry the folio order (set from the format files)"),
        Knob("MAX_FOLIO_PAGES", 512, "largest folio handled in full; pages beyond it count as unprocessed"),
        Knob("TRACK_READS", 1, "1: count read-syscall bytes of the followed tgids (exit_* groups)"),
        Knob("FOLLOW_FORKS", 1, "1: a followed tgid's new processes are followed too (newtask group)"),
        Knob("STREAM_EVENTS", 0, "1: one ring record per (event, expert piece): the per-page stream"),
        Knob("RING_PAGES", 256, "ring buffer size in pages (power of two) when streaming"),
        Knob("EPOCHS", 0, "0: totals only; > 0: per-epoch counters too (EPOCHS x (N_EXPERTS + 1) slots; "
                          "the replay writes one epoch per iteration into epoch_now)"),
        Knob("MOE_CTX_WRITE", 1, "1: the write(2) evictor context (drop_caches; memory.reclaim when small)"),
        Knob("MOE_CTX_INVALIDATE", 1, "1: the fadvise64 / truncate-family / madvise evictor contexts"),
        Knob("MOE_CTX_RECLAIM", 1, "1: the direct / memcg reclaim windows (evictor context)"),
        Knob("MOE_MAX_TASKS", 16384, "task -> evictor context entries (LRU hash)"),
    ),
    table="experts",
    schema=(
        Column("kind", "string", "", "'expert' or 'unattributed' (pool-filesystem pages of no expert)"),
        Column("layer", "Int32", "", "layer of the expert (NA for unattributed)"),
        Column("expert", "Int32", "", "expert index within the layer"),
        Column("expert_id", "Int64", "", "layer * n_experts + expert"),
        Column("added_pages", "Int64", "pages", "pages added to the page cache (misses, readahead included)"),
        Column("evicted_pages", "Int64", "pages", "pages deleted from the page cache"),
        Column("re_added_pages", "Int64", "pages", "pages added again after their eviction (exact, per page)"),
        Column("requested_bytes", "Int64", "bytes",
               "bytes the replay read (its plan accounting; NA without a replay log)"),
        Column("requested_pages", "Int64", "pages", "pages the replay's reads cover (NA without a replay log)"),
        Column("hit_pages", "Int64", "pages", "requested_pages - added_pages (negative: readahead charged here)"),
    ) + _evictor_cols(),
    more_tables=(
        ("expert_epochs", (
            Column("epoch", "int32", "", "epochs.parquet row: one per replay iteration (or per phase)"),
            Column("kind", "string", "", "'expert' or 'unattributed'"),
            Column("layer", "Int32"), Column("expert", "Int32"), Column("expert_id", "Int64"),
            Column("added_pages", "Int64", "pages"), Column("evicted_pages", "Int64", "pages"),
            Column("re_added_pages", "Int64", "pages"))),
        ("epochs", (
            Column("epoch", "int32"),
            Column("phase", "string", "", "setup (before the first iteration), warmup, measured, after"),
            Column("repeat", "Int32", "", "pass of the phase (NA for setup/after, and per-phase epochs)"),
            Column("iteration", "Int32", "", "plan iteration (NA for setup/after and per-phase epochs)"),
            Column("start_ns", "Int64", "ns", "CLOCK_MONOTONIC when the epoch began"),
            Column("end_ns", "Int64", "ns", "when the next began (or the recording ended)"),
            Column("folded", "boolean", "", "later epochs beyond the array were counted here too"))
            + tuple(Column(c.name, c.dtype, c.unit, c.doc + " (pool experts, this epoch)") for c in _evictor_cols())),
    ),
    stats=("add_events", "delete_events", "pool_dev_add_events", "pool_dev_delete_events", "unprocessed_pages",
           "read_bytes", "read_calls", "tgid_map_full", "ring_drops", "bitmap_misses", "dev_mismatch_events",
           "add_runs"),
    structs=(
        Struct("expert_counts", (("added_pages", "u64"), ("evicted_pages", "u64"), ("re_added_pages", "u64"))),
        Struct("ino_val", (("base", "u32"), ("n", "u32"))),
        Struct("page_event", (("ts_ns", "u64"), ("expert_id", "u32"), ("kind", "u32"), ("first_page", "u32"),
                              ("pages", "u32"), ("re_added", "u32"), ("tgid", "u32"), ("evictor", "u32"),
                              ("reserved", "u32"))),
    ),
)

_LRU_FOLIO = ("pfn", "i_ino", "index", "s_dev")


def _lru_pages(name: str, doc: str) -> Column:
    return Column(name, "Int64", "pages", doc)


#: probes/lru.c. Reads only tracepoint arguments; joins LRU events to expert pages on the pfn
#: (the page-cache add gives pfn -> (inode, index, order)); aggregated per expert in the kernel.
LRU = ProbeSpec(
    name="lru",
    description="classic LRU per expert: list at LRU insertion, activations, dwell from insertion to "
                "activation / eviction (LRU events joined to pool pages on the pfn), in the kernel",
    attach=(
        _g("add", _bcc_tp("filemap:mm_filemap_add_to_page_cache", fields=_LRU_FOLIO, field_knobs=_ORDER,
                          note="opens the join: pfn -> (expert, page, folio pages = 1 << order, add time)")),
        _g("delete", _bcc_tp("filemap:mm_filemap_delete_from_page_cache", fields=_LRU_FOLIO, field_knobs=_ORDER,
                             note="closes the join: an eviction; dwell = now - LRU insertion time")),
        _g("insertion", _bcc_tp("pagemap:mm_lru_insertion", fields=("pfn", "lru", "flags"),
                                note="lru_add() moving a batched new folio onto its list (once per folio, no "
                                     "size: charged with the joined folio's pages); takes a folio since the folio "
                                     "conversion (5.16); the C file includes <linux/mmzone.h> for enum lru_list")),
        _g("activate", _bcc_tp("pagemap:mm_lru_activate", fields=("pfn",),
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
    schema=(
        Column("kind", "string", "", "'expert' or 'unattributed' (pool-filesystem pages of no expert)"),
        Column("layer", "Int32", "", "layer of the expert (NA for unattributed)"),
        Column("expert", "Int32", "", "expert index within the layer"),
        Column("expert_id", "Int64", "", "layer * n_experts + expert"),
        _lru_pages("added_pages", "pages added to the page cache during the recording (the join's entries)"),
        _lru_pages("inserted_pages", "LRU insertions of those pages (mm_lru_insertion, any list)"),
        _lru_pages("inserted_inactive_pages", "... onto the inactive file list"),
        _lru_pages("inserted_active_pages", "... onto the active file list (activated before reaching the list: a "
                                            "workingset refault, or a second access while batched)"),
        _lru_pages("inserted_unevictable_pages", "... onto the unevictable list (mlocked)"),
        _lru_pages("inserted_other_pages", "... onto another list (anon lists: swap-backed file pages)"),
        _lru_pages("activated_pages", "inactive -> active moves (mm_lru_activate; NA when not compiled)"),
        Column("activation_dwell_ns_sum", "Int64", "ns",
               "LRU insertion -> activation, summed over activated pages whose insertion was seen"),
        Column("activation_dwell_count", "Int64", "", "pages activation_dwell_ns_sum is over"),
        Column("activation_dwell_ns_mean", "Float64", "ns", "activation_dwell_ns_sum / activation_dwell_count"),
        _lru_pages("evicted_pages", "pages deleted from the page cache (by inode and index: every deletion)"),
        _lru_pages("evicted_joined_pages", "... of them added during the recording (their pfn was joined)"),
        _lru_pages("evicted_activated_pages", "... of those activated (or inserted active) while cached"),
        Column("dwell_ns_sum", "Int64", "ns", "LRU insertion -> eviction, summed over evicted pages whose "
                                              "insertion was seen (page-weighted)"),
        Column("dwell_count", "Int64", "", "pages dwell_ns_sum is over (evicted with a known insertion time)"),
        Column("dwell_ns_mean", "Float64", "ns", "dwell_ns_sum / dwell_count"),
    ),
    more_tables=(
        ("lru_dwell_histogram", (
            Column("kind", "string", "", "insertion_to_eviction, insertion_to_activation, add_to_insertion "
                                         "(page-cache add -> LRU insertion: time in the per-CPU batch)"),
            Column("slot", "int32"), Column("lo_ns", "uint64", "ns"), Column("hi_ns", "uint64", "ns"),
            _lru_pages("pages", "expert pages (pool-wide) whose interval is in [lo_ns, hi_ns)"))),
    ),
    stats=("add_events", "pool_dev_add_events", "insert_events", "insert_joined", "insert_repeated",
           "insert_anon_stale", "activate_events", "activate_joined", "activate_uninserted", "delete_events",
           "pool_dev_delete_events", "delete_joined", "delete_unjoined", "delete_stale", "add_stale",
           "unprocessed_pages", "join_update_failed"),
    structs=(
        Struct("ino_val", (("base", "u32"), ("n", "u32"))),
        Struct("lru_counts", tuple((f, "u64") for f in (
            "added", "inserted", "inserted_inactive", "inserted_active", "inserted_unevictable", "inserted_other",
            "activated", "activation_dwell_ns", "activation_dwell_count", "evicted", "evicted_joined",
            "evicted_activated", "dwell_ns", "dwell_count"))),
        Struct("pfn_val", (("add_ns", "u64"), ("insert_ns", "u64"), ("eid", "u32"), ("pstart", "u32"),
                           ("elast", "u32"), ("pages", "u32"), ("lru", "u32"), ("activations", "u32"))),
    ),
    enrichment=True,
)

_I64 = "int64"


def _pages(name: str, doc: str = "") -> Column:
    return Column(name, _I64, "pages", doc)


_SHRINK_INACTIVE_FIELDS = ("nr_scanned", "nr_reclaimed", "nr_dirty", "nr_writeback", "nr_congested", "nr_immediate",
                           "nr_activate0", "nr_activate1", "nr_ref_keep", "nr_unmap_fail", "reclaim_flags")

#: probes/reclaim.c. Reads only tracepoint arguments; aggregated in the kernel (no stream).
RECLAIM = ProbeSpec(
    name="reclaim",
    description="who reclaimed (memcg limit, direct, kswapd, damon, proactive = memory.reclaim, other), "
                "scan/steal, shrink_active, isolate, invocation durations; all aggregated in the kernel",
    attach=(
        _g("memcg_begin", _tp("vmscan:mm_vmscan_memcg_reclaim_begin",
                              note="memcg limit reclaim (try_to_free_mem_cgroup_pages) opens a window; "
                                   "proactive when it opens inside a small write(2): memory.reclaim")),
        _g("memcg_end", _tp("vmscan:mm_vmscan_memcg_reclaim_end", fields=("nr_reclaimed",))),
        _g("direct_begin", _tp("vmscan:mm_vmscan_direct_reclaim_begin"), required=False, knob="MOE_HAVE_DIRECT"),
        _g("direct_end", _tp("vmscan:mm_vmscan_direct_reclaim_end", fields=("nr_reclaimed",)), required=False,
           knob="MOE_HAVE_DIRECT"),
        _g("kswapd_wake", _tp("vmscan:mm_vmscan_kswapd_wake"), required=False, knob="MOE_HAVE_KSWAPD"),
        _g("kswapd_sleep", _tp("vmscan:mm_vmscan_kswapd_sleep"), required=False, knob="MOE_HAVE_KSWAPD"),
        _g("shrink_inactive", _tp("vmscan:mm_vmscan_lru_shrink_inactive", fields=_SHRINK_INACTIVE_FIELDS,
                                  note="does NOT fire with MGLRU on in 6.1 (evict_folios bypasses "
                                       "shrink_inactive_list); fires again in 6.12; nr_scanned/nr_reclaimed "
                                       "are what pgscan/pgsteal_{anon,file} count")),
        _g("shrink_active", _tp("vmscan:mm_vmscan_lru_shrink_active",
                                fields=("nr_taken", "nr_active", "nr_deactivated", "nr_referenced")),
           required=False, knob="MOE_HAVE_SHRINK_ACTIVE"),
        _g("isolate", _tp("vmscan:mm_vmscan_lru_isolate",
                          fields=("nr_requested", "nr_scanned", "nr_skipped", "nr_taken")),
           required=False, knob="MOE_HAVE_ISOLATE"),
        _g("ctx_enter_write", _tp("syscalls:sys_enter_write", fields=("count",),
                                  note="a write(2) of <= 64 bytes in flight: a memcg window it opens is "
                                       "memory.reclaim (proactive)"),
           required=False, knob="MOE_CTX_WRITE"),
        _g("ctx_exit_write", _tp("syscalls:sys_exit_write"), required=False, knob="MOE_CTX_WRITE"),
    ),
    knobs=(
        Knob("MOE_HAVE_DIRECT", 1, "1: compile direct_reclaim_begin/end (set from the attach plan)"),
        Knob("MOE_HAVE_KSWAPD", 1, "1: compile kswapd_wake/sleep (set from the attach plan)"),
        Knob("MOE_HAVE_SHRINK_ACTIVE", 1, "1: compile lru_shrink_active (set from the attach plan)"),
        Knob("MOE_HAVE_ISOLATE", 1, "1: compile lru_isolate (set from the attach plan)"),
        Knob("MOE_CTX_WRITE", 1, "1: compile sys_enter/exit_write: the small-write context that makes a memcg "
                                 "window proactive (memory.reclaim; set from the attach plan)"),
        Knob("MOE_MAX_TASKS", 16384, "tid -> open reclaim window entries (and tid -> write context entries)"),
        Knob("MOE_BUCKET_NS", 0, "per-time-bucket counters: bucket width in ns (0: off)"),
        Knob("MOE_MAX_BUCKETS", 4096, "time buckets kept; later events land in the last one"),
        Knob("MOE_T0_NS", 0, "bpf_ktime_get_ns() (CLOCK_MONOTONIC) of bucket 0"),
    ),
    table="reclaim",
    schema=(
        Column("kind", "string", "", "reclaimer: memcg (limit reclaim), direct, kswapd, damon (a kdamond thread), "
                                     "proactive (memory.reclaim: memcg reclaim inside a write(2) of <= 64 bytes), "
                                     "other (no open window)"),
        Column("invocations", _I64, "", "*_reclaim_begin / kswapd_wake events"),
        Column("completed", _I64, "", "invocations closed by their end / sleep"),
        _pages("scanned_pages", "shrink_inactive nr_scanned (== pgscan_anon + pgscan_file)"),
        _pages("reclaimed_pages", "shrink_inactive nr_reclaimed (== pgsteal_anon + pgsteal_file)"),
        Column("scan_to_steal", "float64", "", "scanned / reclaimed (NaN without steal)"),
        Column("duration_ns_sum", _I64, "ns", "begin -> end of completed invocations"),
        Column("duration_ns_mean", "float64", "ns"),
        _pages("end_reclaimed_pages", "sum of nr_reclaimed at *_reclaim_end"),
        _pages("scanned_file_pages"), _pages("reclaimed_file_pages"),
        Column("inactive_calls", _I64, "", "lru_shrink_inactive events"),
        _pages("dirty_pages"), _pages("writeback_pages"), _pages("congested_pages"), _pages("immediate_pages"),
        _pages("activate_anon_pages", "nr_activate0"), _pages("activate_file_pages", "nr_activate1"),
        _pages("ref_keep_pages"), _pages("unmap_fail_pages"),
        Column("active_calls", _I64, "", "lru_shrink_active events"),
        _pages("active_taken_pages", "nr_taken (== pgrefill)"), _pages("active_deactivated_pages"),
        _pages("active_kept_pages", "nr_active"), _pages("active_referenced_pages"),
        Column("isolate_calls", _I64, "", "lru_isolate events"),
        _pages("isolate_requested_pages"), _pages("isolate_scanned_pages"), _pages("isolate_skipped_pages"),
        _pages("isolate_taken_pages"),
    ),
    more_tables=(
        ("reclaim_histogram", (Column("kind", "string"), Column("slot", "int32"),
                               Column("lo_ns", "uint64", "ns"), Column("hi_ns", "uint64", "ns"),
                               Column("invocations", _I64, "", "completed invocations of [lo_ns, hi_ns)"))),
        ("reclaim_timeline", (Column("time_ns", _I64, "ns", "bucket start since the recording's t0"),
                              Column("who", "string"), _pages("nr_scanned_pages"), _pages("nr_reclaimed_pages"),
                              Column("invocations", _I64), Column("duration_ns", _I64, "ns"))),
    ),
    stats=("nested_begins", "unmatched_ends", "kind_mismatch", "task_map_full", "timeline_overflow"),
)

#: (syscall, enter fields read, group knob or None: required); probes/mlock.c
_MLOCK_CALLS = (
    ("mlock", ("start", "len"), None),
    ("munlock", ("start", "len"), None),
    ("mlock2", ("start", "len", "flags"), "MOE_HAVE_MLOCK2"),
    ("mlockall", ("flags",), "MOE_HAVE_MLOCKALL"),
    ("munlockall", (), "MOE_HAVE_MLOCKALL"),
    ("munmap", ("addr", "len"), "MOE_TRACK_MUNMAP"),
    ("mmap", ("len", "flags"), "MOE_TRACK_MMAP"),
    ("mremap", ("addr", "old_len", "new_len", "flags"), "MOE_TRACK_MREMAP"),
)
_MLOCK_NOTES = {
    "mlock2": "since 4.4 (MLOCK_ONFAULT); locks like mlock",
    "mlockall": "MCL_CURRENT locks every mapping: the locked bytes are unknowable from arguments (NA until "
                "munlockall)",
    "munmap": "unmapping a locked range unlocks it; recorded only for a tgid that has locked something",
    "mmap": "MAP_LOCKED maps locked; MAP_FIXED may replace a locked range (recorded only for a tgid that "
            "locked)",
    "mremap": "moving / growing a locked mapping moves / grows its locked pages (tgids that locked only)",
}
_MLOCK_INT = "int64"

#: probes/mlock.c. Reads only syscall arguments; one ring record per call of the followed tgids
#: (calls are rare), locked ranges rebuilt exactly in user space (moetrace.record.probes.mlock).
MLOCK = ProbeSpec(
    name="mlock",
    description="every mlock-family call of the command (ring, bounded, lost counted); locked bytes over "
                "time per process, exact (an interval set per tgid, page-rounded like the kernel)",
    attach=tuple(
        _g(f"{sc}_{side}",
           _bcc_tp(f"syscalls:sys_{side}_{sc}", fields=fields if side == "enter" else ("ret",),
                   note=_MLOCK_NOTES.get(sc, "")),
           required=knob is None, knob=knob)
        for sc, fields, knob in _MLOCK_CALLS for side in ("enter", "exit")
    ) + (
        _g("newtask", _bcc_tp("task:task_newtask", fields=("pid", "clone_flags"),
                              note="follow the command's child processes (VM_LOCKED is not inherited)"),
           required=False, knob="MOE_FOLLOW_FORKS"),
        _g("exit", _bcc_tp("sched:sched_process_exit", field_knobs=(("group_dead", "MOE_EXIT_GROUP_DEAD"),),
                           note="a process's end releases its locks; group_dead is newer than 6.12 (without "
                                "it the leader's exit stands for the group's)"),
           required=False, knob="MOE_TRACK_EXIT"),
        _g("exec", _bcc_tp("sched:sched_process_exec", note="execve gives the process a new mm: nothing locked"),
           required=False, knob="MOE_TRACK_EXEC"),
        _g("kp_mlock_folio", _kp("mlock_folio", needs="exact-headers",
                                 note="a folio mlocked (reads folio->flags for PG_head); mlock_page before the "
                                      "mlock folio conversion (6.1 already has mlock_folio)"),
           required=False, knob="MOE_KP_MLOCK_FOLIO"),
        _g("kp_mlock_new", _kp("mlock_new_folio", needs="exact-headers",
                               note="renamed from mlock_new_page by the mlock folio conversion (6.3)"),
           _kp("mlock_new_page", needs="exact-headers", note="6.1 name"), required=False, knob="MOE_KP_MLOCK_NEW"),
        _g("kp_munlock", _kp("munlock_folio", needs="exact-headers", note="6.3+ name"),
           _kp("munlock_page", needs="exact-headers", note="6.1 name"), required=False, knob="MOE_KP_MUNLOCK"),
    ),
    knobs=(
        Knob("MOE_HAVE_MLOCK2", 1, "1: compile mlock2 enter/exit (set from the attach plan)"),
        Knob("MOE_HAVE_MLOCKALL", 1, "1: compile mlockall/munlockall enter/exit (set from the attach plan)"),
        Knob("MOE_TRACK_MUNMAP", 1, "1: compile munmap enter/exit (a locked range unmapped)"),
        Knob("MOE_TRACK_MMAP", 1, "1: compile mmap enter/exit (MAP_LOCKED, MAP_FIXED over a locked range)"),
        Knob("MOE_TRACK_MREMAP", 1, "1: compile mremap enter/exit (a locked mapping moved or resized)"),
        Knob("MOE_FOLLOW_FORKS", 1, "1: a followed tgid's new processes are followed too (newtask group)"),
        Knob("MOE_TRACK_EXIT", 1, "1: compile sched_process_exit (a process's end releases its locks)"),
        Knob("MOE_EXIT_GROUP_DEAD", 1, "1: sched_process_exit carries group_dead (set from the format file)"),
        Knob("MOE_TRACK_EXEC", 1, "1: compile sched_process_exec (execve: a new mm, nothing locked)"),
        Knob("MOE_KP_MLOCK_FOLIO", 0, "1: compile the mlock_folio kprobe (exact headers; set from the plan)"),
        Knob("MOE_KP_MLOCK_NEW", 0, "1: compile the mlock_new_folio / mlock_new_page kprobe"),
        Knob("MOE_KP_MUNLOCK", 0, "1: compile the munlock_folio / munlock_page kprobe"),
        Knob("MOE_MAX_TASKS", 4096, "tid -> call in flight entries"),
        Knob("MOE_MAX_TGIDS", 1024, "followed processes"),
        Knob("MOE_RINGBUF_PAGES", 16, "ring buffer size in pages (power of two)"),
    ),
    table="mlock",
    schema=(
        Column("time_ns", _MLOCK_INT, "ns", "CLOCK_MONOTONIC at the call's exit (the replay's clock)"),
        Column("tgid", "int32"), Column("tid", "int32"),
        Column("call", "string", "", "mlock, mlock2, munlock, mlockall, munlockall, munmap, mmap, mremap; "
                                     "exit / exec: the process ended / exec'd (not calls: its locks went)"),
        Column("start", "uint64", "", "the call's start / addr argument (a user-space address)"),
        Column("len_bytes", _MLOCK_INT, "bytes", "the len argument (mremap: old_len)"),
        Column("new_len_bytes", "Int64", "bytes", "mremap's new_len (NA for the other calls)"),
        Column("flags", "int64", "", "mlock2 / mlockall / mmap / mremap flags (0 for the others)"),
        Column("ret", "int64", "", "the return value (negative errno; mmap / mremap: the mapping's address)"),
        Column("latency_ns", _MLOCK_INT, "ns", "enter -> exit"),
        Column("delta_bytes", "Int64", "bytes",
               "change of the process's locked bytes by this call (NA while unknowable, after mlockall)"),
        Column("locked_bytes", "Int64", "bytes",
               "the process's locked bytes after the call (== VmLck; NA while unknowable)"),
    ),
    more_tables=(
        ("mlock_timeline", (
            Column("time_ns", _MLOCK_INT, "ns", "CLOCK_MONOTONIC of a change"),
            Column("tgid", "int32"),
            Column("call", "string"),
            Column("locked_bytes", "Int64", "bytes", "this process's locked bytes from time_ns on (NA: unknowable)"),
            Column("total_locked_bytes", "Int64", "bytes",
                   "all followed processes' locked bytes from time_ns on (NA when one is unknowable)"),
        )),
    ),
    stats=("calls", "ring_lost", "pending_full", "unmatched_exits", "tgid_map_full", "kp_mlock_folio",
           "kp_mlock_new", "kp_munlock", "kp_large"),
    structs=(Struct("mlock_event", (("ts_ns", "u64"), ("tgid", "u32"), ("tid", "u32"), ("call", "u32"),
                                    ("flags", "u32"), ("start", "u64"), ("len", "u64"), ("len2", "u64"),
                                    ("ret", "s64"), ("latency_ns", "u64"))),),
    enrichment=True,
)

_BIO_FIELDS = ("dev", "sector", "nr_sector", "rwbs")

#: probes/block.c. Reads only tracepoint arguments; bios attributed to experts in user space
#: (FIEMAP extents, moetrace.kernel.extents).
BLOCK = ProbeSpec(
    name="block",
    description="device read bytes per expert via FIEMAP extents (one ring record per bio); request "
                "latency issue -> complete net of requeues, per device",
    attach=(
        _g("bytes",
           _tp("block:block_bio_queue", fields=_BIO_FIELDS, sets=(("MOE_BYTES_TP", 2),),
               note="every kernel; every bio once with its full size, before merging (matched /proc/diskstats "
                    "in 60 of 60 measured runs)"),
           _tp("block:block_io_start", fields=_BIO_FIELDS, sets=(("MOE_BYTES_TP", 1),),
               note="added in 6.5; fires once per request with its first bio's size and misses bios merged "
                    "later (-4.3 % vs diskstats on buffered pool-file reads in 17 of 30 runs): fallback only")),
        _g("rq_issue", _tp("block:block_rq_issue", fields=_BIO_FIELDS,
                           note="over-counts by requeues: net with rq_requeue")),
        _g("rq_complete", _tp("block:block_rq_complete", fields=("dev", "sector", "rwbs"),
                              note="IRQ context: can lose events to BPF recursion protection; latency only")),
        _g("rq_requeue", _tp("block:block_rq_requeue", fields=_BIO_FIELDS)),
    ),
    knobs=(
        Knob("MOE_DEV", 0, "tracepoint dev of the pool's disk, (major << 20) | minor; 0: every device"),
        Knob("MOE_BYTES_TP", 2, "1: bytes at block_io_start, 2: at block_bio_queue (set from the attach plan)"),
        Knob("MOE_RINGBUF_PAGES", 64, "ring buffer size in pages (power of two)"),
        Knob("MOE_STREAM_BIOS", 1, "1: one ring record per read bio (needed to attribute to experts)"),
        Knob("MOE_MAX_INFLIGHT", 65536, "(dev, sector) -> issue time entries for latency"),
    ),
    table="experts",
    schema=(
        Column("device_read_bytes", "Int64", "bytes",
               "read bytes of bios overlapping the expert's extents (unattributed row: bytes of no expert)"),
        Column("bios", "Int64", "", "read bios touching the expert (one spanning two experts counts for both)"),
    ),
    more_tables=(
        ("block_latency", (Column("dev", _I64, "", "tracepoint dev (major << 20) | minor"),
                           Column("disk", "string"), Column("slot", "int32"), Column("lo_ns", "uint64", "ns"),
                           Column("hi_ns", "uint64", "ns"),
                           Column("requests", _I64, "", "read requests issue -> complete in [lo_ns, hi_ns), "
                                                        "requeued ones timed from their last issue"))),
        ("block_device", (Column("dev", _I64), Column("disk", "string"),
                          Column("read_bytes", _I64, "bytes", "at the bytes tracepoint"),
                          Column("bios", _I64), Column("issues", _I64), Column("issue_bytes", _I64, "bytes"),
                          Column("requeues", _I64), Column("requeue_bytes", _I64, "bytes"),
                          Column("completes", _I64), Column("complete_matched", _I64),
                          Column("latency_ns_sum", _I64, "ns"),
                          Column("diskstats_read_bytes", "Int64", "bytes", "/proc/diskstats sectors read delta x 512"))),
    ),
    stats=("read_bytes", "read_bios", "ring_lost", "issues", "issue_bytes", "requeues", "requeue_bytes",
           "completes", "complete_matched", "inflight_full", "latency_ns"),
    structs=(Struct("bio_event", (("sector", "u64"), ("nr_sector", "u32"), ("flags", "u32"))),),
)

_READ_SYSCALLS = ("pread64", "preadv", "preadv2", "read")
#: read syscall -> (enter fields, group knob): pread64 is required, the others optional
_READ_ENTER = {"pread64": (("fd", "pos", "count"), None), "preadv": (("fd", "vec", "vlen", "pos_l"), "MOE_HAVE_PREADV"),
               "preadv2": (("fd", "vec", "vlen", "pos_l"), "MOE_HAVE_PREADV2"),
               "read": (("fd", "count"), "MOE_HAVE_READ")}
_FD_ID_DOC = "fd identity (tgid, fd, gen, epoch): gen counts close() of the fd, epoch close_range()/exec"


def _calls(name: str, doc: str = "") -> Column:
    return Column(name, "Int64", "", doc)


#: probes/reads.c. Reads only tracepoint + syscall arguments and the caller's iovec array
#: (user memory); fd -> inode -> expert is resolved in user space (moetrace.record.probes.reads).
READS = ProbeSpec(
    name="reads",
    description="per read call of the followed processes: latency, bytes, pages added during the call -> "
                "hit-only / miss / error, aggregated per class and per fd identity in the kernel, attributed "
                "to experts in user space (/proc/<tgid>/fd + the first added page's inode)",
    attach=tuple(
        g for sc in _READ_SYSCALLS for g in (
            _g(f"{sc}_enter", _bcc_tp(f"syscalls:sys_enter_{sc}", fields=_READ_ENTER[sc][0],
                                      note="fd, file position and requested bytes of the call"
                                           + (" (bytes summed from the user iovec array; pos_h is ignored by "
                                              "64-bit kernels)" if "vec" in _READ_ENTER[sc][0] else "")
                                           + (" (no position: pool-file reads stay unattributed)"
                                              if sc == "read" else "")
                                           + (" (since 4.6; Python's os.preadv, the replay's read call, "
                                              "issues preadv2)" if sc == "preadv2" else "")),
               required=sc == "pread64", knob=_READ_ENTER[sc][1]),
            _g(f"{sc}_exit", _bcc_tp(f"syscalls:sys_exit_{sc}", fields=("ret",),
                                     note="ret: bytes read or -errno; the call's latency ends here"),
               required=sc == "pread64", knob=_READ_ENTER[sc][1]))
    ) + (
        _g("add", _bcc_tp("filemap:mm_filemap_add_to_page_cache", fields=("i_ino", "index", "s_dev"),
                          field_knobs=(("order", "MOE_HAVE_ORDER"),),
                          note="a folio added while the task has a read call in flight: the call missed; "
                               "pages = 1 << order (large folios), the first add tells the call's inode")),
        _g("close", _bcc_tp("syscalls:sys_enter_close", fields=("fd",),
                            note="a closed fd number starts a new fd identity (gen + 1)"),
           required=False, knob="MOE_TRACK_CLOSE"),
        _g("close_range", _bcc_tp("syscalls:sys_enter_close_range",
                                  note="close_range (5.9+): a new epoch for every fd of the process"),
           required=False, knob="MOE_TRACK_CLOSE_RANGE"),
        _g("exec", _bcc_tp("sched:sched_process_exec",
                           note="exec closes O_CLOEXEC fds without close(): a new epoch"),
           required=False, knob="MOE_TRACK_EXEC"),
        _g("newtask", _bcc_tp("task:task_newtask", fields=("pid", "clone_flags"),
                              note="follow the command's child processes (threads share the tgid)"),
           required=False, knob="MOE_FOLLOW_FORKS"),
    ),
    knobs=(
        Knob("MOE_HAVE_PREADV", 1, "1: compile sys_enter/exit_preadv (set from the attach plan)"),
        Knob("MOE_HAVE_PREADV2", 1, "1: compile sys_enter/exit_preadv2 (set from the attach plan)"),
        Knob("MOE_HAVE_READ", 1, "1: compile sys_enter/exit_read (set from the attach plan)"),
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
    schema=(
        Column("kind", "string", "", "'expert' or 'unattributed'"),
        Column("source", "string", "", "'expert', or why unattributed: other_files (fd of a non-pool file), "
                                       "unresolved_fd (fd never seen open and no page added), no_position "
                                       "(read() of a pool file), pool_tail (past the pool's extents), "
                                       "bad_fd (failed with EBADF: no open file), fd_map_full"),
        Column("layer", "Int32"), Column("expert", "Int32"), Column("expert_id", "Int64"),
        _calls("calls", "read calls (exited)"),
        Column("bytes", "Int64", "bytes", "sum of ret > 0"),
        Column("requested_bytes", "Int64", "bytes", "sum of the calls' count (iovec lengths for preadv)"),
        _calls("hit_only_calls", "calls with no page added while in flight"),
        Column("hit_only_bytes", "Int64", "bytes"),
        Column("hit_only_latency_ns_sum", "Int64", "ns"),
        _calls("miss_calls", "calls with >= 1 page added while in flight"),
        Column("miss_bytes", "Int64", "bytes"),
        Column("miss_latency_ns_sum", "Int64", "ns"),
        _calls("error_calls", "ret < 0"),
        Column("error_latency_ns_sum", "Int64", "ns"),
        Column("latency_ns_sum", "Int64", "ns", "enter -> exit of every call"),
        Column("added_pages", "Int64", "pages", "pages of the call's file added during its calls"),
        Column("beyond_pages", "Int64", "pages", "... of them outside the call's [pos, pos + count) (readahead)"),
        Column("other_added_pages", "Int64", "pages", "pages of other inodes added during the calls"),
        _calls("fd_identities", _FD_ID_DOC),
        Column("hit_only_ns_per_kib", "float64", "ns/KiB", "hit-path cost: hit-only latency per KiB read"),
    ),
    more_tables=(
        ("reads_latency", (Column("scope", "string", "", "all (every followed call), pool (calls on pool-file "
                                                         "fds), not_pool (all - pool)"),
                           Column("class", "string", "", "hit_only, miss, error"),
                           Column("slot", "int32"), Column("lo_ns", "uint64", "ns"), Column("hi_ns", "uint64", "ns"),
                           Column("calls", _I64, "", "calls whose latency is in [lo_ns, hi_ns)"))),
        ("reads_files", (Column("tgid", "int32"), Column("fd", "int32"), Column("gen", "int32"),
                         Column("epoch", "int32"),
                         Column("extent", "Int64", "", "pos // MOE_EXTENT (0 without split; NA: read())"),
                         Column("ino", "UInt64", "", "NA: unresolved"), Column("dev", "Int64", "", "kernel s_dev"),
                         Column("path", "string", "", "readlink of /proc/<tgid>/fd/<fd> (NA: not seen open)"),
                         Column("resolved_by", "string", "", "proc (fd scan), add (first added page), or NA"),
                         Column("source", "string"), Column("expert_id", "Int64"),
                         Column("calls", _I64), Column("bytes", _I64, "bytes"), Column("hit_only_calls", _I64),
                         Column("miss_calls", _I64), Column("error_calls", _I64),
                         Column("added_pages", _I64, "pages"), Column("latency_ns_sum", _I64, "ns"))),
        ("read_calls", (Column("ts_ns", _I64, "ns", "call entry, CLOCK_MONOTONIC"), Column("tid", "int32"),
                        Column("tgid", "int32"), Column("fd", "int32"), Column("gen", "int32"),
                        Column("epoch", "int32"), Column("syscall", "string"),
                        Column("offset_bytes", "Int64", "bytes", "file position (NA: read(), preadv2 pos -1)"),
                        Column("count_bytes", _I64, "bytes"), Column("ret", _I64, "", "bytes read or -errno"),
                        Column("latency_ns", _I64, "ns"), Column("added_pages", _I64, "pages"),
                        Column("beyond_pages", _I64, "pages"), Column("other_added_pages", _I64, "pages"),
                        Column("ino", "UInt64", "", "inode of the first page added (NA: none added)"),
                        Column("class", "string"), Column("expert_id", "Int64"), Column("source", "string"))),
        ("read_calls_intervals", (Column("start_ns", _I64, "ns"), Column("end_ns", _I64, "ns"),
                                  Column("records", _I64), Column("lost_kernel_records", _I64),
                                  Column("lost_user_records", _I64))),
    ),
    stats=("calls_pread64", "calls_preadv", "calls_preadv2", "calls_read", "nested_enters", "inflight_full",
           "exit_without_enter", "add_events_in_calls", "pages_added_outside_calls", "fd_map_full",
           "ring_drops", "tgid_full", "iov_truncated", "iov_read_errors", "closes",
           "epoch_bumps", "fdgen_full", "ident_drops", "retire_failed"),
    structs=(
        Struct("class_counts", tuple((f, "u64") for f in ("calls", "bytes", "requested_bytes", "added_pages",
                                                           "beyond_pages", "other_pages", "latency_ns"))),
        Struct("fd_key", (("tgid", "u32"), ("fd", "u32"), ("gen", "u32"), ("epoch", "u32"), ("chunk", "u64"))),
        Struct("fd_counts", tuple((f, "u64") for f in (
            "calls", "bytes", "requested_bytes", "hit_calls", "hit_bytes", "hit_latency_ns", "miss_calls",
            "miss_bytes", "miss_latency_ns", "error_calls", "error_latency_ns", "added_pages", "beyond_pages",
            "other_pages", "ino", "dev"))),
        Struct("ident", tuple((f, "u32") for f in ("tgid", "fd", "gen", "epoch"))),
        Struct("read_call", (("ts_ns", "u64"), ("pos", "u64"), ("count", "u64"), ("ret", "s64"),
                             ("latency_ns", "u64"), ("ino", "u64"), ("tid", "u32"), ("tgid", "u32"), ("fd", "u32"),
                             ("gen", "u32"), ("epoch", "u32"), ("syscall", "u32"), ("added_pages", "u32"),
                             ("beyond_pages", "u32"), ("other_pages", "u32"), ("dev", "u32"))),
    ),
)

#: probes/stacks.c. Reads only the sample's registers (stack ids) and task_newtask's arguments;
#: counted in the kernel per (tgid, user stack, kernel stack, comm), symbolized in user space
#: (moetrace.record.probes.stacks, moetrace.kernel.symbolize).
STACKS = ProbeSpec(
    name="stacks",
    description="perf cpu-clock samples of the command's processes and kswapd, kernel + user stacks counted in "
                "the kernel, symbolized in user space (stacks.folded, stacks.parquet)",
    attach=(
        _g("cpu_clock", AttachCandidate("perf_event", "software:cpu-clock", "on_cpu_clock",
                                        "PERF_COUNT_SW_CPU_CLOCK, an hrtimer per CPU: no hardware PMU needed "
                                        "in a VM; sample_freq becomes a fixed period of 1e9 / MOE_SAMPLE_HZ ns")),
        _g("newtask", _bcc_tp("task:task_newtask", fields=("pid", "clone_flags"),
                              note="follow the command's child processes (threads share the tgid)"),
           required=False, knob="MOE_FOLLOW_FORKS"),
    ),
    knobs=(
        Knob("MOE_SAMPLE_HZ", 99, "samples per second per CPU (perf sample_freq); 99 Hz costs well under "
                                  "1 % of a CPU and stays out of lockstep with 100 Hz timers"),
        Knob("MOE_STACK_ENTRIES", 16384, "stack-trace map entries (distinct user + kernel stacks; ~1 KiB each)"),
        Knob("MOE_MAX_KEYS", 16384, "(tgid, user stack, kernel stack, comm) counters"),
        Knob("MOE_MAX_TASKS", 4096, "followed tgids + kswapd threads"),
        Knob("MOE_FOLLOW_FORKS", 1, "1: a followed tgid's new processes are followed too (newtask group)"),
    ),
    table="stacks",
    schema=(
        Column("stack", "string", "", "folded frames: comm;user frames (root first);kernel frames_[k]"),
        Column("samples", "int64", "", "cpu-clock samples of this stack (one per 1e9 / sample_hz ns on CPU)"),
        Column("comm", "string", "", "the sampled thread's comm"),
        Column("tgid", "int64", "", "process id (kswapd: the thread's pid)"),
        Column("who", "string", "", "command (the followed processes) or kswapd"),
        Column("user_frames", "int32", "", "user frames in the stack (0: none, lost or a kernel thread)"),
        Column("kernel_frames", "int32", "", "kernel frames in the stack (0: sampled in user mode, or lost)"),
        Column("user_stack", "string", "", "ok | none (no user frames: a kernel thread) | lost (stack-map "
                                           "collision) | error"),
        Column("kernel_stack", "string", "", "ok | none (sampled in user mode) | lost | error"),
    ),
    stats=("ticks", "idle_ticks", "samples", "kswapd_samples", "user_stack_eexist", "user_stack_efault",
           "user_stack_other_err", "kernel_stack_eexist", "kernel_stack_efault", "kernel_stack_other_err",
           "keys_full", "tasks_full"),
    enrichment=True,
)

def _mglru_kp(group: str, knob: str, *cands: AttachCandidate) -> AttachGroup:
    return _g(group, *cands, required=False, knob=knob)


_GEN_COLS = (Column("time_ns", "int64", "ns", "CLOCK_MONOTONIC when the sample was read"),
             Column("sample", "int32", "", "sample index (0: at open, the last: at close)"),
             Column("memcg_id", "int64"), Column("node", "int32"))

#: probes/mglru.c (kprobes, lab only) + the lru_gen sampler (moetrace.record.probes.mglru, moetrace.kernel.lru_gen).
MGLRU = ProbeSpec(
    name="mglru",
    description="MGLRU generations over time from <debugfs>/lru_gen (a sampler, no BPF: birth times, ages, "
                "sizes per memcg / node / generation); where kprobes exist, aging attempts (a ring record "
                "each), eviction / isolation / look-around / workingset counts and the generation a "
                "promoted folio leaves",
    attach=(
        _g("lru_gen", AttachCandidate("debugfs", "lru_gen", "",
                                      "Python sampler of <debugfs>/lru_gen (MOE_LRU_GEN_FULL=1: lru_gen_full): "
                                      "wherever MGLRU is built, no BPF")),
        _mglru_kp("evict_folios", "MOE_HAVE_EVICT_FOLIOS",
                  _kp("evict_folios", note="6.1: (lruvec, sc, swappiness, bool *need_swapping); 6.12 drops "
                                           "need_swapping; only counted")),
        _mglru_kp("isolate_folios", "MOE_HAVE_ISOLATE_FOLIOS", _kp("isolate_folios", note="only counted")),
        _mglru_kp("should_run_aging", "MOE_HAVE_SHOULD_RUN_AGING",
                  _kp("should_run_aging", note="6.1 only: gone from kallsyms by 6.12 (inlined)")),
        _mglru_kp("inc_max_seq", "MOE_HAVE_INC_MAX_SEQ",
                  _kp("try_to_inc_max_seq", note="6.1: (lruvec, max_seq, sc, can_swap, force_scan); 6.12: "
                                                 "(lruvec, seq, can_swap, force_scan): PARM2 is the seq either way"),
                  _kp("inc_max_seq", note="the aging step itself; 6.8+ returns bool and takes seq (not read)"),
                  _kp("inc_max_seq.constprop.0", note="6.12 exports only a compiler clone: arguments not read")),
        _mglru_kp("folio_inc_gen", "MOE_HAVE_FOLIO_INC_GEN",
                  _kp("folio_inc_gen", needs="exact-headers",
                      note="per-folio generation: reads folio->flags (LRU_GEN_MASK / LRU_GEN_PGOFF from the "
                           "build's <linux/mmzone.h>)")),
        _mglru_kp("look_around", "MOE_HAVE_LOOK_AROUND", _kp("lru_gen_look_around", note="6.12 returns bool")),
        _mglru_kp("workingset_eviction", "MOE_HAVE_WS_EVICTION", _kp("workingset_eviction")),
        _mglru_kp("workingset_refault", "MOE_HAVE_WS_REFAULT", _kp("workingset_refault")),
    ),
    knobs=(
        Knob("MOE_HAVE_EVICT_FOLIOS", 0, "1: compile the evict_folios kprobe (set from the attach plan)"),
        Knob("MOE_HAVE_ISOLATE_FOLIOS", 0, "1: compile the isolate_folios kprobe"),
        Knob("MOE_HAVE_SHOULD_RUN_AGING", 0, "1: compile the should_run_aging kprobe"),
        Knob("MOE_HAVE_INC_MAX_SEQ", 0, "1: compile the aging kprobes (+ the aging ring)"),
        Knob("MOE_HAVE_FOLIO_INC_GEN", 0, "1: compile the folio_inc_gen kprobe (exact headers)"),
        Knob("MOE_HAVE_LOOK_AROUND", 0, "1: compile the lru_gen_look_around kprobe"),
        Knob("MOE_HAVE_WS_EVICTION", 0, "1: compile the workingset_eviction kprobe"),
        Knob("MOE_HAVE_WS_REFAULT", 0, "1: compile the workingset_refault kprobe"),
        Knob("MOE_RINGBUF_PAGES", 16, "aging ring size in pages (power of two)"),
        Knob("MOE_LRU_GEN_PERIOD_MS", 1000, "lru_gen sampling period (the Python sampler; also one sample at "
                                            "open and one at close)"),
        Knob("MOE_LRU_GEN_FULL", 0, "1: sample lru_gen_full (adds the tier and walk tables)"),
    ),
    table="lru_gen",
    schema=_GEN_COLS[:3] + (
        Column("memcg_path", "string", "", "the memcg's cgroup path ('' without memcg)"),
        Column("node", "int32"),
        Column("seq", "int64", "", "generation number (min_seq .. max_seq); a new one is born by aging"),
        Column("gen", "int32", "", "seq % MAX_NR_GENS (the folio flags' generation slot)"),
        Column("age_ms", "int64", "ms", "ms since the generation's birth (jiffies resolution)"),
        Column("birth_ns", "int64", "ns", "time_ns - age_ms: CLOCK_MONOTONIC of the generation's birth"),
        Column("nr_anon_pages", "int64", "pages"), Column("nr_file_pages", "int64", "pages"),
        Column("anon_evicted", "bool", "", "lru_gen_full's 'x': seq < min_seq[anon] (False in lru_gen)"),
        Column("file_evicted", "bool", "", "lru_gen_full's 'x': seq < min_seq[file]"),
    ),
    more_tables=(
        ("lru_gen_tiers", _GEN_COLS + (
            Column("seq", "int64"), Column("tier", "int32"), Column("type", "string", "", "anon or file"),
            Column("avg_refaulted_pages", "Int64", "pages", "max_seq only ('R')"),
            Column("avg_total_pages", "Int64", "pages", "max_seq only ('T')"),
            Column("refaulted_pages", "Int64", "pages", "history generations ('r')"),
            Column("evicted_pages", "Int64", "pages", "('e')"),
            Column("protected_pages", "Int64", "pages", "('p')"))),
        ("lru_gen_walk", _GEN_COLS + (
            Column("seq", "int64"), Column("leaf_total", "Int64"), Column("leaf_old", "Int64", "", "6.1 only"),
            Column("leaf_young", "Int64"), Column("nonleaf_total", "Int64", "", "6.1 only"),
            Column("nonleaf_found", "Int64"), Column("nonleaf_added", "Int64"))),
        ("mglru_aging", (Column("time_ns", "int64", "ns", "CLOCK_MONOTONIC of the aging attempt"),
                         Column("tgid", "int32", "", "who aged: kswapd, a reclaimer, a writer of lru_gen"),
                         Column("kind", "string", "", "try_to_inc_max_seq, inc_max_seq, inc_max_seq.constprop.0"),
                         Column("seq", "Int64", "", "the max_seq it was asked to grow (NA: not read)"))),
        ("mglru_inc_gen", (Column("from_gen", "Int32", "", "generation slot a promoted folio left (NA: off MGLRU)"),
                           Column("folios", "int64"))),
    ),
    stats=("evict_folios", "isolate_folios", "should_run_aging", "inc_max_seq", "folio_inc_gen", "look_around",
           "workingset_eviction", "workingset_refault", "ring_lost"),
    structs=(Struct("aging_event", (("ts_ns", "u64"), ("seq", "u64"), ("tgid", "u32"), ("kind", "u32"))),),
    enrichment=True,
)

PROBES: dict[str, ProbeSpec] = {p.name: p for p in
                                (PAGECACHE, LRU, RECLAIM, MLOCK, BLOCK, READS, STACKS, MGLRU)}
DEFAULT_PROBES: tuple[str, ...] = tuple(n for n, p in PROBES.items() if p.default)
