"""The block probe (probes/block.bpf.c + toolkit/record/probes/block.py) (unit tier)."""

from __future__ import annotations

from common.block_probe import *  # noqa: F401,F403


def test_slots_and_record_match_the_declaration():
    """The C file: histogram slots and the ring record as the declaration says (the CO-RE
    object's struct layout and STAT_* enum are checked from its BTF: test_core_objects.py)."""
    src = SRC
    assert int(re.search(r"#define HIST_SLOTS (\d+)", src).group(1)) == blockattr.HIST_SLOTS
    body = re.search(r"struct bio_event \{(.*?)\};", src, re.S).group(1)
    fields = re.findall(r"^\s*(u\d+)\s+(\w+);", body, re.M)
    assert [f for _, f in fields] == list(BIO_EVENT_DTYPE.names)
    assert [int(t[1:]) // 8 for t, _ in fields] == [BIO_EVENT_DTYPE[n].itemsize for n in BIO_EVENT_DTYPE.names]


def test_core_source_matches_the_declaration():
    """probes/block.bpf.c: one program per candidate, in the section of the candidate's tracepoint
    (both bytes candidates: the plan loads one), and a read-only global per knob."""
    spec = PROBES["block"]
    for g in spec.attach:
        for c in g.candidates:
            cat, ev = c.target.split(":")
            assert re.search(r'^SEC\("tracepoint/%s/%s"\)\nint %s\(' % (cat, ev, c.fn_name), SRC, re.M), c
            assert c.fn_name == "tp_" + c.target.split(":", 1)[1]  # blockattr derives fn names so
    assert {c.target for c in spec.group("bytes").candidates} == set(BYTES_TP)
    for k in spec.knobs:
        assert re.search(r"^const volatile u(32|64) %s = " % k.name.lower(), SRC, re.M), k.name
    assert "{" + "{" not in SRC and "%s" not in SRC and "#if" not in SRC  # globals, no -D


def test_knobs_are_checked():
    assert block_knobs(254 << 20, 1, 64) == {"MOE_DEV": 266338304, "MOE_BYTES_TP": 1, "MOE_RINGBUF_PAGES": 64,
                                             "MOE_STREAM_BIOS": 1, "MOE_MAX_INFLIGHT": 65536}
    with pytest.raises(ValueError):
        block_knobs(0, 1, ring_pages=100)
