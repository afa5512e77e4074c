"""moetrace.progress: when a bar is drawn (terminal only; never with --json, CI or
MOETRACE_PROGRESS=0; MOETRACE_PROGRESS=1 forces it), the no-op bar, tqdm imported lazily, and
`moetrace pool create` drawing a bar on a pty's stderr but none with --json."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from moetrace.progress import NoBar, bar, progress_enabled


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("MOETRACE_PROGRESS", raising=False)
    return monkeypatch


def test_enabled_on_a_terminal_only(clean_env):
    assert progress_enabled(False, _Tty())
    assert not progress_enabled(False, io.StringIO())


def test_disabled_with_json(clean_env):
    assert not progress_enabled(True, _Tty())
    clean_env.setenv("MOETRACE_PROGRESS", "1")  # --json wins: its output is for a program
    assert not progress_enabled(True, _Tty())


@pytest.mark.parametrize("ci", ["1", "true"])
def test_disabled_under_ci(clean_env, ci):
    clean_env.setenv("CI", ci)
    assert not progress_enabled(False, _Tty())


@pytest.mark.parametrize("ci", ["", "0", "false"])
def test_ci_off_values_do_not_disable(clean_env, ci):
    clean_env.setenv("CI", ci)
    assert progress_enabled(False, _Tty())


def test_moetrace_progress_0_disables(clean_env):
    clean_env.setenv("MOETRACE_PROGRESS", "0")
    assert not progress_enabled(False, _Tty())


def test_moetrace_progress_1_forces(clean_env):
    clean_env.setenv("MOETRACE_PROGRESS", "1")
    assert progress_enabled(False, io.StringIO())
    clean_env.setenv("CI", "true")
    assert progress_enabled(False, io.StringIO())


def test_a_stream_without_isatty_or_closed(clean_env):
    assert not progress_enabled(False, object())
    s = io.StringIO()
    s.close()
    assert not progress_enabled(False, s)


def test_default_stream_is_the_current_stderr(clean_env):
    old = sys.stderr
    try:
        sys.stderr = _Tty()
        assert progress_enabled(False)
        sys.stderr = io.StringIO()
        assert not progress_enabled(False)
    finally:
        sys.stderr = old


def test_noop_bar_accepts_the_calls():
    with bar(100, "x", unit="B", enabled=False, unit_scale=True, unit_divisor=1024) as b:
        assert isinstance(b, NoBar) and not b
        b.update(10)
        b.update()
        b.set_postfix(C="1GiB")
        b.set_postfix({"C": "1GiB"}, refresh=False)
        b.set_postfix_str("C=1GiB warmup")
        b.set_description("cell: warmup")
        b.set_description_str("cell: measured", refresh=True)
        b.refresh()
        b.write("x")


def test_enabled_bar_draws_on_the_stream():
    out = io.StringIO()
    with bar(4, "demo", unit="cell", enabled=True, stream=out) as b:
        b.update(2)
        b.set_postfix_str("C=1GiB-r0")
        b.set_description("sweep")
        b.update(2)
    text = out.getvalue()
    assert "4/4" in text and "cell" in text and "C=1GiB-r0" in text


def test_closed_on_an_exception():
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with bar(10, "x", enabled=True, stream=out) as b:
            b.update(3)
            raise RuntimeError("boom")
    assert b.disable  # tqdm marks a closed bar disabled


def test_tqdm_imported_only_for_an_enabled_bar():
    code = ("import sys, moetrace.progress as p\n"
            "with p.bar(3, 'x', enabled=False) as b: b.update(1)\n"
            "a = 'tqdm' in sys.modules\n"
            "import io\n"
            "with p.bar(3, 'x', enabled=True, stream=io.StringIO()) as b: b.update(1)\n"
            "print(a, 'tqdm' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]


def test_the_cli_modules_do_not_import_tqdm():
    code = ("import sys, moetrace.cli, moetrace.cli.pool, moetrace.cli.cell, moetrace.cli.sweep, "
            "moetrace.cli.record, moetrace.progress; print('tqdm' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


# --- run_sweep reports cells done and the running cell; run_cell's phases are passed through ---

def test_run_sweep_reports_progress(tmp_path, monkeypatch):
    import moetrace.capacity.cell as cellmod
    from moetrace.capacity.sweep import run_sweep

    phases_seen = []

    def fake_run_cell(spec, cdir, curve=None, on_phase=None):
        for p in ("clean", "warmup", "measured"):
            if on_phase:
                on_phase(p)
        return {"capacity_bytes": spec.capacity_bytes, "retained": True, "reasons": []}

    class Spec:
        def __init__(self, c):
            self.capacity_bytes, self.mechanism, self.mode = c, "cgroup", "pagecache"

    monkeypatch.setattr(cellmod, "run_cell", fake_run_cell)
    monkeypatch.setattr(cellmod, "miss_curve", lambda *a: None)
    caps = [("1GiB", 1 << 30), ("512MiB", 512 << 20)]
    calls = []
    done = run_sweep({lab: Spec(c) for lab, c in caps}, caps, 2, 0, tmp_path, "plan.bin", 1, 1,
                     progress=lambda n, total, cur: calls.append((n, total, cur)),
                     on_phase=phases_seen.append)
    assert len(done.rows) == 4
    assert [c[0] for c in calls] == [0, 1, 2, 3, 4] and {c[1] for c in calls} == {4}
    assert calls[-1][2] is None
    assert sorted(c[2] for c in calls[:-1]) == ["1GiB-r0", "1GiB-r1", "512MiB-r0", "512MiB-r1"]
    assert [r["cell_dir"].rsplit("/", 1)[1] for r in done.rows] == [c[2] for c in calls[:-1]]
    assert phases_seen == ["clean", "warmup", "measured"] * 4
    # the default: nothing reported, the same cells
    again = run_sweep({lab: Spec(c) for lab, c in caps}, caps, 2, 0, tmp_path / "b", "plan.bin", 1, 1)
    assert [r["capacity"] for r in again.rows] == [r["capacity"] for r in done.rows]


# --- `moetrace pool create` under a pty ---

POOL_ARGS = ["--layers", "2", "--experts", "4", "--k", "2", "--expert-bytes", "256KiB"]  # 2 MiB


def _moetrace() -> list[str]:
    exe = Path(sys.executable).with_name("moetrace")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("moetrace")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from moetrace.cli import main; sys.exit(main())"]


def _run_on_pty(args: list[str], env: dict[str, str], size: tuple[int, int] | None = None
                ) -> tuple[int, str, str]:
    """Run with stderr on a pty (stdout a pipe): exit status, stdout, what the pty got.
    ``size``: (rows, columns) to set on the pty; None leaves a new pty's 0 x 0."""
    master, slave = pty.openpty()
    if size is not None:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[0], size[1], 0, 0))
    try:
        proc = subprocess.Popen(_moetrace() + args, stdout=subprocess.PIPE, stderr=slave,
                                stdin=subprocess.DEVNULL, env=env)
    finally:
        os.close(slave)
    got = bytearray()
    try:
        while True:
            r, _, _ = select.select([master], [], [], 60)
            if not r:
                proc.kill()
                raise AssertionError(f"no output for 60 s; so far {bytes(got)!r}")
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its side of the pty
                break
            if not chunk:
                break
            got += chunk
        out = proc.stdout.read().decode()
        rc = proc.wait(60)
    finally:
        os.close(master)
        if proc.stdout:
            proc.stdout.close()
    return rc, out, got.decode(errors="replace")


