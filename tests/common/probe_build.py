"""Probe build tier: probes/pagecache.c compiles and loads with its -D knobs; the C
side and the Python declaration agree."""


from __future__ import annotations


import re


import pytest


from moetrace.kernel import bpf


from moetrace.record.probes import PROBES


from moetrace.kernel.bpf import prog_id_exists, prog_info


from moetrace.record.recorder import PAGE_EVENT_DTYPE


PAGECACHE = PROBES["pagecache"]


SRC = bpf.probe_source("pagecache").read_text()


#: -D macros a C file may define beyond its declared knobs: derived in the file from the knobs,
#: or accepted and unused (block.c / reclaim.c keep MOE_MAX_* for a common command line)
UNDECLARED_OK = {"pagecache": {"MAX_SEGS", "MAX_WPS", "MAX_TGIDS", "MAX_INODES"},
                 "block": {"MOE_MAX_INODES", "MOE_MAX_EXPERTS", "MOE_MAX_EXTENTS"},
                 "reclaim": {"MOE_MAX_INODES", "MOE_MAX_EXPERTS"}}


#: probes whose STAT_* names are exactly the declaration's stats names (lower-cased)
EXACT_STAT_NAMES = {"block", "reclaim"}


def _struct_fields(src: str, name: str) -> list[tuple[str, str]]:
    body = re.search(r"struct %s \{(.*?)\};" % name, src, re.S).group(1)
    return re.findall(r"^\s*(u\d+|s\d+)\s+(\w+);", body, re.M)  # [(type, field)]


_PROG = re.compile(r"TRACEPOINT_PROBE\((\w+),\s*(\w+)\)|^int (\w+)\(struct tracepoint__(\w+)__(\w+) \*args\)", re.M)


def _tracepoint_bodies(src: str) -> dict[str, tuple[str, str, list[str]]]:
    """{"cat:event": (C function name, body text up to the next program, the knobs of every
    enclosing `#if KNOB...`)} for both bcc forms: TRACEPOINT_PROBE(cat, ev) and
    ``int fn(struct tracepoint__cat__ev *args)``."""
    out = {}
    ms = list(_PROG.finditer(src))
    for i, m in enumerate(ms):
        if m.group(1):
            cat, ev, fn = m.group(1), m.group(2), f"tracepoint__{m.group(1)}__{m.group(2)}"
        else:
            fn, cat, ev = m.group(3), m.group(4), m.group(5)
        stack: list[str | None] = []
        for d in re.finditer(r"^#(if|ifdef|ifndef|endif)\b\s*(\w*)", src[:m.start()], re.M):
            if d.group(1) == "endif":
                stack.pop()
            else:
                stack.append(d.group(2) if d.group(1) == "if" else None)
        body = src[m.end(): ms[i + 1].start() if i + 1 < len(ms) else len(src)]
        out[f"{cat}:{ev}"] = (fn, body, [k for k in stack if k])
    return out


#: every declared probe that has its C file (a probe without one is declared only: doctor resolves it)
WITH_SOURCE = [n for n, sp in PROBES.items() if sp.source_path.exists()]


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


__all__ = ['EXACT_STAT_NAMES', 'KNOB_SETS', 'PAGECACHE', 'PAGE_EVENT_DTYPE', 'PROBES', 'SRC', 'UNDECLARED_OK', 'WITH_SOURCE', '_PROG', '_struct_fields', '_tracepoint_bodies', 'bpf', 'prog_id_exists', 'prog_info', 'pytest', 're']
