"""The probes of ``moetrace record``: one module each (its declaration ``SPEC`` and its
recorder), one C file each in probes/. The modules of this package are found, not listed:
adding a probe adds its module (and its C file and docs), and the registry below follows."""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from moetrace.errors import MoetraceError
from moetrace.record.spec import AttachPlan, ProbeSpec, resolve

if TYPE_CHECKING:
    from moetrace.kernel.features import Features
    from moetrace.record.probe import ProbeRecorder


def _discover() -> dict[str, ProbeSpec]:
    """{name: SPEC} of every module of this package, in the specs' declared ``order``."""
    specs = []
    for m in pkgutil.iter_modules(__path__):
        if m.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{m.name}")
        spec = getattr(mod, "SPEC", None)
        if not isinstance(spec, ProbeSpec):
            raise MoetraceError(f"moetrace.record.probes.{m.name} declares no SPEC (a ProbeSpec)",
                                hint="every module of moetrace/record/probes is one probe: its SPEC and recorder")
        if spec.name != m.name:
            raise MoetraceError(f"moetrace.record.probes.{m.name}: its SPEC is named {spec.name!r}",
                                hint="a probe's module, C file and SPEC.name are the same name")
        specs.append(spec)
    return {s.name: s for s in sorted(specs, key=lambda s: (s.order, s.name))}


#: every declared probe, in the order a recording lists them (the manifest's ``probes``)
PROBES: dict[str, ProbeSpec] = _discover()
#: what `record` attaches without --probes
DEFAULT_PROBES: tuple[str, ...] = tuple(n for n, p in PROBES.items() if p.default)
#: probes this version records: every one whose declaration names its recorder (the rest are
#: declared and resolved by doctor, and listed in the manifest's attach plan as not recorded)
RECORDED: tuple[str, ...] = tuple(n for n, p in PROBES.items() if p.recorder)
#: probes whose knobs come from the pool and the kernel only (no ``record --knob``)
DERIVED_KNOBS: tuple[str, ...] = tuple(n for n, p in PROBES.items() if not p.user_knobs)
#: probes whose counts go into the experts table (written with it, after the replay log is read)
EXPERTS_PROBES: tuple[str, ...] = tuple(n for n, p in PROBES.items() if p.experts)


def recorder_class(name: str) -> "type[ProbeRecorder]":
    """The recorder class the probe's declaration names (in the probe's own module)."""
    spec = PROBES.get(name)
    if spec is None or not spec.recorder:
        raise MoetraceError(f"probe {name} has no recorder",
                            hint=f"recorded probes: {', '.join(RECORDED)}")
    return getattr(importlib.import_module(f"{__name__}.{name}"), spec.recorder)


def resolve_all(feats: "Features | None" = None, names: list[str] | None = None) -> dict[str, AttachPlan]:
    """Resolve the named probes (default: every registered probe)."""
    if feats is None:
        from moetrace.kernel.features import Features
        feats = Features()
    return {n: resolve(PROBES[n], feats) for n in (names or list(PROBES))}
