"""Rules of the house, read from the source (no-kernel tier): no module of the package uses
another module's private names, no function is longer than a person can hold, and a command
(moetrace.cli) is a thin shell around the library.

The checks parse every module of the package (toolkit/ as moetrace, analyses/ as
moetrace.analyses, probes/ as moetrace.probes) with ast; each has a test of its own on a snippet
that breaks the rule, so a checker that cannot fail would fail here first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"toolkit": "moetrace", "analyses": "moetrace.analyses", "probes": "moetrace.probes"}
MAX_FUNCTION_LINES = 100
#: a command parses, calls one library function and prints: what is longer holds library work
MAX_CLI_FUNCTION_LINES = 80


def modules() -> list[tuple[str, Path]]:
    out = []
    for folder, pkg in PACKAGES.items():
        for p in sorted((ROOT / folder).rglob("*.py")):
            rel = p.relative_to(ROOT / folder).with_suffix("")
            parts = [x for x in rel.parts if x != "__init__"]
            out.append((".".join([pkg, *parts]), p))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a (relative) import's module."""
    if not level:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def private_uses(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every use in ``source`` (the text of ``module``) of another package module's private
    name: ``from moetrace.x import _name`` and ``M._name`` where M was imported from moetrace."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the moetrace module it is
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("moetrace"):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            src = _absolute(module, is_package, node.level, node.module)
            if not src.startswith("moetrace"):
                continue
            for a in node.names:
                if _private(a.name) and src != module:
                    bad.append(f"line {node.lineno}: from {src} import {a.name}")
                elif not _private(a.name):
                    bound[a.asname or a.name] = f"{src}.{a.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in bound and bound[node.value.id] != module):
            bad.append(f"line {node.lineno}: {node.value.id}._{node.attr[1:]} ({bound[node.value.id]})")
    return bad


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    tree = ast.parse(source)
    return [f"{n.name} (line {n.lineno}): {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def test_the_private_name_checker_finds_each_form():
    src = ("from moetrace.inputs.trace import _ranges, typed\n"
           "from . import _local\n"
           "import moetrace.analyses.sim as S\n"
           "from moetrace.inputs import stream as ST\n"
           "import os\n"
           "def f(self):\n"
           "    S._counts(); ST._Fallback; os._exit(0); self._x; typed._y\n")
    bad = sorted(private_uses(src, "moetrace.reports.report"))
    assert bad == ["line 1: from moetrace.inputs.trace import _ranges", "line 2: from moetrace.reports import _local",
                   "line 7: S._counts (moetrace.analyses.sim)", "line 7: ST._Fallback (moetrace.inputs.stream)",
                   "line 7: typed._y (moetrace.inputs.trace.typed)"]
    # a module's own private names, and a package's __init__ importing from itself, are its business
    assert private_uses("from moetrace.reports.report import _x\n", "moetrace.reports.report") == []
    assert private_uses("from . import _x\n", "moetrace.reports", is_package=True) == []
    assert private_uses("from .. import _x\n", "moetrace.reports.report") == ["line 1: from moetrace import _x"]


def test_the_length_checker_counts_lines():
    body = "\n".join(f"    x{i} = {i}" for i in range(100))
    assert long_functions(f"def f():\n{body}\n") == ["f (line 1): 101 lines"]
    assert long_functions(f"def f():\n{body}\n", limit=101) == []


@pytest.mark.parametrize("module,path", modules(), ids=[m for m, _ in modules()])
def test_no_module_uses_another_modules_private_names(module, path):
    bad = private_uses(path.read_text(), module, path.name == "__init__.py")
    assert not bad, f"{path.relative_to(ROOT)} uses private names of other modules (make them public, or move " \
                    "the helper down a floor where both can import it):\n" + "\n".join(bad)


def test_no_function_is_over_100_lines():
    bad = [f"{p.relative_to(ROOT)}: {f}" for _, p in modules() for f in long_functions(p.read_text())]
    assert not bad, "functions over 100 lines (split them into named steps):\n" + "\n".join(bad)


def test_no_command_function_is_over_80_lines():
    """A command parses, calls one library function, prints (docs/architecture.md): a function of
    moetrace.cli over 80 lines (its docstring counts: it is the command's --help) does more."""
    cli = [(m, p) for m, p in modules() if m == "moetrace.cli" or m.startswith("moetrace.cli.")]
    assert len(cli) > 10
    bad = [f"{p.relative_to(ROOT)}: {f}" for _, p in cli for f in long_functions(p.read_text(), MAX_CLI_FUNCTION_LINES)]
    assert not bad, ("command functions over 80 lines (move the work into the library, the room it belongs "
                     "to, and call it):\n" + "\n".join(bad))
