"""The headless-Chromium test driver (tests/browser.py) sees what a browser sees (live tier:
needs the chromium binary; without it these skip, or fail under MOETRACE_LIVE=1).

Oracles are pages whose content is known: a real PNG (built with zlib) and an inline SVG must
decode and lay out with no error; a missing image, a console.error and an uncaught exception
must each be reported; the screenshot is a PNG of the viewport's size; after the context exits
no process of the browser's group is alive and its temp dir is gone."""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import struct
import zlib

import pytest

from browser import (Browser, BrowserError, EvaluateError, group_members, processes_mentioning,
                     require_browser)
from conftest import sigint_default


def png_bytes(width: int = 4, height: int = 3) -> bytes:
    """A real RGB PNG, ``width`` x ``height``, red."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    rows = b"".join(b"\0" + b"\xff\0\0" * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def chromium() -> str:
    return require_browser()


@pytest.fixture(scope="module")
def browser(chromium):
    with Browser(chromium) as b:
        yield b


def test_good_image_and_svg(browser, tmp_path):
    """A valid data-URI PNG decodes at its natural size, an inline SVG has a box, no errors."""
    uri = "data:image/png;base64," + base64.b64encode(png_bytes(4, 3)).decode()
    html = tmp_path / "good.html"
    html.write_text(f"""<!doctype html><html><body>
<img id="png" src="{uri}">
<svg id="chart" width="120" height="80" xmlns="http://www.w3.org/2000/svg">
  <rect x="10" y="10" width="100" height="60" fill="steelblue"/></svg>
<script>console.log("ready", 42)</script></body></html>""")
    page = browser.open(html)
    try:
        r = page.images()
        assert page.errors == []
        assert page.console == [{"type": "log", "text": "ready 42", "url": html.as_uri(), "line": 5}]
        (img,) = r["img"]
        assert img["src"] == uri[:60]
        assert (img["complete"], img["naturalWidth"], img["naturalHeight"]) == (True, 4, 3)
        assert img["decoded"] == "ok", img
        (svg,) = r["svg"]
        assert (svg["id"], svg["width"], svg["height"]) == ("chart", 120, 80)
        assert svg["bbox"] == {"width": 100, "height": 60}
    finally:
        page.close()


def test_broken_image_console_error_and_exception(browser, tmp_path):
    """A missing image (decode fails, naturalWidth 0, a network Log error naming it), a
    console.error and an uncaught exception are each reported."""
    html = tmp_path / "bad.html"
    html.write_text("""<!doctype html><html><body>
<img src="missing.png">
<script>console.error("boom");</script>
<script>throw new Error("kaput");</script>
</body></html>""")
    page = browser.open(html)
    try:
        (img,) = page.images()["img"]
        assert img["decoded"] == "failed" and img["naturalWidth"] == 0 and img["complete"], img
        assert [c["text"] for c in page.console if c["type"] == "error"] == ["boom"]
        exc = [e for e in page.errors if e["source"] == "exception"]
        assert len(exc) == 1 and "kaput" in exc[0]["text"] and exc[0]["url"] == html.as_uri(), page.errors
        assert exc[0]["line"] == 4  # 1-based
        net = [e for e in page.errors if e["source"] == "network"]
        assert len(net) == 1 and net[0]["url"] == (tmp_path / "missing.png").as_uri(), page.errors
        assert len(page.errors) == 2, page.errors
    finally:
        page.close()


def test_evaluate(browser):
    page = browser.open("about:blank")
    try:
        assert page.evaluate("1+1") == 2
        assert page.evaluate("({a: [1, 'x', null], b: true})") == {"a": [1, "x", None], "b": True}
        assert page.evaluate("undefined") is None
        assert page.evaluate("new Promise(r => setTimeout(() => r(7), 10))", await_promise=True) == 7
        with pytest.raises(EvaluateError, match="nope"):
            page.evaluate("throw new Error('nope')")
        with pytest.raises(EvaluateError, match="rejected"):
            page.evaluate("Promise.reject(new Error('rejected'))", await_promise=True)
        with pytest.raises(EvaluateError, match="SyntaxError"):
            page.evaluate("1 +")
        # a promise that never settles: a timeout naming what was awaited, and the
        # connection stays usable (the late reply, if any, is dropped)
        with pytest.raises(BrowserError, match="timed out after 0.3 s waiting for the result of evaluating"):
            page.evaluate("new Promise(() => {})", await_promise=True, timeout=0.3)
        assert page.evaluate("2*3") == 6
        assert page.errors == []  # evaluate's exceptions are its own, not the page's
    finally:
        page.close()


def test_screenshot(browser, tmp_path):
    html = tmp_path / "tall.html"
    html.write_text('<!doctype html><body style="margin:0"><div style="height:2000px;background:#c00"></div>')
    page = browser.open(html)
    try:
        shot = page.screenshot(tmp_path / "shot.png")
        assert png_size(shot.read_bytes()) == (1280, 800)
        full = page.screenshot(tmp_path / "full.png", full_page=True)
        assert png_size(full.read_bytes()) == (1280, 2000)
    finally:
        page.close()


@pytest.mark.parametrize("how", ["clean", "exception", "ctrl-c"])
def test_nothing_left_behind(chromium, tmp_path, how):
    """After the context exits (normally, by an exception, by Ctrl-C) the browser's pid and
    every live process of its group are gone and its temp dir (profile) is removed."""
    import tempfile

    raised = {"clean": None, "exception": RuntimeError, "ctrl-c": KeyboardInterrupt}[how]
    shared_tmp = os.listdir(tempfile.gettempdir())  # Chromium's SingletonSocket dirs went here
    with pytest.raises(raised) if raised else contextlib.nullcontext():
        with Browser(chromium) as b:
            pid, tmp, profile = b.pid, b.temp_dir, b.profile_dir
            page = b.open("about:blank")
            assert page.evaluate("1") == 1
            assert profile.is_dir() and group_members(pid)
            if raised:
                raise raised("stop")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, not a zombie
    assert group_members(pid) == []
    assert not tmp.exists()
    assert not processes_mentioning(str(tmp))
    assert b.closed
    assert sorted(set(os.listdir(tempfile.gettempdir())) - set(shared_tmp)) == []


_CHILD = """
import sys
sys.path.insert(0, {tests!r})
from browser import Browser
b = Browser({chromium!r})
page = b.open("about:blank")
print(b.pid, b.temp_dir, flush=True)
if sys.argv[1] == "sigint":
    with b:
        page.evaluate("new Promise(() => {{}})", await_promise=True, timeout=60)
