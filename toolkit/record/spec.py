"""Probe declarations: the one registry of a probe, and its attach candidates resolved once
against the kernel.

One probe = one CO-RE C file (``probes/<name>.bpf.c``, built once by scripts/build-probes.sh;
configured only by read-only globals set before load) + one module
``moetrace/record/probes/<name>.py`` holding its :class:`ProbeSpec` (``SPEC``) and its
recorder (docs/architecture.md). The spec is everything else knows of the probe: its recorder
class, its place in the default set and in a recording's order, whether a recording needs it,
its knobs (docs and defaults), its tables (columns), its ``STAT_*`` slots and C structs, its
attach candidates. :mod:`moetrace.record.probes` finds the modules (no list to edit) and
derives the registry :data:`moetrace.record.probes.PROBES` and the default set from them.

A spec lists its logical attach points (:class:`AttachGroup`), each an ordered list of
:class:`AttachCandidate` (first available wins), each citing the kernel change that made it
necessary. :func:`resolve` asks a :class:`moetrace.kernel.features.Features` (never a version
number) and returns an :class:`AttachPlan`: per group the candidate that will be attached, or
"unavailable: reason". Resolving never needs the C file to exist.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

if TYPE_CHECKING:
    from moetrace.kernel.features import Features

Kind = Literal["tracepoint", "raw_tracepoint", "kprobe", "kretprobe", "fentry", "fexit", "perf_event", "debugfs"]
KINDS = ("tracepoint", "raw_tracepoint", "kprobe", "kretprobe", "fentry", "fexit", "perf_event", "debugfs")
from moetrace.probes import PROBES_DIR  # noqa: E402
from moetrace.run.tables import Column  # noqa: E402  (a table's column: the run directory's contract)


@dataclass(frozen=True)
class AttachCandidate:
    """One way to attach.

    kind: tracepoint | raw_tracepoint (target "category:event"), kprobe | kretprobe
    (target a kallsyms symbol), perf_event (target "software:cpu-clock"), debugfs (target
    a file under debugfs read by a Python sampler, no BPF: fn_name "").
    fn_name: the program (C function) in the probe's object.
    fields: the tracepoint format fields the C code reads; a format file lacking one
    rejects the candidate. field_knobs: (field, knob) pairs: the knob is 1 when the
    chosen candidate's format has the field, else 0 (e.g. folio ``order``).
    sets: (knob, value) pairs set when this candidate is the one chosen (which of
    several implementations of the C file runs, e.g. block's ``MOE_BYTES_TP``)."""

    kind: Kind
    target: str
    fn_name: str
    note: str = ""
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
                "fields": list(self.fields),
                "field_knobs": {f: k for f, k in self.field_knobs}, "sets": {k: v for k, v in self.sets}}


@dataclass(frozen=True)
class AttachGroup:
    """One logical attach point: ordered candidates, the first available wins.

    required: the probe cannot do its job without it (the probe is "no" when it is
    unavailable); an optional group only degrades the probe.
    knob: the knob that turns the group on (optional groups only; its programs load only
    when it is 1). Groups sharing a knob go together: when one is unavailable the knob is 0
    and the others are "unavailable: switched off" (a plan never says "attached" for a
    program that is not there)."""

    name: str
    candidates: tuple[AttachCandidate, ...]
    required: bool = True
    note: str = ""
    knob: str | None = None

    def __post_init__(self) -> None:
        if self.knob is not None and self.required:
            raise ValueError(f"attach group {self.name}: a group behind a knob must be optional")


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
    """A read-only global of the probe's object (``const volatile``, its name in lower case),
    with its default; set before load. Every knob's name starts with ``MOE_``; ``was``: the
    name it had before (without the prefix), still accepted from a user with a deprecation
    notice (:meth:`ProbeSpec.knob_named`)."""

    name: str
    default: int | str
    help: str = ""
    was: str = ""


