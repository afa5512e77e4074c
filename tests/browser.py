"""A minimal headless-Chromium driver for tests, over the Chrome DevTools Protocol.

Standard library only. Chromium runs with ``--remote-debugging-pipe``: it reads CDP JSON
messages, each terminated by a NUL byte, on its fd 3 and writes replies and events on its fd 4.
One thread drives everything: :meth:`Browser._pump` reads (poll with a deadline) until the
reply or event awaited arrives, routing events by ``sessionId`` to the :class:`Page` they
belong to (``Target.attachToTarget`` with ``flatten``).

    from browser import Browser, require_browser

    require_browser()                       # skip (MOETRACE_LIVE=1: fail) without chromium
    with Browser() as b:
        page = b.open(tmp_path / "report.html")
        assert not page.errors, page.errors
        page.evaluate("document.title")
        page.images()                       # every <img> decoded? every <svg> laid out?
        page.screenshot(tmp_path / "shot.png")

The browser runs in its own session (process group) with a private profile, HOME and caches
under one temp dir; :meth:`Browser.close` (the context exit, also on exceptions and Ctrl-C, and
a finalizer at interpreter exit as the last resort) asks it to close, then SIGKILLs its process
group if anything is left, reaps it and removes the temp dir.
"""

from __future__ import annotations

import base64
import fcntl
import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

INSTALL_HINT = "apt-get install chromium; `make setup` installs it"

FLAGS = (
    "--headless=new",
    "--no-sandbox",  # we run as root
    "--disable-gpu",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-sync",
    "--disable-domain-reliability",
    "--disable-client-side-phishing-detection",
    "--disable-breakpad",
    "--disable-crash-reporter",
    "--no-pings",
    "--metrics-recording-only",
    "--mute-audio",
    "--password-store=basic",
    "--use-mock-keychain",
    "--disable-features=Translate,MediaRouter,OptimizationHints,AutofillServerCommunication",
    "--hide-scrollbars",
    "--window-size=1280,800",
)


class BrowserError(RuntimeError):
    """Chromium died, timed out, or answered a command with an error."""


class EvaluateError(BrowserError):
    """The evaluated JavaScript threw (or its promise rejected); ``text`` is the exception text."""

    def __init__(self, text: str, details: dict | None = None):
        super().__init__(text)
        self.text = text
        self.details = details or {}


def chromium_path() -> str | None:
    """The Chromium binary: $MOETRACE_CHROMIUM (a path or a name on PATH) when set, else
    chromium or chromium-browser on PATH; None when there is none."""
    env = os.environ.get("MOETRACE_CHROMIUM")
    if env:
        return shutil.which(env)
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def require_browser() -> str:
    """The Chromium binary, or skip the calling test — fail it under MOETRACE_LIVE=1, the
    live tier's convention (tests/conftest.py) — with a reason naming the fix."""
    import pytest

    path = chromium_path()
    if path is not None:
        return path
    env = os.environ.get("MOETRACE_CHROMIUM")
    if env:
        reason = f"MOETRACE_CHROMIUM={env!r} is not an executable"
    else:
        reason = f"no chromium on PATH ({INSTALL_HINT}; or set MOETRACE_CHROMIUM)"
    if os.environ.get("MOETRACE_LIVE") == "1":
        pytest.fail(f"MOETRACE_LIVE=1 but browser tests cannot run: {reason}")
    pytest.skip(reason)


def _to_url(url_or_path) -> str:
    if isinstance(url_or_path, Path):
        return url_or_path.resolve().as_uri()
    s = str(url_or_path)
    if "://" in s or s.split(":", 1)[0] in ("about", "data", "javascript", "blob"):
        return s
    return Path(s).resolve().as_uri()


def group_members(pgid: int) -> list[int]:
    """The pids of the live (not zombie) processes in process group ``pgid``, from /proc.
    Zombies do not count: an orphaned renderer is reaped by init, which may take its time
    (this machine's init reaps about once a second), and a zombie holds no files."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()  # state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            out.append(int(entry.name))
    return out


def processes_mentioning(text: str) -> list[int]:
    """The pids of the live processes whose command line contains ``text`` (zombies have none).
    Chromium's crashpad handlers leave the browser's session (they double-fork and setsid);
    their ``--database`` lies under the browser's temp dir, which finds them."""
    needle = text.encode()
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                    if needle in fh.read():
                        out.append(int(entry.name))
            except OSError:
                pass
    return out


