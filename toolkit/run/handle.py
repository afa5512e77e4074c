"""Open what moetrace wrote, for notebooks and reports: a run, a cell or a sweep.

    >>> import moetrace
    >>> run = moetrace.open_run("demo-out/sweep/cells/48MiB-r0")   # a cell, or its run/
    >>> run.tables["experts"].head()                                # every table, loaded lazily
    >>> run.manifest["kernel"], run.cell["amplification"]
    >>> sweep = moetrace.open_sweep("demo-out/sweep")
    >>> sweep.results, [c.name for c in sweep.cells]

Nothing here needs root or a kernel. Paths recorded in a manifest are absolute on the
recording machine; a directory moved elsewhere (a copied sweep, tests/data) is still
read through the paths relative to it (a cell's ``replay/``, a sweep's ``cells/``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from moetrace.lazyimport import pandas as pd

from moetrace.errors import InputError
from moetrace.run import directory as rundir
from moetrace.run import metadata
from moetrace.run.documents import Cell, Manifest, ReplaySummary, Snapshot, Snapshots

CELL_JSON = "cell.json"
SWEEP_RESULTS = "results.parquet"
#: an engine cell's and an engine sweep's documents (moetrace.capacity.enginecell)
ENGINE_CELL_JSON = "engine_cell.json"
ENGINE_SWEEP_JSON = "engine_sweep.json"


class Tables(Mapping):
    """The run's Parquet tables by name, each read on first use (``iterations``: the
    replay's iteration log)."""

    def __init__(self, paths: dict[str, Path], manifest: Manifest | None = None):
        self._paths = dict(sorted(paths.items()))
        self._cache: dict[str, pd.DataFrame] = {}
        self._manifest = manifest  # the geometry the per-expert tables are checked against

    def __getitem__(self, name: str) -> pd.DataFrame:
        if name not in self._cache:
            self._cache[name] = rundir.read_table(self._paths[name], name, self._manifest)
        return self._cache[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def path(self, name: str) -> Path:
        return self._paths[name]


@dataclass
class Run:
    """One recording: ``manifest`` (manifest.json), ``tables`` (name -> DataFrame, lazy),
    ``snapshots`` (snapshots.json or {}), ``cell`` (the enclosing cell.json, or None),
    ``folded`` (stacks.folded text, or None), ``replay`` (replay.json, or None)."""

    path: Path
    manifest: Manifest
    tables: Tables
    snapshots: Snapshots | dict[str, Snapshot] = field(default_factory=dict)  # a cell's: by label
    cell: Cell | None = None
    replay: ReplaySummary | None = None
    folded_path: Path | None = None

    @property
    def name(self) -> str:
        return self.path.parent.name if self.cell is not None else self.path.name

    @property
    def folded(self) -> str | None:
        """stacks.folded (InputError naming it when it cannot be read or is not UTF-8)."""
        if self.folded_path is None:
            return None
        try:
            raw = self.folded_path.read_bytes()
            return raw.decode("utf-8")
        except OSError as e:
            raise InputError(f"cannot read: {e.strerror}", path=str(self.folded_path)) from None
        except UnicodeDecodeError as e:
            raise InputError(f"stacks.folded is not UTF-8 text (byte {raw[e.start]:#04x})",
                             path=str(self.folded_path), offset=e.start) from None

    @property
    def meta(self) -> dict[str, Any]:
        """What the analyses take beside the tables: the manifest, plus ``cell`` and
        ``snapshots`` (the analyses' ``meta`` argument)."""
        return {**self.manifest, "cell": self.cell, "snapshots": self.snapshots, "replay": self.replay,
                "run_path": str(self.path)}

    def plan_path(self) -> Path | None:
        """The plan the replay ran, when it is still where it was (or beside a moved sweep)."""
        cands = []
        plan = self.manifest.get("plan")
        p = plan.get("path") if plan else None
        if p:
            cands.append(Path(p))
        if self.cell is not None:
            cands += [self.path.parent / "plan.bin", self.path.parent.parent.parent / "plan.bin"]
        for c in cands:
            if c.is_file():
                return c
        return None


@dataclass
class Sweep:
    """A capacity sweep: ``results`` (one row per cell), ``capacity`` (one row per C),
    ``cells`` (each a :class:`Run`, in results order; cells without a recording are left out)."""

    path: Path
    results: pd.DataFrame
    capacity: pd.DataFrame | None
    cells: list[Run]


def _replay_dir(run: Path, manifest: Manifest) -> Path | None:
    cands = [run / rundir.REPLAY_SUBDIR, run.parent / rundir.REPLAY_SUBDIR]
    if manifest.get("replay_dir"):
        cands.append(Path(manifest["replay_dir"]))
    for c in cands:
        if (c / "iterations.parquet").is_file() or (c / "replay.json").is_file():
            return c
    return None


def open_run(path: str | os.PathLike, unrecorded: bool = False) -> Run:
    """A run directory (``manifest.json``) or a cell directory (``cell.json`` + ``run/``).
    ``unrecorded``: a cell without ``run/`` opens too, from its cell.json and replay log
    (no probe tables; the manifest holds the replay's plan, pool and the cell's kernel)."""
    p = Path(path)
    cell = None
    if (p / ENGINE_CELL_JSON).is_file():
        cell = engine_cell_as_cell(p)
        p = p / "run"
    elif (p / CELL_JSON).is_file():
        cell = metadata.read_cell(p / CELL_JSON)
        if not (p / "run" / rundir.MANIFEST).is_file():
            if unrecorded:
                return _open_unrecorded_cell(p, cell)
            raise InputError("this cell was not recorded (no run/manifest.json)", path=str(p),
                             hint="run the cell or sweep with --record")
        p = p / "run"
    elif (p / SWEEP_RESULTS).is_file() and not (p / rundir.MANIFEST).exists():
        raise InputError("this is a sweep directory, not a run", path=str(p),
                         hint="use moetrace.open_sweep(path), or open one of its cells/*")
    elif (p.parent / CELL_JSON).is_file():
        cell = metadata.read_cell(p.parent / CELL_JSON)
    manifest = rundir.read_manifest(p)
    paths = {q.stem: q for q in p.glob("*.parquet")}
    rdir = _replay_dir(p, manifest)
    replay = None
    if rdir is not None:
        if (rdir / "iterations.parquet").is_file():
            paths["iterations"] = rdir / "iterations.parquet"
        if (rdir / "replay.json").is_file():
            replay = metadata.read_replay(rdir / "replay.json")
    snaps = metadata.read_snapshots(p / "snapshots.json") if (p / "snapshots.json").is_file() else {}
    folded = p / "stacks.folded"
    return Run(p, manifest, Tables(paths, manifest), snaps, cell, replay, folded if folded.is_file() else None)


def engine_cell_as_cell(p: Path) -> Cell:
    """An engine cell's engine_cell.json as the cell figures a check compares: a decode token is
    its iteration (decode time, device bytes and miss demand per token), the loader its mode."""
    import json

    try:
        d = json.loads((p / ENGINE_CELL_JSON).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read the engine cell: {e}", path=str(p / ENGINE_CELL_JSON)) from None
    if not isinstance(d, dict) or not isinstance(d.get("inputs"), dict):
        raise InputError("not an engine cell document", path=str(p / ENGINE_CELL_JSON))
    ms = d.get("decode_ms_p50")
    return cast(Cell, {"capacity_bytes": d["inputs"].get("capacity_bytes"), "mechanism": "cgroup",
                       "mode": d.get("label"), "retained": bool(d.get("retained")), "host": d.get("host"),
                       "kernel": {"release": d.get("kernel")}, "measured_iterations": d.get("measured_tokens"),
                       "iteration_time_median_ns": None if ms is None else ms * 1e6,
                       "device_bytes_per_iteration": d.get("device_bytes_per_token"),
                       "miss_bytes_per_iteration": d.get("miss_bytes_per_token"),
                       "amplification": d.get("amplification"), "engine": d})


def _open_unrecorded_cell(p: Path, cell: Cell) -> Run:
    rdir = p / rundir.REPLAY_SUBDIR
    replay = metadata.read_replay(rdir / "replay.json") if (rdir / "replay.json").is_file() else None
    paths = {"iterations": rdir / "iterations.parquet"} if (rdir / "iterations.parquet").is_file() else {}
    snaps = {q.stem: metadata.read_snapshot(q) for q in sorted((p / "snapshots").glob("*.json"))} \
        if (p / "snapshots").is_dir() else {}
    old_kernel = cast(dict, cell.get("inputs") or {}).get("kernel")  # cells written before `kernel`
    manifest = cast(Manifest, {"plan": replay.get("plan") if replay else None,
                               "pool": replay.get("pool") if replay else None,
                               "kernel": cell.get("kernel") or {"release": old_kernel}, "recorded": False})
    return Run(p, manifest, Tables(paths), snaps, cell, replay, None)


def open_sweep(path: str | os.PathLike) -> Sweep:
    """A sweep directory (``results.parquet``, ``capacity.parquet``, ``cells/*``)."""
    p = Path(path)
    if not (p / SWEEP_RESULTS).is_file():
        raise InputError("not a sweep directory (no results.parquet)", path=str(p),
                         hint="give the --out directory of `moetrace sweep`")
    from moetrace.run.validate import check_sweep_tables

    results = rundir.read_table(p / SWEEP_RESULTS, "results")
    cap = rundir.read_table(p / "capacity.parquet", "capacity") if (p / "capacity.parquet").is_file() else None
    check_sweep_tables(results, cap, p)
    cells = []
    names = [Path(str(d)).name for d in results["cell_dir"]] if "cell_dir" in results else []
    for name in names:
        d = p / "cells" / name
        if (d / "run" / rundir.MANIFEST).is_file():
            cells.append(open_run(d))
    return Sweep(p, results, cap, cells)


def kind_of(path: str | os.PathLike) -> str:
    """'engine_sweep', 'engine_cell', 'sweep', 'cell' or 'run' (InputError when none)."""
    p = Path(path)
    if (p / ENGINE_SWEEP_JSON).is_file():
        return "engine_sweep"
    if (p / ENGINE_CELL_JSON).is_file():
        return "engine_cell"
    if (p / SWEEP_RESULTS).is_file():
        return "sweep"
    if (p / CELL_JSON).is_file():
        return "cell"
    if (p / rundir.MANIFEST).is_file():
        return "run"
    raise InputError("not a moetrace run, cell or sweep directory", path=str(p),
                     hint="give a `moetrace record --out`, `cell --out` or `sweep --out` directory")
