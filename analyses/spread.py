"""The spread between identical cells: how far a metric moves from one cell to the next when
nothing changed (A/A), per host and capacity mechanism; what `moetrace check` needs before it
calls a move of one cell a side a regression.

With one cell a side the only test is within the cells (Mann-Whitney U of the per-iteration
samples, or none): it does not see what changes from one cell to the next (the page cache's
state, what else the machine runs, the device), so it names moves the next cell would not
repeat. `check` calls such a move a regression only beyond the metric's spread (``limit``);
within it, *inconclusive*, with the repeats a side that would decide (:func:`repeats_to_decide`,
from the spread's ``cv``).

Where a spread comes from, per metric, first that has it (:func:`resolve`): the ``[spread]``
table of the thresholds file given to `check --thresholds`; the per-machine file
(moetrace.reports.machine_thresholds, which `moetrace calibrate` writes by default); the shipped
defaults (:data:`DEFAULT_SPREAD`). Both files hold it per host (cell.json ``host.name``) and
mechanism (cell.json ``mechanism``)::

    [spread."myhost".cgroup]
    cells = 20                    # what it was measured on (not read by check)
    iteration_time_ns = { limit = 0.85, cv = 0.2 }
    device_bytes_per_iteration = { limit = 0.12, cv = 0.03 }

``limit``: the relative move (0.85 = 85 %) past which one cell a side is a regression; ``cv``:
the standard deviation of ln(value) between identical cells. Either may be left out: the other
is derived (``limit = exp(Z x sqrt(2) x cv) - 1``, :data:`Z`). ``floor`` (optional, the metric's
unit; default :data:`NOISE_FLOOR`): a move no larger is no move at all, whatever its ratio (noise
that adds rather than scales: other processes' reads on the device near a value of zero).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from moetrace.errors import InputError

#: one-sided normal quantile of the limit: exp(Z x sqrt(2) x cv) - 1 is the move one A/A pair in
#: 1,000 exceeds on one metric (log-normal noise between cells; a check tests up to 11 metrics)
Z = 3.09

#: the move (in the metric's own unit) no larger than which nothing moved, with one cell a side.
#: Device bytes are the device's (diskstats): other processes' reads land in them. Measured on a
#: 2-CPU VM host with a kernel build and other work in the background (olmoe x 128 KiB pool,
#: 300 iterations of 16 MB requested, cgroup, 10 identical cells whose pool fits at C = 256 MiB):
#: 191 B to 523 KB per iteration; 1 MiB covers that twice over and stays a fraction of an
#: eighth-capacity cut's change (64 -> 8 MiB: +4.6 MB per iteration; 256 -> 32 MiB: +2.2 MB).
#: Refaults and re-reads are the cell's own pages (its memcg; 0-0.17 per iteration there), but
#: the same traffic as the device's bytes, so their floor is the same 1 MiB in 4 KiB pages:
#: measured in CI (100-step trace, cgroup, C = 64 MiB), both A/A pairs moved 123 -> 192 refault
#: pages per iteration (x1.56) while the device's 504 -> 787 KB per iteration stayed under its
#: floor; a floor of 16 pages named that a regression, twice.
#: Amplification (device bytes / the simulated miss demand) carries the device's noise: check
#: raises its floor to device bytes' over the miss demand (compare.amplification_floor).
NOISE_FLOOR: dict[str, float] = {
    "device_bytes_per_iteration": float(1 << 20),
    "rereads_per_iteration": float((1 << 20) // 4096),
    "refaults_per_iteration": float((1 << 20) // 4096),
    "amplification": 0.05,
    "scan_to_steal": 0.05,
}

#: the mechanism key of a unit that names none (a `record` run, an old cell)
UNKNOWN = "unknown"


@dataclass(frozen=True)
class Spread:
    """One metric's spread between identical cells (module doc): ``limit`` relative, ``cv`` of
    ln(value), ``floor`` absolute, ``source`` where it came from (said in check's notes)."""

    limit: float
    cv: float
    floor: float = 0.0
    source: str = "check's defaults"

    @classmethod
    def of(cls, limit: float | None = None, cv: float | None = None, floor: float = 0.0,
           source: str = "check's defaults") -> "Spread":
        """From either or both of ``limit`` and ``cv`` (the other derived, module doc)."""
        if limit is None and cv is None:
            raise ValueError("a spread needs a limit or a cv")
        if limit is None:
            limit = math.expm1(Z * math.sqrt(2) * cv)
        if cv is None:
            cv = math.log1p(limit) / (Z * math.sqrt(2))
        return cls(float(limit), float(cv), float(floor), source)


#: Shipped defaults, mechanism -> metric -> (limit, cv): used where neither a --thresholds file
#: nor the per-machine file has the host and mechanism. Measured on the noisiest host we have
#: (a 2-CPU VM, Linux 6.18, cgroup v1, a kernel build at nice 19 and other work beside it):
#: `moetrace cell` of an olmoe x 128 KiB pool (128 MiB, 300 iterations of 16 MB), unrecorded,
#: identical cells back to back, `moetrace calibrate` over them:
#:   cgroup, 10 cells at C = 64 MiB and 10 at 256 MiB (the pool fits): iteration time cv 0.197
#:     (6.2-13.3 ms at 64 MiB: 2.14x between two identical cells; 4.4-7.5 ms at 256 MiB), device
#:     bytes cv 0.087 (0.97-1.15 MB per iteration at 64 MiB; at 256 MiB under the floor),
#:     amplification cv 0.048, refaults cv 0.004 (235-239 pages per iteration);
#:   balloon, 5 cells at C = 2 GiB and 5 at 4 GiB (this host's smallest balloon C is 1.93 GB;
#:     the pool fits): iteration time cv 0.132, device bytes and refaults under their floors.
#: The kernel lab (README, "How far check can be trusted": 60 identical cells under TCG) adds
#: iteration time cv 9-34 % and device bytes cv 0-7.6 % under a cgroup wall, 9-27 % under
#: balloons and vm-memory (the `machine` mechanism; bistable capacities at that size).
#: So: cgroup and balloon iteration time and hit-path latency cv 0.2 (limit 1.5: 2.5x); device
#: bytes, amplification, refaults and re-reads cv 0.09 (limit 0.5) under a cgroup wall and 0.27
#: (limit 2.3) under a balloon or vm-memory; vm-memory's times cv 0.34 (limit 3.4, TCG); the
#: metrics only a recorded cell has (scan-to-steal, latency quantiles and ages from log2
#: histograms, MGLRU aging) were not measured here: limit 1.0 (scan-to-steal) or 2.0 (a log2
#: bucket is 2x), cv derived.
_TIME, _SLOW_TIME = (1.5, 0.2), (3.4, 0.34)
_WALL, _LOOSE = (0.5, 0.09), (2.3, 0.27)
_UNMEASURED = {"scan_to_steal": (1.0, 0.159), "hit_only_p50_ns": (2.0, 0.251), "hit_only_p99_ns": (2.0, 0.251),
               "age_at_eviction_p50_ns": (2.0, 0.251), "aging_ms_per_increment": (2.0, 0.251)}


def _defaults(time: tuple[float, float], reads: tuple[float, float]) -> dict[str, tuple[float, float]]:
    return {"iteration_time_ns": time, "hit_only_ns_per_kib": time, "device_bytes_per_iteration": reads,
            "amplification": reads, "rereads_per_iteration": reads, "refaults_per_iteration": reads, **_UNMEASURED}


DEFAULT_SPREAD: dict[str, dict[str, tuple[float, float]]] = {
    "cgroup": _defaults(_TIME, _WALL),
    "balloon": _defaults(_TIME, _LOOSE),
    "machine": _defaults(_SLOW_TIME, _LOOSE),
}


def default_spread(mechanism: str | None) -> dict[str, Spread]:
    """{metric: Spread} of the shipped defaults for ``mechanism``; an unknown or absent one gets
    the largest of every mechanism's (the most conservative)."""
    table = DEFAULT_SPREAD.get(mechanism or UNKNOWN)
    if table is None:
        table = {}
        for t in DEFAULT_SPREAD.values():
            for m, (lim, cv) in t.items():
                old = table.get(m, (0.0, 0.0))
                table[m] = (max(old[0], lim), max(old[1], cv))
    what = f"check's defaults ({mechanism})" if mechanism in DEFAULT_SPREAD else "check's defaults (any mechanism)"
    return {m: Spread(lim, cv, NOISE_FLOOR.get(m, 0.0), what) for m, (lim, cv) in table.items()}


def combine(spreads: Iterable[Mapping[str, Spread]]) -> dict[str, Spread]:
    """Per metric, the larger limit and cv of several units' spreads (base and candidate of
    another host or mechanism): the move must be beyond both."""
    out: dict[str, Spread] = {}
    for sp in spreads:
        for m, s in sp.items():
            o = out.get(m)
            if o is None:
                out[m] = s
            elif (s.limit, s.cv, s.floor) != (o.limit, o.cv, o.floor):
                src = o.source if s.source == o.source else f"{o.source}; {s.source}"
                out[m] = Spread(max(o.limit, s.limit), max(o.cv, s.cv), max(o.floor, s.floor), src)
    return out


# -- repeats that would decide ---------------------------------------------------------------------

#: check's power when it estimates the repeats that would decide
POWER = 0.8
#: the most repeats repeats_to_decide counts to (beyond: None, "more than this")
MAX_REPEATS = 100
#: simulated checks per number of repeats
SIMULATIONS = 1000


def repeats_to_decide(worse: float, cv: float, threshold: float = 0.0, alpha: float = 0.05,
                      power: float = POWER, seed: int = 0) -> int | None:
    """Cells a side with which `check` would name a move of ``worse`` (> 1: candidate / base, made
    direction-free, taken as the true move): the smallest n >= 2 at which ``power`` of
    SIMULATIONS simulated checks of n cells against n call it a regression the way check does
    with repeats (the ratio of the medians past 1 + ``threshold`` and Welch's t over the cells' logs
    at p < ``alpha``, moetrace.analyses.compare.welch), each cell's value log-normal with the
    spread between identical cells ``cv`` (sd of ln value). Simulated, not a formula: with 2 or 3 cells a side Welch's degrees of freedom
    fall well below the pooled test's and the normal approximation promises too much. None beyond
    MAX_REPEATS (or no move)."""
    import numpy as np
    from scipy import stats

    if not worse > 1:
        return None
    if not math.isfinite(worse) or cv <= 0:
        return 2
    rng = np.random.default_rng(seed)
    d = math.log(worse)
    for n in range(2, MAX_REPEATS + 1):
        lb = rng.normal(0.0, cv, (SIMULATIONS, n))  # the cells' ln values
        lc = rng.normal(d, cv, (SIMULATIONS, n))
        named = (np.exp(np.median(lc, axis=1) - np.median(lb, axis=1)) > 1 + threshold) & \
            (stats.ttest_ind(lc, lb, axis=1, equal_var=False).pvalue < alpha)
        if named.mean() >= power:
            return n
    return None


# -- the [spread] table of a thresholds TOML (the per-machine file has the same form) ------------

#: keys of a [spread.HOST.MECHANISM] table that are not metrics: what it was measured on
META_KEYS = ("cells", "groups", "pairs", "source", "written")

#: {(host, mechanism): {"metrics": {metric: Spread}, "meta": {...}}}
SpreadEntries = dict[tuple[str, str], dict[str, Any]]


def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v <= 1e300


def parse_spread(table: Any, metrics: Iterable[str], path: str, source: str) -> SpreadEntries:
    """The ``[spread]`` table of a TOML document (module doc) as entries; ``metrics`` are the
    names it may hold, ``source`` what check's notes call it. Raises InputError, naming the key."""
    out: SpreadEntries = {}
    if table is None:
        return out
    known = set(metrics)
    example = 'spread."HOST".MECHANISM.METRIC = { limit = 0.5, cv = 0.1 }'
    if not isinstance(table, dict):
        raise InputError(f"spread must be a table: {example}", path=path)
    for host, mechs in table.items():
        if not isinstance(mechs, dict):
            raise InputError(f"spread.{host} must be a table of mechanisms: {example}", path=path)
        for mech, entry in mechs.items():
            if not isinstance(entry, dict):
                raise InputError(f"spread.{host}.{mech} must be a table of metrics: {example}", path=path)
            got: dict[str, Spread] = {}
            for m, v in entry.items():
                if m in META_KEYS:
                    continue
                if m not in known:
                    raise InputError(f"unknown metric {m!r} in spread.{host}.{mech}", path=path,
                                     hint="metrics: " + ", ".join(sorted(known)))
                if not isinstance(v, dict) or not set(v) <= {"limit", "cv", "floor"} or not {"limit", "cv"} & set(v) \
                        or not all(_number(x) for x in v.values()):
                    raise InputError(f"spread.{host}.{mech}.{m} must be {{ limit = L, cv = S, floor = F }}: numbers "
                                     ">= 0, limit or cv (the other derived), floor optional", path=path)
                got[m] = Spread.of(v.get("limit"), v.get("cv"), v.get("floor", NOISE_FLOOR.get(m, 0.0)),
                                   f"{source} ({host}, {mech})")
            out[(str(host), str(mech))] = {"metrics": got, "meta": {k: entry[k] for k in META_KEYS if k in entry}}
    return out


def resolve(units: Iterable[tuple[str | None, str | None]], given: SpreadEntries,
            machine: SpreadEntries | None = None) -> dict[str, Spread]:
    """{metric: Spread} for units of these (host, mechanism): per unit and metric the first of
    ``given`` (a --thresholds file's), ``machine`` (the per-machine file's), the shipped defaults;
    then the larger over the units (:func:`combine`). A unit naming no host takes nothing from
    ``machine`` (which keys by the host it measured)."""
    machine = machine or {}
    per_unit = []
    for host, mech in dict.fromkeys(units):
        sp = default_spread(mech)
        key = (host or UNKNOWN, mech or UNKNOWN)
        if host is not None and key in machine:
            sp.update(machine[key]["metrics"])
        if key in given:
            sp.update(given[key]["metrics"])
        per_unit.append(sp)
    return combine(per_unit)


def spread_toml(entries: SpreadEntries) -> str:
    """The [spread] tables of ``entries`` as TOML text (hosts and mechanisms quoted)."""
    import json

    lines = []
    for (host, mech), e in sorted(entries.items()):
        lines += ["", f"[spread.{json.dumps(host)}.{json.dumps(mech)}]"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in e.get("meta", {}).items()]
        lines += [f"{m} = {{ limit = {s.limit:.4g}, cv = {s.cv:.4g}, floor = {s.floor:.6g} }}"
                  for m, s in e["metrics"].items()]
    return "\n".join(lines) + "\n"


# -- measuring it: identical cells -> entries ------------------------------------------------------

def _logs(values: Iterable[float | None], floor: float) -> list[float]:
    """ln(value + floor) of the values there are (a value of 0 with no floor says nothing)."""
    return [math.log(v + floor) for v in values if v is not None and v + floor > 0]


def measure_spread(groups: Mapping[str, list[Mapping[str, Any]]], metrics: Iterable[str],
                   source: str = "") -> SpreadEntries:
    """Entries from groups of identical cells ({label: [unit metrics]}, each unit's ``host`` and
    ``mechanism`` as unit_metrics gives them), per (host, mechanism) of a group's first unit:

    - ``floor``: twice the widest range (max - min) of a group whose range is larger than its
      median (noise that adds: a value near zero), if that is above :data:`NOISE_FLOOR`'s;
    - ``cv``: the pooled standard deviation of ln(value + floor) within the groups (near zero a
      relative spread is the floor's noise);
    - ``limit``: exp of the larger of the widest A/A move seen (max - min of those logs in a
      group) and Z x sqrt(2) x cv, minus 1, rounded up to the percent.

    A metric with fewer than two values in every group of a key is left out (its defaults stay)."""
    by_key: dict[tuple[str, str], list[list[Mapping[str, Any]]]] = {}
    for units in groups.values():
        if len(units) >= 2:
            key = (units[0].get("host") or UNKNOWN, units[0].get("mechanism") or UNKNOWN)
            by_key.setdefault(key, []).append(list(units))
    out: SpreadEntries = {}
    for key, gs in by_key.items():
        got = {}
        for m in metrics:
            sp = _measure_one([[u.get(m) for u in g] for g in gs], NOISE_FLOOR.get(m, 0.0),
                              f"{source} ({key[0]}, {key[1]})")
            if sp is not None:
                got[m] = sp
        out[key] = {"metrics": got, "meta": {"cells": sum(map(len, gs)), "groups": len(gs), "source": source}}
    return out


def _measure_one(groups: list[list[float | None]], floor: float, source: str) -> Spread | None:
    """One metric's Spread from its values in groups of identical cells (measure_spread)."""
    import statistics

    vals = [[v for v in g if v is not None] for g in groups]
    vals = [g for g in vals if len(g) >= 2]
    if not vals:
        return None
    wide_abs = [max(g) - min(g) for g in vals if max(g) - min(g) > statistics.median(g)]
    if wide_abs:
        floor = max(floor, 2 * max(wide_abs))
    ss = df = 0.0
    wide = 0.0
    for g in vals:
        x = _logs(g, floor)
        if len(x) < 2:
            continue
        mean = sum(x) / len(x)
        ss += sum((v - mean) ** 2 for v in x)
        df += len(x) - 1
        wide = max(wide, max(x) - min(x))
    if not df:
        return None
    cv = math.sqrt(ss / df)
    limit = math.ceil(math.expm1(max(wide, Z * math.sqrt(2) * cv)) * 100 - 1e-9) / 100
    return Spread(limit, cv, floor, source)
