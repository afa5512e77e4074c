"""Loading one probe's compiled object the way the probe-build tests need it."""

from __future__ import annotations

from moetrace.kernel import bpf


def load_first(spec, knobs: dict[str, int], gated: bool = False):
    """Load ``spec``'s object with ``knobs``, attaching the first candidate of every group whose
    knob is on (a perf_event program is loaded, not attached). Returns the CoreProbe."""
    attach = [(g.candidates[0].fn_name, g.candidates[0].kind, g.candidates[0].target) for g in spec.attach
              if g.knob is None or knobs.get(g.knob, 1)]
    return bpf.load_core(spec.name, knobs, attach, spec.map_sizes(knobs), gated=gated)


def loaded_object(spec, knobs: dict[str, int], programs, btf=None):
    """``spec``'s object opened (relocated against ``btf``, else the kernel's BTF), its knobs
    and map sizes set, only ``programs`` loaded (not attached): a context manager yielding the
    :class:`moetrace.kernel.libbpf.BpfObject`, closed on exit."""
    from moetrace.kernel.libbpf import BpfObject

    o = BpfObject(bpf.object_path(spec.name), btf_custom_path=btf)
    try:
        o.set_globals({k.lower(): int(v) for k, v in knobs.items()} | {"gated": 1})
        for m, n in (spec.map_sizes(knobs) if spec.map_sizes else {}).items():
            o.set_max_entries(m, n)
        for prog in o.programs:
            o.set_autoload(prog, prog in programs)
        o.load()
    except BaseException:
        o.close()
        raise
    return o


__all__ = ["load_first", "loaded_object"]
