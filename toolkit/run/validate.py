"""Types of the values analyses read from a run's JSON files: manifest.json, cell.json,
replay.json and the /proc snapshots, checked once where they are read (read_manifest and the
readers of moetrace.run.metadata), so that a damaged or hand-edited file fails with an InputError that
names the file and the key instead of a TypeError deep in an analysis.

Only keys that a reader uses are checked, and only when present: every reader treats a
missing key or null as "not recorded". A spec maps a dotted key path (``*`` matches any key
of an object) to a kind:

    obj    a JSON object            list   a JSON array          str   a string
    bool   true / false             num    a finite number       int   an integer (not a bool)
    count  an integer in [0, 2**53] geo    an integer in [1, 2**24] (layers, experts, k)
    kernel an object or a string (a kernel release)
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from moetrace.errors import InputError
from moetrace.run.documents import Manifest
from moetrace.run.tables import TABLES, checks

_MAX_COUNT = 2**53
_MAX_GEO = 2**24  # layers or experts per layer: far beyond any model (Kimi-K3 has 92 x 896)
#: layers x experts a run may describe (per-expert tables and heatmaps are that large)
MAX_EXPERTS = 2**24

_GEOMETRY = {"n_layers": "geo", "n_experts": "geo", "k": "geo", "expert_bytes": "count"}

MANIFEST_SPEC: dict[str, str] = {
    "plan": "obj", "plan.path": "str", "plan.n_layers": "geo", "plan.n_experts": "geo", "plan.k": "geo",
    "plan.expert_bytes": "count", "plan.iterations": "count",
    "pool": "obj", "pool.geometry": "obj", **{f"pool.geometry.{k}": v for k, v in _GEOMETRY.items()},
    "pool.pages_per_expert": "count", "pool.extent_bytes": "count", "pool.root": "str", "pool.layout": "str",
    "kernel": "kernel", "kernel.release": "str",
    "mglru": "obj", "mglru.on": "bool",
    "lost": "obj", "lost.*": "obj", "lost.*.stream": "obj", "lost.*.stream.*": "count",
    "attach_plan": "obj",
    "notes": "list",
    "interval": "obj", "interval.armed_ns": "int", "interval.disarmed_ns": "int",
    "summaries": "obj", "summaries.*": "obj", "summaries.reclaim.t0_ns": "int",
    "replay_dir": "str",
    "epochs": "obj", "epochs.by_phase": "obj", "epochs.by_phase.*": "obj",
}

CELL_SPEC: dict[str, str] = {
    "inputs": "obj", "inputs.warmup": "count", "inputs.passes": "count", "inputs.kernel": "str",
    "capacity_bytes": "count", "device_bytes": "num", "device_bytes_per_iteration": "num",
    "miss_bytes_per_iteration": "num", "amplification": "num", "refault_file_pages": "num",
    "measured_iterations": "count", "iteration_time_median_ns": "num", "iteration_time_spread": "num",
    "mechanism": "str", "mode": "str", "reasons": "list", "notes": "list", "flags": "list",
    "kernel": "kernel", "kernel.release": "str", "kernel.mglru": "obj", "kernel.mglru.on": "bool",
    "simulated": "obj", "oom_events": "obj", "outside_evictions": "obj", "host": "obj", "host.name": "str",
}

REPLAY_SPEC: dict[str, str] = {
    "warmup": "count", "passes": "count", "mode": "str", "plan": "obj", "plan.path": "str", "pool": "obj",
    "epochs": "obj",
}

# one /proc snapshot (snapshots/<label>.json of a cell); a run's snapshots.json holds them by label
_SNAPSHOT = {"monotonic_ns": "num", "realtime_ns": "num", "vmstat": "obj", "vmstat.*": "num",
             "diskstats": "obj", "meminfo": "obj", "psi": "obj", "psi.*": "obj", "psi.*.*": "obj",
             "psi.*.*.total_us": "num", "vmlck_bytes": "obj", "scope": "obj"}
SNAPSHOT_SPEC: dict[str, str] = dict(_SNAPSHOT)
SNAPSHOTS_SPEC: dict[str, str] = {"*": "obj", **{f"{label}.{k}": v for label in ("pre", "post")
                                                 for k, v in _SNAPSHOT.items()}}


def _kind_ok(kind: str, v: Any) -> bool:
    if kind == "obj":
        return isinstance(v, dict)
    if kind == "list":
        return isinstance(v, list)
    if kind == "str":
        return isinstance(v, str)
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "kernel":
        return isinstance(v, (dict, str))
    if kind == "num":
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
            and abs(v) <= 2.0**63
    if kind in ("int", "count", "geo"):
        if isinstance(v, bool) or not isinstance(v, int):
            return False
        if kind == "int":
            return abs(v) < 2**62
        return 0 <= v <= _MAX_COUNT if kind == "count" else 1 <= v <= _MAX_GEO
    raise ValueError(kind)


_WHAT = {"obj": "an object", "list": "an array", "str": "a string", "bool": "true or false",
         "kernel": "an object or a string", "num": "a finite number", "int": "an integer",
         "count": "an integer in [0, 2**53]", "geo": "an integer in [1, 2**24]"}


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _walk(doc: Any, parts: list[str], prefix: tuple) -> Iterable[tuple[tuple, Any]]:
    if not parts:
        yield prefix, doc
        return
    if not isinstance(doc, dict):
        return
    head, rest = parts[0], parts[1:]
    keys = list(doc) if head == "*" else ([head] if head in doc else [])
    for k in keys:
        yield from _walk(doc[k], rest, prefix + (k,))


def check_types(doc: Mapping[str, Any], spec: Mapping[str, str], path: str) -> None:
    """InputError naming ``path`` and the key when a value present in ``doc`` (and not null)
    has another kind than ``spec`` gives it."""
    for key, kind in spec.items():
        for at, v in _walk(doc, key.split("."), ()):
            if v is None or _kind_ok(kind, v):
                continue
            name = ".".join(map(str, at))
            raise InputError(f"key {name!r} must be {_WHAT[kind]}, not {_short(v)}", path=path,
                             hint="the file was damaged or edited; moetrace writes it")


def check_geometry(doc: Mapping[str, Any], path: str) -> None:
    """The geometry of ``pool.geometry`` or ``plan`` within what moetrace records."""
    for where in ("pool.geometry", "plan"):
        g: Any = doc
        for k in where.split("."):
            g = g.get(k) if isinstance(g, dict) else None
        if isinstance(g, dict) and isinstance(g.get("n_layers"), int) and isinstance(g.get("n_experts"), int) \
                and g["n_layers"] * g["n_experts"] > MAX_EXPERTS:
            raise InputError(f"key {where!r}: {g['n_layers']} layers x {g['n_experts']} experts is beyond any "
                             f"pool moetrace records ({MAX_EXPERTS} experts)", path=path)


def check_manifest(doc: Manifest | Mapping[str, Any], path: str) -> None:
    """A run manifest's values, where analyses read them."""
    check_types(doc, MANIFEST_SPEC, path)
    check_geometry(doc, path)