@dataclass(frozen=True)
class ProbeSpec:
    """A probe: its recorder, C source, attach groups, knobs, tables.

    recorder: the name of its :class:`moetrace.record.probe.ProbeRecorder` subclass in the
    probe's module ("": declared and resolved by doctor, not recorded). order: its place in
    a recording (the manifest's ``probes``, doctor's rows), ascending. default: part of
    ``record``'s default set. enrichment: a missing enrichment probe warns; a missing
    required one (:attr:`required`) is an error under ``--missing-probes error``.
    user_knobs: ``record --knob PROBE.NAME=V`` may set its knobs (False: the pool and the
    kernel decide them all). experts: its counts go into experts.parquet (written with it,
    after the replay log is read). table: the run-directory table ``schema`` describes.
    more_tables: further run-directory tables the probe writes, as (name, columns) pairs.
    A table's columns are declared once: in the probe's module, or for the run's core
    tables (experts, epochs, ...) in :mod:`moetrace.run.tables`; the manifest's ``tables``
    section carries them (with the readers' checks) to run/. stats: names of the C file's
    ``STAT_*`` slots in slot order (its ``enum`` of them: a test checks the object's BTF).
    structs: C structs shared with Python (:class:`Struct`)."""

    name: str
    attach: tuple[AttachGroup, ...]
    recorder: str = ""
    order: int = 100
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
    #: {map: max_entries} from the knob values, for the CO-RE object's loader (its C file
    #: sizes every map 1: the sizes live here, beside the knobs they come from)
    map_sizes: Callable[[dict[str, int]], dict[str, int]] | None = None
    #: knobs computed from the others ({knob: value}), applied by :meth:`knob_values` last
    derived: Callable[[dict[str, Any]], dict[str, int]] | None = None
    user_knobs: bool = True
    experts: bool = False

    @property
    def required(self) -> bool:
        """A recording that cannot attach it fails under ``--missing-probes error``."""
        return not self.enrichment

    def tables(self) -> dict[str, tuple[Column, ...]]:
        """{run-directory table: its columns}: ``table``/``schema`` first, then ``more_tables``."""
        out = {self.table: self.schema} if self.table else {}
        out.update(dict(self.more_tables))
        return out

    @property
    def source_path(self) -> Path:
        """probes/<name>.bpf.c (it need not exist to resolve)."""
        return self.source if self.source is not None else PROBES_DIR / f"{self.name}.bpf.c"

    def knob_values(self, **overrides: int | str) -> dict[str, int | str]:
        """{knob: value} for every knob: defaults, then ``overrides`` by knob name."""
        names = {k.name for k in self.knobs}
        unknown = set(overrides) - names
        if unknown:
            raise ValueError(f"probe {self.name}: unknown knob(s) {sorted(unknown)}; knobs: {sorted(names)}")
        out = {k.name: overrides.get(k.name, k.default) for k in self.knobs}
        if self.derived is not None:
            out.update(self.derived(out))
        return out

    def knob_named(self, name: str) -> tuple[str, str]:
        """The knob a user's ``name`` means, and a one-line deprecation notice when ``name`` is
        the one it had before (:attr:`Knob.was`), else ""; other names come back as given."""
        for k in self.knobs:
            if k.was and name == k.was:
                return k.name, (f"knob {self.name}.{name} is deprecated: it is now {self.name}.{k.name} "
                                f"(the old name stops working in a later version)")
        return name, ""

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
    "no" (a required group unavailable, or the probe blocked as a whole: no BTF, BPF unusable)."""

    probe: str
    entries: list[PlanEntry]
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
        return {"probe": self.probe, "status": self.status, "reason": self.reason,
                "blocked": self.blocked, "knobs": dict(self.knobs),
                "entries": [e.to_dict() for e in self.entries]}


def _not_checked(reason: str) -> bool:
    return reason.startswith("could not check")


def candidate_reason(cand: AttachCandidate, feats: "Features", ctx_struct: str | None = None) -> str | None:
    """None when ``cand`` can be attached on ``feats``' kernel, else why not.

    Order: infrastructure (tracefs, kprobes, trampolines, perf, debugfs), then the target
    itself (tracefs entry, kallsyms / BTF), then the fields it reads: from the kernel's BTF
    where ``ctx_struct`` (the struct the candidate's program reads, from its object's BTF)
    describes them, else from the format file (:meth:`Features.tracepoint_fields`). Kernel
    structs are read through BTF relocations, so no candidate depends on headers."""
    r: str | None
    if cand.kind in ("tracepoint", "raw_tracepoint"):
        cat, ev = cand.target.split(":", 1)
        r = feats.tracepoint_reason(cat, ev)
    elif cand.kind in ("kprobe", "kretprobe"):
        r = feats.kprobes_reason() or feats.symbol_reason(cand.target)
    elif cand.kind in ("fentry", "fexit"):
        r = feats.fentry_reason(cand.target)
    elif cand.kind == "perf_event":
        r = feats.perf_event_reason(cand.target)
    else:  # debugfs
        r = feats.debugfs_reason(cand.target)
    if r:
        return r
    if cand.fields and cand.kind in ("tracepoint", "raw_tracepoint"):
        have = _fields(cand, feats, ctx_struct)
        if have is not None:
            missing = [f for f in cand.fields if f not in have]
            if missing:
                return f"format of {cand.target} lacks {', '.join(missing)} (the probe reads them)"
    return None


def _fields(cand: AttachCandidate, feats: "Features", ctx_struct: str | None):
    """The field names of a tracepoint candidate's format (None: could not be read)."""
    cat, ev = cand.target.split(":", 1)
    by_btf = getattr(feats, "tracepoint_fields", None)
    if by_btf is not None:
        return by_btf(cat, ev, ctx_struct)
    fmt = feats.tracepoint_format(cat, ev)
    return None if fmt is None else set(fmt)


def _ctx_structs(spec: ProbeSpec, feats: "Features") -> dict[str, str]:
    """{program: the struct it takes as context} from the probe's compiled object ({} without
    one: the fields then come from the format files)."""
    contexts = getattr(feats, "program_contexts", None)
    if contexts is None or not any(c.fields or c.field_knobs for g in spec.attach for c in g.candidates):
        return {}
    from moetrace.kernel.bpf import object_path

    return contexts(object_path(spec.name))


