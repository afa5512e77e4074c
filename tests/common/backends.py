"""Loading one probe's compiled object the way the probe-build tests need it."""

from __future__ import annotations

from moetrace.kernel import bpf


def load_first(spec, knobs: dict[str, int], gated: bool = False):
    """Load ``spec``'s object with ``knobs``, attaching the first candidate of every group whose
    knob is on (a perf_event program is loaded, not attached). Returns the CoreProbe."""
    attach = [(g.candidates[0].fn_name, g.candidates[0].kind, g.candidates[0].target) for g in spec.attach
              if g.knob is None or knobs.get(g.knob, 1)]
    return bpf.load_core(spec.name, knobs, attach, spec.map_sizes(knobs), gated=gated)


__all__ = ["load_first"]
