"""A recorded cell with the page stream, reported (live tier): `cell --record --stream-events`
writes page_events.parquet, and the report counts re-reads within one iteration from it, per
page. Oracles: the pagecache probe's own per-epoch re-added pages (a re-read within an
iteration is a re-add of that iteration) and the stream's lost counts."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd

from conftest import io_lock


def _moetrace(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moetrace.cli", *map(str, args)], capture_output=True, text=True,
                          env={**__import__("os").environ, "CI": "1"}, timeout=600)


def test_cell_with_the_page_stream_reports_exact_in_iteration_rereads(live, tmp_path):
    geo = ["--layers", 4, "--experts", 16, "--k", 4, "--expert-bytes", "1MiB"]
    # speculative fallbacks read a layer twice in one iteration: what can be re-read within it
    assert _moetrace("trace", "synth", "--layers", 4, "--experts", 16, "--k", 4, "--steps", 20, "--seed", 2,
                     "--spec-fallback-rate", "0.5", "-o", tmp_path / "t.jsonl").returncode == 0
    assert _moetrace("plan", "compile", tmp_path / "t.jsonl", *geo, "-o", tmp_path / "plan.bin").returncode == 0
    assert _moetrace("pool", "create", tmp_path / "pool", *geo, "--force").returncode == 0
    with io_lock():
        r = _moetrace("cell", "--plan", tmp_path / "plan.bin", "--pool", tmp_path / "pool", "--capacity", "32MiB",
                      "--headroom", "40MiB", "--threads", 2, "--record", "--stream-events", "--out",
                      tmp_path / "cell", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "cell" / "run" / "page_events.parquet").is_file()
    r = _moetrace("report", tmp_path / "cell", "--out", tmp_path / "rep", "--only", "amp", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    man = json.loads((tmp_path / "cell" / "run" / "manifest.json").read_text())
    stream = man["lost"]["pagecache"]["stream"]
    lost = stream["lost_kernel"] + stream["lost_user"]
    assert doc["summary"]["in_iteration_exact"] is (lost == 0)
    it = pd.read_parquet(tmp_path / "rep" / "tables" / "amp_iterations.parquet")
    assert "in_iteration_re_added_pages" in it and "in_iteration_re_added_pages_min" not in it
    # every re-read within an iteration is one of that iteration's re-adds (a lost event can only
    # hide one: a counted re-read needs its add, delete and add all seen)
    assert (it["in_iteration_re_added_pages"] <= it["re_added_pages"]).all()
    assert int(it["in_iteration_re_added_pages"].sum()) > 0