class _Resources:
    """What a Browser owns, released by :meth:`release` (idempotent, no reference to the
    Browser, so a weakref.finalize can hold it)."""

    def __init__(self, root: str):
        self.root = root
        self.proc: subprocess.Popen | None = None
        self.fds: list[int] = []
        self.released = False

    def release(self, grace: float = 0.0) -> None:
        if self.released:
            return
        self.released = True
        try:
            proc = self.proc
            if proc is not None:
                if grace > 0:
                    try:
                        proc.wait(timeout=grace)
                    except subprocess.TimeoutExpired:
                        pass
                # whatever is left of the group (renderers, zygote, utilities) goes now; the
                # group id is the browser's pid (start_new_session), so even with the browser
                # already reaped the rest of its group is found
                deadline = time.monotonic() + 10
                while group_members(proc.pid) and time.monotonic() < deadline:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        break
                    if proc.poll() is None:
                        try:
                            proc.wait(timeout=0.05)
                        except subprocess.TimeoutExpired:
                            pass
                    else:
                        time.sleep(0.01)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
            # anything else still running from our temp dir (crashpad handlers, which exit by
            # themselves once the browser is gone, normally before we get here)
            deadline = time.monotonic() + 5
            while (strays := processes_mentioning(self.root)) and time.monotonic() < deadline:
                for pid in strays:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.02)
        finally:
            for fd in self.fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.fds = []
            shutil.rmtree(self.root, ignore_errors=True)