#: results.parquet columns the sweep report and check read, with the pandas kinds they may have
RESULTS_COLUMNS = {"capacity_bytes": "iuf", "cell_dir": "OSU", "retained": "b"}
CAPACITY_COLUMNS = {"capacity_bytes": "iuf", "cells": "iuf", "retained": "iuf", "iteration_time_median_ns": "iuf",
                    "iteration_time_spread": "iuf", "device_bytes_per_iteration": "iuf",
                    "miss_bytes_per_iteration": "iuf", "amplification": "iuf"}


def _check_columns(df, want: Mapping[str, str], path: str) -> None:
    for c, kinds in want.items():
        if c not in df.columns:
            raise InputError(f"column {c!r} is missing", path=path)
        kind = getattr(df[c].dtype, "kind", "O")
        if kind not in kinds:
            raise InputError(f"column {c!r} has type {df[c].dtype}, not {'a number' if 'f' in kinds else kinds}",
                             path=path)


def check_sweep_tables(results, capacity, sweep_dir) -> None:
    """results.parquet and capacity.parquet hold the columns the report and check read, and
    cell_dir names cells of this sweep (a relative path, no '..')."""
    from pathlib import Path

    rp = str(Path(sweep_dir) / "results.parquet")
    _check_columns(results, RESULTS_COLUMNS, rp)
    for v in results["cell_dir"]:
        if not isinstance(v, str) or not v or "\0" in v or Path(v).name in ("", ".", ".."):
            raise InputError(f"column 'cell_dir' holds {_short(v)}, not a cell directory", path=rp)
    if capacity is not None:
        cp = str(Path(sweep_dir) / "capacity.parquet")
        _check_columns(capacity, CAPACITY_COLUMNS, cp)


# -- tables ----------------------------------------------------------------------------------------
# The columns each table's readers index, with the kinds they may have, are the ``check`` of the
# table's one declaration: in moetrace.run.tables for the tables declared there, else in the probe's
# module (moetrace.record.probes.<name>, which run/ never imports), from where the recorder writes
# it into the manifest's ``tables`` section beside dtype, unit and doc (run/ reads it back there).
# Parquet pages carry no checksums: a damaged file may still decode, with a column renamed or
# retyped, or values out of range, so the readers check what the analyses rely on (ids inside the
# geometry, unique keys).

#: {table: {column: check}}: the columns the readers rely on, of the tables run/ declares
TABLE_SPEC: dict[str, dict[str, str]] = {name: checks(name) for name in TABLES if checks(name)}
#: columns that identify a row: no two rows may share them (and every per-expert table, one that
#: checks kind, layer, expert and expert_id: one row per (expert_id, kind))
TABLE_KEYS: dict[str, tuple[str, ...]] = {
    "experts": ("expert_id", "kind"), "expert_epochs": ("epoch", "expert_id", "kind"), "epochs": ("epoch",),
    "iterations": ("phase", "repeat", "iteration"),
}
_PER_EXPERT = {"kind", "layer", "expert", "expert_id"}
_KINDS = {"n": "iuf", "i": "iu", "s": "OSU", "b": "b"}
_KIND_WHAT = {"n": "a number", "i": "an integer", "s": "a string", "b": "a boolean"}


