"""Property-based fuzzing of the files a user hands moetrace: mutations, the typed-failure
check and a CLI runner, shared by tests/unit/test_fuzz_readers.py and any other reader's
fuzz test (the trace importers' can reuse every helper here).

The property every reader must keep: a mutated input either reads, or raises the one
typed error :class:`moetrace.errors.InputError` (or its subclass PlanFormatError, or a
UsageError where it really is a usage problem) whose message names the file; nothing
else escapes. Through the CLI: exit status 0, 1 or 2, no traceback, and no half-written
output (no ``*.tmp-*`` left, earlier outputs untouched when the command fails).

Budget: ``FUZZ`` (the ``moetrace-fuzz`` hypothesis profile) runs ``MOETRACE_FUZZ_EXAMPLES``
examples per property (default 50), no deadline, derandomized when ``CI`` is set (a CI run
is reproducible and needs no example database). A long local run::

    MOETRACE_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest tests/unit/test_fuzz_readers.py
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable

from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st

FUZZ_EXAMPLES = int(os.environ.get("MOETRACE_FUZZ_EXAMPLES") or 50)
IN_CI = bool(os.environ.get("CI"))

settings.register_profile(
    "moetrace-fuzz",
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=IN_CI,
    database=None if IN_CI else settings.default.database,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                           HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
#: the settings of every fuzz property (apply as ``@FUZZ`` or ``@fuzz(fraction)``)
FUZZ = settings.get_profile("moetrace-fuzz")


def fuzz(fraction: float = 1.0) -> settings:
    """The fuzz profile with ``fraction`` of the examples (at least 5): for slow properties."""
    return settings(FUZZ, max_examples=max(5, int(FUZZ_EXAMPLES * fraction)))


# -- values ------------------------------------------------------------------------------------

#: numbers that break naive readers: huge, past int64 / uint64, negative, non-finite
HUGE_NUMBERS: list[Any] = [1e23, -1e23, 3e9, 2**31, 2**32, 2**63, 2**64, -(2**63), -1, -7, 1e308,
                           math.inf, -math.inf, math.nan, 0.5]
#: values of every JSON type (and the numbers above): a key given the wrong type
WRONG_VALUES: list[Any] = [None, True, False, 0, 1, "", "x", "é\u202e", [], [1, "a"], {}, {"x": 1},
                           *HUGE_NUMBERS]


# -- byte mutations ----------------------------------------------------------------------------

class Mutation(tuple):
    """(description, mutated value), shown by its description alone in hypothesis' reports."""

    def __new__(cls, what: str, value: Any):
        return super().__new__(cls, (what, value))

    def __repr__(self) -> str:
        return f"<{self[0]}>"

    def _repr_pretty_(self, p, cycle) -> None:  # hypothesis' reports: the description, not the bytes
        p.text(repr(self))


def _note(msg: str) -> None:
    """hypothesis.note inside a property, nothing outside one (deterministic tests share helpers)."""
    try:
        note(msg)
    except Exception:  # noqa: BLE001 - InvalidArgument: not inside a hypothesis test
        pass


BYTE_OPS = ("truncate", "flip", "overwrite", "insert", "delete", "empty", "invalid_utf8", "latin1", "zero_run")


def mutated_bytes(data: bytes, ops: Iterable[str] = BYTE_OPS) -> st.SearchStrategy[Mutation]:
    """A :class:`Mutation` of ``data`` by one of ``ops`` (see :func:`_byte_edit`). Compose it in
    a property: ``what, mutated = data.draw(mutated_bytes(raw))``."""
    return _mutated_bytes(data, tuple(ops))


@st.composite
def _mutated_bytes(draw, data: bytes, ops: Iterable[str] = BYTE_OPS) -> Mutation:
    return Mutation(*_byte_edit(draw, data, ops))


