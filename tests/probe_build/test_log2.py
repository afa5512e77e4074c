"""The one log2 decode (moetrace.record.probe.log2_bounds) against the C macro every probe's
histogram slot comes from (probes/moetrace.bpf.h moe_log2l): the macro, compiled for this host as
the header writes it, puts each slot's lower bound, its upper bound - 1, and 0 into the slot the
decode says holds them."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from moetrace.probes import PROBES_DIR
from moetrace.record.probe import log2_bounds

pytestmark = pytest.mark.probe_build

_SHIM = """#include <stdio.h>
#include <stdlib.h>
typedef unsigned long long u64;
typedef unsigned int u32;
#define __always_inline inline __attribute__((always_inline))
#define barrier_var(v) asm volatile("" : "+r"(v))
%s
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) printf("%%u\\n", moe_log2l(strtoull(argv[i], 0, 10)));
    return 0;
}
"""


def _macro_source() -> str:
    """moe_above and moe_log2l, verbatim from the header."""
    text = (PROBES_DIR / "moetrace.bpf.h").read_text()
    out = []
    for fn in ("moe_above", "moe_log2l"):
        m = re.search(r"^static __always_inline u\d+ %s\(.*?^}\n" % fn, text, re.M | re.S)
        assert m, f"moetrace.bpf.h defines no {fn}"
        out.append(m.group(0))
    return "\n".join(out)


@pytest.fixture(scope="module")
def moe_log2l(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("clang") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the host (cc, clang, gcc): cannot evaluate moe_log2l")
    d = tmp_path_factory.mktemp("log2")
    (d / "log2.c").write_text(_SHIM % _macro_source())
    subprocess.run([cc, "-O2", "-o", str(d / "log2"), str(d / "log2.c")], check=True)

    def run(values: list[int]) -> list[int]:
        r = subprocess.run([str(d / "log2")] + [str(v) for v in values], check=True, capture_output=True, text=True)
        return [int(x) for x in r.stdout.split()]

    return run


def test_the_decode_is_the_macros_buckets(moe_log2l):
    slots = np.arange(1, 64)
    lo, hi = log2_bounds(slots)
    probes = [0] + [int(v) for v in lo] + [int(v) - 1 for v in hi]
    got = moe_log2l(probes)
    assert got[0] == 1  # 0 falls in slot 1 with 1: slot 1 is [0, 2)
    assert got[1:64] == list(slots), "each slot's lower bound lands in the slot"
    assert got[64:] == list(slots), "each slot's upper bound - 1 lands in the slot"
    assert moe_log2l([2**63, 2**64 - 1]) == [64, 64]  # beyond every histogram's 64 slots
    assert (int(lo[0]), int(hi[0])) == (0, 2) and (int(lo[1]), int(hi[1])) == (2, 4)
    assert log2_bounds([0])[1][0] == 1  # slot 0: never produced, [0, 1)


def test_the_header_states_the_same_convention():
    text = (PROBES_DIR / "moetrace.bpf.h").read_text()
    assert "slot s of a log2 histogram holds\n// [2^(s-1), 2^s), slot 1 also 0" in text
    with pytest.raises(ValueError):
        log2_bounds([64])