@pytest.fixture
def pty_env():
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "MOETRACE_PROGRESS")}
    env.setdefault("TERM", "xterm")
    return env


@pytest.mark.parametrize("size", [(24, 80), None], ids=["80x24", "unsized"])
def test_pool_create_shows_a_bar_on_a_terminal(tmp_path, pty_env, size):
    rc, out, err = _run_on_pty(["pool", "create", str(tmp_path / "p"), *POOL_ARGS], pty_env, size)
    assert rc == 0, err
    assert "created" in out
    # tqdm's bar: the description, a percentage, bytes with a unit and the bar's edges
    assert "pool 2 MiB" in err and "100%" in err and "|" in err, err
    assert "MiB" in err or "KiB" in err, err


def test_pool_create_json_shows_no_bar(tmp_path, pty_env):
    rc, out, err = _run_on_pty(["pool", "create", str(tmp_path / "p"), *POOL_ARGS, "--json"], pty_env)
    assert rc == 0, err
    assert err == "", err
    info = json.loads(out)
    assert info["experts"] == 8 and info["data_bytes"] == 2 << 20


def test_pool_create_quiet_under_ci_and_when_off(tmp_path, pty_env):
    for i, extra in enumerate(({"CI": "true"}, {"MOETRACE_PROGRESS": "0"})):
        rc, out, err = _run_on_pty(["pool", "create", str(tmp_path / f"p{i}"), *POOL_ARGS], pty_env | extra)
        assert rc == 0, err
        assert err == "" and "created" in out, (extra, err)


