"""Packages found, not listed: every package beneath the folders pyproject.toml's
[tool.setuptools] package-dir maps (moetrace = toolkit/, moetrace.analyses = analyses/,
moetrace.probes = probes/). Everything else is in pyproject.toml."""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

ROOTS = tomllib.loads((Path(__file__).parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def packages() -> list[str]:
    """Each mapped package and the packages under its folder (a folder with __init__.py)."""
    return sorted({name for pkg, folder in ROOTS.items()
                   for name in [pkg, *(f"{pkg}.{sub}" for sub in find_packages(folder))]})


setup(packages=packages())
