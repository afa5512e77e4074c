"""`moetrace check` with one cell a side (no-kernel tier): a metric regressed only beyond its
spread between identical cells of that mechanism on that machine, otherwise inconclusive (exit 3)
with the cells a side that would decide; where that spread comes from (a --thresholds file, the
per-machine file `calibrate` writes, the shipped defaults)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from common.reports import DATA

from moetrace.analyses import compare as C
from moetrace.analyses import spread as S
from moetrace.errors import InputError
from moetrace.reports.check import INCONCLUSIVE, NO_REGRESSION, REGRESSION, run_check
from moetrace.reports.machine_thresholds import (MACHINE_ENV, SYSTEM_FILE, machine_paths, machine_write_path,
                                                 read_machine_file)


@pytest.fixture(autouse=True)
def machine_file(tmp_path, monkeypatch):
    """The tests' own per-machine thresholds file (absent until a test writes it)."""
    p = tmp_path / "state" / "thresholds.toml"
    monkeypatch.setenv(MACHINE_ENV, str(p))
    return p


def _cell(rng, level: dict[str, float], n_samples: int = 300) -> dict:
    """One cell's unit metrics at ``level`` (metric -> value), its per-iteration times scattered
    by 5 % around the cell's median (within a cell: what Mann-Whitney U sees)."""
    u = {m: None for m in C.METRICS}
    u.update(level)
    u.update(host="node-a", mechanism="cgroup", refault_counting=None)
    t = level["iteration_time_ns"]
    u["samples"] = {"iteration_time_ns": t * np.exp(rng.normal(0, 0.05, n_samples))}
    return u


def _aa_cells(rng, n: int) -> list[dict]:
    """Identical cells as this host's cgroup cells at C = 64 MiB were (olmoe x 128 KiB pool): the
    between-cell cv of iteration time 0.2, device bytes 0.05, refaults 0.004."""
    return [_cell(rng, {"iteration_time_ns": 9e6 * math.exp(rng.normal(0, 0.2)),
                        "device_bytes_per_iteration": 1.03e6 * math.exp(rng.normal(0, 0.05)),
                        "refaults_per_iteration": 237 * math.exp(rng.normal(0, 0.004))}) for _ in range(n)]


def test_identical_cells_one_a_side_are_never_a_regression():
    """The user's finding (2 of 4 A/A pairs exited 1): within-cell tests see none of the noise
    between cells. With the spread between cells: 0 or inconclusive, never a regression."""
    rng = np.random.default_rng(7)
    cells = _aa_cells(rng, 24)
    old = new = 0
    verdicts: dict[str, int] = {}
    for i in range(0, 24, 2):
        for b, c in ((cells[i], cells[i + 1]), (cells[i + 1], cells[i])):
            old += bool(C.regressed(C.compute_comparison([b], [c], spread={})))  # the within-cell rule alone
            df = C.compute_comparison([b], [c])  # the shipped cgroup defaults
            new += bool(C.regressed(df))
            for v in df["verdict"]:
                verdicts[v] = verdicts.get(v, 0) + 1
    assert old >= 10  # what the user saw: about half the 24 pairs "regressed" (14 with this seed)
    assert new == 0 and verdicts.get("inconclusive", 0) > 0


def test_an_eighth_of_the_capacity_is_a_regression_naming_the_metrics():
    """C/8 against C with one cell a side, as measured on this host (64 -> 8 MiB: iteration time
    2.9x, device bytes 5.5x, refaults 4.4x): named beyond the spread."""
    rng = np.random.default_rng(3)
    base = _aa_cells(rng, 1)[0]
    cut = _cell(rng, {"iteration_time_ns": base["iteration_time_ns"] * 2.9,
                      "device_bytes_per_iteration": base["device_bytes_per_iteration"] * 5.5,
                      "refaults_per_iteration": base["refaults_per_iteration"] * 4.4})
    df = C.compute_comparison([base], [cut]).set_index("metric")
    assert {"device_bytes_per_iteration", "refaults_per_iteration", "iteration_time_ns"} <= set(
        df.index[df["verdict"] == "regression"])
    # the recorded golden cells, 128 MiB against 32 MiB (a quarter): exit 1, naming device bytes
    res = run_check(DATA / "sweep" / "cells" / "128MiB-r0", DATA / "sweep" / "cells" / "32MiB-r0")
    assert res.status == REGRESSION and "device_bytes_per_iteration" in res.regressed["128MiB -> 32MiB"]