def test_pool_create_forced_without_a_terminal(tmp_path, pty_env):
    r = subprocess.run(_moetrace() + ["pool", "create", str(tmp_path / "p"), *POOL_ARGS],
                       capture_output=True, text=True, env=pty_env | {"MOETRACE_PROGRESS": "1", "CI": "true"},
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "100%" in r.stderr and "created" in r.stdout
    r = subprocess.run(_moetrace() + ["pool", "create", str(tmp_path / "q"), *POOL_ARGS],
                       capture_output=True, text=True, env=pty_env, timeout=120)
    assert r.returncode == 0 and r.stderr == ""


# --- `moetrace cell` and `moetrace sweep`: the CLI turns phases and cells into bar updates
# (run_cell faked: nothing here needs root or touches cgroups) ---

@pytest.fixture
def fake_cells(tmp_path, monkeypatch):
    import moetrace.capacity.cell as cellmod
    import moetrace.reports.sweep as repmod

    def fake_run_cell(spec, out_dir, curve=None, on_phase=None):
        for p in ("clean", "drop caches", "scope", "warmup", "measured", "cleanup", "results"):
            if on_phase:
                on_phase(p)
        return {"retained": True, "reasons": [], "capacity_bytes": spec.capacity_bytes,
                "mechanism": spec.mechanism, "mode": spec.mode}

    def fake_write_results(rows, out, plot=True):
        import pandas as pd

        return {"table": pd.DataFrame({"capacity": [r["capacity"] for r in rows]}), "files": {}}

    monkeypatch.setattr(cellmod, "run_cell", fake_run_cell)
    monkeypatch.setattr(cellmod, "check_privileges", lambda: None)
    monkeypatch.setattr(cellmod, "miss_curve", lambda *a: None)
    monkeypatch.setattr(repmod, "write_results", fake_write_results)
    plan = tmp_path / "plan.bin"
    plan.write_bytes(b"")
    (tmp_path / "pool").mkdir()
    return ["--plan", str(plan), "--pool", str(tmp_path / "pool")]


def _invoke(args, env):
    from click.testing import CliRunner

    from moetrace.cli import cli

    return CliRunner().invoke(cli, args, env=env)


def test_cell_shows_its_phases(tmp_path, fake_cells):
    args = ["cell", *fake_cells, "--capacity", "64MiB", "--out", str(tmp_path / "c")]
    r = _invoke(args, {"MOETRACE_PROGRESS": "1", "CI": None})
    assert r.exit_code == 0, r.output
    assert "cell: warmup" in r.stderr and "cell: measured" in r.stderr and "cell: results" in r.stderr
    assert "retained" in r.stdout and "cell:" not in r.stdout
    r = _invoke(args + ["--json"], {"MOETRACE_PROGRESS": "1", "CI": None})
    assert r.exit_code == 0, r.output
    assert r.stderr == "" and json.loads(r.stdout)["retained"] is True
    r = _invoke(args, {"MOETRACE_PROGRESS": None, "CI": "true"})
    assert r.exit_code == 0 and r.stderr == ""


def test_sweep_shows_cells_done(tmp_path, fake_cells):
    args = ["sweep", *fake_cells, "--capacities", "128MiB,64MiB", "--repeats", "2", "--out", str(tmp_path / "s")]
    r = _invoke(args, {"MOETRACE_PROGRESS": "1", "CI": None})
    assert r.exit_code == 0, r.output
    assert "4/4" in r.stderr and "cell" in r.stderr and "C=128MiB-r" in r.stderr, r.stderr
    assert "C=64MiB-r1 measured" in r.stderr or "C=64MiB-r0 measured" in r.stderr
    assert "4/4" not in r.stdout
    r = _invoke(args + ["--json"], {"MOETRACE_PROGRESS": "1", "CI": None})
    assert r.exit_code == 0, r.output
    assert r.stderr == "" and json.loads(r.stdout)["cells"] == 4
    r = _invoke(args, {"MOETRACE_PROGRESS": "0", "CI": None})
    assert r.exit_code == 0 and r.stderr == ""


def test_an_enabled_bar_starts_no_thread():
    """`cell` forks the replay with a preexec_fn: no tqdm_monitor thread beside it."""
    code = ("import io, threading, moetrace.progress as p\n"
            "with p.bar(3, 'x', enabled=True, stream=io.StringIO()) as b:\n"
            "    b.update(1)\n"
            "    print(threading.active_count())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"


def test_run_sweep_survives_a_failing_display(tmp_path, monkeypatch):
    import moetrace.capacity.cell as cellmod
    from moetrace.capacity.sweep import run_sweep

    class Spec:
        capacity_bytes, mechanism, mode = 1 << 20, "cgroup", "pagecache"

    def boom(*a):
        raise OSError("the terminal went away")

    monkeypatch.setattr(cellmod, "run_cell", lambda spec, cdir, curve=None, on_phase=None: {"retained": True})
    monkeypatch.setattr(cellmod, "miss_curve", lambda *a: None)
    done = run_sweep({"1MiB": Spec()}, [("1MiB", 1 << 20)], 3, 0, tmp_path, "plan.bin", 1, 1, progress=boom)
    assert len(done.rows) == 3 and done.stopped is None
