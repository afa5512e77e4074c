"""The probes' C sources (probes/<name>.bpf.c) and their Python declarations: what the text says
that the objects' BTF cannot (slot numbers, knob defaults); tests/probe_build/test_core_objects.py
checks layouts and programs from the compiled objects."""


from __future__ import annotations


import re


import pytest


from moetrace.kernel import bpf


from moetrace.record.probes import PROBES


from moetrace.kernel.bpf import prog_id_exists, prog_info


from moetrace.record.recorder import PAGE_EVENT_DTYPE


PAGECACHE = PROBES["pagecache"]


SRC = bpf.core_source("pagecache").read_text()




def stat_enum(src: str) -> list[str]:
    """The enumerators of a probe C file's ``enum moe_stat`` (its STAT_* slots, N_STATS last)."""
    body = re.search(r"^enum moe_stat \{(.*?)^\};", src, re.M | re.S)
    assert body, "no enum moe_stat in the C file"
    text = re.sub(r"//[^\n]*", "", body.group(1))
    return [e.strip() for e in text.split(",") if e.strip()]


#: every declared probe that has its C file (a probe without one is declared only: doctor resolves it)
WITH_SOURCE = [n for n, sp in PROBES.items() if sp.source_path.exists()]


_GLOBAL = re.compile(r"^const volatile (u32|u64|s32|s64|int) (\w+) = (-?\w+);", re.M)


def globals_of(src: str) -> dict[str, int]:
    """{name: default} of a C file's read-only globals (its knobs)."""
    return {n: int(v, 0) for _t, n, v in _GLOBAL.findall(src)}


KNOB_SETS = [
    # files layout, 1 MiB experts
    dict(POOL_DEV=254 << 20, N_EXPERTS=23, PPE=256, WPE=4),
    # pool file of 4 KiB extents: one folio spans up to 512 experts
    dict(POOL_DEV=254 << 20, N_EXPERTS=600, PPE=1, WPE=1),
    # odd extent, per-page stream on
    dict(POOL_DEV=0, N_EXPERTS=7, PPE=100, WPE=2, STREAM_EVENTS=1),
    # an older kernel: no folio order, no read tracking, no fork following
    dict(POOL_DEV=0, N_EXPERTS=1, PPE=4096, WPE=64, HAVE_ORDER=0, TRACK_READS=0, FOLLOW_FORKS=0),
]


__all__ = ['KNOB_SETS', 'PAGECACHE', 'PAGE_EVENT_DTYPE', 'PROBES', 'SRC', 'WITH_SOURCE',
           'bpf', 'globals_of', 'stat_enum', 'prog_id_exists', 'prog_info', 'pytest', 're']
