"""moetrace watch without a kernel: scope readings of fake trees, interval figures, alarms,
thresholds, the views and the CLI's refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from moetrace.analyses.compare import WATCH_THRESHOLDS, load_thresholds
from moetrace.errors import InputError
from moetrace.live.alarms import judge, raised
from moetrace.live.host import cgroup_pids, cgroup_version, read_scope
from moetrace.live.interval import OUTSIDE_EVICTORS, Reading, figures
from moetrace.live.view import json_line, plain_lines
from moetrace.run.evictors import EVICTORS

DEFAULTS = {k: v[0] for k, v in WATCH_THRESHOLDS.items()}


def _host_tree(root, scan=1000, steal=400, refault=50, some=2_000_000, full=1_000_000):
    (root / "proc" / "pressure").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "vmstat").write_text(f"pgscan_kswapd 7\npgscan_file {scan}\npgsteal_file {steal}\n"
                                          f"workingset_refault_file {refault}\n")
    (root / "proc" / "meminfo").write_text("MemTotal:       4194304 kB\nMlocked:        1048576 kB\n"
                                           "Cached:          100 kB\n")
    (root / "proc" / "pressure" / "memory").write_text(
        f"some avg10=1.50 avg60=0.00 avg300=0.00 total={some}\nfull avg10=0.50 avg60=0.00 avg300=0.00 total={full}\n")


def test_host_scope_reads_file_lru_scan_steal_refaults_psi_and_mlocked(tmp_path):
    _host_tree(tmp_path)
    s = read_scope(None, root=tmp_path)
    assert s["scope"] == "host" and s["reclaim_scope"] == "host"
    assert (s["scanned_pages"], s["stolen_pages"], s["refault_file_pages"]) == (1000, 400, 50)
    assert s["locked_bytes"] == 1 << 30 and s["memory_bytes"] == 4 << 30
    assert (s["some_us"], s["full_us"], s["full_avg10"]) == (2_000_000, 1_000_000, 0.5)


def _cgroup(tmp_path, name: str, **files: str):
    """A fake host tree and a cgroup directory in it with these files ("memory_stat": memory.stat)."""
    _host_tree(tmp_path)
    cg = tmp_path / name
    cg.mkdir()
    for f, text in files.items():
        (cg / f.replace("_", ".", 1)).write_text(text)
    return cg


def test_v2_cgroup_scope_is_the_cgroups_own(tmp_path):
    cg = _cgroup(tmp_path, "cg", memory_stat="file 4096\npgscan 90\npgsteal 30\nworkingset_refault_file 12\n"
                                             "unevictable 8192\n", memory_max="1073741824\n",
                 memory_pressure="some avg10=9.00 avg60=0 avg300=0 total=77\nfull avg10=3.00 avg60=0 avg300=0 "
                                 "total=55\n", cgroup_procs="10\n11\n")
    assert cgroup_version(cg) == 2 and cgroup_pids(cg) == [10, 11]
    s = read_scope(cg, root=tmp_path)
    assert s["reclaim_scope"] == s["psi_scope"] == str(cg)
    assert (s["scanned_pages"], s["stolen_pages"], s["refault_file_pages"]) == (90, 30, 12)
    assert (s["locked_bytes"], s["memory_bytes"], s["some_us"], s["full_us"]) == (8192, 1 << 30, 77, 55)


def test_v1_cgroup_scope_keeps_the_hosts_reclaim_and_psi(tmp_path):
    cg = _cgroup(tmp_path, "v1", memory_stat="cache 1\ntotal_workingset_refault_file 5\ntotal_unevictable 4096\n",
                 memory_limit_in_bytes="9223372036854771712\n")
    assert cgroup_version(cg) == 1 and cgroup_version(tmp_path / "nope") is None
    s = read_scope(cg, root=tmp_path)
    assert s["reclaim_scope"] == "host" and s["psi_scope"] == "host" and s["scope"] == str(cg)
    assert (s["scanned_pages"], s["refault_file_pages"], s["locked_bytes"]) == (1000, 5, 4096)
    assert s["memory_bytes"] == 4 << 30  # an unlimited v1 limit is the host's memory
    assert cgroup_pids(tmp_path / "gone") == []


def _reading(t_s, added, re_added, evicted, by, dev, read_bytes=0, scope=None):
    n = len(added)
    pc = {"added_pages": np.array(added + [3]), "re_added_pages": np.array(re_added + [0]),
          "evicted_pages": np.array(evicted + [0]), "evicted_by": np.array(by + [[0] * len(EVICTORS)]),
          "read_bytes": read_bytes, "read_calls": read_bytes // 4096}
    blk = {"device_read_bytes": np.array(dev), "unattributed_bytes": 0, "lost_events": 0}
    assert len(dev) == n
    return Reading(t_ns=int(t_s * 1e9), pagecache=pc, block=blk, scope=scope or {
        "reclaim_scope": "host", "psi_scope": "host", "scanned_pages": 0, "stolen_pages": 0,
        "refault_file_pages": 0, "some_us": 0, "full_us": 0, "locked_bytes": 1, "memory_bytes": 4})


def _by(**kw):
    return [kw.get(e, 0) for e in EVICTORS]


def test_figures_are_the_difference_of_two_readings_with_the_top_experts_ordered():
    z = _by()
    a = _reading(1.0, [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [z, z, z, z], [0, 0, 0, 0])
    scope = {"reclaim_scope": "host", "psi_scope": "host", "scanned_pages": 300, "stolen_pages": 100,
             "refault_file_pages": 9, "some_us": 500_000, "full_us": 250_000, "locked_bytes": 3, "memory_bytes": 4}
    b = _reading(3.0, [10, 0, 5, 5], [2, 0, 0, 4], [8, 0, 1, 0],
                 [_by(kswapd=6, fadvise=2), z, _by(damon=1), z], [40960, 0, 20480, 24576],
                 read_bytes=8192, scope=scope)
    a.scope = dict(scope, scanned_pages=0, stolen_pages=0, refault_file_pages=0, some_us=0, full_us=0)
    f = figures(a, b, n_experts=4, n_per_layer=2, top=10)
    p = f["pool"]
    assert f["interval_s"] == 2.0
    assert (p["added_pages"], p["re_added_pages"], p["evicted_pages"]) == (20, 6, 9)
    assert p["unattributed_added_pages"] == 0  # 3 in both readings
    assert p["evicted_by"]["kswapd"] == 6 and p["evicted_by"]["fadvise"] == 2 and p["evicted_by"]["damon"] == 1
    assert p["device_read_bytes"] == 40960 + 20480 + 24576 and p["device_read_bytes_per_s"] == p["device_read_bytes"] / 2
    assert p["requested_bytes"] == 8192
    assert f["reclaim"]["scan_to_steal"] == 3.0 and f["reclaim"]["refault_file_pages"] == 9
    assert f["psi"]["some_pct"] == 25.0 and f["psi"]["full_pct"] == 12.5
    assert f["locked_fraction"] == 0.75
    # re-added first, then added, then device bytes; idle experts are left out
    assert [(e["layer"], e["expert"]) for e in f["experts"]] == [(1, 1), (0, 0), (1, 0)]
    assert f["experts"][1]["outside_evicted_pages"] == 2 and f["experts"][2]["outside_evicted_pages"] == 1
    assert figures(a, b, 4, 2, top=1)["experts"] == f["experts"][:1]
    json.loads(json_line(f))


def test_alarms_name_the_evidence():
    z = _by()
    a = _reading(0, [0, 0], [0, 0], [0, 0], [z, z], [0, 0])
    b = _reading(1, [300, 10], [290, 0], [5, 7], [_by(fadvise=5), _by(memcg=7)], [0, 0],
                 scope=dict(a.scope, full_us=200_000))
    f = figures(a, b, 2, 2)
    al = judge(f, DEFAULTS)
    assert al["outside_evictor"]["on"] == 1 and "fadvise 5" in al["outside_evictor"]["evidence"]
    assert "L0E0:5" in al["outside_evictor"]["evidence"]
    assert al["rereads"]["on"] == 1 and "L0E0:290" in al["rereads"]["evidence"]
    assert al["psi_full"]["on"] == 1 and "20.0 %" in al["psi_full"]["evidence"]
    assert al["amplification"]["on"] is None
    f["alarms"] = al
    lines = plain_lines(f, rows=1)
    assert len([x for x in lines if x.startswith("ALARM ")]) == 3 and lines[1].startswith("  L0")
    # below every threshold: quiet
    c = _reading(2, [301, 10], [291, 0], [5, 14], [_by(fadvise=5), _by(memcg=14)], [0, 0], scope=b.scope)
    quiet = judge(figures(b, c, 2, 2), DEFAULTS)
    assert [k for k, v in quiet.items() if v["on"]] == [] and raised(quiet) == []
    assert set(OUTSIDE_EVICTORS) == set(EVICTORS) - {"kswapd", "direct", "memcg"}


def test_amplification_needs_the_scan_to_steal_signature_too():
    fig = {"pool": {"amplification": 2.0, "device_read_bytes": 2, "computed_miss_bytes": 1},
           "reclaim": {"scan_to_steal": 1.5}, "psi": {}, "experts": []}
    assert judge(fig, DEFAULTS)["amplification"]["on"] == 0
    fig["reclaim"]["scan_to_steal"] = 2.5
    assert judge(fig, DEFAULTS)["amplification"]["on"] == 1


def test_watch_thresholds_live_in_checks_toml(tmp_path):
    p = tmp_path / "th.toml"
    p.write_text("[metrics.iteration_time_ns]\nthreshold = 0.2\n[watch]\nscan_to_steal = 3\npsi_full_pct = 5.5\n")
    th = load_thresholds(p)
    assert th.per_metric["iteration_time_ns"] == 0.2
    assert th.watch == dict(DEFAULTS, scan_to_steal=3.0, psi_full_pct=5.5)
    assert load_thresholds(None).watch == DEFAULTS
    for bad, msg in (("[watch]\nnope = 1\n", "unknown watch threshold 'nope'"),
                     ("[watch]\nrereads_pages = -1\n", "watch.rereads_pages must be a number"),
                     ("watch = 3\n", "watch must be a table")):
        p.write_text(bad)
        with pytest.raises(InputError, match=msg):
            load_thresholds(p)


@pytest.mark.parametrize("args, msg", [
    (["--pid", "1", "--cgroup", "/sys/fs/cgroup"], "--pid and --cgroup"),
    (["--cgroup", "/nonexistent-cgroup"], "not a memory cgroup directory"),
    (["--pid", "999999999"], "no such process"),
])
def test_watch_refuses_a_bad_scope_with_the_fix(args, msg):
    from moetrace.cli import cli

    r = CliRunner().invoke(cli, ["watch", *args, "1", "1"])
    assert r.exit_code != 0 and msg in r.output, r.output
    assert "Traceback" not in r.output


def test_metrics_are_node_exporter_style_and_bounded_per_expert(tmp_path):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from moetrace.live.exposition import TEXTFILE_NAME, Exposition

    z = _by()
    n = 30
    a = _reading(0, [0] * n, [0] * n, [0] * n, [z] * n, [0] * n)
    b = _reading(1, list(range(n)), list(range(n)), [1] * n, [_by(kswapd=1)] * n, [4096] * n,
                 scope=dict(a.scope, scanned_pages=50, stolen_pages=10, some_us=3_000_000))
    fig = figures(a, b, n, 10)
    fig["alarms"] = judge(fig, DEFAULTS)
    ex = Exposition(n, 10, top=5)
    ex.update(b, fig)
    ex.serve("127.0.0.1:0")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{ex.port}/metrics", timeout=10).read().decode()
    finally:
        ex.close()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    val = {f.name: f.samples[0].value for f in fams.values() if len(f.samples) == 1}
    assert val["moetrace_pool_readded_pages"] == sum(range(n)) and val["moetrace_pool_added_pages"] == sum(range(n))
    assert val["moetrace_pool_device_read_bytes"] == 4096 * n
    assert val["moetrace_psi_memory_some_stalled_seconds"] == 3.0
    ev = {s.labels["evictor"]: s.value for s in fams["moetrace_pool_evicted_pages"].samples if s.name.endswith("_total")}
    assert ev["kswapd"] == n and set(ev) == set(EVICTORS)
    top = [s for s in fams["moetrace_expert_readded_pages"].samples if s.name.endswith("_total")]
    assert len(top) == 5 and {(s.labels["layer"], s.labels["expert"]) for s in top} == {
        ("2", "9"), ("2", "8"), ("2", "7"), ("2", "6"), ("2", "5")}
    alarms = {s.labels["name"]: s.value for s in fams["moetrace_alarm"].samples}
    assert alarms == {"rereads": 1.0, "outside_evictor": 0.0, "psi_full": 0.0}  # amplification: not judged
    assert fams["moetrace_reclaim_scan_to_steal_ratio"].samples[0].value == 5.0
    # the textfile: written whole, removed at close
    ex2 = Exposition(n, 10)
    ex2.update(b, fig)
    path = ex2.write_textfile(str(tmp_path))
    assert path.name == TEXTFILE_NAME and "moetrace_pool_readded_pages_total 435.0" in path.read_text()
    ex2.close()
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_the_grafana_dashboard_queries_only_metrics_watch_exports():
    import re
    from pathlib import Path

    from prometheus_client import generate_latest

    from moetrace.live.exposition import Exposition

    z = _by()
    a = _reading(0, [0, 0], [0, 0], [0, 0], [z, z], [0, 0])
    b = _reading(1, [1, 1], [1, 1], [0, 0], [z, z], [8192, 0], scope=dict(a.scope, scanned_pages=2, stolen_pages=1))
    a.extra = {"accesses": 0, "miss_bytes": 0, "lost_calls": 0, "requested_bytes": 0}
    b.extra = {"accesses": 2, "miss_bytes": 4096, "lost_calls": 0, "requested_bytes": 8192, "hit_only_p50_ns": 5.0, "hit_only_p99_ns": 9.0}
    fig = figures(a, b, 2, 2)
    fig["alarms"] = judge(fig, DEFAULTS)
    ex = Exposition(2, 2)
    ex.update(b, fig)
    exported = set(re.findall(r"^(moetrace_\w+)", generate_latest(ex.registry).decode(), re.M))
    dash = json.loads((Path(__file__).parents[2] / "examples" / "grafana-moetrace-watch.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append(dash["templating"]["list"][0]["query"])
    used = {m for e in exprs for m in re.findall(r"moetrace_\w+", e)}
    assert used and used <= exported, used - exported


def test_live_stack_fed_in_pieces_equals_the_one_pass_distances():
    from moetrace.analyses.stackdist import LiveStack, lru_misses, stack_distances
    from moetrace.inputs.trace import Accesses

    rng = np.random.default_rng(7)
    x = rng.integers(0, 40, 3000).astype(np.int32)
    ls = LiveStack(40)
    d = np.concatenate([ls.feed(c) for c in np.array_split(x, 23)])
    acc = Accesses(np.zeros(len(x), np.int64), np.zeros(len(x), np.int32), np.zeros(len(x), np.int32), x, 1, 40, 1)
    assert (d == stack_distances(acc, "global")).all()
    # an LRU of 3 items over a cycle of 4 misses every access; of 4, only the first round
    cyc = np.tile(np.arange(4, dtype=np.int32), 5)
    dc = LiveStack(4).feed(cyc)
    assert lru_misses(dc, 3).all() and lru_misses(dc, 4).sum() == 4
    with pytest.raises(Exception, match="stack items"):
        LiveStack(4).feed(np.array([4]))


def test_computed_misses_and_amplification_per_interval():
    z = _by()
    a = _reading(0, [0, 0], [0, 0], [0, 0], [z, z], [0, 0])
    a.extra = {"accesses": 10, "miss_bytes": 1 << 20, "lost_calls": 0, "capacity_experts": 1, "requested_bytes": 0}
    b = _reading(1, [512, 0], [256, 0], [256, 0], [_by(memcg=256), z], [3 << 20, 0],
                 scope=dict(a.scope, scanned_pages=30, stolen_pages=10))
    b.extra = {"accesses": 14, "miss_bytes": 3 << 20, "lost_calls": 1, "capacity_experts": 1, "requested_bytes": 4 << 20,
               "hit_only_p50_ns": 1000.0, "hit_only_p99_ns": 9000.0}
    p = figures(a, b, 2, 2)["pool"]
    assert (p["expert_accesses"], p["computed_miss_bytes"], p["lost_accesses"]) == (4, 2 << 20, 1)
    assert p["amplification"] == 1.5 and p["hit_only_p99_ns"] == 9000.0 and p["lru_capacity_experts"] == 1
    assert p["requested_bytes"] == 4 << 20  # the reads stream's, not pagecache's (which does not track reads then)
    f = figures(a, b, 2, 2)
    al = judge(f, DEFAULTS)["amplification"]
    assert al["on"] == 0  # 1.5 is not above 1.5
    assert judge(f, dict(DEFAULTS, amplification=1.2))["amplification"]["on"] == 1  # scan/steal 3 > 2
    b.extra["miss_bytes"] = 1 << 20  # no computed misses in the interval: nothing to judge
    assert figures(a, b, 2, 2)["pool"]["amplification"] is None


def test_the_terminal_table_renders_the_pool_the_experts_and_the_alarms():
    from rich.console import Console

    from moetrace.live.view import table

    z = _by()
    a = _reading(0, [0, 0, 0], [0, 0, 0], [0, 0, 0], [z, z, z], [0, 0, 0])
    b = _reading(1, [300, 20, 1], [290, 0, 0], [5, 0, 0], [_by(damon=5), z, z], [1 << 20, 0, 0])
    f = figures(a, b, 3, 3)
    f["alarms"] = judge(f, DEFAULTS)
    con = Console(record=True, width=240, force_terminal=False)
    con.print(table(f, rows=2))
    text = con.export_text()
    assert "device 1.0 MB" in text and "re-added 290" in text and "(damon 5)" in text
    assert "ALARM rereads: 290 pages re-added" in text and "ALARM outside_evictor" in text
    rows = [ln for ln in text.splitlines() if ln.strip().startswith("0 ")]
    assert len(rows) == 2  # -r 2: the top two experts of three
