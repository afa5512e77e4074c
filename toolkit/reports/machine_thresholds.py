"""The per-machine thresholds file: the spread between identical cells that `moetrace calibrate`
measured on this machine, per host and mechanism, which `moetrace check` finds by itself with one
cell a side (moetrace.analyses.spread: its form, and what check does with it).

Where: ``$MOETRACE_MACHINE_THRESHOLDS`` when set (empty: no file at all); else check reads
``$XDG_STATE_HOME/moetrace/thresholds.toml`` (``~/.local/state``; what calibrate writes when not
root), then :data:`SYSTEM_FILE` (``/var/lib/moetrace/thresholds.toml``, beside the lab's state:
what calibrate writes as root, readable by every user); the first that has a host and mechanism
wins. calibrate merges into its file: its host and mechanism entries replace the file's, the rest
stay.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from moetrace.analyses.spread import SpreadEntries, parse_spread, spread_toml
from moetrace.errors import InputError

#: an explicit per-machine file (tests, a shared cluster's own place); empty: none at all
MACHINE_ENV = "MOETRACE_MACHINE_THRESHOLDS"
#: where `moetrace calibrate` run as root writes the machine's spread, and every user's check reads it
SYSTEM_FILE = Path("/var/lib/moetrace/thresholds.toml")


def user_file() -> Path:
    """$XDG_STATE_HOME/moetrace/thresholds.toml (~/.local/state): where calibrate as another user
    than root writes."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "moetrace" / "thresholds.toml"


def machine_paths() -> list[Path]:
    """The per-machine files check reads, first match wins: $MOETRACE_MACHINE_THRESHOLDS alone
    when set (empty: none), else the user's (:func:`user_file`) then :data:`SYSTEM_FILE`."""
    env = os.environ.get(MACHINE_ENV)
    if env is not None:
        return [Path(env)] if env.strip() else []
    return [user_file(), SYSTEM_FILE]


def machine_write_path() -> Path | None:
    """Where calibrate writes by default: $MOETRACE_MACHINE_THRESHOLDS when set (empty: nowhere),
    else :data:`SYSTEM_FILE` as root, the user's file otherwise."""
    env = os.environ.get(MACHINE_ENV)
    if env is not None:
        return Path(env) if env.strip() else None
    return SYSTEM_FILE if os.geteuid() == 0 else user_file()


def read_machine_file(path: Path, metrics: Iterable[str]) -> SpreadEntries:
    """The entries of one per-machine file ({} when it does not exist); a broken one is an
    InputError naming it and the fix."""
    import tomllib

    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise InputError(f"cannot read the per-machine thresholds file: {e}", path=str(path),
                         hint=f"run `moetrace calibrate` again, remove the file, or set {MACHINE_ENV}= to ignore "
                              "it") from None
    return parse_spread(doc.get("spread"), metrics, str(path), f"this machine's file {path}")


def machine_entries(metrics: Iterable[str]) -> SpreadEntries:
    """Every per-machine file's entries, the first path's winning (machine_paths)."""
    metrics = list(metrics)
    out: SpreadEntries = {}
    for p in reversed(machine_paths()):
        out.update(read_machine_file(p, metrics))
    return out


MACHINE_HEADER = ("# moetrace: the spread of each metric between identical cells, per host and capacity\n"
                  "# mechanism. Written by `moetrace calibrate`; read by `moetrace check` with one cell a side\n"
                  "# (a regression only beyond `limit` and `floor`; `cv`: sd of ln(value) between identical\n"
                  "# cells, for the repeats that would decide).\n")


def write_machine_file(path: Path, entries: SpreadEntries, metrics: Iterable[str]) -> None:
    """Merge ``entries`` into the per-machine file ``path`` (theirs replace the file's of the same
    host and mechanism; the rest are kept), atomically, its directory made first."""
    from moetrace.atomic import atomic_write

    merged = read_machine_file(path, metrics)
    merged.update(entries)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot make the per-machine thresholds file's directory: {e.strerror}",
                         path=str(path.parent), hint=f"run as root, or set {MACHINE_ENV} to a writable path") from None
    with atomic_write(path, what="per-machine thresholds file") as tmp:
        tmp.write_text(MACHINE_HEADER + spread_toml(merged))
