"""`moetrace doctor`: JSON shape on fake trees (no kernel), and the live kernel's answers (live tier)."""

from __future__ import annotations

from common.doctor import *  # noqa: F401,F403


def test_live_this_kernel(live, unmount_after):
    """On the project's machines: pagecache on tracepoints, MGLRU kprobes refused for "kprobes",
    headers mismatched. Each expectation is cross-checked against the kernel's own files."""
    F.clear_cache()
    feats = F.Features("/", mount=True)  # mounts tracefs when absent (as record does) and says so
    assert feats.tracefs is not None, "tracefs could not be mounted"
    if feats.notes:
        assert all(n.startswith("mounted ") for n in feats.notes)
    plans = resolve_all(feats)
    pc = plans["pagecache"]
    for g in ("add", "delete"):
        e = pc.entry(g)
        assert e.attached and e.candidate.kind == "tracepoint", (g, e.reason)
    for e in pc.entries:
        if e.attached:
            cat, ev = e.candidate.target.split(":")
            assert (feats.tracefs / "events" / cat / ev / "format").exists()
    fmt = F.tracepoint_format("filemap", "mm_filemap_add_to_page_cache")
    assert {"pfn", "i_ino", "index", "s_dev"} <= set(fmt)

    if feats.kprobes_reason() is not None:  # this machine: CONFIG_KPROBES off
        assert not Path("/sys/kernel/tracing/kprobe_events").exists()
        mg = plans["mglru"]
        for e in mg.entries:
            if any(c.kind == "kprobe" for c in PROBES["mglru"].group(e.group).candidates):
                assert not e.attached and "kprobes" in e.reason
        assert not plans["mlock"].entry("kp_mlock_folio").attached

    # the probes read kernel structs through BTF: no kernel headers are looked for
    assert not hasattr(feats, "headers") and feats.btf
    if plans["mlock"].entry("kp_mlock_folio").attached is False:
        assert "kprobes" in plans["mlock"].entry("kp_mlock_folio").reason

    rep = _run("--json")
    rows = _rows(rep)
    assert rows["root"]["status"] == "yes" and rows["bpf"]["status"] == "yes"
    assert rows["tracefs"]["status"] == "yes"
    assert rows["pagecache.add"]["status"] == "yes"
    assert "headers" not in rows and rows["btf"]["status"] == "yes"
