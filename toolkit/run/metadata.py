"""The one reader and the one writer of each JSON document of the run, cell, sweep and lab
directories (declared in :mod:`moetrace.run.documents`; manifest.json's own are
:func:`moetrace.run.directory.read_manifest` and ``write_manifest``).

A reader returns the typed form, or raises an InputError naming the file and the key: a file
that is not JSON, not an object, of another schema or a newer version, without a key every
writer writes (``Required`` in the declaration), or with a value of the wrong type where a
reader uses it (:mod:`moetrace.run.validate`). A writer writes atomically (moetrace.jsonutil).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

from moetrace.errors import InputError
from moetrace.jsonutil import write_json
from moetrace.run import documents as D
from moetrace.run.directory import read_json
from moetrace.run.validate import (CELL_SPEC, REPLAY_SPEC, SNAPSHOT_SPEC, SNAPSHOTS_SPEC,
                                   check_geometry, check_types)


def check_schema(doc: dict[str, Any], want: str, path: str) -> None:
    """``doc["schema"]`` names ``want``'s schema at a version up to ``want``'s (a newer one: upgrade)."""
    name, _, ver = want.partition("/")
    have = doc.get("schema")
    hname, _, hver = str(have).partition("/")
    if hname != name or not hver.isdigit():
        raise InputError(f"not a {name} document (schema {have!r})", path=path)
    if int(hver) > int(ver):
        raise InputError(f"{name} schema version {hver} is newer than this moetrace reads ({ver})", path=path,
                         hint="upgrade moetrace")


def read_object(path: str | os.PathLike, td: type, what: str, schema: str | None = None,
                spec: dict[str, str] | None = None) -> dict[str, Any]:
    """A JSON object declared by ``td``: its schema (when given), its Required keys and the types
    in ``spec`` checked; InputError naming the file (and the key) otherwise."""
    path = Path(path)
    doc = read_json(path, what)
    if not isinstance(doc, dict):
        raise InputError(f"{what} holds a JSON {type(doc).__name__}, not an object", path=str(path))
    if schema is not None:
        check_schema(doc, schema, str(path))
    missing = D.missing_required(doc, td)
    if missing:
        raise InputError(f"{what} lacks the key {missing[0]!r}", path=str(path),
                         hint="the file was damaged, or written by another program")
    if spec:
        check_types(doc, spec, str(path))
    return doc


def _file_in(path: str | os.PathLike, name: str) -> Path:
    """``path`` itself, or ``path/name`` when ``path`` is a directory."""
    p = Path(path)
    return p / name if p.is_dir() else p


def read_cell(path: str | os.PathLike) -> D.Cell:
    """A cell's cell.json (``path``: the file, or the cell directory)."""
    return cast(D.Cell, read_object(_file_in(path, "cell.json"), D.Cell, "cell.json", D.CELL_SCHEMA, CELL_SPEC))


def write_cell(path: str | os.PathLike, doc: D.Cell) -> None:
    write_json(path, doc, indent=2)


def read_replay(path: str | os.PathLike) -> D.ReplaySummary:
    """A replay's replay.json."""
    doc = read_object(path, D.ReplaySummary, "replay.json", D.REPLAY_SCHEMA, REPLAY_SPEC)
    check_geometry(doc, str(path))
    return cast(D.ReplaySummary, doc)


def read_snapshot(path: str | os.PathLike) -> D.Snapshot:
    """A cell's snapshots/<label>.json."""
    return cast(D.Snapshot, read_object(path, D.Snapshot, Path(path).name, None, SNAPSHOT_SPEC))


def write_snapshot(path: str | os.PathLike, doc: D.Snapshot) -> None:
    write_json(path, doc, indent=2)


def read_snapshots(path: str | os.PathLike) -> D.Snapshots:
    """A run's snapshots.json."""
    return cast(D.Snapshots, read_object(path, D.Snapshots, "snapshots.json", None, SNAPSHOTS_SPEC))


def read_sweep_meta(path: str | os.PathLike) -> D.SweepMeta:
    """A sweep's sweep.json."""
    return cast(D.SweepMeta, read_object(path, D.SweepMeta, "sweep.json", D.SWEEP_SCHEMA))


def write_sweep_meta(path: str | os.PathLike, doc: D.SweepMeta) -> None:
    write_json(path, doc)


def read_ran(path: str | os.PathLike) -> D.Ran:
    """A job's jobs/<name>.ran.json (its last attempt)."""
    return cast(D.Ran, read_object(path, D.Ran, "ran.json"))


