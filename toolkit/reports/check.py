"""`moetrace check BASE CAND`: did the same cell get worse? (analyses.compare arranged)

BASE and CAND are each a run (`record --out`), a cell (`cell --out`), a sweep (`sweep --out`:
its retained recorded-or-not cells, grouped by capacity, are repeats) or a directory holding
several runs or cells (repeats). Groups are matched by capacity; two single groups are
compared whatever their capacities (a smaller C is a fair candidate). A set of repeats comes
from one host (cell.json ``host``, else the run manifest's): repeats from several are refused
unless ``mixed_hosts`` pools them (noted); base and candidate on different hosts are compared
(a cross-host comparison, noted).

With one cell a side (no repeats to test between), a metric regressed only when it moved beyond
its spread between identical cells of that mechanism on that machine (moetrace.analyses.spread:
a --thresholds file's [spread], else the per-machine file `moetrace calibrate` writes, else
check's shipped defaults); a move past its threshold but within that spread is inconclusive.

Exit status: 0 no regression, 1 regression (the metrics are named), 2 could not compare
(the reason is given), 3 inconclusive (the metrics and the repeats a side that would decide).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetrace.analyses.capacity_response import UNKNOWN_HOST  # a unit naming no host: never conflicts
from moetrace.analyses.spread import MAX_REPEATS
from moetrace.errors import InputError

NO_REGRESSION, REGRESSION, CANNOT_COMPARE, INCONCLUSIVE = 0, 1, 2, 3


def _label(run) -> str:
    c = (run.cell or {}).get("capacity_bytes")
    return f"{int(c) >> 20}MiB" if c else "run"


def load_units(path: str | os.PathLike) -> dict[str, list]:
    """{group label (capacity, or 'run'): [Run, ...]} of a run, cell, sweep or a directory of them.
    A sweep's cells that were not retained are left out (their figures do not count)."""
    from moetrace.run.handle import kind_of, open_run, open_sweep

    p = Path(path)
    try:
        kind = kind_of(p)
    except InputError:
        kind = None
    runs = []
    if kind == "sweep":
        runs = [c for c in open_sweep(p).cells if (c.cell or {}).get("retained", True)]
        if not runs:
            raise InputError("no retained recorded cell in this sweep", path=str(p),
                             hint="run the sweep with --record")
    elif kind in ("run", "cell", "engine_cell"):
        runs = [open_run(p, unrecorded=True)]
    else:
        subs = sorted(d for d in p.iterdir() if d.is_dir()) if p.is_dir() else []
        for d in subs:
            try:
                k = kind_of(d)
            except InputError:
                continue
            if k in ("run", "cell", "engine_cell"):
                runs.append(open_run(d, unrecorded=True))  # an unrecorded cell: its cell.json metrics
        if not runs:
            raise InputError("not a run, cell or sweep, nor a directory of them", path=str(p),
                             hint="give `record --out`, `cell --out` or `sweep --out` directories")
    groups: dict[str, list] = {}
    for r in runs:
        groups.setdefault(_label(r), []).append(r)
    return groups


@dataclass
class CheckResult:
    status: int
    reason: str | None
    tables: dict[str, Any] = field(default_factory=dict)  # group -> comparison DataFrame
    regressed: dict[str, list[str]] = field(default_factory=dict)
    pairs: list[tuple[str, str]] = field(default_factory=list)
    #: why a metric was not compared (e.g. refaults counted differently by the two kernels)
    notes: list[str] = field(default_factory=list)
    #: group -> {metric: cells a side that would decide (None: more than MAX_REPEATS)}
    inconclusive: dict[str, dict[str, int | None]] = field(default_factory=dict)

    def verdict(self) -> str:
        if self.status == CANNOT_COMPARE:
            return f"could not compare: {self.reason}"
        undecided = self.undecided_text()
        if self.status == REGRESSION:
            return "regression: " + "; ".join(f"{g}: {', '.join(m)}" for g, m in self.regressed.items() if m) + \
                (f" (inconclusive: {undecided})" if undecided else "")
        if self.status == INCONCLUSIVE:
            return (f"inconclusive: {undecided}: past the threshold, within the spread between identical cells "
                    f"(one cell a side; in parentheses the cells a side that would decide)")
        return "no regression"

    def undecided_text(self) -> str:
        """'64MiB: iteration_time_ns (~12 cells a side)' of the inconclusive metrics."""
        def n(v):
            return f"~{v} cells a side" if v else f"> {MAX_REPEATS} cells a side"
        return "; ".join(f"{g}: " + ", ".join(f"{m} ({n(v)})" for m, v in ms.items())
                         for g, ms in self.inconclusive.items() if ms)

    def repeats_to_decide(self) -> int | None:
        """The cells a side that would decide every inconclusive metric (None: more than MAX_REPEATS
        or nothing inconclusive)."""
        ns = [v for ms in self.inconclusive.values() for v in ms.values()]
        return None if not ns or None in ns else max(ns)