def _byte_edit(draw, data: bytes, ops: Iterable[str]) -> tuple[str, bytes]:
    """(description, mutated data): truncation at any offset, 1-4 bit flips, a run of random
    or zero bytes written over, bytes inserted or deleted, the empty file, invalid UTF-8
    (0xff 0xfe, a lone continuation byte) or latin-1 (the text with a non-ASCII
    character, encoded as latin-1)."""
    op = draw(st.sampled_from([o for o in ops]))
    n = len(data)
    if op == "empty" or n == 0:
        return "empty file", b""
    if op == "truncate":
        at = draw(st.integers(0, n - 1))
        return f"truncated at offset {at} of {n}", data[:at]
    if op == "flip":
        out = bytearray(data)
        flips = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 7)), min_size=1, max_size=4))
        for at, bit in flips:
            out[at] ^= 1 << bit
        return f"bits flipped at (offset, bit) {flips}", bytes(out)
    if op in ("overwrite", "zero_run"):
        at = draw(st.integers(0, n - 1))
        ln = draw(st.integers(1, min(64, n - at)))
        junk = bytes(ln) if op == "zero_run" else draw(st.binary(min_size=ln, max_size=ln))
        return f"{ln} bytes {'zeroed' if op == 'zero_run' else 'overwritten'} at offset {at}", \
            data[:at] + junk + data[at + ln:]
    if op == "insert":
        at = draw(st.integers(0, n))
        junk = draw(st.binary(min_size=1, max_size=16))
        return f"{junk!r} inserted at offset {at}", data[:at] + junk + data[at:]
    if op == "delete":
        at = draw(st.integers(0, n - 1))
        ln = draw(st.integers(1, min(32, n - at)))
        return f"{ln} bytes deleted at offset {at}", data[:at] + data[at + ln:]
    if op == "invalid_utf8":
        at = draw(st.integers(0, n))
        junk = draw(st.sampled_from([b"\xff\xfe", b"\x80", b"\xc3(", b"\xed\xa0\x80", b"\x00"]))
        return f"{junk!r} (invalid UTF-8) inserted at offset {at}", data[:at] + junk + data[at:]
    if op == "latin1":
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return "latin-1 skipped (not UTF-8)", data
        quotes = [i for i, c in enumerate(text) if c == '"'] or [0]
        at = draw(st.sampled_from(quotes)) + 1
        text = text[:at] + "café " + text[at:]
        return f"'café' at character {at}, the file encoded as latin-1", text.encode("latin-1", "replace")
    raise AssertionError(op)


# -- JSON mutations ----------------------------------------------------------------------------

