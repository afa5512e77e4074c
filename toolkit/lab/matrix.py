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
    kernel_modules = {"/src/linux/arch/x86/boot/bzImage" = "/var/tmp/mods"}   # an own build's modules
    # the guest's dimensions (moetrace.lab.dims; a value or a list, absent: as before)
    cpus = [1, 2]; readers = 2; bite_fraction = [0.02, 0.26]; window = "8min"; pool_layout = "layer"
    read_ahead_kb = 128; min_ttl_ms = 0; swap = "off"; thp = "off"; tcg_thread = "single"
    stream_events = true                      # page and read-call streams: pages evicted before read

A mechanism may add the eviction controller, ``+lru_gen-bites:F`` (F a fraction of C or a size):
``balloon:0.81+lru_gen-bites:0.26`` (moetrace.lab.bites_controller, in the guest).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from moetrace.capacity.scope import RESERVE_ENV
from moetrace.errors import InputError, MoetraceError, UsageError
from moetrace.lab.dims import DIMENSIONS, combinations, load_dims, window_of
from moetrace.jsonutil import write_json
from moetrace.run import metadata
from moetrace.run.documents import MATRIX_SCHEMA as SCHEMA
from moetrace.run.documents import JOB_SCHEMA, Cell, Job, Lab, LabSummary, MatrixCellDoc, MatrixRow, MatrixSpecDoc
MGLRU_STATES = ("on", "off")
MODES = ("pagecache", "mmap")
REQUIRED = ("kernels", "mechanisms", "capacities", "plan", "pool")
KNOWN = REQUIRED + ("mglru", "repeats", "mode", "seed", "headroom", "warmup", "passes", "threads", "guest_base",
                    "cgroup_guest_memory", "balloon_reserve", "timeout", "kernel_modules", *DIMENSIONS, "tcg_thread",
                    "stream_events")
DONE = "done.json"


@dataclass(frozen=True)
class Mechanism:
    """How a cell's capacity is made: ``cgroup`` (a v2 memory wall), ``balloon`` (mlocked anonymous
    memory locking ``locked_fraction`` of the guest's), ``vm-memory`` (the guest's RAM itself);
    ``bites``: the eviction controller's bite (moetrace.lab.bites_controller), a fraction of C
    ("0.26") or a size ("5MiB"), None without it."""

    kind: str
    locked_fraction: float | None = None
    bites: str | None = None

    @property
    def label(self) -> str:
        base = f"balloon{self.locked_fraction:g}" if self.kind == "balloon" else self.kind
        return base + (f"+bites{self.bites}" if self.bites else "")

    def bite_bytes(self, capacity_bytes: int) -> int | None:
        """The bite in bytes for a cell of ``capacity_bytes`` (None: no controller)."""
        from moetrace.inputs.geometry import parse_bytes

        if self.bites is None:
            return None
        f = float(self.bites) if re.fullmatch(r"[0-9]*\.?[0-9]+", self.bites) else None
        return int(f * capacity_bytes) if f is not None and f < 1 else parse_bytes(self.bites)


_BITES_HINT = ('add "+lru_gen-bites:F" to "balloon:L" or "vm-memory", F a fraction of C (0 < F < 1, e.g. 0.26) '
               'or a size (e.g. 5MiB)')


def parse_mechanism(text: str, where: str) -> Mechanism:
    """'cgroup', 'balloon:0.81' or 'vm-memory', optionally '+lru_gen-bites:F' (F a fraction of C
    or a size; the label's 'bitesF' is read too); UsageError naming ``where`` otherwise."""
    t = str(text).strip()
    base, _, suffix = t.partition("+")
    bites = _parse_bites(suffix, text, where) if suffix else None
    if base in ("cgroup", "vm-memory"):
        if bites is not None and base == "cgroup":
            raise UsageError(f"{where}: {text!r}: the bites controller watches the guest's MemFree, which a cgroup "
                             "wall does not lower", hint=_BITES_HINT)
        return Mechanism(base, None, bites)
    m = re.fullmatch(r"balloon:([0-9]*\.?[0-9]+)", base)
    if m and 0 < float(m.group(1)) < 1:
        return Mechanism("balloon", float(m.group(1)), bites)
    raise UsageError(f"{where}: unknown mechanism {text!r}",
                     hint='write "cgroup", "vm-memory" or "balloon:F" with F the locked fraction, 0 < F < 1')


def _parse_bites(suffix: str, text: str, where: str) -> str:
    """The F of '+lru_gen-bites:F' (or of a label's '+bitesF'), checked."""
    from moetrace.inputs.geometry import parse_bytes

    m = re.fullmatch(r"(?:lru_gen-bites:|bites)(\S+)", suffix)
    f = m.group(1) if m else None
    try:
        ok = f is not None and (0 < float(f) < 1 if re.fullmatch(r"[0-9]*\.?[0-9]+", f) else parse_bytes(f) > 0)
    except UsageError:
        ok = False
    if not ok:
        raise UsageError(f"{where}: {text!r}: not a bites controller suffix", hint=_BITES_HINT)
    return f