class Browser:
    """Headless Chromium over CDP on a pipe. A context manager; launches on construction."""

    def __init__(self, binary: str | None = None, *, timeout: float = 30.0, extra_flags=()):
        binary = binary or chromium_path()
        if binary is None:
            raise BrowserError(f"no chromium binary ({INSTALL_HINT}; or set MOETRACE_CHROMIUM)")
        self.binary = binary
        self.timeout = timeout
        self.extra_flags = tuple(extra_flags)
        self._ids = itertools.count(1)
        self._init_reader()
        self._closed = False
        root = tempfile.mkdtemp(prefix="moetrace-chromium-")
        self._res = _Resources(root)
        self._finalizer = weakref.finalize(self, self._res.release)
        try:
            self._launch(root)
            self.version = self.send("Browser.getVersion", timeout=timeout,
                                     what="the first reply after launch (Browser.getVersion)")
        except BaseException:
            self._closed = True
            self._res.release()
            raise

    def _init_reader(self) -> None:
        self._buf = bytearray()
        self._scan = 0  # self._buf[:self._scan] holds no NUL
        self._replies: dict[int, dict] = {}
        self._abandoned: set[int] = set()  # ids of commands whose wait timed out
        self._pages: dict[str, Page] = {}  # sessionId -> Page

    def _attach_pipe(self, rfd: int, wfd: int) -> None:
        """Talk over ``rfd`` (Chromium's fd 4) and ``wfd`` (its fd 3), both non-blocking."""
        self._rfd, self._wfd = rfd, wfd
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        self._rpoll, self._wpoll = select.poll(), select.poll()
        self._rpoll.register(rfd, select.POLLIN)  # POLLHUP/POLLERR come regardless
        self._wpoll.register(wfd, select.POLLOUT)

    # -- process -----------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self._res.proc.pid

    @property
    def profile_dir(self) -> Path:
        return Path(self._res.root) / "profile"

    @property
    def temp_dir(self) -> Path:
        """The private temp dir (profile, HOME, caches, stderr log); removed on close."""
        return Path(self._res.root)

    def _launch(self, root: str) -> None:
        for sub in ("profile", "home", "home/.cache", "home/.config"):
            os.makedirs(os.path.join(root, sub), exist_ok=True)
        self._stderr_path = os.path.join(root, "stderr.log")
        # to_child: we write, chromium reads on its fd 3; from_child: chromium writes on fd 4
        c_read, p_write = os.pipe()
        p_read, c_write = os.pipe()
        self._res.fds += [c_read, p_write, p_read, c_write]
        # move the child's ends to fds >= 10 (close-on-exec) so that dup2 onto 3 and 4 in the
        # child never clobbers one with the other and always clears close-on-exec
        hi_read = fcntl.fcntl(c_read, fcntl.F_DUPFD_CLOEXEC, 10)
        self._res.fds.append(hi_read)
        hi_write = fcntl.fcntl(c_write, fcntl.F_DUPFD_CLOEXEC, 10)
        self._res.fds.append(hi_write)

        def remap():  # runs in the child between fork and exec: keep it to the two dup2s
            os.dup2(hi_read, 3)  # dup2 leaves 3 and 4 inheritable
            os.dup2(hi_write, 4)

        env = dict(os.environ)
        home = os.path.join(root, "home")
        # TMPDIR too: Chromium puts its SingletonSocket directory (org.chromium.Chromium.*) there
        # and never removes it (measured: one left in /tmp per launch)
        tmp = os.path.join(root, "tmp")
        os.makedirs(tmp, exist_ok=True)
        env.update(HOME=home, XDG_CACHE_HOME=os.path.join(home, ".cache"),
                   XDG_CONFIG_HOME=os.path.join(home, ".config"), TMPDIR=tmp)
        argv = [self.binary, *FLAGS, *self.extra_flags, f"--user-data-dir={os.path.join(root, 'profile')}",
                "--remote-debugging-pipe", "about:blank"]
        with open(self._stderr_path, "wb") as err:
            # close_fds must stay off: it would run after preexec_fn and close 3 and 4 (and
            # pass_fds=(3, 4) fails when this process has no fd 3 or 4). Python opens every
            # fd close-on-exec, so nothing else is inherited unless made inheritable on purpose.
            self._res.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env,
                close_fds=False, preexec_fn=remap, start_new_session=True)
        for fd in (c_read, c_write, hi_read, hi_write):
            os.close(fd)
            self._res.fds.remove(fd)
        self._attach_pipe(p_read, p_write)

    def stderr_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines Chromium wrote to stderr, without its D-Bus complaints
        (there is no bus here; they are most of what it writes)."""
        try:
            text = Path(self._stderr_path).read_text(errors="replace")
        except OSError:
            return ""
        kept = [ln for ln in text.splitlines() if ":ERROR:dbus/" not in ln]
        return "\n".join(kept[-lines:])

    def _died(self, what: str) -> BrowserError:
        proc = self._res.proc
        try:
            rc = proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            rc = None
        return BrowserError(f"chromium (pid {proc.pid}) exited (rc={rc}) while waiting for {what}; "
                            f"stderr tail:\n{self.stderr_tail()}")

    # -- the pipe ----------------------------------------------------------------------------

    def _write(self, data: bytes, deadline: float, what: str) -> None:
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"timed out writing {what} to chromium; "
                                   f"stderr tail:\n{self.stderr_tail()}")
            if not self._wpoll.poll(left * 1000):
                continue
            try:
                n = os.write(self._wfd, view)
            except BlockingIOError:
                continue
            except BrokenPipeError:
                raise self._died(what) from None
            view = view[n:]

    def _read_some(self, deadline: float, what: str) -> bool:
        """Read what is there (waiting until ``deadline``) and dispatch every complete message.
        False on timeout."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if not self._rpoll.poll(left * 1000):
            return False
        try:
            chunk = os.read(self._rfd, 1 << 20)
        except BlockingIOError:
            return True
        if not chunk:
            raise self._died(what)
        self._buf += chunk
        while True:
            end = self._buf.find(b"\0", self._scan)
            if end < 0:
                self._scan = len(self._buf)
                break
            raw = bytes(self._buf[:end])
            del self._buf[:end + 1]
            self._scan = 0
            self._dispatch(json.loads(raw))
        return True

    def _dispatch(self, msg: dict) -> None:
        if "id" in msg:
            if msg["id"] in self._abandoned:
                self._abandoned.discard(msg["id"])
            else:
                self._replies[msg["id"]] = msg
            return
        page = self._pages.get(msg.get("sessionId"))
        if page is not None:
            page._on_event(msg["method"], msg.get("params", {}))
        elif msg.get("method") == "Target.detachedFromTarget":
            gone = self._pages.pop(msg.get("params", {}).get("sessionId"), None)
            if gone is not None:
                gone._detached = True

    def _pump(self, until, timeout: float, what: str):
        """Read and dispatch until ``until()`` returns something truthy (returned), raising a
        BrowserError naming ``what`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            got = until()
            if got:
                return got
            if not self._read_some(deadline, what) and time.monotonic() >= deadline:
                raise BrowserError(f"timed out after {timeout:g} s waiting for {what}; "
                                   f"stderr tail:\n{self.stderr_tail()}")

    def drain(self, seconds: float) -> None:
        """Dispatch whatever arrives during ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._read_some(deadline, "events")

    def send(self, method: str, params: dict | None = None, session_id: str | None = None,
             timeout: float | None = None, what: str | None = None) -> dict:
        """Send one CDP command and return its result (raising BrowserError on a CDP error)."""
        if self._closed:
            raise BrowserError(f"browser closed; cannot send {method}")
        timeout = self.timeout if timeout is None else timeout
        what = what or f"the reply to {method}"
        mid = next(self._ids)
        msg = {"id": mid, "method": method, "params": params or {}}
        if session_id:
            msg["sessionId"] = session_id
        self._write(json.dumps(msg).encode() + b"\0", time.monotonic() + timeout, what)
        try:
            reply = self._pump(lambda: self._replies.pop(mid, None), timeout, what)
        except BaseException:
            self._abandoned.add(mid)  # its reply, should it come, is dropped
            raise
        if "error" in reply:
            e = reply["error"]
            raise BrowserError(f"{method} failed: {e.get('message')} ({e.get('code')}) "
                               f"{e.get('data', '')}".rstrip())
        return reply.get("result", {})

    # -- pages -------------------------------------------------------------------------------

    def open(self, url_or_path, timeout: float = 30.0, settle: float = 0.2,
             viewport: tuple[int, int] | None = (1280, 800)) -> "Page":
        """A new tab showing ``url_or_path`` (a URL, or a file path made a file:// URL), once its
        load event fired and ``settle`` seconds passed without any event of it (at most 2 s
        more), so that late errors are in :attr:`Page.errors`. ``viewport``: the CSS size of
        the layout viewport (and of a screenshot), at device scale factor 1; None keeps the
        headless window's (1280 x 800 less what it reserves)."""
        url = _to_url(url_or_path)
        deadline = time.monotonic() + timeout

        def left():
            return max(0.001, deadline - time.monotonic())

        target = self.send("Target.createTarget", {"url": "about:blank"}, timeout=left())["targetId"]
        sid = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                        timeout=left())["sessionId"]
        page = Page(self, target, sid, url)
        self._pages[sid] = page
        try:
            for domain in ("Runtime", "Log", "Page"):
                self.send(f"{domain}.enable", session_id=sid, timeout=left())
            self.send("Page.setLifecycleEventsEnabled", {"enabled": True}, session_id=sid, timeout=left())
            if viewport is not None:
                self.send("Emulation.setDeviceMetricsOverride",
                          {"width": viewport[0], "height": viewport[1], "deviceScaleFactor": 1,
                           "mobile": False},
                          session_id=sid, timeout=left())
            page._navigate(url, left(), settle)
        except BaseException:
            if not self._closed:
                try:
                    page.close()
                except BrowserError:
                    pass
            raise
        return page

    # -- shutdown ----------------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Ask Chromium to close (Browser.close), wait up to ``timeout``, then SIGKILL its
        process group if anything is left; reap it, close the pipes, remove the temp dir."""
        if self._closed:
            return
        graceful = False
        try:
            if self._res.proc.poll() is None:
                try:
                    self.send("Browser.close", timeout=timeout)
                    graceful = True
                except BrowserError:
                    pass  # already gone, or not answering: killed below
        finally:
            self._closed = True
            self._pages.clear()
            self._res.release(grace=timeout if graceful else 0.0)
            self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_IMAGES_JS = r"""
