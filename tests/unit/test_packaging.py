"""The wheel (issue 33, acceptance 1; no-kernel tier): built from this checkout, installed into a
fresh venv outside it, it holds every module of the tree and the probe objects, and from a
directory outside the checkout every command answers --help and `doctor --json` prints JSON.
The live tier (tests/live/test_wheel.py) records and watches with it. The version is declared once."""

from __future__ import annotations

import json
import os
import re
import tomllib

import pytest

from common.wheel import PACKAGE_DIR, ROOT, installed_wheel, tree_modules


# what the installed package holds, as the venv's Python sees it (run with the wheel's python)
_INSPECT = """
import importlib, json, pkgutil, moetrace
from moetrace.probes import BUILD_SCRIPT, PROBES_DIR
mods = {"moetrace"} | {m.name for m in pkgutil.walk_packages(moetrace.__path__, "moetrace.")}
failed = {}
for m in sorted(mods):
    try:
        importlib.import_module(m)
    except Exception as e:
        failed[m] = f"{type(e).__name__}: {e}"
print(json.dumps({"file": moetrace.__file__, "version": moetrace.__version__, "modules": sorted(mods),
                  "failed": failed, "build_script": str(BUILD_SCRIPT), "probes_dir": str(PROBES_DIR),
                  "probe_files": sorted(str(p.relative_to(PROBES_DIR)) for p in PROBES_DIR.rglob("*.bpf.*"))}))
"""

# every command path of the installed click group (walked, not listed)
_COMMANDS = """
import json, click
from moetrace.cli import cli

def walk(group, prefix):
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        yield prefix + [name]
        if isinstance(cmd, click.Group):
            yield from walk(cmd, prefix + [name])

print(json.dumps([[]] + list(walk(cli, []))))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    w = installed_wheel(tmp_path_factory)
    print(f"\nwheel built in {w.build_s:.1f} s{' (build isolation)' if w.isolated else ''}, "
          f"installed in {w.install_s:.1f} s")
    return w


@pytest.fixture(scope="module")
def inspected(wheel, tmp_path_factory) -> dict:
    """What the installed package holds, as the wheel's Python sees it from outside the checkout."""
    r = wheel.run("python", "-c", _INSPECT, cwd=tmp_path_factory.mktemp("outside"))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def outside(tmp_path):
    """A working directory outside the checkout."""
    assert ROOT not in tmp_path.resolve().parents
    return tmp_path


def test_the_wheel_installs_every_module_of_the_tree_and_each_imports(wheel, inspected):
    got = inspected
    assert got["file"].startswith(str(wheel.venv)), f"moetrace imported from {got['file']}, not the wheel"
    missing = tree_modules() - set(got["modules"])
    assert not missing, f"modules of the tree the wheel lacks (a package setup.py did not find?): {sorted(missing)}"
    assert set(got["modules"]) == tree_modules()
    assert got["failed"] == {}
    assert got["build_script"] == "None"  # installed: objects are used as built, never called stale


def test_the_wheel_carries_the_probe_objects_and_sources_not_vmlinux_h(inspected):
    files = set(inspected["probe_files"])
    probes_dir = ROOT / PACKAGE_DIR["moetrace.probes"]
    names = sorted(p.name.removesuffix(".bpf.c") for p in probes_dir.glob("*.bpf.c"))
    assert names, "no probes/*.bpf.c in the checkout"
    assert {f"build/{n}.bpf.o" for n in names} <= files, "a probe object is missing: bash scripts/build-probes.sh"
    assert {f"{n}.bpf.c" for n in names} | {"moetrace.bpf.h"} <= files
    assert "build/vmlinux.h" not in files  # only a compile reads it


def test_every_command_answers_help_outside_the_checkout(wheel, outside):
    r = wheel.run("python", "-c", _COMMANDS, cwd=outside)
    assert r.returncode == 0, f"the command tree does not load from the wheel:\n{r.stderr}"
    paths = json.loads(r.stdout)
    assert ["watch"] in paths and ["lab", "run"] in paths and len(paths) > 20
    bad = {}
    for path in paths:
        h = wheel.run("moetrace", *path, "--help", cwd=outside, timeout=120)
        if h.returncode != 0 or "Usage:" not in h.stdout:
            bad[" ".join(["moetrace", *path])] = (h.stdout + h.stderr)[-800:]
    assert not bad, bad
    h = wheel.run("replay", "--help", cwd=outside)  # the second console script
    assert h.returncode == 0 and "Usage:" in h.stdout, h.stderr


def test_doctor_json_outside_the_checkout(wheel, outside):
    r = wheel.run("moetrace", "doctor", "--json", cwd=outside)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["rows"] and {"plans", "kernel"} <= set(rep)


def test_the_version_is_declared_once():
    """pyproject.toml reads it from moetrace/version.py; the package and the wheel's metadata say it."""
    import moetrace
    from moetrace.version import __version__

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert moetrace.__version__ == __version__ and re.fullmatch(r"\d+\.\d+\.\d+\S*", __version__)


def test_the_wheel_is_named_by_that_version_and_says_it(wheel, inspected):
    from moetrace.version import __version__

    assert wheel.wheel.name.startswith(f"moetrace-{__version__}-") and inspected["version"] == __version__


def test_an_installed_object_is_never_stale_and_a_missing_one_says_to_reinstall(monkeypatch, tmp_path):
    from moetrace.kernel import bpf

    obj = tmp_path / "pagecache.bpf.o"
    monkeypatch.setattr(bpf, "object_path", lambda name: tmp_path / f"{name}.bpf.o")
    monkeypatch.setattr(bpf, "core_source", lambda name: tmp_path / f"{name}.bpf.c")
    obj.write_bytes(b"")
    (tmp_path / "pagecache.bpf.c").write_text("newer")
    os.utime(obj, (1, 1))
    monkeypatch.setattr(bpf, "BUILD_SCRIPT", ROOT / "scripts" / "build-probes.sh")
    assert "older than pagecache.bpf.c" in bpf.stale_object("pagecache")  # a checkout: rebuild
    monkeypatch.setattr(bpf, "BUILD_SCRIPT", None)
    assert bpf.stale_object("pagecache") is None  # installed: as the wheel built it
    assert "reinstall moetrace" in bpf.stale_object("block")