def resolve(spec: ProbeSpec, feats: "Features | None" = None) -> AttachPlan:
    """Resolve every attach group of ``spec`` against ``feats`` (default: the live kernel)."""
    if feats is None:
        from moetrace.kernel.features import Features
        feats = Features()
    blocked = ""
    bpf_groups = any(c.kind != "debugfs" for g in spec.attach for c in g.candidates)
    if bpf_groups and not getattr(feats, "btf", True):
        blocked = ("no kernel BTF (/sys/kernel/btf/vmlinux): libbpf cannot relocate the compiled probes, "
                   "and moetrace has no other loader (a kernel built with CONFIG_DEBUG_INFO_BTF=y has it)")
    elif bpf_groups:
        ok, detail = feats.bpf()
        if not ok:
            blocked = f"BPF unusable: {detail}"
    entries: list[PlanEntry] = []
    ctx = _ctx_structs(spec, feats)
    for g in spec.attach:
        tried: list[tuple[AttachCandidate, str]] = []
        chosen: AttachCandidate | None = None
        for c in g.candidates:
            r = candidate_reason(c, feats, ctx.get(c.fn_name))
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
    return AttachPlan(spec.name, entries, blocked, _derive_knobs(spec, entries, feats, ctx))


def _derive_knobs(spec: ProbeSpec, entries: list[PlanEntry], feats: "Features",
                  ctx: dict[str, str] | None = None) -> dict[str, int]:
    """Knobs the kernel decides: group knobs (1 only when every group of the knob is
    attached; the attached siblings of an unavailable one are "switched off"), the
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
            e.tried.append((e.candidate, f"switched off ({k}=0: {', '.join(off[k])} unavailable)"))
            e.status, e.reason, e.candidate = "unavailable", e.tried[-1][1], None
    for e in entries:
        if e.attached:
            knobs.update(dict(e.candidate.sets))
    for e in entries:
        c = e.candidate
        if not e.attached or not c.field_knobs or c.kind not in ("tracepoint", "raw_tracepoint"):
            continue
        have = _fields(c, feats, (ctx or {}).get(c.fn_name))
        if have is None:
            continue  # unreadable: the knob keeps its default
        for fld, knob in c.field_knobs:
            knobs[knob] = min(knobs.get(knob, 1), int(fld in have))
    return knobs


# -- helpers of the declarations (record/probes/<name>.py) -----------------------------------

#: a program's name in the probe's object: the prefix of its kind, then the tracepoint's or
#: perf event's event, or the kernel symbol, with "." and "-" as "_" (tp_sys_enter_read,
#: kp_inc_max_seq_constprop_0, fe_folio_inc_gen, pe_cpu_clock); a debugfs sampler has none.
#: A test reads every program of every object and checks it against this.
PROGRAM_PREFIX: dict[str, str] = {"tracepoint": "tp_", "raw_tracepoint": "raw_", "kprobe": "kp_",
                                  "kretprobe": "kret_", "fentry": "fe_", "fexit": "fx_", "perf_event": "pe_"}


def program_name(kind: Kind, target: str) -> str:
    """The program (C function) that attaches as ``kind`` to ``target``: :data:`PROGRAM_PREFIX`
    + the event or symbol ("" for debugfs, which loads no program)."""
    if kind == "debugfs":
        return ""
    return PROGRAM_PREFIX[kind] + re.sub(r"[^A-Za-z0-9_]", "_", target.rpartition(":")[2])


def tp_cand(target: str, note: str = "", fields: tuple[str, ...] = (),
            field_knobs: tuple[tuple[str, str], ...] = (),
            sets: tuple[tuple[str, int], ...] = ()) -> AttachCandidate:
    """A tracepoint "category:event", its program tp_<event>."""
    return AttachCandidate("tracepoint", target, program_name("tracepoint", target), note,
                           fields=fields, field_knobs=field_knobs, sets=sets)


def kp_cand(sym: str, note: str = "", kind: Kind = "kprobe") -> AttachCandidate:
    """A kprobe (or kretprobe) on ``sym``, its program kp_<sym> (kret_<sym>)."""
    return AttachCandidate(kind, sym, program_name(kind, sym), note)


def fn_cands(sym: str, note: str = "") -> tuple[AttachCandidate, AttachCandidate]:
    """A kernel function hook: fentry (BPF trampoline: no kprobe machinery, a direct call) where
    the kernel allows it, else a kprobe; programs fe_<sym> / kp_<sym> of the probe's C."""
    return (AttachCandidate("fentry", sym, program_name("fentry", sym), note), kp_cand(sym, note))


def group(name: str, *cands: AttachCandidate, required: bool = True, note: str = "",
          knob: str | None = None) -> AttachGroup:
    return AttachGroup(name, tuple(cands), required, note, knob)


#: a folio event's `order` field decides MOE_HAVE_ORDER (pages = 1 << order, else one page per event)
FOLIO_ORDER = (("order", "MOE_HAVE_ORDER"),)
