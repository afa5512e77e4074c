"""`moetrace doctor`: JSON shape on fake trees (no kernel), and the live kernel's answers."""

from __future__ import annotations

import pytest

import json
import re
from pathlib import Path

from click.testing import CliRunner

from moetrace.kernel import features as F
from moetrace.cli.doctor import doctor, doctor_report
from moetrace.record.probes import PROBES, resolve_all

from test_features import make_tree  # noqa: E402  (tests/ is on sys.path under pytest)

STATUSES = {"yes", "no", "degraded"}
CAPS = {"root", "cap_bpf", "cap_perfmon", "bpf", "tracefs", "debugfs", "headers", "kprobes", "btf",
        "perf_events", "mglru", "cgroup_v2_memory", "cgroup_v1_memory", "psi"}


def _run(*args: str) -> dict:
    res = CliRunner().invoke(doctor, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def _rows(rep: dict) -> dict[str, dict]:
    """Rows by name; probe summary rows as "probe:<name>" (the capability "mglru" is another row)."""
    return {("probe:" if r["section"] == "probe" else "") + r["name"]: r for r in rep["rows"]}


def test_json_shape_fake_tree(tmp_path):
    rep = _run("--json", "--root", str(make_tree(tmp_path)))
    assert set(rep) == {"kernel", "root", "mounted", "rows", "plans", "not_checked", "damon"}
    assert rep["kernel"] == "6.18.44-fc-v973" and rep["mounted"] == []
    for r in rep["rows"]:
        assert set(r) == {"section", "name", "status", "detail", "fix", "checked"}
        assert r["section"] in {"capability", "probe", "attach", "background"}
        assert r["status"] in (STATUSES if r["section"] != "background" else {"active", "passive", "no"})
        assert r["detail"]
    rows = _rows(rep)
    assert CAPS <= {n for n, r in rows.items() if r["section"] == "capability"}
    assert set(rep["plans"]) == set(PROBES)
    for name, spec in PROBES.items():
        assert rows[f"probe:{name}"]["section"] == "probe"
        for g in spec.attach:
            assert rows[f"{name}.{g.name}"]["section"] == "attach"
        plan = rep["plans"][name]
        assert plan["status"] == rows[f"probe:{name}"]["status"]
        assert [e["group"] for e in plan["entries"]] == [g.name for g in spec.attach]
    assert rows["headers"]["status"] == "degraded" and "mismatched" in rows["headers"]["detail"]
    assert rows["kprobes"]["status"] == "no"
    assert rows["mglru"]["status"] == "no"
    assert rows["cgroup_v1_memory"]["status"] == "yes" and rows["cgroup_v2_memory"]["status"] == "no"
    assert rows["pagecache.add"]["status"] == "yes"
    assert rows["mglru.evict_folios"]["status"] == "no" and "kprobes" in rows["mglru.evict_folios"]["detail"]
    assert rows["probe:mlock"]["status"] == "degraded"
    assert rows["probe:mglru"]["status"] == "no"


def test_fixes_named(tmp_path):
    rep = _run("--json", "--root", str(make_tree(tmp_path, tracefs=None, headers=None)))
    rows = _rows(rep)
    assert rows["tracefs"]["status"] == "no" and F.TRACEFS_MOUNT_CMD in rows["tracefs"]["fix"]
    assert rows["headers"]["status"] == "no" and "apt-get install" in rows["headers"]["fix"]
    assert rows["debugfs"]["fix"].startswith(F.DEBUGFS_MOUNT_CMD)
    assert rows["probe:pagecache"]["status"] == "no"


def test_fallback_shows_degraded(tmp_path):
    from test_features import EVENTS_618
    events = {c: [e for e in evs if e != "block_bio_queue"] for c, evs in EVENTS_618.items()}
    rep = _run("--json", "--root", str(make_tree(tmp_path, events=events)))
    row = _rows(rep)["block.bytes"]
    assert row["status"] == "degraded" and row["detail"].startswith("tracepoint block:block_io_start (fallback")


def test_text_output(tmp_path):
    res = CliRunner().invoke(doctor, ["--root", str(make_tree(tmp_path))])
    assert res.exit_code == 0
    assert "kernel 6.18.44-fc-v973" in res.output
    assert re.search(r"degraded\s+headers\s+mismatched", res.output)
    assert re.search(r"yes\s+pagecache\.add\s+tracepoint filemap:mm_filemap_add_to_page_cache", res.output)
    res = CliRunner().invoke(doctor, ["--help"])
    assert res.exit_code == 0 and "Examples" in res.output


def test_not_root_says_what_it_could_not_check(tmp_path):
    root = make_tree(tmp_path, capeff="0" * 16, uid=1000)
    rep = doctor_report(str(root))
    rows = _rows(rep)
    assert rows["root"]["status"] == "no" and rows["bpf"]["status"] == "no"
    assert "unprivileged_bpf_disabled" in rows["bpf"]["detail"]


# -- live -------------------------------------------------------------------------------------

@pytest.fixture
def unmount_after():
    """Whatever a test mounted through Features(mount=True) is unmounted afterwards."""
    yield
    F.unmount_ours()


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

    osrel = Path("/proc/sys/kernel/osrelease").read_text().strip()
    uts = Path(f"/lib/modules/{osrel}/build/include/generated/utsrelease.h")
    if uts.exists():
        m = re.search(r'UTS_RELEASE\s+"([^"]*)"', uts.read_text())
        expect = "exact" if m and m.group(1) == osrel else "mismatched"
        assert feats.headers == expect
        if expect == "mismatched":  # this machine: 6.1 headers linked under a 6.18 kernel
            assert plans["mglru"].entry("folio_inc_gen").attached is False

    rep = _run("--json")
    rows = _rows(rep)
    assert rows["root"]["status"] == "yes" and rows["bpf"]["status"] == "yes"
    assert rows["tracefs"]["status"] == "yes"
    assert rows["pagecache.add"]["status"] == "yes"
    assert rows["headers"]["status"] == {"exact": "yes", "mismatched": "degraded", "none": "no"}[feats.headers]


def _fake_damon(root, state="on", action="pageout", filters=(("anon", "Y", "N"), ("unmapped", "Y", "Y"))):
    """A kdamond like this machine's (sysfs layout of 6.14+, with ops_filters)."""
    kd = root / "sys/kernel/mm/damon/admin/kdamonds/0"
    files = {"state": state, "pid": "79", "refresh_ms": "0", "contexts/nr_contexts": "1",
             "contexts/0/operations": "paddr",
             "contexts/0/monitoring_attrs/intervals/sample_us": "500000",
             "contexts/0/monitoring_attrs/intervals/aggr_us": "5000000",
             "contexts/0/monitoring_attrs/intervals/update_us": "60000000",
             "contexts/0/targets/0/pid_target": "0",
             "contexts/0/targets/0/regions/0/start": str(4 << 30), "contexts/0/targets/0/regions/0/end": str(7 << 30),
             "contexts/0/schemes/0/action": action,
             "contexts/0/schemes/0/access_pattern/age/min": "12",
             "contexts/0/schemes/0/access_pattern/age/max": str(2**32 - 1),
             "contexts/0/schemes/0/access_pattern/nr_accesses/min": "0",
             "contexts/0/schemes/0/access_pattern/nr_accesses/max": "1",
             "contexts/0/schemes/0/access_pattern/sz/min": "0",
             "contexts/0/schemes/0/access_pattern/sz/max": str(2**64 - 1),
             "contexts/0/schemes/0/quotas/bytes": str(128 << 20), "contexts/0/schemes/0/quotas/ms": "50",
             "contexts/0/schemes/0/quotas/reset_interval_ms": "1000",
             "contexts/0/schemes/0/stats/sz_applied": "0"}
    for i, (typ, matching, allow) in enumerate(filters):
        files.update({f"contexts/0/schemes/0/ops_filters/{i}/type": typ,
                      f"contexts/0/schemes/0/ops_filters/{i}/matching": matching,
                      f"contexts/0/schemes/0/ops_filters/{i}/allow": allow})
    for rel, text in files.items():
        (kd / rel).parent.mkdir(parents=True, exist_ok=True)
        (kd / rel).write_text(text + "\n")
    return root


def test_damon_scheme_rows_fake_tree(tmp_path):
    from moetrace.kernel.damon import read_damon

    root = _fake_damon(make_tree(tmp_path))
    d = read_damon(root)
    (s,) = d["active_schemes"]
    assert s["thread"] == "kdamond.0" and s["action"] == "pageout" and s["min_idle_s"] == 60.0
    assert s["regions"] == [{"start": 4 << 30, "end": 7 << 30}] and s["evicts_page_cache"] is True
    assert [(f["type"], f["allow"]) for f in s["filters"]] == [("anon", False), ("unmapped", True)]
    rep = _run("--json", "--root", str(root))
    (row,) = [r for r in rep["rows"] if r["section"] == "background"]
    assert row["name"] == "damon.kdamond.0.scheme0" and row["status"] == "active"
    assert "idle >= 60 s" in row["detail"] and "4.00-7.00 GiB" in row["detail"] and "damon" in row["fix"]
    # a kdamond that is off, or a scheme that only takes anonymous pages, is no hazard
    off = _fake_damon(make_tree(tmp_path / "off"), state="off")
    assert read_damon(off)["active_schemes"] == []
    anon = _fake_damon(make_tree(tmp_path / "anon"), filters=(("anon", "N", "N"),))
    assert read_damon(anon)["active_schemes"][0]["evicts_page_cache"] is False
    assert read_damon(tmp_path / "nothing")["available"] is False
