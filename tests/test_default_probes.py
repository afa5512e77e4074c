"""Acceptance 3: every probe in record's default set attaches on this kernel or is listed by
doctor with its reason; every probe with a C file compiles, loads and detaches here with the
knobs its attach plan derives (probe-build tier).

The per-probe tests (test_<probe>_probe.py) check what each probe measures; these check the
set as a whole, the way `moetrace record` and `moetrace doctor` see it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moetrace.kernel import bpf
from moetrace.record import spec as probespec
from moetrace.record import probes as probe_registry
from moetrace.record import recorder
from moetrace.run import directory as rundir
from moetrace.record.probes import DEFAULT_PROBES, PROBES

RECORD = [sys.executable, "-c", "from moetrace.cli.record import record; record.main(prog_name='moetrace record')"]
# --mount: record unmounts the debugfs it mounted; doctor must see the same tracefs (the session fixture
# unmounts what it mounts)
DOCTOR = [sys.executable, "-c", "from moetrace.cli import main; main()", "doctor", "--json", "--mount"]
WITH_SOURCE = [n for n, sp in PROBES.items() if sp.source_path.exists()]


def test_every_default_probe_has_a_recorder():
    """The declared default set is what record attaches: no default probe is declared only."""
    assert set(DEFAULT_PROBES) <= set(recorder.RECORDED), set(DEFAULT_PROBES) - set(recorder.RECORDED)
    assert recorder.DEFAULT_RECORD == DEFAULT_PROBES


def test_every_bpf_probe_has_its_c_file():
    for name, spec in PROBES.items():
        uses_bpf = any(c.kind != "debugfs" for g in spec.attach for c in g.candidates)
        assert not uses_bpf or spec.source_path.exists(), name


@pytest.fixture(scope="module")
def plans(live):
    from moetrace.kernel.features import Features

    return probe_registry.resolve_all(Features("/", mount=True))


@pytest.mark.probe_build
@pytest.mark.parametrize("name", WITH_SOURCE)
def test_probe_compiles_loads_and_detaches_with_its_plan_knobs(plans, name):
    """Compile + load + attach with the knobs the kernel decides (unavailable groups compiled
    out); a probe the kernel cannot run at all still compiles with every group compiled out."""
    from moetrace.kernel.bpf import prog_id_exists, prog_info

    spec, plan = PROBES[name], plans[name]
    knobs = spec.knob_values(**{k: v for k, v in plan.knobs.items() if k in {kn.name for kn in spec.knobs}})
    probe = bpf.load_probe(name, {k: int(v) for k, v in knobs.items()})
    try:
        b = probe.bpf
        # bcc attaches every TRACEPOINT_PROBE it compiles; named programs are attached as record does
        for e in plan.attached:
            c = e.candidate
            if c.kind == "tracepoint" and not c.fn_name.startswith("tracepoint__"):
                b.attach_tracepoint(tp=c.target.encode(), fn_name=c.fn_name.encode())
            elif c.kind == "perf_event":
                b.load_func(c.fn_name.encode(), type(b).PERF_EVENT)
        tps = {k.decode() if isinstance(k, bytes) else str(k) for k in b.tracepoint_fds}
        attached = {e.candidate.target for e in plan.attached if e.candidate.kind == "tracepoint"}
        assert tps == attached, (name, tps ^ attached)
        ids = [prog_info(f.fd)["id"] for f in b.funcs.values()]
        bpf_groups = [e for e in plan.attached if e.candidate.kind != "debugfs"]
        # a probe whose BPF groups are all unavailable here (mglru without kprobes) loads no program
        assert bool(ids) == bool(bpf_groups), (name, ids, [e.group for e in bpf_groups])
        assert all(prog_id_exists(i) for i in ids)
    finally:
        probe.close()
    assert not any(prog_id_exists(i) for i in ids)


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
    _doc, tables = rundir.load_run(tmp_path / "run")
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
    add = rt["programs"]["pagecache"]["tracepoint__filemap__mm_filemap_add_to_page_cache"]
    # the program runs from attach to detach; it counts (add_events) only while armed
    st = doc["stats"]["pagecache"]
    assert add["run_cnt"] == st["add_runs"] >= st["add_events"] > 0
    assert rt["per_probe_runs"]["reads"] > 0 and 0 < rt["cpu_fraction_of_wall"] < 1
    assert open("/proc/sys/kernel/bpf_stats_enabled").read().strip() == before
