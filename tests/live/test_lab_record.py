"""`moetrace record` inside the kernel lab: a real MGLRU kernel (Debian 6.12, MGLRU on), the pool
on a virtio-blk ext4 image, the replay in a cgroup v2 memcg smaller than the pool (live tier:
needs the set-up's QEMU and kernels; skips without them, fails under MOETRACE_LIVE=1).

Oracles, all from the guest: its /proc/vmstat deltas over the recording (snapshots.json, taken
inside the probes' armed interval) — pgpgin (the pool image is the guest's only block device, so
every KiB read in is a pool KiB), pgsteal_file, workingset_refault_file — and its own lru_gen
file (max_seq must grow when an mmap replay re-touches pages under a limit)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import moetrace_cli
from moetrace.inputs.trace import write_jsonl
from moetrace.record.recorder import DEFAULT_RECORD

from .test_lab_run import K612, _lab, _need

EXPERTS, STEPS = 64, 4


@pytest.fixture(scope="module")
def lab_pool(tmp_path_factory):
    _need()
    d = tmp_path_factory.mktemp("labpool")
    geo = ["--layers", "1", "--experts", str(EXPERTS), "--k", str(EXPERTS), "--expert-bytes", "1MiB"]
    moetrace_cli("pool", "create", d / "pool", *geo, "--layout", "files")
    write_jsonl([(s, 0, list(range(EXPERTS))) for s in range(STEPS)], d / "t.jsonl")
    moetrace_cli("plan", "compile", d / "t.jsonl", *geo, "-o", d / "plan.bin")
    return d


def test_full_default_set_records_on_612_with_mglru_under_a_v2_memcg(lab_pool, tmp_path):
    """Every default probe, in the guest, under memory pressure: no crash, every table written
    (under QEMU's -cpu max, numpy's AVX2 sort crashed the recorder while it wrote them)."""
    out = tmp_path / "lab"
    bindir = str(Path(sys.executable).parent)
    r = _lab(out, "--kernel", "6.12", "--mglru", "on", "--pool", str(lab_pool / "pool"), "--memcg", "80M",
             "--timeout", "600", "--json", "--",
             f"{bindir}/moetrace", "record", "--out", "/tmp/lab/run", "--cgroup", "/sys/fs/cgroup/lab",
             "--",
             "replay", str(lab_pool / "plan.bin"), "--pool", str(lab_pool / "pool"), "--mode", "mmap",
             "--warmup", "1", "--passes", "2", timeout=700)
    assert r.returncode == 0, r.stderr + (out / "stderr").read_text() if (out / "stderr").exists() else r.stderr
    lab = json.loads(r.stdout)
    assert lab["release"] == K612 and lab["mglru"] == "0x0007" and lab["status"] == "ok"
    assert lab["cmd_start_uptime_s"] < 20  # boot to COMMAND (measured 4.4 s)
    assert lab["memcg"] == {"path": "/sys/fs/cgroup/lab", "memory.max": "80M"}
    run = out / "run"
    m = json.loads((run / "manifest.json").read_text())
    assert m["complete"] is True and m["exit_status"] == 0 and m["kernel"]["release"] == K612
    assert m["mglru"]["on"] is True and m["cgroup"] == "/sys/fs/cgroup/lab"
    assert {p: a["recorded"] for p, a in m["attach_plan"].items()} == {p: True for p in DEFAULT_RECORD}
    assert "failed_probes" not in m
    for table in ("experts", "epochs", "lru", "reclaim", "mlock", "block_latency", "reads", "stacks", "lru_gen",
                  "mglru_aging"):
        assert (run / f"{table}.parquet").is_file(), table
    assert (run / "stacks.folded").stat().st_size > 0
    # the pool came from the virtio-blk image: an ext4 device of the guest, not 9p
    assert m["pool"]["root"] == str((lab_pool / "pool").resolve())
    snaps = json.loads((run / "snapshots.json").read_text())
    d = {k: snaps["post"]["vmstat"].get(k, 0) - snaps["pre"]["vmstat"].get(k, 0)
         for k in ("pgpgin", "pgsteal_file", "workingset_refault_file")}
    t = m["totals"]
    # every page read from the pool image is an expert page added: pgpgin counts KiB; the block
    # probe maps every bio to an expert through the image's extents
    assert t["experts_added_pages"] * 4 == d["pgpgin"], (t, d)
    assert t["experts_device_read_bytes"] == t["experts_added_pages"] * 4096 and \
        t["unattributed_device_read_bytes"] == 0
    assert t["experts_added_pages"] >= EXPERTS * 256 * STEPS * 3 * 0.5  # the limit forces re-reads
    # the kernel's own evictions: the reclaim probe and the workingset_eviction kprobe = pgsteal_file
    mg, rc = m["summaries"]["mglru"], m["summaries"]["reclaim"]
    assert rc["reclaimed_pages"] == d["pgsteal_file"] == mg["kprobe_counts"]["workingset_eviction"]
    # pool evictions are a part of them; refaults of other pages (the replay's Python over 9p, in
    # the same memcg) can only come from the other evictions
    assert t["experts_evicted_pages"] <= d["pgsteal_file"]
    assert 0 <= d["workingset_refault_file"] - t["experts_re_added_pages"] \
        <= d["pgsteal_file"] - t["experts_evicted_pages"], (t, d)
    assert mg["kprobe_counts"]["workingset_refault"] == d["workingset_refault_file"]
    # MGLRU aged /lab: generations born (max_seq's delta) with aging events from this kernel's
    # own try_to_inc_max_seq, and lru_gen samples of the memcg
    lab_vec = [v for v in mg["lruvecs"].values() if v["memcg_path"] == "/lab"]
    assert len(lab_vec) == 1 and lab_vec[0]["generations_born"] > 0
    assert lab_vec[0]["generations_born"] >= lab_vec[0]["generations_seen"]
    assert mg["kprobes"]["inc_max_seq"] == "try_to_inc_max_seq" and mg["kprobe_counts"]["inc_max_seq"] > 0
    aging = pd.read_parquet(run / "mglru_aging.parquet")
    assert len(aging) == mg["kprobe_counts"]["inc_max_seq"] and aging["seq"].notna().all()
    g = pd.read_parquet(run / "lru_gen.parquet")
    assert (g["memcg_path"] == "/lab").any() and g["sample"].nunique() == mg["samples"]
    # the age report renders the MGLRU side from this kernel's tables
    rep = subprocess.run([sys.executable, "-m", "moetrace.cli", "report", str(run), "--only", "age", "--out",
                          str(tmp_path / "rep"), "--json"], capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    cad = {c["memcg_path"]: c for c in json.loads(rep.stdout)["summary"]["mglru"]["cadence"]}
    assert cad["/lab"]["seq_increments"] == lab_vec[0]["generations_born"]
    assert cad["/lab"]["aging_events_all_memcgs"] == mg["kprobe_counts"]["inc_max_seq"]
    assert "MGLRU on this kernel: on (enabled 0x0007)" in (tmp_path / "rep" / "REPORT.md").read_text()
    print(f"\n6.12 lab record: command at {lab['cmd_start_uptime_s']} s guest uptime; probes attached in "
          f"{m['timings']['probes_attach_s']:.1f} s; host wall {lab['host_wall_s']:.1f} s; added "
          f"{t['experts_added_pages']} = pgpgin/4; reclaimed {rc['reclaimed_pages']}; generations born "
          f"{lab_vec[0]['generations_born']} (seen {lab_vec[0]['generations_seen']})")
