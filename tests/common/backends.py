"""Both loaders of one probe, for the probe-build tests of the ported probes (lru, reads, stacks):
the CO-RE object through libbpf (the default) and bcc's compile of probes/<name>.c (while both
exist). A test parametrized over BACKENDS loads through the one it names."""

from __future__ import annotations

import pytest

from moetrace.kernel import bpf

#: the loaders a probe with both probes/<name>.bpf.c and probes/<name>.c can be loaded by
BACKENDS = ("core", "bcc")


def load_backend(spec, knobs: dict[str, int], backend: str, gated: bool = False):
    """Load ``spec``'s probe with ``knobs`` by ``backend``, attaching the first candidate of every
    group whose knob is on (bcc attaches its TRACEPOINT_PROBEs by itself; a perf_event program is
    loaded, not attached). Returns the probe handle (LoadedProbe or CoreProbe)."""
    if backend == "bcc":
        return bpf.load_probe(spec.name, knobs, gated=gated)
    attach = [(g.candidates[0].fn_name, g.candidates[0].kind, g.candidates[0].target) for g in spec.attach
              if g.knob is None or knobs.get(g.knob, 1)]
    return bpf.load_core(spec.name, knobs, attach, spec.map_sizes(knobs), gated=gated)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> str:
    """Each loader in turn; MOETRACE_BPF_BACKEND names it for code that picks by itself."""
    monkeypatch.setenv("MOETRACE_BPF_BACKEND", request.param)
    return request.param


__all__ = ["BACKENDS", "backend", "load_backend"]
