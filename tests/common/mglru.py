"""The mglru probe: the lru_gen parser (moetrace.kernel.lru_gen), the sampler (moetrace.record.probes.mglru),
probes/mglru.bpf.c.

No-kernel tier: the parser on fixtures of both formats and both kernels (tests/data/lru_gen/,
rendered from lru_gen_seq_show's formats with the lab's real samples), garbage -> InputError
with its line; the sampler against a fake debugfs tree (samples at open, while polling, at
close; a bad sample counted, the recording intact); no MGLRU / no debugfs -> "no" with the
reason. Probe-build tier: mglru.c with every kprobe knob off compiles to its stats map and
loads no program (what every kernel without kprobes gets); with every knob on, each kprobe
program compiles against the installed headers and passes this kernel's verifier (loaded, not
attached: there are no kprobes here). Live tier: `record --probes mglru` on this host — the
probe is "no" (no MGLRU) and the manifest says why; where MGLRU exists, lru_gen.parquet holds
the samples instead.
"""


from __future__ import annotations


import subprocess


import sys


import time


from pathlib import Path


import pandas as pd


import pytest


from moetrace.kernel import lru_gen


from moetrace.errors import InputError


from moetrace.record.spec import resolve


from moetrace.record.probes import PROBES


SPEC = PROBES["mglru"]


FIX = Path(__file__).resolve().parents[1] / "data" / "lru_gen"


RECORD = [sys.executable, "-c", "from moetrace.cli.record import record; record.main(prog_name='moetrace record')"]


# the real lab samples (README.md, "Kernel lab"), generation by generation: (memcg, path, seq, age_ms, anon, file)
REAL_61 = [(1, "/", 0, 65272, 0, 0), (1, "/", 3, 65272, 5072, 36786),
           (2, "/moe", 10, 1924, 0, 0), (2, "/moe", 11, 1924, 0, 29492), (2, "/moe", 12, 1564, 0, 37934),
           (2, "/moe", 13, 1224, 0, 29223)]


REAL_612 = [(2, "/moe", 5, 10600, 0, 0), (2, "/moe", 6, 676, 2, 42038), (2, "/moe", 7, 676, 1021, 34956),
            (2, "/moe", 8, 356, 0, 18973)]


def _gens(s: lru_gen.LruGenSample, node: int = 0):
    return [(g["memcg_id"], g["memcg_path"], g["seq"], g["age_ms"], g["nr_anon_pages"], g["nr_file_pages"])
            for g in s.generations if g["node"] == node]


BAD = [
    ("memcg     1 /\n node     0\n          0      65272          zero           0\n", 3, "not a number"),
    (" node     0\n", 1, "before any memcg"),
    ("          0      65272          0           0\n", 1, "before any memcg / node"),
    ("memcg     1 /\n node     0\n          1  2  3  4  5\n", 3, "unrecognised line"),
    ("memcg     1 /\n node     0\n          5  2  3  4\n          4  2  3  4\n", 4, "not increasing"),
    ("memcg     1 /\n node     0\n          5  2  3  4\n   0  1q 2 3 4 5 6\n", 4, "unknown tier markers"),
    ("memcg     1 /\n node     0\n          5  2  3  4\n   1Z 2Y 3F 4A\n", 4, "unknown walk-stat markers"),
    ("memcg one /\n", 1, "malformed memcg"),
    ("memcg     1 /\n node zero\n", 2, "malformed node"),
    ("memcg     1 /\n node     0\n   0  1 2 3 4 5 6\n", 3, "before any generation"),
]


def _tree(root: Path, mglru: bool = True, debugfs: bool = True, text: str | None = None) -> Path:
    (root / "proc").mkdir(parents=True)
    (root / "proc" / "mounts").write_text("none /sys/kernel/debug debugfs rw,relatime 0 0\n" if debugfs else "")
    (root / "proc/sys/kernel").mkdir(parents=True)
    (root / "proc/sys/kernel/osrelease").write_text("6.12.95+deb12-amd64\n")
    (root / "proc/sys/kernel/unprivileged_bpf_disabled").write_text("2\n")
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/status").write_text("Uid:\t0\t0\t0\t0\nCapEff:\t000001ffffffffff\n")
    # exact headers, as in the kernel lab (the fake tree has no kprobes: those groups stay "no")
    inc = root / "lib/modules/6.12.95+deb12-amd64/build/include/generated"
    inc.mkdir(parents=True)
    (inc / "utsrelease.h").write_text('#define UTS_RELEASE "6.12.95+deb12-amd64"\n')
    (root / "sys/kernel/btf").mkdir(parents=True)  # BTF, as every lab kernel has (the CO-RE object needs it)
    (root / "sys/kernel/btf/vmlinux").write_bytes(b"")
    if mglru:
        (root / "sys/kernel/mm/lru_gen").mkdir(parents=True)
        (root / "sys/kernel/mm/lru_gen/enabled").write_text("0x0007\n")
        (root / "sys/kernel/mm/lru_gen/min_ttl_ms").write_text("0\n")
    dbg = root / "sys/kernel/debug"
    dbg.mkdir(parents=True)
    if mglru and debugfs:
        (dbg / "lru_gen").write_text(text if text is not None else (FIX / "6.1_lru_gen.txt").read_text())
        (dbg / "lru_gen_full").write_text((FIX / "6.1_lru_gen_full.txt").read_text())
    return dbg


def _ctx(root: Path):
    from moetrace.kernel.features import Features
    from moetrace.record.probe import RecordContext

    feats = Features(root)
    return RecordContext(features=feats, plan=resolve(SPEC, feats), log_dir=root / "replay"), feats


__all__ = ['BAD', 'FIX', 'InputError', 'PROBES', 'Path', 'REAL_61', 'REAL_612', 'RECORD', 'SPEC', '_ctx', '_gens', '_tree', 'lru_gen', 'pd', 'pytest', 'resolve', 'subprocess', 'sys', 'time']
