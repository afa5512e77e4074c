"""`moetrace doctor`: JSON shape on fake trees (no kernel), and the live kernel's answers (unit tier)."""

from __future__ import annotations

from common.doctor import *  # noqa: F401,F403


def test_json_shape_fake_tree(tmp_path):
    rep = _run("--json", "--root", str(make_tree(tmp_path)))
    assert set(rep) == {"kernel", "root", "mounted", "rows", "plans", "not_checked", "damon"}
    assert rep["kernel"] == "6.18.44-fc-v973" and rep["mounted"] == []
    for r in rep["rows"]:
        assert set(r) == {"section", "name", "status", "detail", "fix", "checked"}
        assert r["section"] in {"capability", "probe", "attach", "background", "engine"}
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
    assert "headers" not in rows and rows["btf"]["status"] == "yes"
    assert rows["kprobes"]["status"] == "no"
    assert rows["mglru"]["status"] == "no"
    assert rows["cgroup_v1_memory"]["status"] == "yes" and rows["cgroup_v2_memory"]["status"] == "no"
    assert rows["pagecache.add"]["status"] == "yes"
    assert rows["mglru.evict_folios"]["status"] == "no" and "kprobes" in rows["mglru.evict_folios"]["detail"]
    assert rows["probe:mlock"]["status"] == "degraded"
    assert rows["probe:mglru"]["status"] == "no"


def test_fixes_named(tmp_path):
    rep = _run("--json", "--root", str(make_tree(tmp_path, tracefs=None, btf=False)))
    rows = _rows(rep)
    assert rows["tracefs"]["status"] == "no" and F.TRACEFS_MOUNT_CMD in rows["tracefs"]["fix"]
    assert rows["btf"]["status"] == "no" and "CONFIG_DEBUG_INFO_BTF=y" in rows["btf"]["fix"]
    assert "no kernel BTF" in rows["probe:reads"]["detail"]
    assert rows["debugfs"]["fix"].startswith(F.DEBUGFS_MOUNT_CMD)
    assert rows["probe:pagecache"]["status"] == "no"


def test_fallback_shows_degraded(tmp_path):
    from unit.test_features import EVENTS_618
    events = {c: [e for e in evs if e != "block_bio_queue"] for c, evs in EVENTS_618.items()}
    rep = _run("--json", "--root", str(make_tree(tmp_path, events=events)))
    row = _rows(rep)["block.bytes"]
    assert row["status"] == "degraded" and row["detail"].startswith("tracepoint block:block_io_start (fallback")


def test_text_output(tmp_path):
    res = CliRunner().invoke(doctor, ["--root", str(make_tree(tmp_path))])
    assert res.exit_code == 0
    assert "kernel 6.18.44-fc-v973" in res.output
    assert re.search(r"yes\s+btf\s+/sys/kernel/btf/vmlinux", res.output)
    assert re.search(r"yes\s+pagecache\.add\s+tracepoint filemap:mm_filemap_add_to_page_cache", res.output)
    res = CliRunner().invoke(doctor, ["--help"])
    assert res.exit_code == 0 and "Examples" in res.output


def test_not_root_says_what_it_could_not_check(tmp_path):
    root = make_tree(tmp_path, capeff="0" * 16, uid=1000)
    rep = doctor_report(str(root))
    rows = _rows(rep)
    assert rows["root"]["status"] == "no" and rows["bpf"]["status"] == "no"
    assert "unprivileged_bpf_disabled" in rows["bpf"]["detail"]


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