def json_paths(doc: Any, prefix: tuple = ()) -> Iterable[tuple]:
    """Every path (tuple of keys / indices) to a value in ``doc``, the root () first."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from json_paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:8]):  # long lists: their first items stand for the rest
            yield from json_paths(v, prefix + (i,))


def get_path(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def set_path(doc: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    """A deep copy of ``doc`` with the value at ``path`` replaced (or deleted)."""
    if not path:
        return value
    out = copy.deepcopy(doc)
    parent = get_path(out, path[:-1])
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return out


def dotted(path: tuple) -> str:
    return ".".join(str(k) for k in path) or "(the document)"


def mutated_json(doc: Any, max_mutations: int = 3) -> st.SearchStrategy[Mutation]:
    """A :class:`Mutation` of the JSON document ``doc`` (see :func:`_json_edit`); write it with
    :func:`dump_json`."""
    return _mutated_json(doc, max_mutations)


@st.composite
def _mutated_json(draw, doc: Any, max_mutations: int = 3) -> Mutation:
    return Mutation(*_json_edit(draw, doc, max_mutations))


def _json_edit(draw, doc: Any, max_mutations: int) -> tuple[str, Any]:
    """(description, mutated document): 1..max_mutations edits, each replacing one value by
    one of another type (WRONG_VALUES), a numeric leaf by a huge or negative number, or
    deleting a key. Paths are drawn depth first (a depth, then a path of that depth), so
    top-level keys, which readers touch most, are not drowned by deep ones."""
    what = []
    for _ in range(draw(st.integers(1, max_mutations))):
        paths = list(json_paths(doc))
        by_depth: dict[int, list[tuple]] = {}
        for p in paths:
            by_depth.setdefault(len(p), []).append(p)
        depth = draw(st.sampled_from(sorted(by_depth)))
        numeric = [p for p in paths if isinstance(get_path(doc, p), (int, float))
                   and not isinstance(get_path(doc, p), bool)]
        op = draw(st.sampled_from(["replace", "number", "delete"] if numeric else ["replace", "delete"]))
        if op == "number":
            path = draw(st.sampled_from(numeric))
            value = draw(st.sampled_from(HUGE_NUMBERS))
        else:
            path = draw(st.sampled_from(by_depth[depth]))
            value = draw(st.sampled_from(WRONG_VALUES))
        if op == "delete" and path and isinstance(get_path(doc, path[:-1]), dict):
            doc = set_path(doc, path, None, delete=True)
            what.append(f"deleted {dotted(path)}")
        else:
            doc = set_path(doc, path, value)
            what.append(f"{dotted(path)} = {value!r}")
    return "; ".join(what), doc


def dump_json(doc: Any) -> bytes:
    """JSON as Python writes it (NaN / Infinity allowed, as in any file json.dump made)."""
    return (json.dumps(doc, indent=1) + "\n").encode()


# -- the property ------------------------------------------------------------------------------

def typed_errors() -> tuple[type, ...]:
    from moetrace.errors import InputError, UsageError

    return InputError, UsageError


def assert_typed_failure(fn: Callable[[], Any], *paths: str | os.PathLike, usage_ok: bool = False,
                         what: str = "") -> Any:
    """Call ``fn``: return its result, or the typed error it raised, which must name one of
    ``paths`` (the file read, or the directory it lives in). Any other exception, a UsageError
    where ``usage_ok`` is false, or a message naming none of the paths fails the test."""
    from moetrace.errors import InputError, UsageError

    try:
        return fn()
    except (InputError, UsageError) as e:
        msg = e.format_message()
        _note(f"{what}: {type(e).__name__}: {msg}")
        if isinstance(e, UsageError) and not usage_ok:
            raise AssertionError(f"{what}: a UsageError for bad input data: {msg}") from e
        names = [str(p) for p in paths]
        assert any(n in msg for n in names), f"{what}: the error names none of {names}: {msg}"
        return e


def is_error(x: Any) -> bool:
    from moetrace.errors import MoetraceError

    return isinstance(x, MoetraceError)


def run_cli(args: list[Any], codes: Iterable[int] = (0, 1, 2), env: dict | None = None):
    """Invoke the moetrace click group in-process; assert the exit status is in ``codes``,
    no exception other than SystemExit escaped, and no traceback was printed."""
    from click.testing import CliRunner

    from moetrace.cli import cli

    r = CliRunner().invoke(cli, [str(a) for a in args], env=env)
    _note(f"moetrace {' '.join(map(str, args))} -> {r.exit_code}: {r.output[-2000:]}")
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        import traceback

        tb = "".join(traceback.format_exception(*r.exc_info))
        raise AssertionError(f"moetrace {' '.join(map(str, args))}: {type(r.exception).__name__} escaped\n{tb}")
    assert r.exit_code in tuple(codes), f"exit {r.exit_code}: {r.output[-2000:]}"
    assert "Traceback" not in r.output, r.output
    return r


def tree_state(root: Path) -> dict[str, bytes | None]:
    """Every file under ``root`` with its content (None for directories): to prove a failed
    command left earlier outputs untouched."""
    out: dict[str, bytes | None] = {}
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = None if p.is_dir() else p.read_bytes()
    return out


def leftover_temps(root: Path) -> list[str]:
    """Temporary files a writer left behind (``*.tmp-*``, ``.*.tmp``) under ``root``."""
    if not root.exists():
        return []
    return sorted(str(p) for p in root.rglob("*") if ".tmp-" in p.name or p.name.endswith(".tmp"))


__all__ = ["Mutation", "FUZZ", "FUZZ_EXAMPLES", "IN_CI", "HUGE_NUMBERS", "WRONG_VALUES", "BYTE_OPS", "fuzz",
           "mutated_bytes", "mutated_json", "json_paths", "get_path", "set_path", "dotted", "dump_json",
           "assert_typed_failure", "is_error", "run_cli", "tree_state", "leftover_temps", "typed_errors"]
