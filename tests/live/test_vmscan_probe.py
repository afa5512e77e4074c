"""The vmscan probe (probes/vmscan.bpf.c + toolkit/record/probes/vmscan.py) (live tier).

`record --probes vmscan --cgroup` runs a reader in a 64 MiB memory scope that reads 256 MiB of
files twice: memcg limit reclaim, in the reader's own task, does the work. Oracles: /proc/vmstat
(pgsteal_{anon,file} count every batch; pgsteal_kswapd / pgsteal_direct only global reclaim,
never a memcg's own) read by the recorder at arm / disarm, and by the test around the whole
command. What can be exact is: every batch of the reader is memcg reclaim, and the kswapd /
direct batches are exactly what vmstat counts as kswapd / direct reclaim; the totals are
machine-wide and agree within the tolerance measured (edges of the armed interval)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.reclaim_probe import MiB, PAGE, READER, file_set, io_lock  # noqa: F401  (fixtures)
from moetrace.kernel.procfs import read_vmstat
from moetrace.record.probes.vmscan import VMSTAT_KEYS, WHO


def _record(run, cgroup, files, passes: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moetrace.cli", "record", "--probes", "vmscan", "--out", str(run),
                           "--cgroup", str(cgroup), "--", sys.executable, "-c", READER, str(passes), *map(str, files)],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.live
def test_record_probes_vmscan_attributes_each_batch(live, io_lock, file_set, tmp_path):
    import moetrace
    from moetrace.capacity.scope import Scope

    limit, passes = 64 * MiB, 2
    scope = Scope(f"vmscan-test-{os.getpid()}")
    scope.create(limit)
    try:
        vm0 = read_vmstat("/", VMSTAT_KEYS)
        r = _record(tmp_path / "run", scope.path, file_set, passes)
        vm1 = read_vmstat("/", VMSTAT_KEYS)
    finally:
        scope.remove(kill=True)
    assert r.returncode == 0, r.stderr
    assert not scope.exists()
    outer = {k: vm1[k] - vm0[k] for k in VMSTAT_KEYS if k in vm0 and k in vm1}

    run = moetrace.open_run(tmp_path / "run")  # read through run/: the checks the manifest carries
    doc = run.meta
    assert doc["probes"] == ["vmscan"] and doc["attach_plan"]["vmscan"]["recorded"] is True
    assert doc["tables"]["vmscan_batches"]["scanned_pages"]["check"] == "n"
    b, w = run.tables["vmscan_batches"], run.tables["vmscan_wakes"]
    lost = doc["lost"]["vmscan"]
    s = doc["summaries"]["vmscan"]
    chk = s["vmstat_check"]
    print(f"\nbatches by who: {s['who']}\nkswapd: {s['kswapd']}\ninterval vmstat: {s['vmstat_delta']}\n"
          f"outer vmstat: {outer}\nlost: { {k: v for k, v in lost.items() if k != 'note'} }")
    assert lost["lost_events"] == 0 and lost["task_map_full"] == 0
    assert doc["stats"]["vmscan"]["batch_records"] == len(b) and doc["stats"]["vmscan"]["wake_records"] == len(w)
    assert set(b["who"]) <= set(WHO) and set(w["kind"]) <= {"wake", "sleep"}
    assert b["time_ns"].between(doc["interval"]["armed_ns"], doc["interval"]["disarmed_ns"]).all()

    # the reader's own batches: all memcg reclaim (no PF_KSWAPD, no global direct-reclaim window),
    # at least the pages read beyond the limit, less slack, mostly from the file list
    mine = b[b["tgid"] == doc["child_pid"]]
    read_pages = passes * 256 * MiB // PAGE
    assert set(mine["who"]) == {"memcg"}, mine["who"].value_counts().to_dict()
    assert int(mine["reclaimed_pages"].sum()) >= 0.9 * (read_pages - limit // PAGE)
    assert int(mine.loc[mine["file"], "reclaimed_pages"].sum()) >= 0.9 * int(mine["reclaimed_pages"].sum())
    assert (mine["scanned_pages"] >= mine["reclaimed_pages"]).all() and mine["priority"].between(0, 12).all()

    # exact: kswapd's and global direct reclaim's batches are what vmstat counts as theirs over the
    # same interval (a memcg's reclaim is in neither); kswapd batches run on a PF_KSWAPD thread
    assert s["who"]["kswapd"]["reclaimed_pages"] == s["vmstat_delta"]["pgsteal_kswapd"]
    assert s["who"]["direct"]["reclaimed_pages"] == s["vmstat_delta"]["pgsteal_direct"]
    assert chk["kswapd_reclaimed_pages"] == chk["vmstat_pgsteal_kswapd"]
    # machine-wide: every batch is in pgsteal_{anon,file} (within 2 %: batches at the interval's edges)
    steal, scan = chk["vmstat_pgsteal"], chk["vmstat_pgscan"]
    assert steal > 0 and abs(chk["batches_reclaimed_pages"] - steal) <= 0.02 * steal
    assert abs(chk["batches_scanned_pages"] - scan) <= 0.02 * scan  # scans that isolated nothing: no record
    # the outer oracle (the whole command, record's start and end included) holds the interval's
    outer_steal = outer["pgsteal_anon"] + outer["pgsteal_file"]
    assert chk["batches_reclaimed_pages"] <= outer_steal + 0.02 * steal
