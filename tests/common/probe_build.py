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
    # files layout, 1 MiB experts: 23 files of 2 runs
    dict(MOE_POOL_DEV=254 << 20, MOE_N_EXPERTS=23, MOE_N_FILES=23, MOE_N_RUNS=46, MOE_BM_WORDS=92,
         MOE_SEARCH_STEPS=1),
    # pool file of 4 KiB extents: one folio spans up to 512 experts
    dict(MOE_POOL_DEV=254 << 20, MOE_N_EXPERTS=600, MOE_N_FILES=1, MOE_N_RUNS=601, MOE_BM_WORDS=10,
         MOE_SEARCH_STEPS=10),
    # a model file of 2^20 runs (the search's depth), per-page stream on
    dict(MOE_POOL_DEV=0, MOE_N_EXPERTS=82432, MOE_N_FILES=200, MOE_N_RUNS=1 << 20, MOE_BM_WORDS=1 << 20,
         MOE_SEARCH_STEPS=21, MOE_STREAM_EVENTS=1),
    # an older kernel: no folio order, no read tracking, no fork following
    dict(MOE_POOL_DEV=0, MOE_N_EXPERTS=1, MOE_N_FILES=1, MOE_N_RUNS=2, MOE_BM_WORDS=64, MOE_SEARCH_STEPS=1,
         MOE_HAVE_ORDER=0, MOE_TRACK_READS=0, MOE_FOLLOW_FORKS=0),
]


__all__ = ['KNOB_SETS', 'PAGECACHE', 'PAGE_EVENT_DTYPE', 'PROBES', 'SRC', 'WITH_SOURCE',
           'bpf', 'globals_of', 'stat_enum', 'prog_id_exists', 'prog_info', 'pytest', 're']
