"""The wheel on the live kernel (issue 33, acceptance 1; live tier): installed into a fresh venv,
run from outside the checkout with neither clang nor bpftool on PATH, `record -- true` writes a
complete run and `watch --pid` follows a short process to its end. The wheel is built once per
session (tests/common/wheel.py; the no-kernel half is tests/unit/test_packaging.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from common.wheel import installed_wheel

#: the only programs on PATH besides the venv's: what record and watch exec (the command, mount(8))
_TOOLS = ("true", "sh", "mount", "umount")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return installed_wheel(tmp_path_factory)


@pytest.fixture
def bare_env(wheel, tmp_path) -> dict[str, str]:
    """The venv's bin/ and a directory of the few tools record runs: no clang, no bpftool (the
    minimal BTF is then not made and libbpf reads the kernel's own); the BTF cache in tmp_path."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for t in _TOOLS:
        where = shutil.which(t)
        assert where, f"{t} not found"
        (tools / t).symlink_to(where)
    return wheel.env(PATH=f"{wheel.venv / 'bin'}{os.pathsep}{tools}", MOETRACE_BTF_CACHE=str(tmp_path / "btf"))


@pytest.mark.live
def test_record_true_from_the_wheel(live, wheel, bare_env, tmp_path):
    run = tmp_path / "run"
    r = subprocess.run([str(wheel.venv / "bin" / "moetrace"), "record", "--out", str(run), "--", "true"],
                       cwd=tmp_path, env=bare_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["exit_status"] == 0, manifest
    assert not list((tmp_path / "btf").glob("*.btf"))  # no bpftool: no minimal BTF, and no need of one


@pytest.mark.live
def test_watch_pid_of_a_short_process_from_the_wheel(live, wheel, bare_env, tmp_path):
    """watch attaches, then the process (waiting on its stdin until then) ends, and watch with it."""
    child = subprocess.Popen(["sh", "-c", "read x; exit 0"], stdin=subprocess.PIPE, env=bare_env)
    out, err = tmp_path / "watch.out", tmp_path / "watch.err"
    with open(out, "w") as o, open(err, "w") as e:
        w = subprocess.Popen([str(wheel.venv / "bin" / "moetrace"), "watch", "--json", "--pid", str(child.pid), "0.5"],
                             cwd=tmp_path, env=bare_env, stdout=o, stderr=e)
    try:
        deadline = time.monotonic() + 120
        while "watching every" not in err.read_text() and w.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "watching every" in err.read_text(), err.read_text()
        child.stdin.close()  # the process ends now
        assert child.wait(30) == 0
        rc = w.wait(60)
    finally:
        for p in (child, w):
            if p.poll() is None:
                p.kill()
                p.wait()
    text = err.read_text()
    assert rc == 0 and f"stopped: process {child.pid} exited; probes detached" in text, text
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines and all("pool" in x for x in lines), out.read_text()[-2000:]
