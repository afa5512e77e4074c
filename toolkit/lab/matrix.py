"""The paper's §5 matrix: (kernel x MGLRU) conditions x capacity mechanisms x capacities x repeats,
every cell Algorithm 1 in a fresh boot of its condition (never a runtime MGLRU toggle: shadow
entries left by a switch make refaults activate pages; upstream calls switching at runtime not
recommended).

This module holds what does not need a guest: the spec (SPEC.toml), its cells and their order,
and the matrix directory's state, so that a stopped matrix resumes and never redoes a finished
cell. The directory::

    DIR/matrix.json                      the spec (resolved), its digest and every cell in order
    DIR/cells/<condition>/<cell>/        one lab directory per cell (lab.json, the cell's output)
    DIR/cells/<condition>/<cell>/done.json   written last, atomically: the cell is finished

A cell directory without done.json is a cell that was stopped part-way: it is cleared and run
again on resume.

SPEC.toml (every key but the first four has a default)::

    kernels = ["6.1", "6.12", "newest"]       # `lab run --kernel` names, or image paths
    mglru = ["on", "off"]
    mechanisms = ["cgroup", "balloon:0.74", "balloon:0.81", "vm-memory"]
    capacities = ["192MiB", "320MiB"]
    plan = "plan.bin"                         # relative paths: to the spec's directory
    pool = "/var/tmp/pool"
    repeats = 3
    mode = "pagecache"                        # the replay's read mode (pagecache = pread, mmap)
    seed = 1                                  # the cells' order within each condition
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moetrace.errors import InputError, UsageError

SCHEMA = "moetrace.matrix/1"
MGLRU_STATES = ("on", "off")
MODES = ("pagecache", "mmap")
REQUIRED = ("kernels", "mechanisms", "capacities", "plan", "pool")
KNOWN = REQUIRED + ("mglru", "repeats", "mode", "seed")
DONE = "done.json"


@dataclass(frozen=True)
class Mechanism:
    """How a cell's capacity is made: ``cgroup`` (a v2 memory wall), ``balloon`` (mlocked anonymous
    memory locking ``locked_fraction`` of the guest's), ``vm-memory`` (the guest's RAM itself)."""

    kind: str
    locked_fraction: float | None = None

    @property
    def label(self) -> str:
        return f"balloon{self.locked_fraction:g}" if self.kind == "balloon" else self.kind


def parse_mechanism(text: str, where: str) -> Mechanism:
    """'cgroup', 'balloon:0.81' or 'vm-memory'; UsageError naming ``where`` otherwise."""
    t = str(text).strip()
    if t in ("cgroup", "vm-memory"):
        return Mechanism(t)
    m = re.fullmatch(r"balloon:([0-9]*\.?[0-9]+)", t)
    if m and 0 < float(m.group(1)) < 1:
        return Mechanism("balloon", float(m.group(1)))
    raise UsageError(f"{where}: unknown mechanism {text!r}",
                     hint='write "cgroup", "vm-memory" or "balloon:F" with F the locked fraction, 0 < F < 1')


@dataclass(frozen=True)
class MatrixCell:
    kernel: str
    mglru: str
    mechanism: Mechanism
    capacity_label: str
    capacity_bytes: int
    repeat: int
    order: int  # position within its condition (randomized)

    @property
    def condition(self) -> str:
        return f"{_safe(self.kernel)}-mglru-{self.mglru}"

    @property
    def name(self) -> str:
        return f"{self.mechanism.label}-{self.capacity_label}-r{self.repeat}"

    @property
    def rel_dir(self) -> str:
        return f"cells/{self.condition}/{self.name}"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mechanism"] = self.mechanism.label
        d.update(condition=self.condition, name=self.name, dir=self.rel_dir)
        return d


def _safe(text: str) -> str:
    """A kernel name or path as a directory name ('/boot/vmlinuz-6.12.1' -> 'vmlinuz-6.12.1')."""
    return re.sub(r"[^A-Za-z0-9.+_-]+", "_", Path(text).name if "/" in text else text)


@dataclass(frozen=True)
class MatrixSpec:
    kernels: tuple[str, ...]
    mglru: tuple[str, ...]
    mechanisms: tuple[Mechanism, ...]
    capacities: tuple[tuple[str, int], ...]
    plan: str
    pool: str
    repeats: int = 3
    mode: str = "pagecache"
    seed: int = 1
    source: str | None = field(default=None, compare=False)

    def canonical(self) -> dict[str, Any]:
        """The spec as resolved (what the cells depend on), for matrix.json and the digest."""
        return {"kernels": list(self.kernels), "mglru": list(self.mglru),
                "mechanisms": [m.label for m in self.mechanisms],
                "capacities": [[lbl, b] for lbl, b in self.capacities], "plan": self.plan, "pool": self.pool,
                "repeats": self.repeats, "mode": self.mode, "seed": self.seed}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.canonical(), sort_keys=True).encode()).hexdigest()[:16]

    def cells(self) -> list[MatrixCell]:
        """Every cell: conditions in the spec's order (kernel, then MGLRU), the cells of each in a
        random order drawn from ``seed`` and the condition (stable across runs and resumes)."""
        out = []
        for k in self.kernels:
            for g in self.mglru:
                jobs = [(m, c, r) for m in self.mechanisms for c in self.capacities for r in range(self.repeats)]
                random.Random(f"{self.seed}/{k}/{g}").shuffle(jobs)
                out += [MatrixCell(k, g, m, c[0], c[1], r, i) for i, (m, c, r) in enumerate(jobs)]
        return out


def _list(doc: dict, key: str, path: str, default=None) -> list:
    v = doc.get(key, default)
    if isinstance(v, (str, int)):
        v = [v]
    if not isinstance(v, list) or not v:
        raise InputError(f"key {key!r} must be a non-empty list", path=path)
    return v


def load_spec(path: str | os.PathLike) -> MatrixSpec:
    """SPEC.toml -> MatrixSpec, every value checked; errors name the file and the key."""
    import tomllib

    from moetrace.capacity.sweep import parse_capacities

    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text())
    except OSError as e:
        raise InputError(f"cannot read the matrix spec: {e.strerror or e}", path=str(p)) from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"not TOML: {e}", path=str(p)) from None
    where = str(p)
    missing = [k for k in REQUIRED if k not in doc]
    if missing:
        raise InputError(f"missing key(s): {', '.join(missing)}", path=where,
                         hint="see `moetrace lab matrix --help` for a complete spec")
    unknown = sorted(set(doc) - set(KNOWN))
    if unknown:
        raise InputError(f"unknown key(s): {', '.join(unknown)}", path=where, hint=f"known: {', '.join(KNOWN)}")
    mglru = [str(g) for g in _list(doc, "mglru", where, list(MGLRU_STATES))]
    bad = [g for g in mglru if g not in MGLRU_STATES]
    if bad:
        raise InputError(f"mglru: {', '.join(bad)} is not on or off", path=where)
    mechs = [parse_mechanism(m, f"{where}: mechanisms") for m in _list(doc, "mechanisms", where)]
    try:
        caps = parse_capacities(",".join(str(c) for c in _list(doc, "capacities", where)))
    except UsageError as e:
        raise InputError(f"capacities: {e.message}", path=where) from None
    repeats, seed, mode = doc.get("repeats", 3), doc.get("seed", 1), str(doc.get("mode", "pagecache"))
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise InputError(f"repeats must be an integer >= 1, not {repeats!r}", path=where)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise InputError(f"seed must be an integer, not {seed!r}", path=where)
    if mode not in MODES:
        raise InputError(f"mode {mode!r} is not one of {', '.join(MODES)}", path=where)
    for lst, key in ((mglru, "mglru"), ([m.label for m in mechs], "mechanisms"), (doc["kernels"], "kernels")):
        if len(set(map(str, lst))) != len(lst):
            raise InputError(f"{key} names one twice", path=where)
    base = p.resolve().parent
    files = {k: str((base / str(doc[k])).resolve()) for k in ("plan", "pool")}
    return MatrixSpec(tuple(str(k) for k in _list(doc, "kernels", where)), tuple(mglru), tuple(mechs), tuple(caps),
                      files["plan"], files["pool"], repeats, mode, seed, source=str(p))


# ---------------------------------------------------------------------------
# the matrix directory: state and resume


@dataclass
class Work:
    """The cells of a matrix directory: finished (done.json present) and still to run, in order."""

    done: list[MatrixCell]
    todo: list[MatrixCell]
    cleared: list[str]  # cell directories of stopped cells, removed to be run again


def prepare(out: str | os.PathLike, spec: MatrixSpec, resume: bool) -> Work:
    """Start a matrix in ``out`` (matrix.json written) or, with ``resume``, continue the one there.

    A new matrix needs ``out`` absent or empty; a directory holding a matrix needs ``resume``
    and the same spec (its digest: a changed spec would mix cells of two experiments)."""
    out = Path(out)
    meta = out / "matrix.json"
    cells = spec.cells()
    if meta.exists():
        if not resume:
            raise UsageError(f"{out} holds a matrix already", hint="--resume continues it; or give another --out")
        try:
            old = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"unreadable: {e}", path=str(meta)) from None
        if old.get("digest") != spec.digest():
            was = old.get("spec") or {}
            diff = sorted(k for k in set(was) | set(spec.canonical()) if was.get(k) != spec.canonical().get(k))
            raise UsageError(f"{out} holds a matrix of another spec (differs in: {', '.join(diff) or 'its digest'})",
                             hint="resume with the spec it was started with, or give another --out")
    else:
        if resume and out.exists() and any(out.iterdir()):
            raise UsageError(f"--resume: {out} holds no matrix.json", hint="give the directory a matrix was started in")
        if out.exists() and any(out.iterdir()):
            raise UsageError(f"{out} is not empty", hint="give a new or empty directory as --out")
        out.mkdir(parents=True, exist_ok=True)
        _write_json(meta, {"schema": SCHEMA, "digest": spec.digest(), "spec": spec.canonical(),
                           "spec_file": spec.source, "cells": [c.as_dict() for c in cells]})
    work = Work([], [], [])
    for c in cells:
        d = out / c.rel_dir
        if (d / DONE).exists():
            work.done.append(c)
            continue
        if d.exists():
            shutil.rmtree(d)
            work.cleared.append(c.rel_dir)
        work.todo.append(c)
    return work


def mark_done(out: str | os.PathLike, cell: MatrixCell, result: dict[str, Any]) -> Path:
    """The cell is finished: its result in done.json, written atomically and last."""
    path = Path(out) / cell.rel_dir / DONE
    _write_json(path, {"cell": cell.as_dict(), **result})
    return path


def finished(out: str | os.PathLike) -> list[dict[str, Any]]:
    """Every finished cell's done.json, in the matrix's order."""
    out = Path(out)
    meta = json.loads((out / "matrix.json").read_text())
    docs = []
    for c in meta["cells"]:
        p = out / c["dir"] / DONE
        if p.exists():
            docs.append(json.loads(p.read_text()))
    return docs


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    from moetrace.jsonutil import json_default

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=json_default) + "\n")
    os.replace(tmp, path)
