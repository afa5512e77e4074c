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
# (the job function runs in this process, run_cell faked: nothing here needs root or cgroups)

def fake_cell_jobs(monkeypatch, tmp_path, run=None):
    """run_cell faked (writing cell.json as the real one does), the miss curve skipped, and the
    local executor replaced by the in-process one: the sweep's jobs, dispatch and merge are real."""
    import moetrace.capacity.cell as cellmod
    import moetrace.capacity.dispatch as dispatch

    def fake_run_cell(spec, out_dir, curve=None, on_phase=None):
        for p in ("clean", "drop caches", "scope", "warmup", "measured", "cleanup", "results"):
            if on_phase:
                on_phase(p)
        res = {"schema": "moetrace.cell/1", "complete": True, "retained": True, "reasons": [],
               "capacity_bytes": spec.capacity_bytes,
               "mechanism": spec.mechanism, "mode": spec.mode}
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "cell.json").write_text(json.dumps(res))
        return res

    monkeypatch.setattr(cellmod, "run_cell", run or fake_run_cell)
    monkeypatch.setattr(cellmod, "check_privileges", lambda: None)
    monkeypatch.setattr(cellmod, "ensure_miss_curve", lambda path, *a: Path(path))
    monkeypatch.setattr(cellmod, "load_miss_curve", lambda *a: None)
    monkeypatch.setattr(dispatch, "LocalExecutor", dispatch.InlineExecutor)
    plan = tmp_path / "plan.bin"
    plan.write_bytes(b"")
    (tmp_path / "pool").mkdir(exist_ok=True)
    return str(plan), str(tmp_path / "pool")


def _specs(plan, pool, caps):
    from moetrace.capacity.cell import CellSpec

    return {label: CellSpec(plan=plan, pool=pool, capacity_bytes=c) for label, c in caps}


def test_run_sweep_reports_progress(tmp_path, monkeypatch):
    from moetrace.capacity.sweep import run_sweep

    plan, pool = fake_cell_jobs(monkeypatch, tmp_path)
    caps = [("1GiB", 1 << 30), ("512MiB", 512 << 20)]
    seen = []
    done = run_sweep(_specs(plan, pool, caps), caps, 2, 0, tmp_path / "a",
                     on_status=lambda st: seen.append((st.done, st.total, dict(st.running))))
    assert len(done.rows) == 4 and done.ran == done.submitted and len(done.ran) == 4
    assert {t for _, t, _ in seen} == {4} and seen[-1][0] == 4 and seen[-1][2] == {}
    running = [next(iter(r)) for _, _, r in seen if r]
    assert sorted(set(running)) == ["1GiB-r0", "1GiB-r1", "512MiB-r0", "512MiB-r1"]
    # the cells ran in the seeded order, and the rows come in it
    assert list(dict.fromkeys(running)) == done.ran == [Path(r["cell_dir"]).name for r in done.rows]
    assert [r["order"] for r in done.rows] == [0, 1, 2, 3]
    phases = [r[n] for _, _, r in seen for n in r if n == "1GiB-r0"]
    assert phases == ["clean", "drop caches", "scope", "warmup", "measured", "cleanup", "results"]
    # the default: nothing reported, the same cells in the same order
    again = run_sweep(_specs(plan, pool, caps), caps, 2, 0, tmp_path / "b")
    assert [r["capacity"] for r in again.rows] == [r["capacity"] for r in done.rows]
    # run again into its directory: every cell was retained, none runs
    third = run_sweep(_specs(plan, pool, caps), caps, 2, 0, tmp_path / "a")
    assert third.ran == [] and len(third.rows) == 4


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
    import moetrace.reports.sweep as repmod

    def fake_write_results(rows, out, plot=True):
        import pandas as pd

        return {"table": pd.DataFrame({"capacity": [r["capacity"] for r in rows]}), "files": {}}

    plan, pool = fake_cell_jobs(monkeypatch, tmp_path)
    monkeypatch.setattr(repmod, "write_results", fake_write_results)
    return ["--plan", plan, "--pool", pool]


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
    r = _invoke(args[:-1] + [str(tmp_path / "s2"), "--json"], {"MOETRACE_PROGRESS": "1", "CI": None})
    assert r.exit_code == 0, r.output
    assert r.stderr == "" and json.loads(r.stdout)["cells"] == 4 and len(json.loads(r.stdout)["ran"]) == 4
    r = _invoke(args[:-1] + [str(tmp_path / "s3")], {"MOETRACE_PROGRESS": "0", "CI": None})
    assert r.exit_code == 0 and r.stderr == ""
    # the first sweep's directory again: all 4 retained there, none runs, the bar starts full
    r = _invoke(args + ["--json"], {"MOETRACE_PROGRESS": "0", "CI": None})
    assert r.exit_code == 0 and json.loads(r.stdout)["ran"] == [] and json.loads(r.stdout)["retained"] == 4


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
    from moetrace.capacity.sweep import run_sweep

    def boom(*a):
        raise OSError("the terminal went away")

    plan, pool = fake_cell_jobs(monkeypatch, tmp_path)
    done = run_sweep(_specs(plan, pool, [("1MiB", 1 << 20)]), [("1MiB", 1 << 20)], 3, 0, tmp_path / "s",
                     on_status=boom)
    assert len(done.rows) == 3 and done.stopped is None