@dataclass(frozen=True)
class MatrixCell:
    kernel: str
    mglru: str
    mechanism: Mechanism
    capacity_label: str
    capacity_bytes: int
    repeat: int
    order: int  # position within its condition (randomized)
    #: the cell's values of the spec's dimensions (moetrace.lab.dims), and the name part of those
    #: that vary ('' when none does)
    values: tuple[tuple[str, Any], ...] = ()
    dims: str = ""

    @property
    def condition(self) -> str:
        return f"{_safe(self.kernel)}-mglru-{self.mglru}"

    @property
    def name(self) -> str:
        return f"{self.mechanism.label}-{self.capacity_label}{'-' + self.dims if self.dims else ''}-r{self.repeat}"

    @property
    def rel_dir(self) -> str:
        return f"cells/{self.condition}/{self.name}"

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.values)

    def as_dict(self) -> MatrixCellDoc:
        d = asdict(self)
        del d["values"], d["dims"]
        d["mechanism"] = self.mechanism.label
        d.update(condition=self.condition, name=self.name, dir=self.rel_dir)
        if self.values:  # only where the spec has dimensions: a spec without them writes what it did
            d.update(settings=self.settings, dims=self.dims)
        return cast(MatrixCellDoc, d)


def _safe(text: str) -> str:
    """A kernel name or path as a directory name ('/boot/vmlinuz-6.12.1' -> 'vmlinuz-6.12.1'). An
    image named only bzImage or vmlinuz (a tree's, or `lab build`'s, whose A and B differ by
    their directory alone) is named by the release in its header ('6.12.95-mtcd1a8655'), else by
    its directory and name."""
    name = Path(text).name if "/" in text else text
    if "/" in text and name in ("bzImage", "vmlinuz", "vmlinux"):
        from moetrace.lab.run import image_release

        name = image_release(text) or f"{Path(text).parent.name}-{name}"
    return re.sub(r"[^A-Za-z0-9.+_-]+", "_", name)


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
    headroom: int = 64 << 20
    warmup: int = 1
    passes: int = 2
    threads: int = 2
    #: what a guest needs beside C + headroom (kernel, the cell and the recorder): sizes the RAM
    #: of balloon and vm-memory guests (each cell reports the capacity it really had). Measured on
    #: 6.12, recorded vm-memory cells (C 16 MiB, headroom 96 MiB) had 191 MiB available at loop
    #: entry in 448 MiB (the guest kept ~161 MiB beyond C + headroom) and 503 MiB in 896 MiB (~281
    #: MiB): the kernel's share grows with the RAM, so the capacity a cell had is the one to read
    guest_base: int = 160 << 20
    cgroup_guest_memory: int = 2 << 30
    #: what a balloon must leave a disposable guest (C + headroom at least this; the host's own
    #: rule, MemTotal/16 + 5 %, refuses ~82 % locked in a 4 GiB guest)
    balloon_reserve: int = 160 << 20
    timeout: float = 3600.0
    #: kernel (as in ``kernels``) -> its modules_install directory (a kernel image of one's own)
    kernel_modules: tuple[tuple[str, str], ...] = ()
    #: the guest's dimensions (moetrace.lab.dims): (key, values) in DIMENSIONS order, given keys only
    dims: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    #: QEMU's TCG threading (moetrace.lab.run.TCG_THREAD when None)
    tcg_thread: str | None = None
    #: each cell's recording streams its page and read-call events (``record --stream-events``):
    #: the bite analysis's pages evicted before their first read
    stream_events: bool = False
    source: str | None = field(default=None, compare=False)

    def canonical(self) -> MatrixSpecDoc:
        """The spec as resolved (what the cells depend on), for matrix.json and the digest."""
        return {"kernels": list(self.kernels), "mglru": list(self.mglru),
                "mechanisms": [m.label for m in self.mechanisms],
                "capacities": [[lbl, b] for lbl, b in self.capacities], "plan": self.plan, "pool": self.pool,
                "repeats": self.repeats, "mode": self.mode, "seed": self.seed, "headroom": self.headroom,
                "warmup": self.warmup, "passes": self.passes, "threads": self.threads, "guest_base": self.guest_base,
                "cgroup_guest_memory": self.cgroup_guest_memory, "balloon_reserve": self.balloon_reserve,
                "timeout": self.timeout, **({"kernel_modules": dict(self.kernel_modules)} if self.kernel_modules
                                            else {}),
                **{k: list(v) for k, v in self.dims}, **({"tcg_thread": self.tcg_thread} if self.tcg_thread else {}),
                **({"stream_events": True} if self.stream_events else {})}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.canonical(), sort_keys=True).encode()).hexdigest()[:16]

    def cells(self) -> list[MatrixCell]:
        """Every cell: conditions in the spec's order (kernel, then MGLRU), the cells of each in a
        random order drawn from ``seed`` and the condition (stable across runs and resumes)."""
        out = []
        combos = combinations(self.dims)  # [((), "")] without dimensions: the cells as before them
        for k in self.kernels:
            for g in self.mglru:
                jobs = [(m, c, d, r) for m in self.mechanisms for c in self.capacities for d in combos
                        for r in range(self.repeats)]
                random.Random(f"{self.seed}/{k}/{g}").shuffle(jobs)
                out += [MatrixCell(k, g, m, c[0], c[1], r, i, d[0], d[1]) for i, (m, c, d, r) in enumerate(jobs)]
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
    knobs = _cell_knobs(doc, where)
    mods = doc.get("kernel_modules", {})
    if not isinstance(mods, dict) or any(k not in map(str, doc["kernels"]) for k in mods):
        raise InputError("kernel_modules: a table of kernel (as in kernels) = its modules_install directory",
                         path=where)
    if mods:
        knobs["kernel_modules"] = tuple(sorted((str(k), str((base / str(v)).resolve())) for k, v in mods.items()))
    fields, dims = load_dims(doc, where)
    knobs.update(fields, dims=dims)
    _check_windows(dims, knobs.get("timeout", 3600.0), where)
    return MatrixSpec(tuple(str(k) for k in _list(doc, "kernels", where)), tuple(mglru), tuple(mechs), tuple(caps),
                      files["plan"], files["pool"], repeats, mode, seed, **knobs, source=str(p))


