"""The package's shape: every module imports on its own, no import cycles, arrows down the
flow (docs/architecture.md, "The arrows allowed"): analyses import only inputs and run; record never imports
replay; nothing below the CLI imports it."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import moetrace


def _modules() -> dict[str, Path]:
    import moetrace.analyses
    import moetrace.probes

    # moetrace.probes (probes/: the objects' directory, a leaf) is a module of its own, not `moetrace`
    out = {"moetrace": Path(moetrace.__file__), "moetrace.analyses": Path(moetrace.analyses.__file__),
           "moetrace.probes": Path(moetrace.probes.__file__)}
    # moetrace.analyses lives in analyses/, beside toolkit/ (pyproject's package-dir): walked apart
    for path, prefix in ((moetrace.__path__, "moetrace."), (moetrace.analyses.__path__, "moetrace.analyses.")):
        for m in pkgutil.walk_packages(path, prefix):
            spec = m.module_finder.find_spec(m.name.rsplit(".", 1)[1])  # type: ignore[union-attr]
            if spec is not None and spec.origin and spec.origin.endswith(".py"):
                out[m.name] = Path(spec.origin)
    return out


def test_the_walk_sees_every_folder_of_the_package():
    assert {"moetrace.analyses.sim", "moetrace.analyses.amplification", "moetrace.record.recorder",
            "moetrace.reports.report"} <= set(MODULES)


MODULES = _modules()


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    is_pkg = MODULES[mod].name == "__init__.py"
    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mod: str, top_level_only: bool) -> set[str]:
    """moetrace modules ``mod`` imports (module level only, or anywhere)."""
    tree = ast.parse(MODULES[mod].read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for n in nodes:
        if isinstance(n, ast.If) and top_level_only:  # if TYPE_CHECKING: never at run time
            continue
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = _resolve(mod, n)
            names = [base] + [f"{base}.{a.name}" for a in n.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != mod and name.startswith("moetrace"):
                out.add(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    # every import is an arrow, a package's of its own submodules too (moetrace.__getattr__ imports
    # run.handle: were anything under it to import `moetrace` for its version, that is a cycle)
    return {m: imports(m, top_level_only) for m in MODULES}


def test_the_cycle_check_counts_a_package_importing_its_own_submodule():
    """No allowance: moetrace's lazy __getattr__ importing run.handle is an arrow, so anything under
    run.handle importing `moetrace` (for its version: moetrace.version is the leaf to import) is a cycle."""
    g = _graph(False)
    assert "moetrace.run.handle" in g["moetrace"] and "moetrace.version" in g["moetrace"]
    assert _cycles({**g, "moetrace.run.directory": g["moetrace.run.directory"] | {"moetrace"}}) != []


def test_no_import_cycles_at_module_level():
    assert _cycles(_graph(True)) == []


def test_no_import_cycles_at_all():
    """Also the lazy (function-level) imports: no module needs another that needs it."""
    assert _cycles(_graph(False)) == []


def test_the_flow_points_down():
    g = _graph(False)
    for m, deps in g.items():
        if m.startswith("moetrace.analyses"):
            bad = {d for d in deps if not d.startswith(("moetrace.analyses", "moetrace.inputs", "moetrace.run",
                                                        "moetrace.errors", "moetrace.jsonutil"))}
            assert not bad, (m, bad)
        if m.startswith("moetrace.record"):
            assert not {d for d in deps if d.startswith("moetrace.replay")}, m
        if not m.startswith("moetrace.cli"):
            assert not {d for d in deps if d.startswith("moetrace.cli")}, m


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_every_module_imports_on_its_own(mod):
    r = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_replay_stays_light():
    """The replay runs inside a cell's memory scope: what it imports is taken from the headroom
    (measured: pandas + pyarrow pulled in through the run directory module raised the replay's
    RSS from 32 to 101 MB and made the demo's 96 MiB cell thrash). No pandas, pyarrow, click or
    bcc in `replay`'s process."""
    code = ("import sys, moetrace.cli.replay, moetrace.replay.harness; "
            "print(','.join(m for m in ('pandas', 'pyarrow', 'bcc', 'matplotlib') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"the replay imports {r.stdout.strip()}"


def test_the_recorder_starts_without_the_table_libraries():
    """`record`'s start-up imports no pandas/pyarrow: the recorder loads them in a thread while
    clang compiles the probes (moetrace.lazyimport; 0.35 s of start-up measured). A module of
    record/ that imports pandas at the top puts them back on the start-up path."""
    mods = ["moetrace.cli.record", "moetrace.record.recorder", "moetrace.record.probe",
            *(f"moetrace.record.probes.{p}" for p in ("pagecache", "block", "reclaim", "lru", "mlock", "reads",
                                                      "stacks", "mglru"))]
    code = (f"import sys, importlib; [importlib.import_module(m) for m in {mods!r}]; "
            "print(','.join(m for m in ('pandas', 'pyarrow') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"record's start-up imports {r.stdout.strip()}"


def test_lazy_pandas_is_pandas():
    from moetrace.lazyimport import pandas as lazy_pd
    import pandas

    assert lazy_pd.DataFrame is pandas.DataFrame and lazy_pd.NA is pandas.NA


def test_warm_imports_where_cpus_are_serial_only_for_a_command_in_a_cgroup(monkeypatch):
    """The lab's TCG guest sets MOETRACE_WARM_IMPORTS: the recorder imports those libraries
    before the command only when the command joins a cgroup (their page cache is then charged
    to the recorder's, not to the cgroup under test), else nothing (3 s of a TCG guest's
    start-up); without it, the table libraries while the probes load."""
    from moetrace.lazyimport import TABLE_LIBRARIES, WARM_ENV, warm_names

    monkeypatch.delenv(WARM_ENV, raising=False)
    assert warm_names(joins_cgroup=False) == warm_names(joins_cgroup=True) == TABLE_LIBRARIES
    monkeypatch.setenv(WARM_ENV, "pyarrow, pyarrow.parquet")
    assert warm_names(joins_cgroup=True) == ("pyarrow", "pyarrow.parquet")
    assert warm_names(joins_cgroup=False) == ()
    monkeypatch.setenv(WARM_ENV, "")
    assert warm_names(joins_cgroup=True) == ()


def test_json_default_converts_numpy_without_importing_it():
    """moetrace.jsonutil imports no numpy (1.7 s of a TCG guest's start-up): a numpy object
    exists only once numpy has been imported, and is converted then; anything else is refused."""
    import json
    import subprocess
    import sys

    code = ("import sys, json; from moetrace.jsonutil import json_default; assert 'numpy' not in sys.modules\n"
            "try:\n    json.dumps(object(), default=json_default)\nexcept TypeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "not JSON serializable: object"
    import numpy as np

    from moetrace.jsonutil import json_default

    doc = {"i": np.int64(3), "f": np.float32(0.5), "nan": np.float32("nan"), "b": np.bool_(True), "a": np.arange(3)}
    assert json.loads(json.dumps(doc, default=json_default)) == {"i": 3, "f": 0.5, "nan": None, "b": True, "a": [0, 1, 2]}
