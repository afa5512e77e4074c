"""Acceptance 3: every probe in record's default set attaches on this kernel or is listed by (live tier)."""

from __future__ import annotations

from common.default_probes import *  # noqa: F401,F403
from common import read_run


def test_default_set_attaches_or_doctor_says_why(live, tmp_path):
    """`moetrace record` with the default set around a command that reads a file: each default
    probe is recorded, or skipped with the same reason `moetrace doctor --json` gives; the run
    directory holds no raw kernel address (acceptance 5: stacks are symbolized)."""
    from moetrace.kernel.symbolize import find_kernel_addresses

    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(8 << 20))
    cmd = ["sh", "-c", f"for i in 1 2 3 4 5 6 7 8; do dd if={data} of=/dev/null bs=64k status=none; done; "
                       f"{sys.executable} -c 'sum(range(3_000_000))'"]
    r = subprocess.run([*RECORD, "--out", str(tmp_path / "run"), "--missing-probes", "warn", "--", *cmd],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "run" / "manifest.json").read_text())
    d = subprocess.run(DOCTOR, capture_output=True, text=True, timeout=120)
    assert d.returncode == 0, d.stderr
    dplans = json.loads(d.stdout)["plans"]
    assert doc["probes"] == list(DEFAULT_PROBES)
    for name in DEFAULT_PROBES:
        ap = doc["attach_plan"][name]
        assert ap["status"] == dplans[name]["status"], name
        if ap["status"] == "no":
            assert ap["recorded"] is False and ap["skip_reason"] == dplans[name]["reason"] != "", name
        else:
            assert ap["recorded"] is True, (name, ap["skip_reason"])
    assert doc["complete"] is True
    _doc, tables = read_run(tmp_path / "run")
    if doc["attach_plan"]["stacks"]["recorded"]:
        st = tables["stacks"]
        assert int(st["samples"].sum()) > 0
        assert (tmp_path / "run" / "stacks.folded").stat().st_size > 0
    assert find_kernel_addresses(tmp_path / "run") == []


def test_bpf_stats_count_each_probe_and_switch_off_again(live, tmp_path):
    """--bpf-stats: per-program run counts equal the probe's own event counters (the add
    program runs once per add event), run time is nonzero, and the statistics are off again."""
    before = open("/proc/sys/kernel/bpf_stats_enabled").read().strip()
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(4 << 20))
    fd = os.open(data, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    r = subprocess.run([*RECORD, "--out", str(tmp_path / "run"), "--probes", "pagecache,reads", "--bpf-stats",
                        "--", "dd", f"if={data}", "of=/dev/null", "bs=64k", "status=none"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "run" / "manifest.json").read_text())
    rt = doc["bpf_runtime"]
    assert rt["stats_enabled"] is True and rt["total_run_time_ns"] > 0
    add = rt["programs"]["pagecache"]["tp_mm_filemap_add_to_page_cache"]
    # the program runs from attach to detach; it counts (add_events) only while armed. It is
    # attached system-wide until detach, so other processes' adds run it while the maps are read
    # (a CI run with a concurrent job measured run_cnt 1248 before the read, add_runs 1261):
    # the kernel's run count is read just before and just after the probe's own counter
    st = doc["stats"]["pagecache"]
    assert add["run_cnt"] <= st["add_runs"] <= add["run_cnt_after"]
    assert st["add_runs"] >= st["add_events"] > 0
    assert rt["per_probe_runs"]["reads"] > 0 and 0 < rt["cpu_fraction_of_wall"] < 1
    assert open("/proc/sys/kernel/bpf_stats_enabled").read().strip() == before
