"""moetrace watch on the live kernel: its per-interval sums equal what `record` counts of the
same thrashing replay (both attached at once, each with its own probes), and an outside
eviction (fadvise DONTNEED from another process) raises the outside-evictor alarm naming it
within one interval. Live measurements hold the machine-wide I/O lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import drop_pages, io_lock, make_expert_pools, make_layered_pool
from common.engines import engine, free_port, serving  # noqa: F401  (engine: the fixture)
from common.record import REPLAY, _drop, _resident_pages

MIB = 1 << 20
MOETRACE = Path(sys.executable).with_name("moetrace")
CLI = [str(MOETRACE)] if MOETRACE.exists() else [sys.executable, "-c", "from moetrace.cli import main; main()"]


class WatchProc:
    """`moetrace watch --json` in a process of its own: started, waited on until attached,
    stopped by SIGTERM; its intervals parsed."""

    def __init__(self, *args: str, interval: float = 0.5):
        self.p = subprocess.Popen([*CLI, "watch", "--json", *args, str(interval)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self.lines: list[tuple[float, dict]] = []  # (time.monotonic() when read, interval)
        self.attached = threading.Event()
        self._t = [threading.Thread(target=self._read_err, daemon=True),
                   threading.Thread(target=self._read_out, daemon=True)]
        for t in self._t:
            t.start()
        if not self.attached.wait(120):
            self.stop()
            raise AssertionError("watch did not attach: " + "".join(self.err))

    def _read_err(self):
        for line in self.p.stderr:
            self.err.append(line)
            if "watching every" in line:
                self.attached.set()

    def _read_out(self):
        for line in self.p.stdout:
            self.lines.append((time.monotonic(), json.loads(line)))

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.p.poll() is None:
            self.p.send_signal(sig)
        try:
            rc = self.p.wait(60)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
        for t in self._t:
            t.join(10)
        return rc

    @property
    def intervals(self) -> list[dict]:
        return [f for _t, f in self.lines]

    def total(self, key: str) -> int:
        return sum(int(f["pool"][key]) for f in self.intervals)


@pytest.mark.live
def test_watch_by_cgroup_sums_to_what_record_counts_of_the_same_thrashing_replay(live, tmp_path):
    from moetrace.capacity.scope import Scope, ScopeError, find_memory_controller, remove_stale_scopes

    try:
        ctrl = find_memory_controller()
    except ScopeError as e:
        pytest.skip(str(e))
    base = make_layered_pool(tmp_path / "p", 3, 32)  # 96 MiB through a 32 MiB cache
    pool, plan = base / "pool", base / "plan.bin"
    run = tmp_path / "run"
    replay = [*REPLAY, str(plan), "--pool", str(pool), "--warmup", "0", "--passes", "3", "--threads", "4"]
    with io_lock():
        remove_stale_scopes("watchthrash", ctrl)
        scope = Scope("watchthrash", ctrl).create((72 + 32) * MIB)
        w = None
        try:
            _drop(pool)  # before watch attaches: its re-read bitmap starts with nothing evicted
            w = WatchProc("--pool", str(pool), "--cgroup", str(scope.path))
            r = subprocess.run([*CLI, "record", "--out", str(run), "--probes", "pagecache,block", "--cgroup",
                                str(scope.path), "--", *replay], capture_output=True, text=True, timeout=300)
            time.sleep(1.2)  # at least one interval after the replay: the ring's last bios are read
        finally:
            rc = w.stop() if w is not None else None
            assert scope.remove(kill=True), f"scope {scope.path} not removed"
    assert r.returncode == 0, r.stderr
    assert rc == 0, "".join(w.err)
    doc = json.loads((run / "manifest.json").read_text())
    t = doc["totals"]
    got = {k: w.total(k) for k in ("added_pages", "re_added_pages", "device_read_bytes")}
    print(f"\nwatch: {len(w.intervals)} intervals, {got}; record: added {t['experts_added_pages']} re-added "
          f"{t['experts_re_added_pages']} device {t['experts_device_read_bytes']}; stderr {''.join(w.err)}")
    assert t["experts_re_added_pages"] > t["experts_added_pages"] // 2  # it thrashed
    assert got["added_pages"] == t["experts_added_pages"]
    assert got["re_added_pages"] == t["experts_re_added_pages"]
    assert got["device_read_bytes"] == t["experts_device_read_bytes"]
    assert all(f["pool"]["lost_bios"] == 0 for f in w.intervals)
    assert max(f["followed_processes"] for f in w.intervals) >= 1  # the replay was found in the cgroup
    assert any(f["alarms"]["rereads"]["on"] for f in w.intervals)
    assert "stopped: terminated (SIGTERM); probes detached" in "".join(w.err)
    # the replay's read calls, followed from its start (it joined the cgroup before exec): exact
    rep = json.loads((run / "replay" / "replay.json").read_text())
    reads = sum(int(v["reads"]) for v in rep["phases"].values())
    byts = sum(int(v["bytes"]) for v in rep["phases"].values())
    acc = {k: w.total(k) for k in ("expert_accesses", "requested_bytes", "computed_miss_bytes", "lost_accesses")}
    print(f"accesses {acc}; replay {reads} reads, {byts} bytes")
    assert (acc["expert_accesses"], acc["requested_bytes"], acc["lost_accesses"]) == (reads, byts, 0)
    # a cyclic 96 MiB stream through a 32 MiB LRU misses every access, and a cgroup wall does not
    # amplify (the paper's finding): the device reads what the computed misses say, within readahead
    assert acc["computed_miss_bytes"] == byts
    assert 0.9 <= got["device_read_bytes"] / acc["computed_miss_bytes"] <= 1.1


@pytest.mark.live
def test_an_outside_fadvise_raises_the_outside_evictor_alarm_within_one_interval(live, tmp_path):
    from moetrace.inputs.pool import open_pool

    pools = make_expert_pools(tmp_path, 23)
    files = [Path(p) for p in open_pool(pools["files"]).data_paths()]  # expert i of layer 0 = files[i]
    interval = 0.5
    with io_lock():
        for p in files:  # cached before watch attaches
            p.read_bytes()
        w = WatchProc("--pool", str(pools["files"]), interval=interval)
        try:
            time.sleep(2 * interval)
            resident = _resident_pages(files[5])
            t0 = time.monotonic()
            subprocess.run([sys.executable, "-c", "import os,sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
                            "os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)", str(files[5])], check=True)
            t1 = time.monotonic()
            time.sleep(3 * interval)
        finally:
            rc = w.stop(signal.SIGINT)  # Ctrl-C
    assert rc == 0 and "stopped: interrupted; probes detached" in "".join(w.err), "".join(w.err)
    hit = [f for f in w.intervals if f["pool"]["evicted_by"]["fadvise"]]
    assert len(hit) == 1, w.intervals  # one fadvise, counted in one interval
    f = hit[0]
    al = f["alarms"]["outside_evictor"]
    print(f"\nfadvise at {t0:.3f}-{t1:.3f} ({resident} pages resident), interval ending {f['t_s']}: {al}")
    assert al["on"] == 1 and "fadvise" in al["evidence"] and f"L0E5:" in al["evidence"], al
    assert t0 - interval - 0.25 <= f["t_s"] - f["interval_s"] and f["t_s"] <= t1 + interval + 0.25  # within one interval
    damon = sum(x["pool"]["evicted_by"]["damon"] for x in w.intervals)  # this machine's DAMON may take some first
    fadv = f["pool"]["evicted_by"]["fadvise"]
    assert fadv == resident or (damon and 0 < fadv <= resident), (fadv, resident, damon)


class PromServer:
    """Debian's prometheus on a loopback port, scraping one target every 0.5 s; stopped by pid."""

    BIN = "/usr/bin/prometheus"

    def __init__(self, tmp: Path, target: str):
        self.port = free_port()
        cfg = tmp / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 500ms\n  scrape_timeout: 400ms\nscrape_configs:\n"
                       f"  - job_name: moetrace\n    static_configs:\n      - targets: ['{target}']\n")
        self.log = open(tmp / "prometheus.log", "w")
        self.p = subprocess.Popen([self.BIN, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{self.port}"],
                                  stdout=self.log, stderr=subprocess.STDOUT)
        # ready, then the first scrape done (the scrape manager takes its targets ~5 s after start)
        t_end = time.monotonic() + 60
        while time.monotonic() < t_end:
            try:
                if any(r["value"][1] == "1" for r in self.query("up")):
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError("prometheus did not scrape: " + (tmp / "prometheus.log").read_text()[-2000:])

    def get(self, path: str, **params) -> bytes:
        import urllib.parse
        import urllib.request

        q = ("?" + urllib.parse.urlencode(params)) if params else ""
        return urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}{q}", timeout=10).read()

    def query(self, expr: str) -> list[dict]:
        doc = json.loads(self.get("/api/v1/query", query=expr))
        assert doc["status"] == "success", doc
        return doc["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 0.5) -> list[dict]:
        doc = json.loads(self.get("/api/v1/query_range", query=expr, start=start, end=end, step=step))
        assert doc["status"] == "success", doc
        return doc["data"]["result"]

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


@pytest.mark.live
def test_a_real_prometheus_scrapes_watch_and_sees_the_thrash_alarm_rise_and_fall(live, tmp_path):
    from moetrace.capacity.scope import Scope, ScopeError, find_memory_controller, remove_stale_scopes

    if not Path(PromServer.BIN).exists():
        pytest.fail(f"{PromServer.BIN} missing: scripts/bootstrap.sh installs Debian's prometheus")
    try:
        ctrl = find_memory_controller()
    except ScopeError as e:
        pytest.skip(str(e))
    base = make_layered_pool(tmp_path / "p", 3, 32)
    pool, plan = base / "pool", base / "plan.bin"
    replay = [*REPLAY, str(plan), "--pool", str(pool), "--warmup", "0", "--passes", "3", "--threads", "4"]
    wport = free_port()
    prom = w = None
    with io_lock():
        remove_stale_scopes("watchprom", ctrl)
        scope = Scope("watchprom", ctrl).create((72 + 32) * MIB)
        try:
            _drop(pool)
            w = WatchProc("--pool", str(pool), "--cgroup", str(scope.path), "--prometheus", f"127.0.0.1:{wport}")
            prom = PromServer(tmp_path, f"127.0.0.1:{wport}")
            t_start = time.time()
            # the replay joins the scope, then execs (as `record --cgroup` does)
            r = subprocess.run(["sh", "-c", f'echo $$ > {scope.path}/cgroup.procs && exec "$@"', "sh", *replay],
                               capture_output=True, text=True, timeout=300)
            t_thrash_end = time.time()
            time.sleep(5)  # quiet intervals after the thrash, scraped
            readded = prom.query("moetrace_pool_readded_pages_total")
            alarm = prom.query('moetrace_alarm{name="rereads"}[60s]')  # the raw samples, scrape-stamped
        finally:
            rc = w.stop() if w is not None else None
            if prom is not None:
                prom.stop()
            assert scope.remove(kill=True), f"scope {scope.path} not removed"
    assert r.returncode == 0, r.stderr
    assert rc == 0, "".join(w.err)
    total = w.total("re_added_pages")
    print(f"\nwatch re-added {total} in {len(w.intervals)} intervals; prometheus {readded}; alarm {alarm}")
    assert total > 0 and len(readded) == 1 and float(readded[0]["value"][1]) == total
    vals = [(float(t), float(v)) for t, v in alarm[0]["values"]]
    on = [t for t, v in vals if v == 1.0]
    # raised during the thrash: an interval (0.5 s) reports what happened in it, the next
    # scrape (0.5 s) takes it in; back to 0 after it, and staying there
    assert on and t_start <= on[0] <= t_thrash_end + 1.0 + 0.5, (vals, t_start, t_thrash_end)
    after = [v for t, v in vals if t >= t_thrash_end + 2.0]
    assert len(after) >= 3 and set(after) == {0.0}, (vals, t_thrash_end)


def _bpf_prog_ids() -> set[int]:
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, check=True).stdout
    return {p["id"] for p in json.loads(out or "[]")}


