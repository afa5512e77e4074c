"""A recorder never loses a finished run (live tier): a probe that fails while its data is read is
recorded as failed and the other probes' tables are written; a command killed by a signal (the
OOM killer's SIGKILL) makes an incomplete run. Oracles: the run directory on disk, the kernel's
list of loaded BPF programs."""

from __future__ import annotations

import json

from common.record import *  # noqa: F401,F403
from common import read_run
from moetrace.kernel.bpf import prog_id_exists, wait_pid_exit
from moetrace.record.probes.lru import LruRecorder
from moetrace.record.recorder import RecordOptions, record


def test_a_probe_failing_at_drain_is_recorded_and_the_others_tables_survive(live, pools, tmp_path, monkeypatch):
    def broken_close(self):
        raise RuntimeError("injected: the ring could not be read")

    monkeypatch.setattr(LruRecorder, "close", broken_close)
    replay = [*REPLAY, str(pools["plan"]), "--pool", str(pools["files"]), "--warmup", "0", "--passes", "1"]
    res = record(RecordOptions(command=replay, out=str(tmp_path / "r"), probes=("pagecache", "lru", "reclaim")))
    assert res.exit_status == 0
    doc, tables = read_run(tmp_path / "r")
    assert doc["failed_probes"] == {"lru": {"stage": "collect",
                                            "error": "RuntimeError: injected: the ring could not be read"}}
    assert doc["attach_plan"]["lru"]["failed"]["stage"] == "collect"
    assert doc["complete"] is False and doc["exit_status"] == 0
    assert "lru" not in tables and "reclaim" in tables and len(tables["experts"]) == N + 1
    assert int(tables["experts"]["added_pages"].sum()) >= 0 and "reclaim" in doc["summaries"]
    assert (tmp_path / "r" / "snapshots.json").is_file()
    # the failed probe was detached too
    assert wait_pid_exit(doc["detach"]["releaser_pid"], timeout=60)
    assert not any(prog_id_exists(i) for i in doc["bpf_prog_ids"]), "a probe is still loaded"


def test_a_command_killed_by_a_signal_makes_an_incomplete_run(live, tmp_path):
    r = _record(tmp_path / "k", ["sh", "-c", "kill -9 $$"], "--probes", "pagecache")
    assert r.returncode == 137, r.stderr
    doc = json.loads((tmp_path / "k" / rundir.MANIFEST).read_text())
    assert doc["exit_status"] == 137 and doc["command_signal"] == "SIGKILL" and doc["complete"] is False
