"""The probes of ``moetrace record``: one module each (its declaration ``SPEC`` and its
recorder), one C file each in probes/. Adding a probe touches this list and the docs only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moetrace.record.probes import block, lru, mglru, mlock, pagecache, reads, reclaim, stacks
from moetrace.record.spec import AttachPlan, ProbeSpec, resolve

if TYPE_CHECKING:
    from moetrace.kernel.features import Features

#: every declared probe, in the order a recording lists them (the manifest's ``probes``)
PROBES: dict[str, ProbeSpec] = {m.SPEC.name: m.SPEC for m in
                                (pagecache, lru, reclaim, mlock, block, reads, stacks, mglru)}
#: what `record` attaches without --probes
DEFAULT_PROBES: tuple[str, ...] = tuple(n for n, p in PROBES.items() if p.default)


def resolve_all(feats: "Features | None" = None, names: list[str] | None = None) -> dict[str, AttachPlan]:
    """Resolve the named probes (default: every registered probe)."""
    if feats is None:
        from moetrace.kernel.features import Features
        feats = Features()
    return {n: resolve(PROBES[n], feats) for n in (names or list(PROBES))}