def host_counts(units) -> dict[str, int]:
    """{host name (UNKNOWN_HOST when the unit does not say): units}, most units first."""
    from moetrace.analyses.compare import host_of

    counts: dict[str, int] = {}
    for r in units:
        h = host_of(r) or UNKNOWN_HOST
        counts[h] = counts.get(h, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def hosts_text(counts: dict[str, int]) -> str:
    """'node-a: 2 units, node-b: 1 unit'."""
    return ", ".join(f"{h}: {n} unit{'s' if n != 1 else ''}" for h, n in counts.items())


def host_rule(bg: dict[str, list], cg: dict[str, list], pairs: list[tuple[str, str]],
              mixed_hosts: bool = False) -> tuple[str | None, list[str]]:
    """(why the sides cannot be compared, notes) by the hosts the units ran on: a set of repeats
    (one group of one side) from more than one known host is refused, or with ``mixed_hosts``
    pooled and noted; base and candidate on different hosts is a cross-host comparison, noted."""
    mixed, known = [], {}
    for side, groups, names in (("base", bg, [b for b, _ in pairs]), ("candidate", cg, [c for _, c in pairs])):
        known[side] = set()
        for g in dict.fromkeys(names):
            counts = host_counts(groups[g])
            hosts = [h for h in counts if h != UNKNOWN_HOST]
            known[side] |= set(hosts)
            if len(hosts) > 1:
                mixed.append(f"{side} {g}: repeats from {len(hosts)} hosts ({hosts_text(counts)})")
    if mixed and not mixed_hosts:
        return ("; ".join(mixed) + "; one set of repeats comes from one host (its page cache, device and kernel "
                "are what a cell measures): run a side's repeats on one host, or --mixed-hosts pools them anyway"), []
    notes = [f"{m}: pooled as one set of repeats (--mixed-hosts)" for m in mixed]
    if known["base"] and known["candidate"] and known["base"] != known["candidate"]:
        notes.append(f"cross-host comparison: base on {', '.join(sorted(known['base']))}, candidate on "
                     f"{', '.join(sorted(known['candidate']))}; the difference includes the hosts' (device, kernel, "
                     f"memory: each cell.json's host)")
    return None, notes


def run_check(base: str | os.PathLike, cand: str | os.PathLike, thresholds=None,
              mixed_hosts: bool = False) -> CheckResult:
    """Compare ``cand`` against ``base`` (module doc); ``mixed_hosts`` pools a side's repeats
    from different hosts instead of refusing them (and says so in the notes)."""
    from moetrace.analyses import compare as C

    try:
        bg, cg = load_units(base), load_units(cand)
    except InputError as e:
        return CheckResult(CANNOT_COMPARE, e.format_message())
    if len(bg) == 1 and len(cg) == 1:
        pairs = [(next(iter(bg)), next(iter(cg)))]
    else:
        common = [g for g in bg if g in cg]
        if not common:
            return CheckResult(CANNOT_COMPARE, f"no capacity in common (base: {', '.join(bg)}; candidate: "
                                               f"{', '.join(cg)})")
        pairs = [(g, g) for g in common]
    why = C.incomparable([r for b, _ in pairs for r in bg[b]], [r for _, c in pairs for r in cg[c]])
    if why:
        return CheckResult(CANNOT_COMPARE, why, pairs=pairs)
    why, host_notes = host_rule(bg, cg, pairs, mixed_hosts)
    if why:
        return CheckResult(CANNOT_COMPARE, why, pairs=pairs)
    res = CheckResult(NO_REGRESSION, None, pairs=pairs, notes=host_notes)
    th = thresholds or C.Thresholds.default()
    for b, c in pairs:
        try:
            why = _compare_group(res, b, c, [C.unit_metrics(r) for r in bg[b]], [C.unit_metrics(r) for r in cg[c]],
                                 th)
        except InputError as e:  # a per-machine thresholds file that cannot be read
            why = e.format_message()
        if why:
            return CheckResult(CANNOT_COMPARE, why, pairs=pairs)
    if any(len(bg[b]) == 1 or len(cg[c]) == 1 for b, c in pairs):
        res.notes.append(ONE_A_SIDE)
    if any(res.regressed.values()):
        res.status = REGRESSION
    elif any(res.inconclusive.values()):
        res.status = INCONCLUSIVE
    return res


def _compare_group(res: CheckResult, b: str, c: str, base: list, cand: list, th) -> str | None:
    """Compare one pair of groups into ``res`` (its table, regressions, inconclusive metrics and
    notes); with one unit a side, against the spread between identical cells (module doc). Returns
    why they cannot be compared, or None."""
    from moetrace.analyses import compare as C
    from moetrace.analyses.spread import resolve
    from moetrace.reports.machine_thresholds import machine_entries

    name = b if b == c else f"{b} -> {c}"
    spread = None
    if len(base) == 1 or len(cand) == 1:
        units = [(u.get("host"), u.get("mechanism")) for u in (*base, *cand)]
        # the per-machine file keys by host: units that name none never read it
        spread = resolve(units, th.spread, machine_entries(C.METRICS) if any(h for h, _m in units) else {})
    df = C.compute_comparison(base, cand, th, spread=spread)
    if df.empty:
        return f"{name}: no metric has a value on both sides"
    res.tables[name] = df
    res.regressed[name] = C.regressed(df)
    res.inconclusive[name] = C.inconclusive(df)
    res.notes += [n for n in df.attrs.get("notes", []) if n not in res.notes]
    if spread:
        note = spread_note(name, df, spread)
        if note not in res.notes:
            res.notes.append(note)
    return None


def spread_note(name: str, df, spread: dict) -> str:
    """Where the spread between identical cells that the one-cell verdicts of ``df`` passed came from."""
    used = [m for m in df["metric"] if m in spread]
    sources: dict[str, list[str]] = {}
    for m in used:
        sources.setdefault(spread[m].source, []).append(f"{m} {100 * spread[m].limit:.0f} %")
    return (f"{name}: spread between identical cells (a one-cell move must pass it to be a regression): "
            + "; ".join(f"{', '.join(ms)} from {src}" for src, ms in sources.items()))


#: said whenever a side has one unit: what a check of one cell a side cannot see, and what it does
ONE_A_SIDE = ("one cell a side: samples within a cell do not see the noise between identical cells (boot to "
              "boot, run to run), so a metric regressed only beyond its spread between identical cells of that "
              "mechanism on this machine (above); past its threshold but within that spread it is inconclusive "
              "(exit 3). Measure this machine's spread with `moetrace calibrate` on identical cells (it writes "
              "the per-machine file check reads), or give 3 repeats a side (the cell-level test)")


def check_doc(res: CheckResult, base, cand) -> dict[str, Any]:
    from moetrace.reports.document import table_json

    return {"schema": "moetrace.check/1", "base": str(base), "candidate": str(cand), "status": res.status,
            "verdict": res.verdict(), "reason": res.reason, "regressed": res.regressed,
            "inconclusive": res.inconclusive, "repeats_to_decide": res.repeats_to_decide(), "notes": res.notes,
            "groups": {g: json.loads(table_json(df)) for g, df in res.tables.items()}}


def write_check_report(res: CheckResult, base, cand, out: str | os.PathLike) -> dict[str, Any]:
    """check.html / CHECK.md / tables through the report writer (built aside, then moved into
    ``out``: a failure leaves what was there untouched)."""
    from moetrace.reports.document import Report, staged, write_report

    out = Path(out)
    with staged(out, clear=()) as stage:
        rep = Report(stage, f"moetrace check: {Path(cand).name} against {Path(base).name}")
        rep.h(2, "Verdict", "verdict")
        rep.p(res.verdict())
        for n in res.notes:
            rep.p(n)
        for g, df in res.tables.items():
            rep.h(2, f"Capacity {g}")
            rep.table(f"check_{g.replace(' ', '').replace('>', '').replace('-', '_')}", df,
                      "Per metric: medians, spread, candidate / base, the test's p, bootstrap 95 % interval of the "
                      "ratio (repeats), the spread between identical cells a one-cell move must pass, the verdict "
                      "and the cells a side that would decide an inconclusive one",
                      None)
        rep.summary.update(check_doc(res, base, cand))
        return write_report(rep, ("verdict",), final=out)
