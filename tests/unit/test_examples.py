"""The examples run as shipped (unit tier)."""

from __future__ import annotations

from common.examples import *  # noqa: F401,F403


def test_api_example():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "api.py")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "accepted tokens:" in r.stdout and "belady" in r.stdout


def test_domain_shift_example(tmp_path):
    env = dict(os.environ, MOETRACE=str(Path(sys.executable).with_name("moetrace")))
    r = subprocess.run(["bash", str(ROOT / "examples" / "domain_shift.sh"), str(tmp_path), "olmoe"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "batch4.bin").stat().st_size > 0
    assert (tmp_path / "batch4.png").stat().st_size > 0
    assert "accepted tokens" in r.stdout


def test_notebook_example(tmp_path):
    """examples/notebook.py reads the recorded test sweep through moetrace.open_sweep / open_run."""
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "notebook.py"),
                        str(ROOT / "tests" / "data" / "reports" / "sweep"), str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "32MiB-r0: tables" in r.stdout and "amplification" in r.stdout
    assert (tmp_path / "report" / "report.html").is_file()


def _dry(tmp_path, script: str, out, more: str = ""):
    """Run examples/SCRIPT OUT through a moetrace shim: `pool create` makes an empty directory (no
    512 MiB of writes), `lab matrix` runs with --dry-run (no guests), ``more``: other case arms."""
    real = Path(sys.executable).with_name("moetrace")
    shim = tmp_path / "moetrace"
    shim.write_text(f'#!/bin/sh\ncase "$1" in\n  pool) mkdir -p "$3"; exit 0;;\n  lab) exec {real} "$@" --dry-run;;\n'
                    f'{more}esac\nexec {real} "$@"\n')
    shim.chmod(0o755)
    return subprocess.run(["bash", str(ROOT / "examples" / script), str(out)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, MOETRACE=str(shim)))


def test_lab_matrix_example_builds_its_inputs_and_spec(tmp_path):
    """examples/lab_matrix.sh as shipped, its `lab matrix` run with --dry-run (the real one boots
    90 guests: the live tier runs a two-cell matrix), its pool left out (512 MiB of writes)."""
    r = _dry(tmp_path, "lab_matrix.sh", tmp_path / "m")
    assert r.returncode == 0, r.stderr
    assert "90 cells in 6 conditions" in r.stderr and r.stdout.count("cells/") == 90
    assert "cells/7.2-mglru-off/" in r.stdout or "cells/newest-mglru-off/" in r.stdout


def test_lab_calibrate_example_makes_its_two_matrices_then_calibrates_and_checks(tmp_path):
    """examples/lab_calibrate.sh as shipped: its `lab matrix` runs dry (the real one boots 75
    guests), then calibrate and check, which a shim records instead of running (no cells)."""
    log = tmp_path / "calls"
    r = _dry(tmp_path, "lab_calibrate.sh", tmp_path / "c", f'  calibrate|check) echo "$@" >> {log}; exit 0;;\n')
    assert r.returncode == 0, r.stderr
    assert "72 cells in 4 conditions" in r.stderr and "3 cells in 1 condition\n" in r.stderr
    assert r.stdout.count("cells/") == 75 and "check C/8: exit 0" in r.stdout
    calls = log.read_text().splitlines()
    assert calls[0] == f"calibrate {tmp_path / 'c' / 'aa'} --write-thresholds {tmp_path / 'c' / 'thresholds.toml'}"
    assert calls[1] == f"check {tmp_path / 'c' / 'check-base'} {tmp_path / 'c' / 'check-cand'}"
