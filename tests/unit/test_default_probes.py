"""Acceptance 3: every probe in record's default set attaches on this kernel or is listed by (unit tier)."""

from __future__ import annotations

from common.default_probes import *  # noqa: F401,F403


def test_every_default_probe_has_a_recorder():
    """The declared default set is what record attaches: no default probe is declared only."""
    assert set(DEFAULT_PROBES) <= set(recorder.RECORDED), set(DEFAULT_PROBES) - set(recorder.RECORDED)
    assert recorder.DEFAULT_RECORD == DEFAULT_PROBES


def test_every_bpf_probe_has_its_c_file():
    """probes/<name>.bpf.c (CO-RE, compiled once)."""
    from moetrace.kernel.bpf import core_source

    for name, spec in PROBES.items():
        uses_bpf = any(c.kind != "debugfs" for g in spec.attach for c in g.candidates)
        assert not uses_bpf or core_source(name).exists(), name