(async () => {
  const withTimeout = (p, ms) => Promise.race([p, new Promise((_, no) =>
      setTimeout(() => no(new Error('timeout after ' + ms + ' ms')), ms))]);
  const img = await Promise.all([...document.images].map(async (el) => {
    let decoded = 'ok', decode_error = null;
    try { await withTimeout(el.decode(), %(ms)d); }
    catch (e) { decoded = 'failed'; decode_error = String(e && e.message || e); }
    return {src: (el.currentSrc || el.getAttribute('src') || '').slice(0, 60), complete: el.complete,
            naturalWidth: el.naturalWidth, naturalHeight: el.naturalHeight, decoded, decode_error};
  }));
  const svg = [...document.querySelectorAll('svg')].map((el) => {
    let bbox = null;
    try { const b = el.getBBox(); bbox = {width: b.width, height: b.height}; } catch (e) {}
    const r = el.getBoundingClientRect();
    return {id: el.id || null, width: r.width, height: r.height, bbox};
  });
  return {img, svg};
})()
"""


class Page:
    """One tab (a CDP target attached with a flat session).

    ``console``: every console call, ``{"type", "text", "url", "line"}`` (lines and columns
    1-based; the text joins the arguments' values or descriptions). ``errors``: uncaught
    exceptions (``{"source": "exception", "text", "url", "line", "column"}``) and Log entries of
    level error (``{"source": <Log source, e.g. "network">, "text", "url", "line"}``, e.g. a
    resource that failed to load). ``events``: every (method, params) of this session."""

    def __init__(self, browser: Browser, target_id: str, session_id: str, url: str):
        self.browser = browser
        self.target_id = target_id
        self.session_id = session_id
        self.url = url
        self.console: list[dict] = []
        self.errors: list[dict] = []
        self.events: list[tuple[str, dict]] = []
        self._loader_id: str | None = None
        self._frame_id: str | None = None
        self._loaded_loaders: set[str] = set()  # loaderIds whose "load" lifecycle event came
        self._load_events = 0
        self._detached = False
        self._crashed = False
        self._last_event = time.monotonic()

    def _on_event(self, method: str, params: dict) -> None:
        self.events.append((method, params))
        self._last_event = time.monotonic()
        if method == "Runtime.consoleAPICalled":
            frames = (params.get("stackTrace") or {}).get("callFrames") or [{}]
            self.console.append({"type": params.get("type"),
                                 "text": " ".join(_remote_text(a) for a in params.get("args", [])),
                                 "url": frames[0].get("url"), "line": _line(frames[0].get("lineNumber"))})
        elif method == "Runtime.exceptionThrown":
            d = params.get("exceptionDetails", {})
            desc = (d.get("exception") or {}).get("description")
            text = d.get("text", "")
            if desc:
                text = f"{text} {desc}" if text else desc
            self.errors.append({"source": "exception", "text": text, "url": d.get("url"),
                                "line": _line(d.get("lineNumber")), "column": _line(d.get("columnNumber"))})
        elif method == "Log.entryAdded":
            e = params.get("entry", {})
            if e.get("level") == "error":
                self.errors.append({"source": e.get("source"), "text": e.get("text"),
                                    "url": e.get("url"), "line": _line(e.get("lineNumber"))})
        elif method == "Page.lifecycleEvent":
            # kept for every loader: a fast page's load event can arrive before the reply to
            # Page.navigate that names its loader
            if params.get("name") == "load" and params.get("loaderId"):
                self._loaded_loaders.add(params["loaderId"])
        elif method == "Page.loadEventFired":
            self._load_events += 1
        elif method == "Inspector.detached" or method == "Inspector.targetCrashed":
            self._crashed = True
            self.errors.append({"source": "browser", "text": method, "url": self.url, "line": None})

    def send(self, method: str, params: dict | None = None, timeout: float | None = None,
             what: str | None = None) -> dict:
        return self.browser.send(method, params, session_id=self.session_id, timeout=timeout, what=what)

    def _navigate(self, url: str, timeout: float, settle: float) -> None:
        deadline = time.monotonic() + timeout
        loads_before = self._load_events
        r = self.send("Page.navigate", {"url": url}, timeout=timeout)
        if r.get("errorText"):
            raise BrowserError(f"navigating to {url} failed: {r['errorText']}")
        self._frame_id, self._loader_id = r.get("frameId"), r.get("loaderId")
        if self._loader_id is None:  # same-document navigation: no new loader
            until = lambda: self._load_events > loads_before  # noqa: E731
        else:
            # a late load event of the initial about:blank must not count: match the loader
            until = lambda: self._loader_id in self._loaded_loaders  # noqa: E731
        self.browser._pump(lambda: until() or self._crashed, max(0.001, deadline - time.monotonic()),
                           f"the load event of {url} (Page.loadEventFired)")
        if self._crashed:
            raise BrowserError(f"the tab loading {url} crashed or was detached: {self.errors[-1]['text']}; "
                               f"stderr tail:\n{self.browser.stderr_tail()}")
        self.idle(settle)

    def idle(self, quiet: float = 0.2, at_most: float = 2.0) -> None:
        """Dispatch events until none of this page arrived for ``quiet`` seconds (at most
        ``at_most`` seconds)."""
        end = time.monotonic() + at_most
        self._last_event = time.monotonic()
        while True:
            now = time.monotonic()
            stop = min(end, self._last_event + quiet)
            if now >= stop:
                return
            self.browser._read_some(stop, "events")

    def navigate(self, url_or_path, timeout: float = 30.0, settle: float = 0.2) -> None:
        """Load another URL in this tab (console and errors keep accumulating)."""
        self.url = _to_url(url_or_path)
        self._navigate(self.url, timeout, settle)

    def evaluate(self, expression: str, await_promise: bool = False, timeout: float | None = None):
        """The JSON value of ``expression`` (returnByValue); EvaluateError with the exception
        text when it throws (or, with ``await_promise``, when its promise rejects)."""
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                           "awaitPromise": await_promise, "userGesture": True},
                      timeout=timeout, what=f"the result of evaluating {expression[:60]!r}")
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            desc = (d.get("exception") or {}).get("description") or (d.get("exception") or {}).get("value")
            text = d.get("text", "")
            if desc is not None:
                text = f"{text} {desc}" if text else str(desc)
            raise EvaluateError(text, d)
        return _remote_value(r.get("result", {}))

    def images(self, decode_timeout: float = 5.0) -> dict:
        """``{"img": [...], "svg": [...]}``: for every ``<img>`` its src (first 60 chars),
        complete, naturalWidth, naturalHeight, decoded ("ok" or "failed": does ``img.decode()``
        resolve within ``decode_timeout``) and decode_error; for every ``<svg>`` its id, its
        bounding client rect's width and height and its getBBox() (width, height; None when
        getBBox throws)."""
        return self.evaluate(_IMAGES_JS % {"ms": int(decode_timeout * 1000)}, await_promise=True,
                             timeout=decode_timeout + 10)

    def screenshot(self, path, full_page: bool = False) -> Path:
        """Page.captureScreenshot as PNG into ``path`` (the viewport, or with ``full_page``
        the whole document). Returns the path."""
        params: dict = {"format": "png"}
        if full_page:
            m = self.send("Page.getLayoutMetrics")
            size = m.get("cssContentSize") or m["contentSize"]
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
        data = self.send("Page.captureScreenshot", params)["data"]
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        """Close this tab."""
        if self._detached or self.browser.closed:
            return
        self.browser._pages.pop(self.session_id, None)
        self._detached = True
        self.browser.send("Target.closeTarget", {"targetId": self.target_id})

    def __enter__(self) -> "Page":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _line(n):
    """CDP's 0-based line (column) number, 1-based as editors and tracebacks show it."""
    return None if n is None else n + 1


def _remote_value(obj: dict):
    if "value" in obj:
        return obj["value"]
    u = obj.get("unserializableValue")
    if u is not None:
        if u.endswith("n"):  # BigInt
            return int(u[:-1])
        return {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf"),
                "-0": -0.0}.get(u, u)
    return None  # undefined (or a value that has no JSON form)


def _remote_text(obj: dict) -> str:
    if "value" in obj:
        v = obj["value"]
        return v if isinstance(v, str) else json.dumps(v)
    if "unserializableValue" in obj:
        return obj["unserializableValue"]
    if "description" in obj:
        return obj["description"]
    return obj.get("type", "")