@pytest.mark.parametrize("base,cand,verdict", [
    (10e6, 13e6, "inconclusive"),     # 30 %: past the 5 % threshold, within cgroup's 50 % spread
    (10e6, 16e6, "regression"),       # beyond it
    (10e6, 7e6, "same"),              # better, but within the spread: not an improvement either
    (10e6, 5e6, "improvement"),
    (1.0e6, 1.6e6, "same"),           # 60 %, but 0.6 MB: under the floor
    (200.0, 900e3, "same"),           # 4,500x, but 0.9 MB: under the floor (other processes' reads)
    (200.0, 2.2e6, "regression"),     # past the floor, and 11,000x
])
def test_verdict_of_one_value_a_side(base, cand, verdict):
    sp = S.default_spread("cgroup")["device_bytes_per_iteration"]
    w = cand / base
    got, n = C.verdict_of(base, cand, w, None, 0.05, 0.05, True, sp)
    assert got == verdict
    assert (n is not None) == (verdict == "inconclusive")
    # without a spread (repeats a side): the within-cell rule, as before
    assert C.verdict_of(base, cand, w, None, 0.05, 0.05, True)[0] == (
        "regression" if w > 1.05 else "improvement" if 1 / w > 1.05 else "same")


def test_repeats_to_decide_is_the_fewest_cells_a_simulated_check_names_the_move_with():
    n = S.repeats_to_decide(1.3, 0.2, threshold=0.1)
    assert n == 11
    # independently: check's own rule (medians past the threshold, compare_values' p < alpha) on
    # log-normal cells, another seed: about 80 % named with n cells a side, fewer with n - 3
    rng = np.random.default_rng(12345)

    def named(k):
        hits = 0
        for _ in range(1000):
            b = np.exp(rng.normal(0, 0.2, k))
            c = np.exp(rng.normal(math.log(1.3), 0.2, k))
            ratio, _w, p, _t = C.compare_values(b, c, True)
            hits += ratio > 1.1 and p < 0.05
        return hits / 1000

    assert 0.76 <= named(n) <= 0.86 and named(n - 3) < 0.72
    # larger moves need fewer; a tighter spread fewer; at the threshold, none would do
    assert S.repeats_to_decide(2.0, 0.2, 0.1) < S.repeats_to_decide(1.5, 0.2, 0.1) < n
    assert S.repeats_to_decide(1.3, 0.05, 0.1) < n
    assert S.repeats_to_decide(1.1, 0.2, 0.1) is None and S.repeats_to_decide(0.9, 0.2) is None
    assert S.repeats_to_decide(math.inf, 0.2) == 2 and S.repeats_to_decide(1.2, 0.0) == 2


def _copies(base, n: int, host: str | None = None, slow: dict[int, float] | None = None):
    """n copies of the golden pinned cell in base/r<i> (cell.json naming ``host``); ``slow``: i ->
    factor on its iteration times."""
    src = DATA / "pinned"
    for i in range(n):
        d = base / f"r{i}"
        d.mkdir(parents=True)
        cell = json.loads((src / "cell.json").read_text())
        shutil.copytree(src / "replay", d / "replay")
        f = (slow or {}).get(i, 1.0)
        if f != 1.0:
            it = pd.read_parquet(d / "replay" / "iterations.parquet")
            it["duration_ns"] = (it["duration_ns"] * f).astype("int64")
            it.to_parquet(d / "replay" / "iterations.parquet")
            cell["iteration_time_median_ns"] = cell["iteration_time_median_ns"] * f
        if host:
            cell["host"] = {"name": host}
        (d / "cell.json").write_text(json.dumps(cell))
    return base