@pytest.mark.live
def test_watch_by_pid_counts_the_process_reads_and_ends_with_it_leaving_no_probe(live, tmp_path):
    from moetrace.inputs.pool import open_pool

    pools = make_expert_pools(tmp_path, 23)
    files = [str(p) for p in open_pool(pools["files"]).data_paths()]
    before = _bpf_prog_ids()
    with io_lock():
        _drop(pools["files"])
        # a reader that waits to be told, then reads every expert file once with read(2) and exits
        child = subprocess.Popen([sys.executable, "-c", "import sys\nsys.stdin.readline()\nfor p in sys.argv[1:]:\n"
                                  "    open(p, 'rb', buffering=0).read()\n", *files],
                                 stdin=subprocess.PIPE, text=True)
        w = None
        try:
            w = WatchProc("--pool", str(pools["files"]), "--pid", str(child.pid))
            child.stdin.write("go\n")
            child.stdin.close()
            assert child.wait(60) == 0
            w.p.wait(60)  # ends by itself: the process exited
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            rc = w.stop() if w is not None else None
    err = "".join(w.err)
    assert rc == 0 and f"stopped: process {child.pid} exited; probes detached" in err, err
    tot = {k: w.total(k) for k in ("expert_accesses", "requested_bytes", "added_pages", "device_read_bytes",
                                   "computed_miss_bytes")}
    print(f"\n{tot}")
    # every file read once, cold: 23 accesses of 1 MiB, each a first access (a computed miss), each
    # page added once and read from the device once
    assert tot == {"expert_accesses": 23, "requested_bytes": 23 * MIB, "added_pages": 23 * MIB // 4096,
                   "device_read_bytes": 23 * MIB, "computed_miss_bytes": 23 * MIB}, tot
    assert _bpf_prog_ids() <= before  # every program watch loaded is gone


