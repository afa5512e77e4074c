"""The HTML report in a real browser (live tier: needs chromium; skips without it, fails under
MOETRACE_LIVE=1): every image and SVG decodes with a non-zero size, the console shows no error,
and the flame graph's search and zoom work in the page and in the standalone flame.svg."""

from __future__ import annotations

from pathlib import Path

import pytest

from browser import Browser, require_browser

DATA = Path(__file__).resolve().parents[1] / "data" / "reports"


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    from moetrace.reports.report import build_report

    out = tmp_path_factory.mktemp("browser") / "report"
    build_report(DATA / "sweep", out)
    return out


def _no_errors(page) -> None:
    assert page.errors == [], page.errors
    bad = [m for m in page.console if m["type"] in ("error", "warning", "assert")]
    assert bad == [], bad


def test_report_page_decodes_every_image_and_svg(report_dir):
    require_browser()
    import json

    doc = json.loads((report_dir / "report.json").read_text())
    with Browser() as b, b.open(report_dir / "report.html") as page:
        im = page.images()
        assert len(im["img"]) == len(doc["figures"]) >= 8
        for i in im["img"]:
            assert i["complete"] and i["decoded"] == "ok" and i["naturalWidth"] > 100 and i["naturalHeight"] > 100, i
        assert len(im["svg"]) >= 1
        for s in im["svg"]:
            assert s["width"] > 100 and s["height"] > 50, s
        _no_errors(page)
        page.screenshot(report_dir / "screenshot.png")
    assert (report_dir / "screenshot.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("where", ["report.html", "flame.svg"])
def test_flame_search_and_zoom_work_in_the_browser(report_dir, where):
    require_browser()
    with Browser() as b, b.open(report_dir / where) as page:
        api = "window.moetraceFlame['flamegraph']"
        n = page.evaluate(f"{api}.frames()")
        assert n > 10
        # search: a share of the samples between 0 and 1, highlighted frames in the DOM
        share = page.evaluate(f"{api}.search('filemap_')")
        assert 0 < share < 1
        hits = page.evaluate("[...document.querySelectorAll('#flamegraph g.mtf-f[data-match]')].map(g => g.dataset.name)")
        assert hits and all("filemap_" in h for h in hits)
        assert page.evaluate(f"{api}.search('')") in (0, None)
        # zoom into the read path: that frame fills the width; frames outside it are hidden
        visible0 = page.evaluate(f"{api}.visible()")
        assert page.evaluate(f"{api}.zoom('filemap_read_[k]')") is True
        assert page.evaluate(f"{api}.zoomedName()") == "filemap_read_[k]"
        assert 0 < page.evaluate(f"{api}.visible()") < visible0
        page.evaluate(f"{api}.reset()")
        assert page.evaluate(f"{api}.visible()") == visible0 and page.evaluate(f"{api}.zoomedName()") in (None, "")
        # a real click on a frame zooms as well
        page.evaluate("(() => { const g = [...document.querySelectorAll('#flamegraph g.mtf-f')].find("
                      "g => g.dataset.name === 'filemap_read_[k]'); g.dispatchEvent(new MouseEvent('click', "
                      "{bubbles: true})); return true; })()")
        assert page.evaluate(f"{api}.zoomedName()") == "filemap_read_[k]"
        _no_errors(page)