def test_the_spread_table_of_a_thresholds_file(tmp_path):
    t = tmp_path / "t.toml"
    t.write_text('[spread."node-a".cgroup]\ncells = 12\niteration_time_ns = { limit = 0.3 }\n'
                 'device_bytes_per_iteration = { cv = 0.05, floor = 4096 }\n')
    th = C.load_thresholds(t)
    e = th.spread[("node-a", "cgroup")]
    assert e["meta"] == {"cells": 12}
    it, dev = e["metrics"]["iteration_time_ns"], e["metrics"]["device_bytes_per_iteration"]
    assert it.limit == 0.3 and it.cv == pytest.approx(math.log(1.3) / (S.Z * math.sqrt(2)))
    assert dev.floor == 4096 and dev.limit == pytest.approx(math.expm1(S.Z * math.sqrt(2) * 0.05))
    assert it.floor == 0.0 and f"--thresholds {t}" in it.source
    for bad, match in (('[spread."h".cgroup]\nbogus = { limit = 1 }\n', "unknown metric 'bogus' in spread.h.cgroup"),
                       ('[spread."h".cgroup]\niteration_time_ns = { limit = -1 }\n', "numbers >= 0"),
                       ('[spread."h".cgroup]\niteration_time_ns = { floor = 1 }\n', "limit or cv"),
                       ('[spread."h".cgroup]\niteration_time_ns = 0.3\n', "spread.h.cgroup.iteration_time_ns"),
                       ('spread = 3\n', "spread must be a table")):
        t.write_text(bad)
        with pytest.raises(InputError, match=match):
            C.load_thresholds(t)


def test_the_spread_comes_from_the_file_then_the_machine_then_the_defaults():
    def entry(limit, src):
        return {"metrics": {"iteration_time_ns": S.Spread(limit, 0.1, 0.0, src)}, "meta": {}}

    given = {("node-a", "cgroup"): entry(0.2, "given")}
    machine = {("node-a", "cgroup"): entry(0.4, "machine"), ("node-b", "cgroup"): entry(0.6, "machine-b"),
               (S.UNKNOWN, "cgroup"): entry(0.9, "machine-unknown")}
    assert S.resolve([("node-a", "cgroup")], given, machine)["iteration_time_ns"].source == "given"
    assert S.resolve([("node-b", "cgroup")], given, machine)["iteration_time_ns"].limit == 0.6
    # a unit naming no host reads nothing of the per-machine file; another mechanism its defaults
    assert S.resolve([(None, "cgroup")], given, machine)["iteration_time_ns"].limit == 1.5
    assert S.resolve([("node-a", "balloon")], given, machine)["device_bytes_per_iteration"].limit == 2.3
    # what the file leaves out comes from the defaults; two units: beyond both
    both = S.resolve([("node-a", "cgroup"), ("node-b", "cgroup")], given, machine)
    assert both["iteration_time_ns"].limit == 0.6 and both["device_bytes_per_iteration"].limit == 0.5
    # no mechanism (a `record` run): the largest default of any
    assert S.default_spread(None)["iteration_time_ns"].limit == 3.4


def test_measure_spread_from_groups_of_identical_cells():
    def units(host, mech, m, vals):
        return [{"host": host, "mechanism": mech, m: v} for v in vals]

    groups = {"64MiB": units("h", "cgroup", "iteration_time_ns", [1.0, 1.1, 0.9, 1.05]),
              "256MiB": units("h", "cgroup", "iteration_time_ns", [2.0, 2.2]),
              "fits": units("h", "cgroup", "device_bytes_per_iteration", [0.0, 2e6, 1e4]),
              "b": units("h", "balloon", "iteration_time_ns", [1.0, 1.0])}
    e = S.measure_spread(groups, C.METRICS, "camp")
    it = e[("h", "cgroup")]["metrics"]["iteration_time_ns"]
    x = [np.log([1.0, 1.1, 0.9, 1.05]), np.log([2.0, 2.2])]
    cv = math.sqrt(sum(((g - g.mean()) ** 2).sum() for g in x) / 4)
    assert it.cv == pytest.approx(cv)
    assert it.limit == math.ceil(100 * math.expm1(max(S.Z * math.sqrt(2) * cv, math.log(1.1 / 0.9)))) / 100
    # a group whose range is larger than its median: noise that adds; the floor is twice it
    dev = e[("h", "cgroup")]["metrics"]["device_bytes_per_iteration"]
    assert dev.floor == 4e6
    assert e[("h", "cgroup")]["meta"] == {"cells": 9, "groups": 3, "source": "camp"}
    assert e[("h", "balloon")]["metrics"]["iteration_time_ns"].cv == 0.0