def _cell_knobs(doc: dict, where: str) -> dict[str, Any]:
    """The optional per-cell keys (sizes as 64MiB / 2GiB or bytes, counts >= their least)."""
    from moetrace.inputs.geometry import parse_bytes

    out: dict[str, Any] = {}
    for key in ("headroom", "guest_base", "cgroup_guest_memory", "balloon_reserve"):
        if key in doc:
            try:
                out[key] = parse_bytes(doc[key])
            except UsageError as e:
                raise InputError(f"{key}: {e.message}", path=where) from None
    for key, least in (("warmup", 0), ("passes", 1)):
        if key in doc:
            v = doc[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise InputError(f"{key} must be an integer >= {least}, not {v!r}", path=where)
            out[key] = v
    if "timeout" in doc:
        if not isinstance(doc["timeout"], (int, float)) or doc["timeout"] <= 0:
            raise InputError(f"timeout must be seconds > 0, not {doc['timeout']!r}", path=where)
        out["timeout"] = float(doc["timeout"])
    return out


def _check_windows(dims, timeout: float, where: str) -> None:
    """InputError when a window's time leaves the cell less than 5 minutes of its timeout for
    the boot, the warm-up and the recording's start and end."""
    for key, vals in dims:
        for v in vals:
            if key == "window" and isinstance(v, str) and float(v[:-1]) + 300 > timeout:
                raise InputError(f"window {v} leaves less than 300 s of timeout = {timeout:g} for the rest of the cell",
                                 path=where, hint=f"timeout = {float(v[:-1]) + 900:g} or more")


# ---------------------------------------------------------------------------
# the matrix directory: state and resume


@dataclass
class Work:
    """The cells of a matrix directory: finished (done.json present) and still to run, in order."""

    done: list[MatrixCell]
    todo: list[MatrixCell]
    cleared: list[str]  # cell directories of stopped cells, removed to be run again


def check_matrix_dir(out: str | os.PathLike, spec: MatrixSpec) -> None:
    """UsageError unless ``out`` holds a matrix of this spec (read only: nothing is cleared)."""
    meta = Path(out) / "matrix.json"
    if not meta.exists():
        raise UsageError(f"{out} holds no matrix.json", hint="give the directory a matrix was started in")
    _same_spec(meta, spec, out)


def _same_spec(meta: Path, spec: MatrixSpec, out) -> None:
    old = metadata.read_matrix_meta(meta)
    if old["digest"] != spec.digest():
        was = old["spec"]
        diff = sorted(k for k in set(was) | set(spec.canonical()) if was.get(k) != spec.canonical().get(k))
        raise UsageError(f"{out} holds a matrix of another spec (differs in: {', '.join(diff) or 'its digest'})",
                         hint="resume with the spec it was started with, or give another --out")


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
        _same_spec(meta, spec, out)
    else:
        if resume and out.exists() and any(out.iterdir()):
            raise UsageError(f"--resume: {out} holds no matrix.json", hint="give the directory a matrix was started in")
        if out.exists() and any(out.iterdir()):
            raise UsageError(f"{out} is not empty", hint="give a new or empty directory as --out")
        out.mkdir(parents=True, exist_ok=True)
        metadata.write_matrix_meta(meta, {"schema": SCHEMA, "digest": spec.digest(), "spec": spec.canonical(),
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
    """The cell is finished: its result (:func:`cell_outcome`) in done.json, written atomically and last."""
    path = Path(out) / cell.rel_dir / DONE
    metadata.write_matrix_row(path, cast(MatrixRow, {"cell": cell.as_dict(), **result}))
    return path


def finished(out: str | os.PathLike) -> list[MatrixRow]:
    """Every finished cell's done.json, in the matrix's order."""
    out = Path(out)
    meta = metadata.read_matrix_meta(out / "matrix.json")
    return [metadata.read_matrix_row(out / c["dir"] / DONE) for c in meta["cells"] if (out / c["dir"] / DONE).exists()]


# ---------------------------------------------------------------------------
# running the cells, each in a fresh boot of its condition

GUEST_SHARE = "/tmp/lab"  # the lab share inside the guest (moetrace.lab.run.GUEST_SHARE)
GUEST_CELL_DIR = "/tmp/lab/cell"  # the cell's --out inside the guest (the lab share)
_MEM_STEP = 64 << 20


def guest_memory(cell: MatrixCell, spec: MatrixSpec) -> int:
    """The guest's RAM for a cell: cgroup, the spec's fixed size (at least C + headroom + the
    guest's base); balloon:F, so that the balloon locks about F of it and leaves C + headroom (and
    the recorder's allowance: cells are recorded);
    vm-memory, C + headroom + the guest's base + the recorder's allowance (the paper's mem= boot).
    Rounded up to 64 MiB."""
    from moetrace.capacity.cell import RECORDER_ALLOWANCE

    need = cell.capacity_bytes + spec.headroom + spec.guest_base
    if cell.mechanism.kind == "cgroup":
        mem = max(spec.cgroup_guest_memory, need)
    elif cell.mechanism.kind == "balloon":  # the cell's balloon leaves the recorder its allowance
        mem = (need + RECORDER_ALLOWANCE) / (1.0 - float(cell.mechanism.locked_fraction))
    else:  # the recorder's memory beside C + headroom, as a balloon leaves it (measured: a 576 MiB
        mem = need + RECORDER_ALLOWANCE  # guest for C = 320 MiB OOM-killed its replay)
    return int(-(-int(mem) // _MEM_STEP) * _MEM_STEP)


#: the probes a lab cell records: the default set and the vmscan probe (per-batch reclaim, kswapd
#: wakes with their order: the bite each pass took)
CELL_PROBES = "+vmscan"


def cell_command(cell: MatrixCell, spec: MatrixSpec, curve_path: str | None = None,
                 python_bin: str = "moetrace", pool: str | None = None) -> list[str]:
    """`moetrace cell` as the guest runs it (recorded, into the lab share; ``curve_path``: the
    simulated miss curve saved on the host, which the guest would otherwise compute at each boot;
    ``pool``: the pool of the cell's layout, default the spec's). The cell's dimensions give its
    readers, its window (passes, or a time) and its balloon's madvise."""
    mech = {"cgroup": "cgroup", "balloon": "balloon", "vm-memory": "machine"}[cell.mechanism.kind]
    curve = ["--miss-curve", curve_path] if curve_path else []
    v = cell.settings
    passes, duration = window_of(v, spec.passes)
    extra = ["--duration", f"{duration:g}s"] if duration is not None else []
    if v.get("thp") and cell.mechanism.kind == "balloon":
        extra += ["--balloon-thp", v["thp"]]
    if spec.stream_events:
        extra.append("--stream-events")
    return [python_bin, "cell", *curve, "--plan", spec.plan, "--pool", pool or spec.pool, "--capacity",
            str(cell.capacity_bytes), "--mechanism", mech, "--mode", spec.mode, "--headroom", str(spec.headroom),
            "--threads", str(v.get("readers", spec.threads)), "--warmup", str(spec.warmup), "--passes", str(passes),
            *extra, "--record", "--probes", CELL_PROBES, "--timeout", str(int(spec.timeout)), "--out",
            GUEST_CELL_DIR, "--json"]


def guest_settings(cell: MatrixCell, spec: MatrixSpec, pool: str | None = None) -> dict[str, Any]:
    """What the guest wrapper (`moetrace lab guest-cell`, moetrace.lab.guest) applies and starts
    around the cell: the guest's knobs of the cell's dimensions (None: the kernel's), the bites
    controller's bite (None: no controller) and the sampler."""
    from moetrace.capacity.scope import scope_name

    v = cell.settings
    return {"capacity_bytes": cell.capacity_bytes, "pool": pool or spec.pool, "memcg": "/" + scope_name("cell"),
            "min_free_kbytes": v.get("min_free_kbytes"), "bite_fraction": v.get("bite_fraction"),
            "read_ahead_kb": v.get("read_ahead_kb"), "min_ttl_ms": v.get("min_ttl_ms"),
            "swap": bool(v.get("swap")), "thp": v.get("thp"),
            "bites_bytes": cell.mechanism.bite_bytes(cell.capacity_bytes), "sampler": True}


def guest_command(cell: MatrixCell, spec: MatrixSpec, curve_path: str | None = None, python_bin: str = "moetrace",
                  pool: str | None = None) -> list[str]:
    """The guest's command for a cell: the wrapper (settings, sampler, bites controller) around
    :func:`cell_command`."""
    return [python_bin, "lab", "guest-cell", "--dir", GUEST_SHARE, "--settings",
            json.dumps(guest_settings(cell, spec, pool), sort_keys=True), "--",
            *cell_command(cell, spec, curve_path, python_bin, pool)]


#: lab.json fields kept in each cell's done.json (declared once: moetrace.run.documents.LabSummary)
LAB_KEYS = tuple(LabSummary.__annotations__)


def ensure_miss_curve(out: Path, spec: MatrixSpec, passes: int | None = None) -> Path:
    """DIR/miss_curve.npz: the plan's simulated miss curve, computed here once for every cell (the
    guests would compile its numba kernel at every boot); kept across resumes while it matches.
    ``passes`` other than the spec's (a window dimension): DIR/miss_curve-p<N>.npz."""
    from moetrace.capacity.cell import ensure_miss_curve as ensure

    passes = spec.passes if passes is None else passes
    return ensure(Path(out) / _curve_name(passes, spec.passes), spec.plan, spec.warmup, passes)


def _curve_name(passes: int, spec_passes: int) -> str:
    return "miss_curve.npz" if passes == spec_passes else f"miss_curve-p{passes}.npz"


def ensure_pool(out: Path, spec: MatrixSpec, layout: str | None) -> str:
    """The pool a cell of ``layout`` (a pool_layout value; None: the spec's pool as it is) reads:
    the spec's pool when it has that layout, else DIR/pools/<layout>, made once from it (the same
    bytes per expert) and kept while its manifest matches."""
    if layout is None:
        return spec.pool
    from moetrace.inputs.pool import open_pool, relayout_pool
    from moetrace.lab.dims import POOL_LAYOUTS

    if open_pool(spec.pool).layout == POOL_LAYOUTS[layout]:
        return spec.pool
    return str(relayout_pool(spec.pool, Path(out).resolve() / "pools" / layout, POOL_LAYOUTS[layout]).root)


def cell_outcome(lab: Lab | dict[str, Any], cell_json: Cell | None, console: str = "") -> dict[str, Any]:
    """done.json's body from the guest's lab.json and the cell's cell.json (None: none came back).
    A guest that died (out of memory, a panic, the timeout) is a cell not retained, with why."""
    out: dict[str, Any] = {"lab": {k: lab.get(k) for k in LAB_KEYS if k in lab}}
    if cell_json is None:
        why = (f"the guest ended without a cell result (lab status {lab.get('status')}, exit {lab.get('exit_status')}"
               + (f": {lab['error']}" if lab.get("error") else "") + ")")
        if "Out of memory" in console or "oom-kill" in console:
            why += ": the guest ran out of memory"
        elif "Kernel panic" in console:
            why += ": the guest's kernel panicked"
        return {**out, "retained": False, "reasons": [why], "result": None}
    reasons = list(cell_json["reasons"])
    extra = []
    want, end = lab.get("mglru_requested"), lab.get("mglru")
    if want in MGLRU_STATES and end not in (None, "none") and (end != "0x0000") != (want == "on"):
        extra.append(f"MGLRU was {end} at the end, not {want}")
    return {**out, "retained": bool(cell_json["retained"]) and not extra, "reasons": reasons + extra,
            "result": cell_json}


def run_one(out: Path, spec: MatrixSpec, cell: MatrixCell, curve: Path, run_guest=None) -> dict[str, Any]:
    """One cell in a fresh boot of its (kernel, MGLRU) condition, marked done (its done.json
    body returned). ``curve``: the miss curve of the spec's passes (the cell's own is made when
    its window has other passes); ``run_guest``: the lab's run_in_guest (tests give another). A bites
    controller under MGLRU off is not run: not retained, and why."""
    from moetrace.lab import run as lab

    run_guest = run_guest or lab.run_in_guest
    d = Path(out) / cell.rel_dir
    if cell.mechanism.bites and cell.mglru != "on":
        why = "the lru_gen-bites controller evicts through MGLRU's debugfs interface: it needs MGLRU on"
        result = {"lab": {}, "retained": False, "reasons": [why], "result": None}
        mark_done(out, cell, result)
        return result
    v = cell.settings
    try:
        passes = window_of(v, spec.passes)[0]
        curve = ensure_miss_curve(out, spec, passes) if passes != spec.passes else curve
        pool = ensure_pool(out, spec, v.get("pool_layout"))
        doc = run_guest(cell.kernel, guest_command(cell, spec, str(curve), pool=pool), d,
                        memory=f"{guest_memory(cell, spec) >> 20}M",
                        mglru=cell.mglru, timeout_s=spec.timeout + 600, pool=Path(pool),
                        env={RESERVE_ENV: str(spec.balloon_reserve)},
                        modules=dict(spec.kernel_modules).get(cell.kernel), **_boot_options(cell, spec)).doc
    except MoetraceError as e:  # the guest could not run the cell: a cell not retained, and on
        doc = {"status": "error", "error": e.format_message()}
    cj = d / "cell" / "cell.json"
    try:
        cell_json = metadata.read_cell(cj) if cj.exists() else None
    except InputError:  # a guest that died writing it: no cell result
        cell_json = None
    console = (d / "console.log").read_text(errors="replace") if (d / "console.log").exists() else ""
    result = with_guest(cell_outcome(doc, cell_json, console), d)
    mark_done(out, cell, result)
    return result


def _boot_options(cell: MatrixCell, spec: MatrixSpec) -> dict[str, Any]:
    """run_in_guest's keywords of the cell's dimensions (only those set: vCPUs, the swap disk,
    TCG's threading)."""
    v = cell.settings
    opts = {"cpus": v.get("cpus"), "swap_bytes": v.get("swap") or None, "tcg_thread": spec.tcg_thread}
    return {k: x for k, x in opts.items() if x is not None}


def with_guest(result: dict[str, Any], cell_dir: Path) -> dict[str, Any]:
    """done.json's body with what the guest wrapper applied and got (its guest_settings.json, as
    ``guest``): a setting it could not apply, or a controller that could not run, is a reason the
    cell is not retained."""
    from moetrace.lab.guest import GUEST_SETTINGS, read_guest_settings

    path = cell_dir / GUEST_SETTINGS
    if not path.exists():
        return result
    try:
        guest = read_guest_settings(path)
    except InputError as e:
        return {**result, "retained": False, "reasons": [*result["reasons"], e.format_message()]}
    errors = [f"guest: {e}" for e in guest.get("errors") or []]
    return {**result, "guest": guest, "retained": bool(result["retained"]) and not errors,
            "reasons": [*result["reasons"], *errors]}


def run_cells(out: str | os.PathLike, spec: MatrixSpec, work: Work, progress=None, run_guest=None) -> int:
    """Run ``work.todo`` in order in this process, each cell in a fresh boot of its (kernel, MGLRU)
    condition, and mark each done as it finishes (a stopped matrix resumes after the last one).
    ``progress(done, total, cell, seconds)`` is called after each cell. ``run_guest``: the lab's
    run_in_guest (tests give another). Returns the number of cells run. (`lab matrix` runs the
    same cells as jobs: :func:`matrix_jobs`.)"""
    import time

    out = Path(out)
    curve = ensure_miss_curve(out, spec)
    total = len(work.done) + len(work.todo)
    for i, cell in enumerate(work.todo):
        t0 = time.monotonic()
        run_one(out, spec, cell, curve, run_guest)
        if progress is not None:
            progress(len(work.done) + i + 1, total, cell, time.monotonic() - t0)
    return len(work.todo)


# ---------------------------------------------------------------------------
# the cells as jobs (moetrace.capacity.jobs, dispatched here or to Slurm)

@dataclass
class MatrixJob:
    """One matrix cell as a job: DIR/jobs/NAME.json names the cell; the spec is DIR/matrix.json's."""

    cell: MatrixCell
    out: str

    @property
    def name(self) -> str:
        return f"{self.cell.condition}__{self.cell.name}"

    @property
    def job_path(self) -> Path:
        return Path(self.out) / "jobs" / f"{self.name}.json"

    def as_dict(self) -> Job:

        return {"schema": JOB_SCHEMA, "kind": "matrix-cell", "name": self.name, "out": self.out,
                "dir": self.cell.rel_dir}

    def give_up(self, why: str) -> None:
        """The job failed for good: done.json says the cell is not retained, and why (a done.json
        the job wrote is kept)."""
        if not (Path(self.out) / self.cell.rel_dir / DONE).exists():
            mark_done(self.out, self.cell, {"lab": {}, "retained": False, "reasons": [why], "result": None})


def spec_from_canonical(doc: MatrixSpecDoc) -> MatrixSpec:
    """matrix.json's spec back as a MatrixSpec (:meth:`MatrixSpec.canonical` inverted)."""
    d = dict(doc)
    mods = tuple(sorted((d.pop("kernel_modules", None) or {}).items()))
    dims = tuple((k, tuple(d.pop(k))) for k in DIMENSIONS if k in d)
    return MatrixSpec(tuple(d.pop("kernels")), tuple(d.pop("mglru")),
                      tuple(parse_mechanism(re.sub(r"^balloon(?=[0-9.])", "balloon:", m), "matrix.json: mechanisms")
                            for m in d.pop("mechanisms")),
                      tuple((str(lbl), int(b)) for lbl, b in d.pop("capacities")), kernel_modules=mods, dims=dims,
                      **d)


def matrix_jobs(out: str | os.PathLike, work: Work) -> list[MatrixJob]:
    """``work.todo`` as jobs, their files written in DIR/jobs/ (the miss curve saved once)."""
    out = Path(out).resolve()
    jobs = [MatrixJob(c, str(out)) for c in work.todo]
    for j in jobs:
        write_json(j.job_path, j.as_dict())
    return jobs


def run_matrix_job(doc: Job, where: str, phase) -> dict[str, Any]:
    """The job function of a matrix cell (moetrace.capacity.jobs.KINDS): the spec from
    DIR/matrix.json (its digest checked), the cell by its directory, a stopped attempt's
    leftovers cleared, then :func:`run_one`."""
    out = Path(doc["out"])
    meta = metadata.read_matrix_meta(out / "matrix.json")
    spec = spec_from_canonical(meta["spec"])
    if spec.digest() != meta["digest"]:
        raise InputError("matrix.json's spec does not match its digest", path=str(out / "matrix.json"))
    cell = next((c for c in spec.cells() if c.rel_dir == doc.get("dir")), None)
    if cell is None:
        raise InputError(f"no cell {doc.get('dir')!r} in this matrix", path=where)
    d = out / cell.rel_dir
    if d.exists():
        shutil.rmtree(d)
    phase(f"guest {cell.kernel} MGLRU {cell.mglru}")
    return run_one(out, spec, cell, ensure_miss_curve(out, spec))


def matrix_rows(out: str | os.PathLike) -> list[dict[str, Any]]:
    """One row per finished cell: its place in the matrix, the guest, and the cell's figures
    (sweep's columns), with the capacity it really had at loop entry beside nominal C, and what
    its kernel did in the measured window (reports.matrix.cell_window: reclaim, generations,
    eviction ages)."""
    from moetrace.capacity.sweep import cell_row, effective_capacity
    from moetrace.reports.bites import bite_columns
    from moetrace.reports.matrix import cell_window

    out = Path(out)
    curves: dict[int | None, Any] = {}
    rows = []
    for doc in finished(out):
        c, lab, res = doc["cell"], doc["lab"], doc["result"] or cast(Cell, {})
        curve = _cell_curve(out, c, curves)
        row = {"condition": c["condition"], "kernel": c["kernel"], "release": lab.get("release"),
               "mglru": c["mglru"], "mechanism_spec": c["mechanism"], "guest_memory": lab.get("memory"),
               "accel": lab.get("accel")}
        row.update(dimension_columns(doc))  # {} for a cell of a spec without dimensions, before the wrapper
        row.update(cell_row({**res, "retained": doc["retained"], "reasons": doc["reasons"]},
                            c["capacity_label"], c["repeat"], c["order"], c["dir"]))
        row["mem_available_at_loop_entry_bytes"] = res.get("mem_available_at_loop_entry_bytes")
        row["file_capacity_at_loop_entry_bytes"] = res.get("file_capacity_at_loop_entry_bytes")
        row["effective_capacity_bytes"] = eff = effective_capacity(res)
        pool = (res.get("pool") or {}).get("data_bytes")
        # a cell whose capacity held the whole pool has no amplification to report (it read nothing)
        row["pool_fits"] = None if eff is None or pool is None else bool(eff >= pool)
        row.update(at_effective_capacity(res, eff, curve))
        row["locked_fraction"] = locked_fraction(res)
        row["host_wall_s"] = lab.get("host_wall_s")
        row.update(cell_window(out / c["dir"]) if res else {})
        res_bytes = row.get("pool_resident_bytes")
        at = at_effective_capacity(res, None if res_bytes is None else int(res_bytes), curve)
        row["miss_bytes_per_iteration_at_resident"] = at["miss_bytes_per_iteration_at_effective"]
        row["amplification_at_resident"] = at["amplification_at_effective"]
        row.update(bite_columns(out / c["dir"], c["capacity_bytes"]))  # {} without the guest's sampler files
        row["controller_bite_over_fC"] = controller_bite_over_fc(row)
        rows.append(row)
    return rows


def controller_bite_over_fc(row: dict[str, Any]) -> float | None:
    """The bites controller's bite over f x C (f: the oldest generation's median share of the
    memcg's file pages), as Σhigh / (f x C) is kswapd's: the bite over Σhigh times that. None
    without a controller, the sampler's figure or the guest's Σhigh."""
    bite, high, ratio = (row.get(k) for k in ("controller_bite_pages", "guest_sum_high_pages", "sum_high_over_fC"))
    if bite in (None, "") or not high or ratio in (None, ""):
        return None
    return float(bite) / float(high) * float(ratio)


def _saved_curve(out: Path, passes: int | None = None):
    """The matrix's miss curve (miss_curve.npz; of other ``passes`` than the spec's:
    miss_curve-p<N>.npz) when it is there and readable, else None."""
    from moetrace.capacity.cell import load_miss_curve

    meta = out / "matrix.json"
    if not meta.exists():
        return None
    try:
        spec = metadata.read_matrix_meta(meta)["spec"]
        passes = spec["passes"] if passes is None else passes
        path = out / _curve_name(passes, spec["passes"])
        return load_miss_curve(path, spec["plan"], spec["warmup"], passes) if path.exists() else None
    except (InputError, KeyError, OSError):
        return None


def _cell_curve(out: Path, cell: MatrixCellDoc, cache: dict[int | None, Any]):
    """The saved miss curve of a finished cell's passes (its window's), loaded once per passes."""
    passes = window_of(cell.get("settings") or {}, -1)[0]
    key = None if passes == -1 else passes
    if key not in cache:
        cache[key] = _saved_curve(out, key)
    return cache[key]


def dimension_columns(doc: MatrixRow) -> dict[str, Any]:
    """A row's columns of its dimensions: what the cell asked (``dims``, each key's value) and
    what its guest got (the wrapper's guest_settings.json: Σhigh and Σhigh / C after the knobs,
    the knobs read back, the bites controller's totals) and how it was booted (vCPUs, TCG's
    threading). {} for a cell of a spec without dimensions that ran before the wrapper."""
    c, lab, g = doc["cell"], doc["lab"], doc.get("guest") or {}
    if not c.get("settings") and not g:
        return {}
    out: dict[str, Any] = {"dims": c.get("dims", ""), **{k: v for k, v in (c.get("settings") or {}).items()},
                           "vcpus": lab.get("cpus"), "tcg_thread": lab.get("tcg_thread")}
    after = (g.get("watermarks") or {}).get("after") or {}
    knobs = g.get("knobs") or {}
    out.update(guest_sum_high_pages=after.get("sum_high_pages"), guest_bite_fraction=after.get("bite_fraction"),
               guest_min_free_kbytes=after.get("min_free_kbytes"),
               guest_watermark_scale_factor=after.get("watermark_scale_factor"),
               **{f"guest_{k}": (knobs.get(k) or {}).get("after") for k in ("read_ahead_kb", "min_ttl_ms", "thp")},
               guest_swap_on=(g.get("swap") or {}).get("on"))
    ctl = g.get("controller")
    if ctl:
        out.update(controller_bites=ctl.get("bites"), controller_bite_pages=ctl.get("pages"),
                   controller_steal_pages=ctl.get("steal_pages"), controller_agings=ctl.get("agings"),
                   controller_errors=ctl.get("errors"))
    return out


def at_effective_capacity(res: Cell, eff: int | None, curve) -> dict[str, Any]:
    """Miss demand and amplification at the capacity the cell really had (nominal C's are the
    cell's own): a vm-memory guest or a balloon never leaves exactly C."""
    from moetrace.capacity.cell import simulated_miss

    pool = res.get("pool") or {}
    dev = res.get("device_bytes_per_iteration")
    if curve is None or eff is None or not pool.get("extent_bytes"):
        return {"miss_bytes_per_iteration_at_effective": None, "amplification_at_effective": None}
    miss = simulated_miss(curve, int(eff), int(pool["extent_bytes"]), int(pool["expert_bytes"]))
    m = miss["miss_bytes_per_iteration"]
    return {"miss_bytes_per_iteration_at_effective": m,
            "amplification_at_effective": (dev / m) if (dev is not None and m) else None}


def locked_fraction(res: Cell) -> float | None:
    """What a balloon cell really locked (its balloon and top-up VmLck) over the guest's MemTotal."""
    b = res.get("balloon") or {}
    if not b.get("vmlck_bytes") or not b.get("mem_total_bytes"):
        return None
    return (b["vmlck_bytes"] + ((b.get("top_up") or {}).get("vmlck_bytes") or 0)) / b["mem_total_bytes"]


def write_table(out: str | os.PathLike, rows: list[dict[str, Any]] | None = None, pairs=None) -> Path:
    """matrix_cells.csv (:func:`matrix_rows`, unless given) and the summary over repeats beside it
    (matrix_summary.csv / .md, matrix_fig3.png): reports.matrix.write_tables. Returns the cells'
    table."""
    from moetrace.reports.matrix import write_tables

    return write_tables(out, matrix_rows(out) if rows is None else rows, pairs)["cells"]


def matrix_report_inputs(out: str | os.PathLike, cell: str | None = None):
    """What `moetrace report DIR` shows of a matrix (reports.matrix.MatrixInputs): its tables
    written afresh, the summary, the findings, Fig. 3, and the recorded cell to detail (``cell``:
    its directory under cells/, e.g. 6.12-mglru-on/balloon0.81-320MiB-r0; default: the retained
    cell with the highest amplification)."""
    import pandas as pd

    from moetrace.reports.matrix import MatrixInputs, fig3_png, matrix_findings, pair_checks, summarize

    out = Path(out)
    rows, pairs = matrix_rows(out), pair_checks(out)
    write_table(out, rows, pairs)
    summary = summarize(rows)
    if cell is not None:
        detail = out / "cells" / cell / "cell"
        if not (detail / "cell.json").is_file():
            raise UsageError(f"no finished cell {cell!r} in {out}",
                             hint="name it as cells/ does: <kernel>-mglru-<on|off>/<mechanism>-<C>-r<i>")
    else:
        kept = [r for r in rows if r.get("retained") and r.get("amplification") is not None
                and (out / r["cell_dir"] / "cell" / "run").is_dir()]
        best = max(kept, key=lambda r: r["amplification"], default=None)
        detail = out / best["cell_dir"] / "cell" if best else None
    return MatrixInputs(out, pd.DataFrame(rows), pd.DataFrame(summary), matrix_findings(summary),
                        fig3_png(summary) if summary else None, detail, pd.DataFrame(pairs))


def report_matrix(out: str | os.PathLike, report_dir: str | os.PathLike | None = None, cell: str | None = None,
                  **kw: Any) -> dict[str, Any]:
    """`moetrace report MATRIX_DIR`: the matrix's report page in ``report_dir`` (default
    OUT/report), from :func:`matrix_report_inputs` (``cell``: the recorded cell to detail);
    ``kw``: sections, force, progress of :func:`moetrace.reports.matrix.build_matrix_report`."""
    from moetrace.reports.matrix import build_matrix_report

    return build_matrix_report(matrix_report_inputs(out, cell), Path(report_dir or Path(out) / "report"), **kw)


# ---------------------------------------------------------------------------
# `lab matrix`: run the cells, or write the tables of those finished


@dataclass
class MatrixResult:
    """A matrix's finished cells (``rows``: :func:`matrix_rows`) and their summary over repeats,
    the table written (matrix_cells.csv, the summary and Fig. 3 beside it), and why a run
    stopped early (None: every cell ended)."""

    out: Path
    n_cells: int
    rows: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    table: Path
    stopped: Any = None

    def to_dict(self) -> dict[str, Any]:
        """What `lab matrix --json` prints."""
        return {"schema": SCHEMA, "out": str(self.out), "cells": self.rows, "summary": self.summary}


def matrix_tables(out: str | os.PathLike, spec: MatrixSpec, stopped: Any = None) -> MatrixResult:
    """`lab matrix --report`: boot nothing; ``out``'s tables, summary and Fig. 3 written from the
    cells finished so far (also while the matrix runs elsewhere)."""
    from moetrace.reports.matrix import summarize, write_tables

    check_matrix_dir(out, spec)
    rows = matrix_rows(out)
    summary = summarize(rows)
    table = write_tables(out, rows, summary=summary)["cells"]
    return MatrixResult(Path(out), len(spec.cells()), rows, summary, table, stopped)


def run_matrix(out: str | os.PathLike, spec: MatrixSpec, resume: bool = False, executor: str = "local",
               slurm: dict[str, Any] | None = None, on_event: Callable[[str], None] | None = None) -> MatrixResult:
    """`lab matrix`: start the matrix in ``out`` (or continue it, ``resume``), run the cells still
    to run as jobs on ``executor`` (local, or slurm with make_executor's ``slurm`` keywords), then
    write its tables. ``on_event`` hears what a person follows: the cells finished before, each
    failure and resubmission, and a line per cell as it ends (its outcome, the time left). Ctrl-C
    / SIGTERM: the running jobs clean up, the tables are written, ``stopped`` says so."""
    from moetrace.capacity.cell import interrupt_handlers
    from moetrace.capacity.dispatch import dispatch, make_executor

    say = on_event or (lambda text: None)
    out, n_cells = Path(out), len(spec.cells())
    work = prepare(out, spec, resume)
    if work.done:
        say(f"{len(work.done)} of {n_cells} cells finished before; running {len(work.todo)}"
            + (f" ({len(work.cleared)} stopped part-way, run again)" if work.cleared else ""))
    ensure_miss_curve(out, spec)
    jobs = matrix_jobs(out, work)
    t0, ended = time.monotonic(), [0]

    def on_end(sub) -> None:
        ended[0] += 1
        eta = (time.monotonic() - t0) / ended[0] * (n_cells - len(work.done) - ended[0])
        say(cell_line(out, sub.job.cell, len(work.done) + ended[0], n_cells, eta))

    ex = make_executor(executor, out, **(slurm or {}))
    with interrupt_handlers():
        res = dispatch(jobs, ex, on_event=say, on_end=on_end)
    return matrix_tables(out, spec, res.stopped)


def cell_line(out: Path, cell: MatrixCell, done: int, n_cells: int, eta_s: float) -> str:
    """A finished cell in a line: [done/N], its place, retained or why not, its amplification,
    the time left."""
    doc = json.loads((out / cell.rel_dir / DONE).read_text())
    amp = (doc.get("result") or {}).get("amplification")
    return (f"[{done}/{n_cells}] {cell.rel_dir[len('cells/'):]}: "
            + ("retained" if doc.get("retained") else f"not retained ({'; '.join(doc.get('reasons') or [])})")
            + (f", amplification {amp:.2f}" if isinstance(amp, (int, float)) else "")
            + f"; about {eta_s / 60:.0f} min left")
