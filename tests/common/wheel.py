"""A wheel of this checkout, installed into a fresh venv outside it (tests/unit/test_packaging.py,
tests/live/test_wheel.py; issue 33, acceptance 1).

Built once per test session, whichever tier asks first: the sources the wheel is made of
(pyproject.toml, setup.py, README.md, toolkit/, analyses/, probes/ with probes/build/*.bpf.o) are
copied to a temporary directory and built there, so no build/ or egg-info of an earlier build can
slip a module into the wheel that the tree no longer ships, and the checkout is left as it was.
``pip wheel --no-build-isolation`` when this interpreter's setuptools satisfies pyproject's
build requirement (the bootstrap's venv: offline), else with build isolation (pip fetches
setuptools). The venv has no pip and no dependencies of its own: a .pth names the directories
this interpreter has them in (offline, ~0.1 s instead of a download); the venv's own
site-packages, where the wheel goes, comes first.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: package -> folder of the checkout (pyproject's package-dir)
PACKAGE_DIR: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
_SOURCES = ("pyproject.toml", "setup.py", "README.md", *sorted(set(PACKAGE_DIR.values())))
# compiled leftovers and what only a compile needs (vmlinux.h: 2.8 MB) stay out of the copy
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "vmlinux.h", "*.tmp")
#: what a command run from the wheel must not inherit from the test's environment
_ENV_DROP = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MOETRACE_PROBE_OBJECTS")


def tree_modules() -> set[str]:
    """Every module of the checkout, named as installed (toolkit/run/handle.py -> moetrace.run.handle)."""
    out = set()
    for pkg, folder in PACKAGE_DIR.items():
        for p in (ROOT / folder).rglob("*.py"):
            rel = p.relative_to(ROOT / folder).with_suffix("")
            out.add(".".join([pkg, *(x for x in rel.parts if x != "__init__")]))
    return out


@dataclass(frozen=True)
class Installed:
    """The wheel and the venv it is installed in."""

    wheel: Path
    venv: Path
    build_s: float  # copy + pip wheel
    install_s: float  # venv + pip install
    isolated: bool  # built with build isolation (this interpreter's setuptools was too old)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _ENV_DROP}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', os.defpath)}"
        return {**env, **extra}

    def run(self, *argv: str | os.PathLike, cwd: Path, timeout: float = 300,
            **extra_env: str) -> subprocess.CompletedProcess:
        """``argv`` (argv[0] a program of the venv's bin/, e.g. "moetrace" or "python") in ``cwd``."""
        exe = self.venv / "bin" / str(argv[0])
        return subprocess.run([str(exe), *map(str, argv[1:])], cwd=cwd, env=self.env(**extra_env),
                              capture_output=True, text=True, timeout=timeout)


def _setuptools_will_do() -> bool:
    """This interpreter's setuptools satisfies pyproject's [build-system] requires."""
    for r in map(Requirement, PYPROJECT["build-system"]["requires"]):
        try:
            if not r.specifier.contains(md.version(r.name), prereleases=True):
                return False
        except md.PackageNotFoundError:
            return False
    return True


def _dependency_dirs() -> list[str]:
    """The sys.path entries this interpreter finds moetrace's dependencies in."""
    dirs: list[str] = []
    for spec in PYPROJECT["project"]["dependencies"]:
        d = str(md.distribution(Requirement(spec).name).locate_file(""))
        if d not in dirs:
            dirs.append(d)
    return dirs


def build_wheel(work: Path) -> tuple[Path, bool]:
    """Copy the sources under ``work``/src, build the wheel into ``work``/dist."""
    src, dist = work / "src", work / "dist"
    for name in _SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=_IGNORE)
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, src / name)
    isolated = not _setuptools_will_do()
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src),
           *([] if isolated else ["--no-build-isolation"])]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=work)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    (wheel,) = dist.glob("moetrace-*.whl")
    return wheel, isolated


def install(wheel: Path, venv: Path) -> None:
    """A venv without pip at ``venv``, the dependencies by a .pth, ``wheel`` installed into it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site,) = venv.glob("lib/python3*/site-packages")
    (site / "zz_moetrace_dependencies.pth").write_text("".join(d + "\n" for d in _dependency_dirs()))
    # --ignore-installed: the moetrace of this interpreter (an editable install) stays untouched
    cmd = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps",
           "--no-index", "--ignore-installed", str(wheel)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")


_BUILT: dict[str, Installed] = {}


def installed_wheel(tmp_path_factory) -> Installed:
    """The wheel built and installed once per session (a module-scoped fixture of each tier calls this)."""
    if "wheel" not in _BUILT:
        work = tmp_path_factory.mktemp("wheel")
        t0 = time.monotonic()
        wheel, isolated = build_wheel(work)
        t1 = time.monotonic()
        install(wheel, work / "venv")
        _BUILT["wheel"] = Installed(wheel, work / "venv", t1 - t0, time.monotonic() - t1, isolated)
    return _BUILT["wheel"]