def write_ran(path: str | os.PathLike, doc: D.Ran) -> None:
    write_json(path, doc)


def read_lab(path: str | os.PathLike) -> D.Lab:
    """A lab directory's lab.json (``path``: the file, or the directory)."""
    return cast(D.Lab, read_object(_file_in(path, "lab.json"), D.Lab, "lab.json", D.LAB_SCHEMA))


def write_lab(path: str | os.PathLike, doc: D.Lab) -> None:
    write_json(path, doc)


def read_guest_settings(path: str | os.PathLike) -> D.GuestSettings:
    """A matrix cell's guest_settings.json (``path``: the file, or the cell directory)."""
    return cast(D.GuestSettings, read_object(_file_in(path, "guest_settings.json"), D.GuestSettings,
                                             "guest_settings.json", D.GUEST_SCHEMA,
                                             {"request": "obj", "errors": "list"}))


def write_guest_settings(path: str | os.PathLike, doc: D.GuestSettings) -> None:
    write_json(path, doc)


def read_matrix_meta(path: str | os.PathLike) -> D.MatrixMeta:
    """A matrix directory's matrix.json (``path``: the file, or the directory)."""
    return cast(D.MatrixMeta, read_object(_file_in(path, "matrix.json"), D.MatrixMeta, "matrix.json",
                                          D.MATRIX_SCHEMA))


def write_matrix_meta(path: str | os.PathLike, doc: D.MatrixMeta) -> None:
    write_json(path, doc)


def read_matrix_row(path: str | os.PathLike) -> D.MatrixRow:
    """A matrix cell's done.json."""
    doc = read_object(path, D.MatrixRow, "done.json")
    if isinstance(doc.get("result"), dict):
        check_types(doc["result"], CELL_SPEC, f"{path} (result)")
    return cast(D.MatrixRow, doc)


def write_matrix_row(path: str | os.PathLike, doc: D.MatrixRow) -> None:
    write_json(path, doc)


def read_sampler_meta(path: str | os.PathLike) -> D.SamplerMeta:
    """A sampler directory's sampler.json (``path``: the file, or the directory)."""
    return cast(D.SamplerMeta, read_object(_file_in(path, "sampler.json"), D.SamplerMeta, "sampler.json",
                                           D.SAMPLER_SCHEMA, {"t0_monotonic_ns": "int"}))


def write_sampler_meta(path: str | os.PathLike, doc: D.SamplerMeta) -> None:
    write_json(path, doc)


def read_zoneinfo_doc(path: str | os.PathLike) -> D.ZoneinfoDoc:
    """A sampler directory's zoneinfo.json (``path``: the file, or the directory)."""
    return cast(D.ZoneinfoDoc, read_object(_file_in(path, "zoneinfo.json"), D.ZoneinfoDoc, "zoneinfo.json",
                                           D.SAMPLER_SCHEMA,
                                           {"start": "obj", "start.sum_high_pages": "int",
                                            "start.page_size_bytes": "int"}))


def write_zoneinfo_doc(path: str | os.PathLike, doc: D.ZoneinfoDoc) -> None:
    write_json(path, doc)


def retained_matrix_cells(out: str | os.PathLike) -> tuple[D.MatrixMeta, list[D.MatrixCellDoc]]:
    """A matrix directory's matrix.json and its cells whose done.json says retained, in the
    matrix's order (a cell not finished yet is left out)."""
    out = Path(out)
    meta = read_matrix_meta(out)
    keep = [c for c in meta["cells"]
            if (out / c["dir"] / "done.json").is_file() and read_matrix_row(out / c["dir"] / "done.json").get("retained")]
    return meta, keep


#: the readers by the file they read (a snapshot of a cell: by its directory's name)
READERS = {"guest_settings.json": read_guest_settings, "cell.json": read_cell, "replay.json": read_replay, "snapshots.json": read_snapshots,
           "sweep.json": read_sweep_meta, "lab.json": read_lab, "matrix.json": read_matrix_meta,
           "done.json": read_matrix_row}

__all__ = ["READERS", "check_schema", "read_cell", "read_guest_settings", "write_guest_settings", "read_lab", "read_matrix_meta", "read_matrix_row", "read_object",
           "read_ran", "read_replay", "retained_matrix_cells", "read_snapshot", "read_snapshots", "read_sweep_meta", "write_cell", "write_snapshot",
           "write_lab", "write_matrix_meta", "write_matrix_row", "write_ran", "write_sweep_meta"]