def test_calibrate_writes_the_machine_file_and_check_reads_it(tmp_path, machine_file):
    """Identical cells that name their host: calibrate measures their spread (iteration time within
    a few %) into the per-machine file; a one-cell check of a cell 30 % slower is then a regression
    (inconclusive on the shipped defaults, 150 %)."""
    aa = _copies(tmp_path / "aa", 4, host="node-a", slow={1: 1.03, 2: 0.98, 3: 1.01})
    slow = _copies(tmp_path / "slow", 1, host="node-a", slow={0: 1.3})
    assert run_check(aa / "r0", slow / "r0").status == INCONCLUSIVE  # no file yet: the defaults
    r = subprocess.run([sys.executable, "-m", "moetrace.cli", "calibrate", str(aa)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"written to the per-machine file {machine_file}: node-a/cgroup" in r.stdout
    e = read_machine_file(machine_file, C.METRICS)[("node-a", "cgroup")]
    assert e["meta"]["cells"] == 4 and e["metrics"]["iteration_time_ns"].limit < 0.3
    res = run_check(aa / "r0", slow / "r0")
    assert res.status == REGRESSION and res.regressed == {"128MiB": ["iteration_time_ns"]}
    assert any(f"this machine's file {machine_file}" in n for n in res.notes)
    # a second calibration of another host keeps this one's entry
    other = _copies(tmp_path / "other", 2, host="node-b")
    subprocess.run([sys.executable, "-m", "moetrace.cli", "calibrate", str(other)], capture_output=True, check=True)
    assert set(read_machine_file(machine_file, C.METRICS)) == {("node-a", "cgroup"), ("node-b", "cgroup")}
    # cells that name no host: nothing written (the file keys by host), and said
    r = subprocess.run([sys.executable, "-m", "moetrace.cli", "calibrate", str(_copies(tmp_path / "anon", 2)),
                        "--json"], capture_output=True, text=True)
    assert json.loads(r.stdout)["machine_file"]["why"] == "no cell names its host (cell.json host)"
    # --write-thresholds carries the spread too (and of hostless cells)
    t = tmp_path / "t.toml"
    subprocess.run([sys.executable, "-m", "moetrace.cli", "calibrate", str(tmp_path / "anon"), "--write-thresholds",
                    str(t), "--no-machine-file"], capture_output=True, check=True)
    assert (S.UNKNOWN, "cgroup") in C.load_thresholds(t).spread


def test_check_cli_inconclusive_exit_3_and_a_broken_machine_file(tmp_path, machine_file):
    aa = _copies(tmp_path / "aa", 2, slow={1: 1.3})
    cli = [sys.executable, "-m", "moetrace.cli", "check", str(aa / "r0"), str(aa / "r1")]
    r = subprocess.run(cli, capture_output=True, text=True)
    assert r.returncode == INCONCLUSIVE, r.stderr
    assert "inconclusive: 128MiB: iteration_time_ns (~" in r.stdout and "the cells a side that would decide" in r.stdout
    assert "repeats_to_decide" in r.stdout and "spread_limit" in r.stdout
    assert "from check's defaults (cgroup)" in r.stdout
    doc = json.loads(subprocess.run(cli + ["--json"], capture_output=True, text=True).stdout)
    assert doc["status"] == 3 and list(doc["inconclusive"]["128MiB"]) == ["iteration_time_ns"]
    row = next(g for g in doc["groups"]["128MiB"] if g["metric"] == "iteration_time_ns")
    assert row["verdict"] == "inconclusive" and row["repeats_to_decide"] == doc["repeats_to_decide"] >= 2
    # the same cell against itself: 0
    assert subprocess.run(cli[:-1] + [str(aa / "r0")], capture_output=True).returncode == NO_REGRESSION
    # a broken per-machine file: could not compare (2), naming it and the fix, no traceback
    aa2 = _copies(tmp_path / "h", 2, host="node-a", slow={1: 1.3})
    machine_file.parent.mkdir(parents=True)
    machine_file.write_text("[spread\n")
    r = subprocess.run(cli[:-2] + [str(aa2 / "r0"), str(aa2 / "r1")], capture_output=True, text=True)
    assert r.returncode == 2 and f"{machine_file}: cannot read the per-machine thresholds file" in r.stdout
    assert MACHINE_ENV in r.stdout and "Traceback" not in r.stderr
    # --help lists the exit statuses
    h = subprocess.run([sys.executable, "-m", "moetrace.cli", "check", "--help"], capture_output=True, text=True)
    assert "3 inconclusive" in h.stdout and "/var/lib/moetrace/thresholds.toml" in h.stdout


def test_where_the_machine_file_lives(monkeypatch, tmp_path):
    monkeypatch.delenv(MACHINE_ENV)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert SYSTEM_FILE == Path("/var/lib/moetrace/thresholds.toml")
    assert machine_paths() == [tmp_path / "xdg" / "moetrace" / "thresholds.toml", SYSTEM_FILE]
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert machine_write_path() == tmp_path / "xdg" / "moetrace" / "thresholds.toml"
    monkeypatch.setattr("os.geteuid", lambda: 0)
    assert machine_write_path() == SYSTEM_FILE
    monkeypatch.setenv(MACHINE_ENV, "")
    assert machine_paths() == [] and machine_write_path() is None


def test_amplification_carries_the_device_noise_and_its_floor():
    """Two identical cells measured here at 64 MiB: device bytes 1.73 against 0.98 MB per iteration
    (another process's reads), so amplification 0.75 against 0.42 over the same miss demand. Device
    bytes moved less than their floor; amplification by as much over the miss demand: the same,
    both ways round. A cut (5.5x the device bytes) is still named on both."""
    def unit(dev):
        return {"device_bytes_per_iteration": dev, "amplification": dev / 2.33e6, "miss_bytes_per_iteration": 2.33e6,
                "mechanism": "cgroup"}

    for b, c in ((1.73e6, 0.98e6), (0.98e6, 1.73e6)):
        df = C.compute_comparison([unit(b)], [unit(c)]).set_index("metric")
        assert (df.loc[["device_bytes_per_iteration", "amplification"], "verdict"] == "same").all()
    df = C.compute_comparison([unit(1.0e6)], [unit(5.5e6)]).set_index("metric")
    assert (df.loc[["device_bytes_per_iteration", "amplification"], "verdict"] == "regression").all()
    # the floor itself: device bytes' over the miss demand, never below amplification's own
    sp = S.default_spread("cgroup")
    assert C.amplification_floor(sp["amplification"], sp, "amplification", [unit(1e6)]).floor == \
        pytest.approx((1 << 20) / 2.33e6)
    assert C.amplification_floor(sp["amplification"], sp, "amplification",
                                 [{"miss_bytes_per_iteration": 1e9}]).floor == 0.05


def test_cells_that_name_no_host_never_read_the_machine_file(tmp_path, machine_file):
    machine_file.parent.mkdir(parents=True)
    machine_file.write_text("[spread\n")  # broken: read, it would be exit 2
    aa = _copies(tmp_path / "aa", 2, slow={1: 1.3})
    assert run_check(aa / "r0", aa / "r1").status == INCONCLUSIVE
