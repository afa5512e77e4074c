"""`moetrace check` (no-kernel tier): verdicts on the recorded golden cells, golden comparison
tables, the statistics against scipy called directly, thresholds, exit statuses. (One cell a
side against the spread between identical cells: test_check_spread.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from common.reports import DATA, MG

from moetrace.analyses import compare as C
from moetrace.errors import InputError
from moetrace.reports.check import CANNOT_COMPARE, INCONCLUSIVE, NO_REGRESSION, REGRESSION, run_check
from moetrace.reports.machine_thresholds import MACHINE_ENV


@pytest.fixture(autouse=True)
def _own_machine_file(tmp_path, monkeypatch):
    """This machine's per-machine thresholds file is not the tests' (nor written by them)."""
    monkeypatch.setenv(MACHINE_ENV, str(tmp_path / "machine-thresholds.toml"))


#: a spread between identical cells as `moetrace calibrate` would write it for the golden cells'
#: machine (they name no host): tight, so one cell a side names what moved beyond it
CALIBRATED = '[spread."unknown".cgroup]\n' + "".join(f"{m} = {{ limit = 0.08, cv = 0.02 }}\n" for m in C.METRICS)


@pytest.mark.parametrize("name", [c[0] for c in MG.CHECKS])
def test_comparison_tables_equal_the_golden_files(name):
    tables = MG.check_tables(name)
    assert len(tables) == 1
    (g, df), = tables.items()
    want = (DATA / "expected" / "check" / f"{name}.csv").read_text()
    assert f"# group: {g}\n" + MG.golden_csv(df) == want, f"{name}: the comparison changed (if intended: " \
        "python tests/data/reports/make_golden.py golden)"


def test_the_same_cell_is_no_regression():
    res = run_check(DATA / "sweep" / "cells" / "48MiB-r0", DATA / "sweep" / "cells" / "48MiB-r0")
    assert res.status == NO_REGRESSION and res.verdict() == "no regression"
    df = res.tables["48MiB"]
    assert (df["verdict"].iloc[:-1] == "same").all() and df["worse_ratio"].iloc[-1] == 1.0


def test_a_smaller_capacity_regresses_and_names_the_metrics(tmp_path):
    # one cell a side, check's shipped spread for cgroup cells (device bytes 50 %, iteration time
    # 150 %: measured between identical cells on a noisy host): a 2/3 capacity moved everything
    # by ~38 %, within it: inconclusive, with the repeats that would decide
    cells = DATA / "sweep" / "cells"
    res = run_check(cells / "48MiB-r0", cells / "32MiB-r0")
    assert res.status == INCONCLUSIVE and res.regressed["48MiB -> 32MiB"] == []
    assert {"iteration_time_ns", "device_bytes_per_iteration", "rereads_per_iteration"} <= set(
        res.inconclusive["48MiB -> 32MiB"])
    assert res.inconclusive["48MiB -> 32MiB"]["device_bytes_per_iteration"] == 3
    # with this machine's spread calibrated (tight): named
    t = tmp_path / "t.toml"
    t.write_text(CALIBRATED)
    res = run_check(cells / "48MiB-r0", cells / "32MiB-r0", C.load_thresholds(t))
    assert res.status == REGRESSION
    reg = res.regressed["48MiB -> 32MiB"]
    assert {"iteration_time_ns", "device_bytes_per_iteration", "rereads_per_iteration"} <= set(reg)
    assert "device_bytes_per_iteration" in res.verdict()
    # the figures are the cells' own
    df = res.tables["48MiB -> 32MiB"].set_index("metric")
    import json as _j

    b = _j.loads((DATA / "sweep" / "cells" / "48MiB-r0" / "cell.json").read_text())
    c = _j.loads((DATA / "sweep" / "cells" / "32MiB-r0" / "cell.json").read_text())
    assert df.loc["device_bytes_per_iteration", "ratio"] == pytest.approx(
        c["device_bytes_per_iteration"] / b["device_bytes_per_iteration"])
    # the other way round, what regressed improves (and the larger cell's higher amplification,
    # 0.75 -> 0.83, is the one regression)
    back = run_check(DATA / "sweep" / "cells" / "32MiB-r0", DATA / "sweep" / "cells" / "48MiB-r0",
                     C.load_thresholds(t))
    bd = back.tables["32MiB -> 48MiB"].set_index("metric")["verdict"]
    assert (bd[["iteration_time_ns", "device_bytes_per_iteration", "rereads_per_iteration"]] == "improvement").all()
    assert back.regressed["32MiB -> 48MiB"] == ["amplification"]


def test_different_plans_cannot_be_compared(tmp_path):
    other = tmp_path / "cell"
    shutil.copytree(DATA / "sweep" / "cells" / "48MiB-r0", other)
    m = json.loads((other / "run" / "manifest.json").read_text())
    m["plan"]["identity"] = "crc32:00000000:00000000:1"
    (other / "run" / "manifest.json").write_text(json.dumps(m))
    res = run_check(DATA / "sweep" / "cells" / "48MiB-r0", other)
    assert res.status == CANNOT_COMPARE and "different plans" in res.reason
    (tmp_path / "empty").mkdir()
    res = run_check(DATA / "sweep" / "cells" / "48MiB-r0", tmp_path / "empty")
    assert res.status == CANNOT_COMPARE and "not a run, cell or sweep" in res.reason


def test_sweeps_match_capacities():
    res = run_check(DATA / "sweep", DATA / "sweep")
    assert res.status == NO_REGRESSION and sorted(res.tables) == ["128MiB", "32MiB", "48MiB"]


def test_repeats_use_welch_and_a_bootstrap_interval():
    from scipy import stats

    base = [{"iteration_time_ns": v} for v in (10.0, 11.0, 9.0, 10.5)]
    worse = [{"iteration_time_ns": v} for v in (15.0, 16.0, 14.0, 15.5)]
    df = C.compute_comparison(base, worse).set_index("metric")
    r = df.loc["iteration_time_ns"]
    # on the logs (a move is a ratio)
    assert r["p_value"] == pytest.approx(stats.ttest_ind(np.log([15, 16, 14, 15.5]), np.log([10, 11, 9, 10.5]),
                                                         equal_var=False).pvalue)
    assert r["test"] == "cells: Welch t on logs (4 / 4)"
    assert r["verdict"] == "regression" and r["ratio_ci_low"] < 1.5 < r["ratio_ci_high"]
    assert r["base_spread"] == pytest.approx(2.0 / 10.25)
    # a 17 % shift inside the noise: above the threshold, but the t-test does not agree
    noisy = [{"iteration_time_ns": v} for v in (8.0, 16.0, 9.0, 15.0)]
    r = C.compute_comparison(base, noisy).set_index("metric").loc["iteration_time_ns"]
    assert r["worse_ratio"] > 1.1 and r["p_value"] > 0.05 and r["verdict"] == "same"
    # higher is better for age at eviction: pages evicted younger is the regression (one value a
    # side, no spread between cells: the within-cell rule alone)
    r = C.compute_comparison([{"age_at_eviction_p50_ns": 100.0}], [{"age_at_eviction_p50_ns": 50.0}],
                             spread={}).set_index("metric").loc["age_at_eviction_p50_ns"]
    assert r["ratio"] == 0.5 and r["worse_ratio"] == 2.0 and r["verdict"] == "regression"


def test_a_large_noisy_move_is_named_at_three_a_side_and_zeros_are_tested_raw():
    # measured in CI: an engine loader's amplification, 3 cells at ~0.8 against 3 at 40-112; on
    # the raw values one noisy side leaves Welch ~2 degrees of freedom (p = 0.0505): not named
    base = [{"amplification": v} for v in (0.81, 0.75, 0.89)]
    cand = [{"amplification": v} for v in (40.0, 80.0, 112.0)]
    r = C.compute_comparison(base, cand).set_index("metric").loc["amplification"]
    assert r["test"] == "cells: Welch t on logs (3 / 3)" and r["p_value"] < 0.01 and r["verdict"] == "regression"
    # a zero has no log: the values themselves
    r = C.compute_comparison([{"refaults_per_iteration": v} for v in (0.0, 1.0)],
                             [{"refaults_per_iteration": v} for v in (50.0, 60.0)]).set_index("metric")
    assert r.loc["refaults_per_iteration", "test"] == "cells: Welch t (2 / 2)"


def test_thresholds_file(tmp_path):
    t = tmp_path / "t.toml"
    t.write_text("alpha = 0.01\n[metrics.iteration_time_ns]\nthreshold = 0.5\n")
    th = C.load_thresholds(t)
    assert th.alpha == 0.01 and th.per_metric["iteration_time_ns"] == 0.5
    assert th.per_metric["amplification"] == C.METRICS["amplification"][2]
    res = run_check(DATA / "sweep" / "cells" / "48MiB-r0", DATA / "sweep" / "cells" / "32MiB-r0", th)
    assert "iteration_time_ns" not in res.regressed["48MiB -> 32MiB"]
    t.write_text("alpha = 0.01\n[metrics.iteration_time_ns\nthreshold = 0.5\n")
    with pytest.raises(InputError, match="line 2"):
        C.load_thresholds(t)
    t.write_text("[metrics.bogus]\nthreshold = 1\n")
    with pytest.raises(InputError, match="unknown metric 'bogus'"):
        C.load_thresholds(t)


def test_check_cli_exit_statuses_json_and_html(tmp_path):
    def mt(*a):
        return subprocess.run([sys.executable, "-m", "moetrace.cli", "check", *map(str, a)], capture_output=True,
                              text=True)

    cells = DATA / "sweep" / "cells"
    r = mt(cells / "48MiB-r0", cells / "48MiB-r0")
    assert r.returncode == 0 and r.stdout.strip().endswith("no regression")
    r = mt(cells / "128MiB-r0", cells / "32MiB-r0", "--json", "--html", tmp_path / "h")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["status"] == 1 and "device_bytes_per_iteration" in doc["regressed"]["128MiB -> 32MiB"]
    assert (tmp_path / "h" / "report.html").is_file() and "regression:" in (tmp_path / "h" / "report.html").read_text()
    r = mt(cells / "48MiB-r0", tmp_path)
    assert r.returncode == 2 and "could not compare" in r.stdout and "Traceback" not in r.stderr
    pd.read_parquet(next((tmp_path / "h" / "tables").glob("check_*.parquet")))
    assert np.isfinite(doc["groups"]["128MiB -> 32MiB"][-1]["worse_ratio"])
    # a move within the spread between identical cells, one cell a side: inconclusive, exit 3
    r = mt(cells / "48MiB-r0", cells / "32MiB-r0", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == INCONCLUSIVE == doc["status"] and doc["regressed"] == {"48MiB -> 32MiB": []}
    assert doc["inconclusive"]["48MiB -> 32MiB"]["device_bytes_per_iteration"] == 3
    # hit-only ns/KiB moved 13 %, just past its 10 % threshold: no number of cells decides that
    assert doc["inconclusive"]["48MiB -> 32MiB"]["hit_only_ns_per_kib"] is None and doc["repeats_to_decide"] is None
    assert "hit_only_ns_per_kib (> 100 cells a side)" in doc["verdict"]
    assert doc["verdict"].startswith("inconclusive: 48MiB -> 32MiB: iteration_time_ns (~")


def test_unrecorded_cells_compare_on_their_cell_json(tmp_path):
    """Cells run without --record (the cheap way, as in the kernel lab's 6.1 vs 6.12 check) are
    units too: iteration time, device bytes, amplification and refaults come from cell.json; a
    directory of them is a set of repeats."""
    src = DATA / "pinned"
    for side in ("a", "b"):
        for i in (1, 2):
            d = tmp_path / side / f"r{i}"
            d.mkdir(parents=True)
            shutil.copy(src / "cell.json", d / "cell.json")
            shutil.copytree(src / "replay", d / "replay")
    res = run_check(tmp_path / "a", tmp_path / "b")
    assert res.status == NO_REGRESSION, res.reason
    df = next(iter(res.tables.values()))
    assert {"iteration_time_ns", "device_bytes_per_iteration"} <= set(df["metric"])
    assert df.loc[df["metric"] == "iteration_time_ns", "base_n"].tolist() == [2]
    # a unit with no probe tables has no probe metrics, and says nothing it did not measure
    assert "scan_to_steal" not in set(df["metric"]) and "hit_only_ns_per_kib" not in set(df["metric"])


def _cells(tmp_path, side: str, release: str, mglru_on: bool, refaults: list[int]) -> None:
    src = DATA / "pinned"
    for i, n in enumerate(refaults):
        d = tmp_path / side / f"r{i}"
        d.mkdir(parents=True)
        cell = json.loads((src / "cell.json").read_text())
        cell["kernel"] = {"release": release, "mglru": {"on": mglru_on, "enabled_raw": "0x0007" if mglru_on else "0x0000"}}
        cell["refault_file_pages"] = n
        (d / "cell.json").write_text(json.dumps(cell))
        shutil.copytree(src / "replay", d / "replay")


@pytest.mark.parametrize("release,on,want", [
    ("6.1.0-47-amd64", True, C.REFAULTS_OLDEST_GEN), ("6.1.0-47-amd64", False, C.REFAULTS_ALL),
    ("6.4.16", True, C.REFAULTS_OLDEST_GEN), ("6.5.0-1-amd64", True, C.REFAULTS_ALL),
    ("6.12.95+deb12-amd64", True, C.REFAULTS_ALL), ("6.18.0", False, C.REFAULTS_ALL)])
def test_refault_counting_by_kernel_and_mglru(release, on, want):
    class R:
        manifest = {}
        cell = {"kernel": {"release": release, "mglru": {"on": on}}}

    assert C.refault_counting(R) == want
    R.cell = {"kernel": {"release": release}}  # MGLRU state unknown: says nothing
    assert C.refault_counting(R) is None


def test_refaults_counted_differently_are_not_compared(tmp_path):
    """6.1 with MGLRU on counts a refault only from the oldest generation (measured in the lab:
    61 against 1,130 per iteration with MGLRU off, the device re-reading about the same): such
    refaults are 'incomparable', not a regression nor part of the geomean, and a note says why.
    Between 6.12 (MGLRU on) and 6.1 with it off both count every refault: compared."""
    _cells(tmp_path, "on61", "6.1.0-47-amd64", True, [60, 62, 61])
    _cells(tmp_path, "off61", "6.1.0-47-amd64", False, [1100, 1130, 1160])
    _cells(tmp_path, "on612", "6.12.95+deb12-amd64", True, [1100, 1130, 1160])
    res = run_check(tmp_path / "on61", tmp_path / "off61")
    df = next(iter(res.tables.values())).set_index("metric")
    assert df.loc["refaults_per_iteration", "verdict"] == "incomparable"
    assert df.loc["refaults_per_iteration", "cand_median"] == pytest.approx(1130 / 150)
    assert res.status == NO_REGRESSION and res.verdict() == "no regression"
    assert len(res.notes) == 1 and "only refaults of the oldest generation" in res.notes[0] \
        and "every refault" in res.notes[0]
    assert df.loc["geomean", "worse_ratio"] == pytest.approx(1.0)  # the 18x refault ratio left out
    # kernels that both count every refault: compared (equal figures here)
    res = run_check(tmp_path / "off61", tmp_path / "on612")
    assert res.status == NO_REGRESSION and res.notes == []
    assert next(iter(res.tables.values())).set_index("metric").loc["refaults_per_iteration", "verdict"] == "same"
    res = run_check(tmp_path / "on61", tmp_path / "on612")  # 6.1 MGLRU on vs 6.12: incomparable too
    assert res.status == NO_REGRESSION and res.notes
    # the CLI prints the note and puts it in --json
    r = subprocess.run([sys.executable, "-m", "moetrace.cli", "check", str(tmp_path / "on61"), str(tmp_path / "off61"),
                        "--json"], capture_output=True, text=True)
    assert r.returncode == NO_REGRESSION and json.loads(r.stdout)["notes"] == res.notes


def _identical(tmp_path, n: int, slow: dict[int, float] | None = None):
    """n copies of the pinned cell in tmp_path/aa/r<i>; ``slow``: i -> factor on its iteration times."""
    src = DATA / "pinned"
    for i in range(n):
        d = tmp_path / "aa" / f"r{i}"
        d.mkdir(parents=True)
        cell = json.loads((src / "cell.json").read_text())
        shutil.copytree(src / "replay", d / "replay")
        f = (slow or {}).get(i)
        if f:
            it = pd.read_parquet(d / "replay" / "iterations.parquet")
            it["duration_ns"] = (it["duration_ns"] * f).astype("int64")
            it.to_parquet(d / "replay" / "iterations.parquet")
            cell["iteration_time_median_ns"] = cell["iteration_time_median_ns"] * f
        (d / "cell.json").write_text(json.dumps(cell))
    return tmp_path / "aa"


def test_one_cell_a_side_tests_its_per_iteration_samples(tmp_path):
    from moetrace.reports.check import ONE_A_SIDE

    aa = _identical(tmp_path, 2, slow={1: 1.3})
    res = run_check(aa / "r0", aa / "r1")
    assert ONE_A_SIDE in res.notes  # what one cell a side cannot see, said
    df = next(iter(res.tables.values()))
    row = df.set_index("metric").loc["iteration_time_ns"]
    assert row["test"].startswith("per-iteration samples: Mann-Whitney U (") and row["p_value"] < 1e-6
    # 30 % slower: past the test, within check's shipped spread of cgroup cells (150 %)
    assert row["verdict"] == "inconclusive" and row["spread_limit"] == 1.5 and res.status == INCONCLUSIVE
    t = tmp_path / "t.toml"
    t.write_text(CALIBRATED)
    row = next(iter(run_check(aa / "r0", aa / "r1", C.load_thresholds(t)).tables.values())).set_index(
        "metric").loc["iteration_time_ns"]
    assert row["verdict"] == "regression" and row["spread_limit"] == 0.08
    dev = df.set_index("metric").loc["device_bytes_per_iteration"]
    assert dev["test"] == "threshold only (one value a side)"
    # the same samples a side: no evidence, whatever the threshold
    same = run_check(aa / "r0", aa / "r0", C.Thresholds(0.05, {m: 0.0 for m in C.METRICS}))
    it = next(iter(same.tables.values())).set_index("metric").loc["iteration_time_ns"]
    assert it["p_value"] == pytest.approx(1.0) and it["verdict"] == "same"


def test_calibrate_pairs_identical_cells_and_suggests_thresholds(tmp_path):
    from moetrace.reports.calibration import calibrate, suggested_thresholds

    quiet = calibrate(_identical(tmp_path / "q", 3))
    assert (quiet["groups"], quiet["pairs"], quiet["quiet_pairs"]) == (1, 6, 6)
    m = quiet["metrics"]["iteration_time_ns"]
    assert m["aa_worse_ratio_p95"] == 1.0 and m["between_repeat_cv"] == 0.0 and m["false_regressions"] == 0
    assert quiet["by_group"] == {"128MiB": {"cells": 3, "iteration_time_ns_cv": 0.0}}  # grouped by C
    noisy = calibrate(_identical(tmp_path / "n", 3, slow={2: 1.25}))
    n = noisy["metrics"]["iteration_time_ns"]
    assert noisy["pairs"] == 6 and n["false_regressions"] == 2  # r0 -> r2 and r1 -> r2 slower by 25 %
    assert n["aa_worse_ratio_p95"] == pytest.approx(1.25, rel=1e-3)
    assert n["mde_3_repeats"] == pytest.approx(3.0355 * np.std([1, 1, 1.25], ddof=1) / np.mean([1, 1, 1.25]),
                                               rel=1e-3)
    toml = tmp_path / "t.toml"
    toml.write_text(suggested_thresholds(noisy))
    th = C.load_thresholds(toml)
    assert th.per_metric["iteration_time_ns"] == 0.25 and th.per_metric["device_bytes_per_iteration"] == 0.05
    assert calibrate(tmp_path / "n" / "aa", th)["quiet_pairs"] == 6  # the suggested thresholds keep them quiet
    with pytest.raises(InputError, match="no two identical cells"):
        calibrate(DATA / "sweep")


def test_suggest_raises_the_quantile_until_the_pairs_together_are_quiet():
    from moetrace.reports.calibration import quiet_share, suggest

    # 40 pairs, two metrics each loud in a different 2 of them (5 % each, 10 % together): the
    # defaults keep 90 % quiet, the 95th percentiles 95 %; the 97.5th all but the loudest (1.6)
    ratios = {"iteration_time_ns": [1.0] * 38 + [1.5, 1.6], "device_bytes_per_iteration": [1.0] * 40}
    pairs = [{"iteration_time_ns": [r, None], "device_bytes_per_iteration": [1.0, None]}
             for r in ratios["iteration_time_ns"]]
    for i in range(2):
        pairs[i]["device_bytes_per_iteration"] = [1.3, None]
    ratios["device_bytes_per_iteration"] = sorted([1.0] * 38 + [1.3, 1.3])
    cal = {"pair_metrics": pairs, "metrics": {m: {"aa_worse_ratios": sorted(r)} for m, r in ratios.items()}}
    th = C.Thresholds.default()
    assert quiet_share(pairs, th) == pytest.approx(36 / 40)
    sug, q, share = suggest(cal, th)
    assert (q, share) == (0.975, 39 / 40)
    assert sug.per_metric["iteration_time_ns"] == 0.51 and sug.per_metric["device_bytes_per_iteration"] == 0.3
    # a test's p-value above alpha keeps a pair quiet whatever its ratio
    assert quiet_share([{"iteration_time_ns": [3.0, 0.2]}], th) == 1.0
    assert quiet_share([{"iteration_time_ns": [None, None]}], th) == 0.0  # infinitely worse, no test


def test_calibrate_only_the_groups_asked_for(tmp_path):
    from moetrace.reports.calibration import calibrate

    aa = _identical(tmp_path, 2)
    assert calibrate(aa, only=["128MiB"])["pairs"] == 2
    with pytest.raises(InputError, match="no group of identical cells matches 6.1-"):
        calibrate(aa, only=["6.1-*"])
    r = subprocess.run([sys.executable, "-m", "moetrace.cli", "calibrate", str(aa), "--only", "12*", "--json"],
                       capture_output=True, text=True)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["only"] == ["12*"] and doc["suggested"]["quiet_share"] == 1.0


def test_held_out_fits_thresholds_without_the_pairs_it_tries_them_on():
    from moetrace.reports.calibration import held_out

    # two groups of 4 identical cells; in b, cell 3 ran 50 % slower: a candidate of b's cell 3 is
    # 1.5x worse, every other pair the same
    pms, cells = [], []
    for g in ("a", "b"):
        for i in range(4):
            for j in range(4):
                if i != j:
                    pms.append({"iteration_time_ns": [1.5 if (g, j) == ("b", 3) else 1.0, None]})
                    cells.append([g, i, j])
    cal = {"pair_metrics": pms, "pair_cells": cells, "by_group": {"a": {"cells": 4}, "b": {"cells": 4}},
           "splits": [{"group": "b", "base": [0, 1, 2], "cand": [3, 0, 1],
                       "metrics": {"iteration_time_ns": [1.2, 0.01]}},
                      {"group": "b", "base": [0, 1, 2], "cand": [1, 2, 3],
                       "metrics": {"iteration_time_ns": [1.2, 0.2]}}]}
    ho = held_out(cal, C.Thresholds.default())
    # leave b out: fitted on a alone (all 1.0: the default 10 %): b's three pairs into cell 3 loud
    assert ho["groups"] == {"pairs": 24, "quiet": 21, "share": 21 / 24, "loud_by_group": {"b": 3}}
    # halves {0, 1} / {2, 3}: fitted on the first halves (all 1.0), b's 2 -> 3 is loud; fitted on the
    # second halves (which hold that 1.5), the first halves' pairs are quiet
    assert ho["halves"] == {"pairs": 8, "quiet": 7, "share": 7 / 8, "loud_by_group": {"b": 1}}
    # the cell-level comparisons with b left out: loud only where the test says so (p < alpha)
    assert ho["splits"] == {"pairs": 2, "quiet": 1, "share": 0.5, "loud_by_group": {"b": 1}}
    # too few cells for halves: none, and said so
    small = {**cal, "by_group": {"a": {"cells": 3}, "b": {"cells": 3}},
             "pair_metrics": [], "pair_cells": [], "splits": []}
    assert held_out(small)["halves"]["pairs"] == 0 and held_out(small)["halves"]["share"] is None


def test_calibrate_compares_three_cells_against_three_in_groups_of_six(tmp_path):
    from moetrace.reports.calibration import calibrate, held_out

    cal = calibrate(_identical(tmp_path, 6, slow={5: 1.3}))
    assert cal["pairs"] == 30 and len(cal["pair_cells"]) == 30
    assert len(cal["splits"]) == 20  # every triple against the first triple of the other three
    assert all(len(set(s["base"]) | set(s["cand"])) == 6 for s in cal["splits"])
    slow_side = [s for s in cal["splits"] if 5 in s["cand"]]
    assert len(slow_side) == 10 and all(s["metrics"]["iteration_time_ns"][0] == pytest.approx(1.0)
                                        for s in slow_side)  # the median of three: one slow cell moves nothing
    ho = held_out(cal)
    assert ho["halves"]["pairs"] == 12 and ho["groups"]["pairs"] == 0  # one group: nothing to leave out
    r = subprocess.run([sys.executable, "-m", "moetrace.cli", "calibrate", str(tmp_path / "aa")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    from moetrace.reports.check import ONE_A_SIDE
    three = run_check(_identical(tmp_path / "x", 3), _identical(tmp_path / "y", 3))
    assert three.status == 0 and ONE_A_SIDE not in three.notes  # repeats a side: the cell-level test
    assert "3 cells against 3 of the same group (the cell-level test): 20 A/A comparisons, 20 quiet (100.0 %)" in r.stdout
    assert "3v3 quiet" in r.stdout and " 20/20 " in r.stdout
    assert "one group, fitted on every other group: none (needs two groups or more)" in r.stdout
    assert "det(3): the smallest change check names (these thresholds) in >= 80 % of the 3-against-3" in r.stdout
    r = subprocess.run([sys.executable, "-m", "moetrace.cli", "calibrate", str(tmp_path / "aa"), "--json"],
                       capture_output=True, text=True)
    doc = json.loads(r.stdout)
    # one cell of six 30 % slower: more than the 15 % that identical cells would need; no device reads
    # (a pinned cell): nothing to make worse
    cl = doc["cell_level"]
    assert cl["detectable_pct"]["iteration_time_ns"] > 15 and "device_bytes_per_iteration" not in cl["detectable_pct"]
    assert doc["held_out"]["halves"]["pairs"] == 12 and (cl["comparisons"], cl["quiet"]) == (20, 20)
    assert cl["by_group"]["128MiB"]["comparisons"] == 20  # per group: the noise differs by mechanism


def test_detectable_is_the_smallest_change_named_in_most_cell_level_comparisons():
    from moetrace.reports.calibration import detectable

    def split(b, c):
        return {"values": {"device_bytes_per_iteration": [b, c], "iteration_time_ns": [b, c]}}

    # identical values: any change past the threshold is named (no spread: p = 0), the first such
    # change of CHANGES: > 5 % for device bytes, > 10 % for iteration time
    quiet = [split([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])] * 5
    assert detectable(quiet) == {"iteration_time_ns": 15, "device_bytes_per_iteration": 7}
    # a spread of +-20 % between cells: Welch needs a much larger change
    noisy = [split([0.8, 1.0, 1.2], [1.2, 0.8, 1.0]), split([1.0, 1.2, 0.8], [0.8, 1.0, 1.2])]
    d = detectable(noisy)
    assert d["device_bytes_per_iteration"] > 30 and d["iteration_time_ns"] >= d["device_bytes_per_iteration"]
    # higher is better (age at eviction): worse means smaller
    older = [{"values": {"age_at_eviction_p50_ns": [[10.0, 10.0, 10.0], [10.0, 10.0, 10.0]]}}] * 3
    assert detectable(older) == {"age_at_eviction_p50_ns": 30}  # 1 / (1/1.3) = 1.3 > 1.25
    assert detectable([]) == {}


def _hosted(base, hosts: list[str | None]):
    """One copy of the golden sweep's 48 MiB cell per entry of ``hosts`` in base/r<i>, its cell.json
    naming that host (None: no host block, as cells written before it)."""
    src = DATA / "sweep" / "cells" / "48MiB-r0"
    for i, h in enumerate(hosts):
        d = base / f"r{i}"
        shutil.copytree(src, d)
        cell = json.loads((d / "cell.json").read_text())
        if h is not None:
            cell["host"] = {"name": h, "kernel": "6.12.0", "mglru": "0x0007", "device": "259:1 nvme0n1p1",
                            "model": "Samsung SSD 990 PRO 2TB", "cpus": 64, "memory_bytes": 256 << 30}
        (d / "cell.json").write_text(json.dumps(cell))
    return base


def test_repeats_from_different_hosts_are_refused_unless_mixed_hosts(tmp_path):
    base = _hosted(tmp_path / "base", ["node-b", "node-a", "node-a"])
    cand = _hosted(tmp_path / "cand", ["node-a", "node-a", None])  # an unknown host never conflicts
    res = run_check(base, cand)
    assert res.status == CANNOT_COMPARE
    assert res.reason == ("base 48MiB: repeats from 2 hosts (node-a: 2 units, node-b: 1 unit); one set of repeats "
                          "comes from one host (its page cache, device and kernel are what a cell measures): run a "
                          "side's repeats on one host, or --mixed-hosts pools them anyway")
    assert res.verdict() == f"could not compare: {res.reason}"
    pooled = run_check(base, cand, mixed_hosts=True)
    assert pooled.status == NO_REGRESSION, pooled.reason
    assert pooled.tables["48MiB"].set_index("metric").loc["iteration_time_ns", "base_n"] == 3
    assert pooled.notes == [
        "base 48MiB: repeats from 2 hosts (node-a: 2 units, node-b: 1 unit): pooled as one set of repeats "
        "(--mixed-hosts)",
        "cross-host comparison: base on node-a, node-b, candidate on node-a; the difference includes the hosts' "
        "(device, kernel, memory: each cell.json's host)"]
    # the CLI: refused (exit 2) with the reason, pooled with --mixed-hosts and the note
    cli = [sys.executable, "-m", "moetrace.cli", "check", str(base), str(cand)]
    r = subprocess.run(cli, capture_output=True, text=True)
    assert r.returncode == CANNOT_COMPARE and "--mixed-hosts pools them anyway" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(cli + ["--mixed-hosts", "--json"], capture_output=True, text=True)
    assert r.returncode == NO_REGRESSION and json.loads(r.stdout)["notes"] == pooled.notes, r.stderr


def test_each_side_on_its_own_host_is_a_noted_cross_host_comparison(tmp_path):
    base = _hosted(tmp_path / "base", ["node-a", "node-a"])
    cand = _hosted(tmp_path / "cand", ["node-b", None])
    res = run_check(base, cand)
    assert res.status == NO_REGRESSION, res.reason
    assert res.notes == ["cross-host comparison: base on node-a, candidate on node-b; the difference includes the "
                         "hosts' (device, kernel, memory: each cell.json's host)"]
    same = run_check(base, _hosted(tmp_path / "same", ["node-a", None]))
    assert same.status == NO_REGRESSION and same.notes == []
    # the host of a unit: cell.json's host name, else the run manifest's, else unknown
    from moetrace.run.handle import open_run

    assert C.host_of(open_run(base / "r0", unrecorded=True)) == "node-a"
    assert C.identity(open_run(DATA / "sweep" / "cells" / "48MiB-r0"))["host"] is None

    class Manifested:
        cell = None
        manifest = {"host": {"name": "node-m"}}

    assert C.host_of(Manifested) == "node-m"