CLIENT = """
import json, sys, urllib.request
port, n = int(sys.argv[1]), int(sys.argv[2])
for i in range(n):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", method="POST",
                                 data=json.dumps({"prompt": f"the a b {i}", "n_predict": 8}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        json.loads(r.read())
"""


@pytest.mark.live
def test_watch_by_pid_on_llama_server_sums_to_what_record_counts_of_the_same_requests(live, engine, tmp_path):
    """llama-server serving the tiny MoE (a model file as the pool) under a wall of half its expert
    pool: `watch --pool MODEL --pid SERVER` and `record --pool MODEL` around a client's requests
    count the same added, re-added pages and device bytes (the server is idle outside them)."""
    from moetrace.capacity.scope import Scope, remove_stale_scopes
    from moetrace.engines.pageout import drop_unmapped
    from moetrace.inputs.modelsynth import ModelSpec, synth_model

    model = tmp_path / "tiny.gguf"
    synth_model(model, ModelSpec())
    drop_pages([model], lambda ps: sum(_resident_pages(p) for p in ps))  # written here: charged to this memcg
    port, run = free_port(), tmp_path / "run"
    log = open(tmp_path / "server.log", "wb")
    with io_lock():
        remove_stale_scopes("watchllama")
        scope = Scope("watchllama").create((192 + 32) * MIB)
        srv = w = None
        try:
            srv = subprocess.Popen(engine.command("llama-server", "-m", str(model), "-lm", "mmap", "--port", str(port),
                                                  "-t", "1", "-c", "256"), env=engine.env(), stdout=log,
                                   stderr=subprocess.STDOUT, preexec_fn=scope.preexec())
            t_end = time.monotonic() + 120
            while not serving(port):
                assert srv.poll() is None and time.monotonic() < t_end, (tmp_path / "server.log").read_text()[-2000:]
                time.sleep(0.2)
            time.sleep(1)
            # Each tool counts a re-add against the deletions it saw itself: a page evicted after
            # watch attached but before record did, then read again, is a re-add to watch only.
            # The pages the server maps stay (nothing reclaims in an idle memcg); the unmapped
            # ones (its loader's readahead) DAMON may page out at any time (CI measured watch one
            # re-add ahead), so they go now, before either attaches.
            drop_unmapped(model)
            w = WatchProc("--pool", str(model), "--pid", str(srv.pid))
            r = subprocess.run([*CLI, "record", "--out", str(run), "--pool", str(model), "--probes", "pagecache,block",
                                "--", sys.executable, "-c", CLIENT, str(port), "6"], capture_output=True, text=True,
                               timeout=600)
            time.sleep(1.2)  # an interval after the requests: the ring's last bios are read
        finally:
            rc = w.stop() if w is not None else None
            if srv is not None:
                srv.terminate()
                try:
                    srv.wait(20)
                except subprocess.TimeoutExpired:
                    srv.kill()
                    srv.wait()
            log.close()
            assert scope.remove(kill=True), f"scope {scope.path} not removed"
    assert r.returncode == 0, r.stderr[-2000:]
    assert rc == 0, "".join(w.err)
    t = json.loads((run / "manifest.json").read_text())["totals"]
    got = {k: w.total(k) for k in ("added_pages", "re_added_pages", "device_read_bytes")}
    print(f"\nwatch: {len(w.intervals)} intervals, {got}; record: added {t['experts_added_pages']} re-added "
          f"{t['experts_re_added_pages']} device {t['experts_device_read_bytes']}")
    assert t["experts_added_pages"] > 10 * 192  # the wall made the requests read experts again
    assert got == {"added_pages": t["experts_added_pages"], "re_added_pages": t["experts_re_added_pages"],
                   "device_read_bytes": t["experts_device_read_bytes"]}
    assert max(f["followed_processes"] for f in w.intervals) == 1