"""


@pytest.mark.parametrize("how", ["sigint", "never-closed"])
def test_nothing_left_behind_by_a_process(chromium, how):
    """A real Ctrl-C (SIGINT while waiting on the browser) and a script that never closes its
    Browser (the finalizer at interpreter exit) leave nothing behind either."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    code = _CHILD.format(tests=str(Path(__file__).resolve().parents[1]), chromium=chromium)
    proc = subprocess.Popen([sys.executable, "-c", code, how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    try:
        pid, tmp = proc.stdout.readline().split()
        if how == "sigint":
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if how == "sigint":
        # Python ends by re-raising SIGINT on itself after the traceback (and the cleanup)
        assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in err, err
    else:
        assert proc.returncode == 0, err
    assert group_members(int(pid)) == []
    assert not Path(tmp).exists()
    assert not processes_mentioning(tmp)


def test_browser_death_reports_stderr_tail(chromium):
    """If chromium dies, the next command fails naming what it awaited, with the exit code."""
    with Browser(chromium) as b:
        page = b.open("about:blank")
        os.killpg(b.pid, signal.SIGKILL)
        died = r"exited \(rc=-9\) while waiting for the result of evaluating"
        with pytest.raises(BrowserError, match=died) as e:
            page.evaluate("1+1")
        assert "stderr tail:" in str(e.value)
        tmp = b.temp_dir
    assert not tmp.exists() and not processes_mentioning(str(tmp))


def test_framing_split_and_batched():
    """Messages split across reads, several per read, events interleaved with replies: each
    is dispatched whole, replies by id, events by session."""
    b = Browser.__new__(Browser)  # the reader alone, on a pipe of our own
    b._init_reader()
    seen = []

    class FakePage:
        def _on_event(self, method, params):
            seen.append((method, params))

    b._pages["S"] = FakePage()
    r, w = os.pipe()
    try:
        b._attach_pipe(r, w)
        os.set_blocking(w, True)
        stream = (b'{"method":"Runtime.consoleAPICalled","sessionId":"S","params":{"type":"log"}}\0'
                  b'{"id":1,"result":{"x":1}}\0{"id":2,"res' + b'ult":{"y":"\xc3\xa9"}}\0{"method":"Log.entr'
                  + b'yAdded","sessionId":"S","params":{}}\0')
        cuts = [0, 5, 90, 91, 130, len(stream)]
        for a, z in zip(cuts, cuts[1:]):
            os.write(w, stream[a:z])
            assert b._read_some(time_after(1.0), "test")
        assert b._replies == {1: {"id": 1, "result": {"x": 1}}, 2: {"id": 2, "result": {"y": "é"}}}
        assert [m for m, _ in seen] == ["Runtime.consoleAPICalled", "Log.entryAdded"]
        assert not b._buf
        assert b._read_some(time_after(0.05), "test") is False  # nothing more: times out
        b._abandoned.add(3)  # a reply nobody waits for any more is dropped
        os.write(w, b'{"id":3,"result":{}}\0')
        assert b._read_some(time_after(1.0), "test") and 3 not in b._replies and not b._abandoned
    finally:
        os.close(r)
        os.close(w)


def time_after(seconds: float) -> float:
    import time

    return time.monotonic() + seconds