def table_checks(name: str, manifest: Mapping[str, Any] | None = None, path: str = "") -> dict[str, str]:
    """{column: check} of a table: run/'s own declaration, else the one the manifest's ``tables``
    section carries (written from the probe's declaration; an older run's manifest has none: its
    table is read unchecked). InputError for a check that is not one (a damaged manifest)."""
    if name in TABLES:
        return TABLE_SPEC.get(name, {})
    doc = (manifest or {}).get("tables") if isinstance(manifest, Mapping) else None
    cols = doc.get(name) if isinstance(doc, dict) else None
    out: dict[str, str] = {}
    for c, d in (cols.items() if isinstance(cols, dict) else ()):
        k = d.get("check") if isinstance(d, dict) else None
        if k is None or k == "":
            continue
        if not isinstance(k, str) or k.rstrip("?") not in _KINDS or k.count("?") > 1:
            raise InputError(f"manifest key 'tables.{name}.{c}.check' is {_short(k)}, not a column check "
                             f"(n, i, s or b, optionally followed by ?)", path=path,
                             hint="the run's manifest.json was damaged or edited; moetrace writes it")
        out[c] = k
    return out


def _geometry_of(manifest: Manifest | Mapping[str, Any] | None) -> tuple[int, int] | None:
    """(layers, experts) of the manifest's pool, else of its plan (read_manifest checked their types)."""
    pool = (manifest or {}).get("pool")
    for d in (pool.get("geometry") if pool else None, (manifest or {}).get("plan")):
        if isinstance(d, dict) and isinstance(d.get("n_layers"), int) and isinstance(d.get("n_experts"), int):
            return d["n_layers"], d["n_experts"]
    return None


def check_table(name: str, df, path: str, manifest: Manifest | None = None) -> None:
    """A run table as its readers need it: the columns its declaration checks, with their kinds, strings
    that are valid UTF-8, unique keys, and per-expert rows inside the manifest's geometry."""
    import numpy as np
    import pyarrow as pa

    for c in df.columns:  # a damaged page can decode into a string that is not UTF-8
        arr = df[c].array
        if hasattr(arr, "__arrow_array__") and getattr(df[c].dtype, "kind", "") in "OSU":
            try:
                a = pa.array(arr)
                a.validate(full=True)
            except (pa.ArrowException, TypeError, ValueError) as e:
                raise InputError(f"table {name!r}: column {c!r} holds invalid strings ({e})", path=path) from None
    spec = table_checks(name, manifest, path)
    if not spec:
        return
    for c, k in spec.items():
        optional = k.endswith("?")
        k = k.rstrip("?")
        if c not in df.columns:
            if optional:
                continue
            raise InputError(f"table {name!r} lacks column {c!r}", path=path,
                             hint="the file was damaged, or written by another program")
        kind = getattr(df[c].dtype, "kind", "O")
        if kind not in _KINDS[k]:
            raise InputError(f"table {name!r}: column {c!r} has type {df[c].dtype}, not {_KIND_WHAT[k]}", path=path)
        if k in "in" and kind in "iu" and len(df) and (df[c].dropna().abs() > 2**62).any():
            raise InputError(f"table {name!r}: column {c!r} holds a value beyond 2**62", path=path)
    key = TABLE_KEYS.get(name) or (("expert_id", "kind") if _PER_EXPERT <= set(spec) else None)
    rows = df[df["kind"] == "expert"] if "layer" in spec else df  # per-expert tables: their expert rows
    if key and len(rows):
        if rows[list(key)].isna().any().any():
            raise InputError(f"table {name!r}: a row without {', '.join(key)}", path=path)
        dup = rows.duplicated(list(key)).to_numpy()
        if dup.any():
            i = int(np.flatnonzero(dup)[0])
            raise InputError(f"table {name!r}: row {i} repeats the key ({', '.join(key)}) of an earlier row",
                             path=path)
    if name == "epochs" and len(df) and (df["start_ns"].isna().any()):
        raise InputError(f"table {name!r}: an epoch without start_ns", path=path)
    geo = _geometry_of(manifest)
    if geo is not None and "layer" in spec and len(rows):
        L, E = geo
        if rows[["layer", "expert"]].isna().any().any():
            raise InputError(f"table {name!r}: an expert row without its layer or expert", path=path)
        lay, ex, eid = (rows[c].to_numpy(np.int64) for c in ("layer", "expert", "expert_id"))
        bad = (lay < 0) | (lay >= L) | (ex < 0) | (ex >= E) | (eid != lay * E + ex)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InputError(f"table {name!r}: expert row {i} (layer {lay[i]}, expert {ex[i]}, expert_id {eid[i]}) "
                             f"lies outside the run's geometry {L} x {E}", path=path)
