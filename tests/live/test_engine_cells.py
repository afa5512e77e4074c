"""Live, issue 35 acceptance 3 and 4 (at CI's size): engine cells and an engine sweep of llama.cpp
on the tiny MoE under a cgroup wall at half its expert pool, the stock loader against
readahead-limited (MADV_RANDOM), three repeats each (check's Welch test runs on the cells' logs:
on raw values one noisy stock side left it ~2 degrees of freedom, and CI measured a 99x move at
p = 0.0505); `moetrace check` between the loaders and the sweep's report.

Oracles: the recording's /proc/vmstat pgpgin (device-wide, KiB) against the model pages the
pagecache probe counted added; the block probe's device bytes of the model's experts against
their added pages; the engine's own routing for the pages no routed expert needed (with
readahead off there are none); the cgroup gone and read_ahead_kb put back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from common.engines import engine  # noqa: F401  (the fixture)
from conftest import io_lock
from moetrace.inputs.modelsynth import ModelSpec, synth_model

MOETRACE = str(Path(sys.executable).parent / "moetrace")
HALF = 192 << 20  # half the tiny model's 384 MiB expert pool


@pytest.fixture(scope="module")
def sweep(engine, tmp_path_factory):  # noqa: F811
    from moetrace.lab.guest import queue_dir

    d = tmp_path_factory.mktemp("engine-sweep")
    model = d / "tiny.gguf"
    synth_model(model, ModelSpec())
    ra = queue_dir(model, Path("/")) / "read_ahead_kb"
    before = ra.read_text()
    with io_lock():
        r = subprocess.run([MOETRACE, "engine", "sweep", "--model", str(model), "--capacities", f"{HALF >> 20}MiB",
                            "--repeats", "3", "--tokens", "32", "--warmup-tokens", "8", "--out", str(d / "sweep"),
                            "--json"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ra.read_text() == before
    return d / "sweep", json.loads(r.stdout)


def _cells(sweep_dir: Path, loader: str) -> list[dict]:
    return [json.loads((c / "engine_cell.json").read_text()) | {"dir": c}
            for c in sorted((sweep_dir / "cells" / loader).iterdir())]


@pytest.mark.live
def test_stock_reads_the_model_over_and_over_and_readahead_limited_reads_what_it_routes(live, sweep):
    d, out = sweep
    from moetrace.capacity.scope import Scope

    for loader in ("stock", "random"):
        for c in _cells(d, loader):
            assert c["retained"] and c["scope_removed"] and not Scope(c["inputs"]["name"]).exists()
            run = c["dir"] / "run"
            x = pd.read_parquet(run / "experts.parquet")
            model = x[x["kind"].isin(["expert", "shared", "non_expert"])]
            snaps = json.loads((run / "snapshots.json").read_text())
            pgpgin = (snaps["post"]["vmstat"]["pgpgin"] - snaps["pre"]["vmstat"]["pgpgin"]) * 1024
            assert pgpgin == pytest.approx(int(model["added_pages"].sum()) * 4096, rel=0.05), (loader, pgpgin)
            e = x[x["kind"] == "expert"]
            assert (e["device_read_bytes"] == e["added_pages"] * 4096).all()
            assert c["measured_tokens"] == 24 and c["miss_bytes_per_token"] > 0
            print(f"\n{loader}: {c['device_bytes_per_token'] / 2**20:.1f} MiB/token, miss demand "
                  f"{c['miss_bytes_per_token'] / 2**20:.2f} MiB, amplification {c['amplification']:.2f}, unneeded "
                  f"{c['unneeded_share']:.3f}, {c['decode_ms_per_token']:.1f} ms/token, causes {c['added_by_cause']}")
            causes = c["added_by_cause"]
            tok = pd.read_parquet(c["dir"] / "engine_tokens.parquet")
            assert (tok["expert_pages_added"] >= tok["needed_pages"]).all()
            if loader == "stock":  # the fault path reads around: most of it routed by no one
                assert c["amplification"] > 5 and c["unneeded_share"] > 0.5
                assert causes["readahead"] > 0.9 * sum(causes.values())
            else:  # one page per fault: only routed experts' pages, each asked for
                assert c["unneeded_share"] == 0 and causes["readahead"] == 0 and causes["demand"] > 0
                assert c["amplification"] < 2
    cap = pd.DataFrame(out["capacity"])
    assert sorted(cap["loader"]) == ["random", "stock"] and (cap["repeats"] == 3).all()


@pytest.mark.live
def test_check_names_the_stock_loaders_regression_and_the_report_links_its_numbers(live, sweep):
    d, _out = sweep
    r = subprocess.run([MOETRACE, "check", str(d / "cells" / "random"), str(d / "cells" / "stock"), "--json"],
                       capture_output=True, text=True, timeout=300)
    doc = json.loads(r.stdout)
    assert r.returncode == 1, r.stdout[-2000:]
    assert {"device_bytes_per_iteration", "amplification"} <= set(doc["regressed"][f"{HALF >> 20}MiB"])
    r = subprocess.run([MOETRACE, "report", str(d)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    md = (d / "report" / "REPORT.md").read_text()
    html = (d / "report" / "report.html").read_text()
    assert "stock at C = 192 MiB" in md and "random at C = 192 MiB" in md
    assert html.count("data-table='engine_half'") >= 10  # every number of the findings links to its row
    assert (d / "report" / "tables" / "engine_results.parquet").is_file()
