"""The README's demo command runs end to end and writes its artifacts (live tier)."""

from __future__ import annotations

import pytest

from common.demo import *  # noqa: F401,F403


@pytest.fixture(scope="module")
def demo(tmp_path_factory, live):
    """One run of the README's demo for this module's tests."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    return out, run_demo(out)


def test_demo_capacity_sweep(demo):
    out, r = demo
    cells = pd.read_parquet(out / "sweep" / "results.parquet")
    assert len(cells) == 4 and cells["retained"].all(), cells[["capacity", "reasons"]]
    by_c = cells.set_index("capacity_bytes").sort_index()
    # the regime the paper studies: the simulated LRU hit rate bends across the cells (13 % to 92 %)
    hits = by_c["lru_hit_rate"].astype(float).tolist()
    print(f"\nLRU hit rates by C: {[round(h, 3) for h in hits]}")
    assert hits == sorted(hits) and hits[0] <= 0.20 and hits[-1] >= 0.90
    dev = by_c["device_bytes_per_iteration"].astype(float).tolist()
    # device reads fall as C grows; the 192 MiB cell holds every expert the plan reads: (almost)
    # nothing. diskstats is device-wide, so a stray page of another process may land in the interval.
    assert dev[0] > dev[1] > dev[2] > dev[3] and dev[3] < 64 * 1024
    # every cell's effective capacity (C + headroom - the replay's anonymous memory) is above C
    eff = by_c["effective_capacity_bytes"].astype(float)
    assert (eff > eff.index.to_numpy()).all()
    assert (out / "sweep" / "fig2.png").stat().st_size > 0
    assert not (out / "capacity" / "pool").exists()  # the demo's pool is removed, the results stay
    assert "Capacity sweep" in (out / "REPORT.md").read_text()
    # every cell was recorded with the probes: the evictions a small cell forces show up per expert
    runs = sorted((out / "sweep" / "cells").glob("*/run/manifest.json"))
    assert len(runs) == 4 and all(json.loads(m.read_text())["complete"] for m in runs)
    small = pd.read_parquet(out / "sweep" / "cells" / "16MiB-r0" / "run" / "experts.parquet")
    e = small[small["kind"] == "expert"]
    assert e["re_added_pages"].sum() > 0 and e["evicted_pages"].sum() > 0
    # ... and the demo ends with the sweep's HTML report, its path printed, the Markdown in REPORT.md
    rep = json.loads((out / "report" / "report.json").read_text())
    assert rep["summary"]["kind"] == "sweep" and len(rep["summary"]["table2"]) == 4
    assert (out / "report" / "report.html").stat().st_size > 100_000
    md = (out / "REPORT.md").read_text()
    assert "## Sweep report" in md and "(report/figures/heatmap_amp.png)" in md
    assert f"report: {out / 'report' / 'report.html'}" in r.output
    # ... and one more replay at 48 MiB watched live by cgroup: it thrashes, watch says so
    figs = [json.loads(x) for x in (out / "watch.jsonl").read_text().splitlines()]
    readded = sum(f["pool"]["re_added_pages"] for f in figs)
    print(f"\nwatch: {len(figs)} intervals, re-added {readded}; {md.split('## Watched live')[1][:600]}")
    assert len(figs) >= 2 and readded > 0 and sum(f["pool"]["expert_accesses"] for f in figs) > 0
    assert any(f["alarms"]["rereads"]["on"] for f in figs)
    assert "## Watched live (`moetrace watch`)" in md and "alarms raised: " in md
    assert "stopped: terminated (SIGTERM); probes detached" in (out / "watch.log").read_text()


# The old report of the same demo sweep (before the findings panel, issue 21), measured in this
# Chromium at 1280 px: 15,394 px high (15,268 for the old demo's three-cell sweep).
OLD_HEIGHT = 15394

FIG_CHECK = """JSON.stringify(Array.from(document.querySelectorAll('#findings a.fig')).map(a => {
  const tables = document.querySelectorAll('table[data-table="' + a.dataset.table + '"]');
  const t = tables[tables.length - 1];
  if (!t) return [a.textContent, a.dataset.table, null];
  const col = Array.from(t.querySelectorAll('thead th')).findIndex(th => th.textContent === a.dataset.col);
  const row = t.querySelector('tbody tr[data-row="' + a.dataset.row + '"]');
  const cell = row && col >= 0 ? row.children[col].textContent : null;
  return [a.textContent, a.dataset.table + '/' + a.dataset.row + '/' + a.dataset.col, cell];
}))"""


def test_demo_report_answers_first_in_a_browser(demo):
    """The demo's report in headless Chromium: the findings are the first section, say the
    capacity range, the amplification and the alarm verdict, every number in them is the one its
    table shows, and the page is under half as high as before."""
    from browser import Browser, require_browser

    require_browser()
    out, _ = demo
    with Browser() as b, b.open(out / "report" / "report.html") as page:
        first = page.evaluate("document.querySelector('body > section, body > h2').id")
        text = page.evaluate("document.getElementById('findings').innerText")
        figs = json.loads(page.evaluate(FIG_CHECK))
        height = page.evaluate("document.documentElement.scrollHeight")
        width = page.evaluate("window.innerWidth")
        assert page.errors == [], page.errors
    print(f"\nfindings ({len(figs)} linked numbers), page {height} x {width} px (old: {OLD_HEIGHT}):\n{text}")
    assert first == "findings"
    assert "capacities from C = 16 MiB to 192 MiB" in text
    assert "amplif" in text and "Alarm (amplification > 1.02 and scan-to-steal > 2): not raised" in text
    assert len(figs) >= 15
    for shown, where, cell in figs:
        assert shown == cell, (shown, where, cell)
    assert width == 1280 and height < OLD_HEIGHT / 2
    # every other cell's own report is one click away
    for c in ("192MiB-r0", "96MiB-r0", "16MiB-r0"):
        assert (out / "report" / "cells" / c / "report.html").is_file()


def test_demo_engine_cells_and_their_report_in_a_browser(demo):
    """Step 8: llama.cpp on the tiny MoE under a wall of half its expert pool, stock against
    readahead off: both retained, the stock loader amplifies and its pages were mostly needed by
    no routed expert, readahead-limited reads only routed pages; the engine report's findings
    link every number to the table cell that shows it; REPORT.md carries them."""
    from browser import Browser, require_browser

    out, r = demo
    res = pd.read_parquet(out / "engine" / "sweep" / "engine_results.parquet").set_index("loader")
    assert res["retained"].all(), res["reason"].tolist()
    assert res.loc["stock", "amplification"] > 5 and res.loc["stock", "unneeded_share"] > 0.5
    assert res.loc["random", "unneeded_share"] == 0 and res.loc["random", "amplification"] < 2
    assert not (out / "engine" / "tiny.gguf").exists()  # the model is removed, the results stay
    md = (out / "REPORT.md").read_text()
    assert "## Engine: llama.cpp under a wall of half its expert pool" in md and "- stock at C = 192 MiB" in md
    require_browser()
    with Browser() as b, b.open(out / "engine" / "report" / "report.html") as page:
        text = page.evaluate("document.getElementById('findings').innerText")
        figs = json.loads(page.evaluate(FIG_CHECK))
        assert page.errors == [], page.errors
    assert "stock at C = 192 MiB" in text and "random at C = 192 MiB" in text
    assert len(figs) == 12 and all(shown == cell for shown, _where, cell in figs), figs
