"""The §5 matrix's report: what each cell's kernel did in its measured window, the matrix summed
up, and its report page (``moetrace report MATRIX_DIR``).

Per cell, from what the cell already brought back (``cell/snapshots/{loop_entry,post}.json``
and the recording in ``cell/run``):

- reclaim: kswapd and direct pgscan / pgsteal and their ratio (scan-to-steal, the paper's
  indicator: above 2 in every amplified cell of its §5), file refaults and activations,
  PSI memory stall, pages read in (pgpgin);
- MGLRU generations of the replay's memcg: how many were born (max_seq growth) and left
  (min_seq growth) inside the window, the oldest generation's age at the end;
- the generation ages at eviction: every pool folio the mglru probe saw evicted inside the
  window, with the age of the generation it was taken from (analyses.age); distinct pages
  evicted and evictions per distinct page (a page evicted twice in one window was read twice);
- why evicted pages were read again (analyses.eviction_reuse, against the plan and the replay's
  iteration log): the share of re-reads a global LRU of C would have kept (excess traffic), the
  share evicted within one iteration of their last access, the share taken from the oldest
  generation.

Cached per cell in ``cell/window.json``. The summary groups retained cells by (kernel, MGLRU,
mechanism): medians and ranges over the repeats, written to ``matrix_summary.csv``,
``matrix_summary.md`` and ``matrix_fig3.png`` (the paper's Fig. 3, middle: paired MGLRU on/off
bars of device bytes per iteration, miss demand dotted). :func:`build_matrix_report` writes the
page from :class:`MatrixInputs` (``moetrace.lab.matrix.matrix_report_inputs`` gathers them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrace.atomic import atomic_write

if TYPE_CHECKING:
    import pandas as pd

WINDOW = "window.json"
#: cell_window's cache is recomputed when its version differs (2: no generation figures with MGLRU
#: off; 3: the pgpgin oracle, the pool's resident bytes, the file pages' spread over generations;
#: 4: dwell at eviction and activations; 5: the oracle's bounds of skipped probe runs; 6: the
#: cell's memcg by path, eviction records naming another memcg not trusted for generations; 8: the
#: readahead beyond the pool reads' requests)
WINDOW_VERSION = 8
VMSTAT_KEYS = ("pgscan_kswapd", "pgsteal_kswapd", "pgscan_direct", "pgsteal_direct", "workingset_refault_file",
               "workingset_activate_file", "workingset_restore_file", "pgpgin")


def vmstat_window(pre: dict[str, Any], post: dict[str, Any]) -> dict[str, Any]:
    """Deltas of the reclaim counters between two snapshots, and scan-to-steal (None: no steal)."""
    a, b = pre.get("vmstat") or {}, post.get("vmstat") or {}
    d = {k: b[k] - a[k] for k in VMSTAT_KEYS if k in a and k in b}
    scan = d.get("pgscan_kswapd", 0) + d.get("pgscan_direct", 0)
    steal = d.get("pgsteal_kswapd", 0) + d.get("pgsteal_direct", 0)
    d["scan_to_steal"] = scan / steal if steal else None
    pa = ((pre.get("psi") or {}).get("memory") or {})
    pb = ((post.get("psi") or {}).get("memory") or {})
    for kind in ("some", "full"):
        if kind in pa and kind in pb:
            d[f"psi_memory_{kind}_us"] = pb[kind]["total_us"] - pa[kind]["total_us"]
    return d


def generations_window(pre: dict[str, Any], post: dict[str, Any], memcg_path: str) -> dict[str, Any]:
    """The lru_gen snapshots of one memcg (node 0..n summed as their min/max): generations born
    and left between the two, and the oldest's age at the end. Empty without MGLRU."""
    def span(snap):
        rows = [r for r in (snap.get("lru_gen") or []) if r.get("memcg_path") == memcg_path]
        if not rows:
            return None
        oldest = min(rows, key=lambda r: r["seq"])
        return min(r["seq"] for r in rows), max(r["seq"] for r in rows), oldest.get("age_ms")

    a, b = span(pre), span(post)
    if a is None or b is None:
        return {}
    return {"generations_born": b[1] - a[1], "generations_left": b[0] - a[0], "oldest_generation_age_ms": b[2],
            "live_generations": b[1] - b[0] + 1}


def added_pages_oracle(run_dir: Path) -> dict[str, Any]:
    """The recording's expert pages added (its manifest's totals) against the guest's own pgpgin
    (KiB) around it (the run's pre/post snapshots): in a lab guest nothing else reads from a
    block device, so added x 4 equals pgpgin exactly — up to the probe runs the kernel skipped and
    counted (7.2 skips some mm_filemap_add_to_page_cache and block runs: recursion misses in the
    manifest's ``lost``), each at most one folio (2 MiB) or one bio (4 MiB here); the same bounds
    as the lab's live test of the newest kernel. {} without the files."""
    try:
        man = json.loads((run_dir / "manifest.json").read_text())
        snaps = json.loads((run_dir / "snapshots.json").read_text())
        t = man["totals"]
        added = int(t["experts_added_pages"])
        pgpgin = int(snaps["post"]["vmstat"]["pgpgin"]) - int(snaps["pre"]["vmstat"]["pgpgin"])
        dev = int(t["experts_device_read_bytes"]) + int(t["unattributed_device_read_bytes"])
        lost = man.get("lost") or {}
        misses = (lost.get("pagecache") or {}).get("counters_recursion_misses") or {}
        add_miss = int(misses.get("tp_mm_filemap_add_to_page_cache")  # the program (older runs: bcc's name)
                       or misses.get("tracepoint__filemap__mm_filemap_add_to_page_cache") or 0)
        bio_miss = int(((lost.get("block") or {}).get("recursion_misses") or {}).get("bytes") or 0)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return {}
    short = pgpgin * 1024 - dev
    gap = int(t["experts_device_read_bytes"]) - added * 4096
    within = (0 <= short <= bio_miss * (4 << 20)) and (-bio_miss * (4 << 20) <= gap <= add_miss * (2 << 20))
    return {"experts_added_pages": added, "recording_pgpgin_kib": pgpgin,
            "added_pages_equal_pgpgin": added * 4 == pgpgin, "skipped_add_runs": add_miss, "skipped_bio_runs": bio_miss,
            "added_pages_within_skipped_runs": bool(within), "recording_device_bytes": dev,
            "pgpgin_bytes_over_device": short, "expert_device_bytes_over_added": gap}


def readahead_beyond(run_dir: Path, page_bytes: int = 4096) -> dict[str, Any]:
    """The recording's pool read calls (the reads probe's per-expert table, warm-up included): the
    bytes they asked for and the pages added during them outside their own byte range (readahead
    beyond the request), and that over what they asked. {} without the table or a pool read."""
    import pandas as pd

    try:
        r = pd.read_parquet(run_dir / "reads.parquet", columns=["kind", "requested_bytes", "beyond_pages"])
    except (OSError, ValueError, KeyError):
        return {}
    r = r[r["kind"] == "expert"]
    asked = int(r["requested_bytes"].sum())
    if not asked:
        return {}
    beyond = int(r["beyond_pages"].sum())
    return {"read_requested_bytes": asked, "readahead_beyond_pages": beyond,
            "readahead_beyond_share": beyond * page_bytes / asked}


def pool_resident(run_dir: Path, page_bytes: int = 4096) -> dict[str, Any]:
    """The pool pages resident in the page cache at the end of each measured iteration: the
    recording's expert pages added less evicted, summed from its start (a cell drops caches
    before it records: nothing of the pool is resident then), as bytes — median, min and max.
    The capacity the pool really held at steady state, beside nominal C and MemAvailable. {}
    without the tables, or when the sum goes negative (something was resident at the start)."""
    import pandas as pd

    try:
        ep = pd.read_parquet(run_dir / "epochs.parquet", columns=["epoch", "phase"]).set_index("epoch")
        ee = pd.read_parquet(run_dir / "expert_epochs.parquet",
                             columns=["epoch", "kind", "added_pages", "evicted_pages"])
    except (OSError, ValueError, KeyError):
        return {}
    ee = ee[ee["kind"] == "expert"]
    net = (ee["added_pages"].astype("int64") - ee["evicted_pages"].astype("int64")).groupby(ee["epoch"]).sum()
    resident = net.reindex(ep.index.sort_values(), fill_value=0).cumsum()
    measured = resident[ep["phase"].reindex(resident.index) == "measured"]
    if measured.empty or int(resident.min()) < 0:
        return {}
    return {"pool_resident_bytes": float(measured.median()) * page_bytes,
            "pool_resident_bytes_min": int(measured.min()) * page_bytes,
            "pool_resident_bytes_max": int(measured.max()) * page_bytes}


def oldest_file_generation_share(lru_gen, memcg_id: int, t0_ns: int, t1_ns: int) -> float | None:
    """How the memcg's file pages were spread over its generations while the window ran: the
    share in the oldest generation holding file pages, median over the lru_gen samples inside
    the window (1.0: one generation holds them all, and eviction order within it is insertion
    order refined by tiers, not generation age). None without samples."""
    g = lru_gen[(lru_gen["memcg_id"] == memcg_id) & (lru_gen["time_ns"] >= t0_ns) & (lru_gen["time_ns"] <= t1_ns)]
    g = g[g["nr_file_pages"] > 0]
    if g.empty:
        return None
    per = g.groupby(["sample", "node"]).apply(
        lambda x: x.loc[x["seq"].idxmin(), "nr_file_pages"] / x["nr_file_pages"].sum(), include_groups=False)
    return float(per.median())


def lru_dwell(run_dir: Path) -> dict[str, Any]:
    """The classic view of why pages left, for MGLRU on and off alike (the lru probe): median
    insertion-to-eviction dwell over the recording (ms; log2 buckets, within a factor of 2) and
    the pages activated after insertion. {} without the histogram."""
    import pandas as pd

    from moetrace.analyses.age import compute_dwell_quantiles

    try:
        q = compute_dwell_quantiles(pd.read_parquet(run_dir / "lru_dwell_histogram.parquet")).set_index("kind")
    except (OSError, ValueError, KeyError):
        return {}
    out: dict[str, Any] = {}
    if "insertion_to_eviction" in q.index and pd.notna(q.loc["insertion_to_eviction", "p50_ns"]):
        out["dwell_at_eviction_ms_p50"] = float(q.loc["insertion_to_eviction", "p50_ns"]) / 1e6
    if "insertion_to_activation" in q.index:
        out["activated_pages"] = int(q.loc["insertion_to_activation", "pages"])
    return out


def mglru_was_on(run_dir: Path) -> bool | None:
    """The recording's MGLRU state (its manifest's ``mglru.on``); None when unknown."""
    try:
        return (json.loads((run_dir / "manifest.json").read_text()).get("mglru") or {}).get("on")
    except (OSError, json.JSONDecodeError):
        return None


def _eviction_memcg(ev, lru_gen, memcg_path: str | None) -> tuple[int, bool]:
    """(the memcg the window's evictions came from, whether their records can be trusted for
    generations): the records' most common memcg; where the cell's memcg (by path in lru_gen) is
    known and the records name another, the cell's, untrusted (7.2's records carry memcg 0 or the
    root, with generations that do not fit)."""
    memcg = int(ev["memcg_id"].mode().iloc[0]) if "memcg_id" in ev else -1
    ids = lru_gen.loc[lru_gen["memcg_path"] == memcg_path, "memcg_id"] if memcg_path is not None else []
    if len(ids) and memcg != int(ids.iloc[0]):
        return int(ids.iloc[0]), False
    return memcg, True


def eviction_ages_window(run_dir: Path, t0_ns: int, t1_ns: int, reuse_inputs=None,
                         memcg_path: str | None = None, mglru_on: bool | None = None) -> dict[str, Any]:
    """The pool evictions the mglru probe recorded between t0 and t1 (CLOCK_MONOTONIC, as the
    snapshots): count, distinct pages, the age of the generation each came from, and with
    ``reuse_inputs`` (the replay's iteration log, the plan's accesses, the LRU budget) why each
    page was read again (analyses.eviction_reuse). With MGLRU off the generation figures are
    left out: the folios' generation bits and lru_gen's sequence numbers are not maintained
    (``mglru_on``: the recording's state, read from its manifest when not given)."""
    import pandas as pd

    from moetrace.analyses.age import compute_eviction_ages

    ev_path, gen_path = run_dir / "mglru_evictions.parquet", run_dir / "lru_gen.parquet"
    if not ev_path.exists() or not gen_path.exists():
        return {}
    ev = pd.read_parquet(ev_path)
    ev = ev[(ev["time_ns"] >= t0_ns) & (ev["time_ns"] <= t1_ns)]
    out: dict[str, Any] = {"evicted_pages": int(len(ev))}
    if ev.empty:
        return out
    generations = (mglru_was_on(run_dir) if mglru_on is None else mglru_on) is not False
    lru_gen = pd.read_parquet(gen_path) if generations else None
    memcg, trusted = _eviction_memcg(ev, lru_gen, memcg_path) if generations else (-1, False)
    if generations and not trusted:
        out["eviction_records_memcg_unmatched"] = True
    if reuse_inputs is not None:
        from moetrace.analyses import eviction_reuse as R

        reuse = (R.compute_eviction_reuse_generations(ev, *reuse_inputs, lru_gen) if trusted else
                 R.compute_eviction_reuse(ev, reuse_inputs[0], reuse_inputs[1].iteration,
                                          reuse_inputs[1].expert_id, reuse_inputs[2]))
        out.update(R.summarize_eviction_reuse(reuse))
    distinct = int(ev[["ino", "page_index"]].drop_duplicates().shape[0])
    out.update(distinct_evicted_pages=distinct, evictions_per_page=len(ev) / distinct)
    if not generations:
        return out
    out["file_pages_in_oldest_generation_share"] = oldest_file_generation_share(lru_gen, memcg, t0_ns, t1_ns)
    if not trusted:
        return out
    ages = compute_eviction_ages(ev, lru_gen)["age_ms"].astype("float64")
    known = ages.dropna()
    out["eviction_age_birth_known_share"] = float(len(known) / len(ages))
    if len(known):
        out.update(eviction_age_ms_p10=float(known.quantile(0.1)), eviction_age_ms_median=float(known.median()),
                   eviction_age_ms_p90=float(known.quantile(0.9)))
    return out


_ACCESSES: dict[tuple[str, int, int], Any] = {}


def plan_accesses(plan: str):
    """The plan's accesses (inputs.plan.read_accesses), read once per file version."""
    from moetrace.inputs.plan import read_accesses

    st = os.stat(plan)
    key = (plan, st.st_mtime_ns, st.st_size)
    if key not in _ACCESSES:
        _ACCESSES.clear()
        _ACCESSES[key] = read_accesses(plan)
    return _ACCESSES[key]


def _reuse_inputs(cdir: Path, cell: dict[str, Any]):
    """(iteration log, plan accesses, budget) for a cell, or None when one is missing."""
    import pandas as pd

    plan = (cell.get("inputs") or {}).get("plan")
    budget = (cell.get("simulated") or {}).get("budget_experts")
    log = cdir / "replay" / "iterations.parquet"
    if not plan or budget is None or not log.exists() or not os.path.exists(plan):
        return None
    return pd.read_parquet(log), plan_accesses(plan), int(budget)


def cell_window(cell_dir: str | os.PathLike) -> dict[str, Any]:
    """Everything above for one cell directory (the lab's: ``cell/`` inside), cached in
    ``cell/window.json``; {} when the cell brought back no snapshots."""
    cdir = Path(cell_dir) / "cell"
    cache = cdir / WINDOW
    if cache.exists():
        try:
            cached = json.loads(cache.read_text())
            if cached.pop("window_version", None) == WINDOW_VERSION:
                return cached
        except (OSError, json.JSONDecodeError):
            pass
    try:
        pre = json.loads((cdir / "snapshots" / "loop_entry.json").read_text())
        post = json.loads((cdir / "snapshots" / "post.json").read_text())
        cell = json.loads((cdir / "cell.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    memcg = "/" + Path((cell.get("scope") or {}).get("path") or "/").name
    run = cdir / "run"
    out = {**vmstat_window(pre, post), **added_pages_oracle(run), **pool_resident(run), **lru_dwell(run),
           **readahead_beyond(run)}
    on = mglru_was_on(run)
    if on is not False:
        out.update(generations_window(pre, post, memcg))
    out.update(eviction_ages_window(run, int(pre["monotonic_ns"]), int(post["monotonic_ns"]),
                                    _reuse_inputs(cdir, cell), memcg, on))
    n = cell.get("measured_iterations")
    if n and "evicted_pages" in out:
        out["evicted_bytes_per_iteration"] = out["evicted_pages"] * 4096 / n
    if n and "workingset_activate_file" in out:
        out["activations_per_iteration"] = out["workingset_activate_file"] / n
    with atomic_write(cache) as tmp:
        tmp.write_text(json.dumps({**out, "window_version": WINDOW_VERSION}, indent=1) + "\n")
    return out


#: the summary's figures: median and range over a group's retained cells
SUMMARY_FIGURES = ("device_bytes_per_iteration", "amplification", "amplification_at_effective", "scan_to_steal",
                   "iteration_time_median_ns", "pool_resident_bytes", "amplification_at_resident",
                   "miss_bytes_per_iteration_at_resident", "effective_capacity_bytes", "locked_fraction",
                   "evictions_per_page", "eviction_age_ms_median", "generations_born",
                   "file_pages_in_oldest_generation_share", "excess_share_of_rereads",
                   "rereads_evicted_within_one_iteration_share", "evicted_from_oldest_share",
                   "dwell_at_eviction_ms_p50", "activations_per_iteration",
                   # the guest's sampler (reports.bites.bite_columns; absent in older cells)
                   "kswapd_share", "scan_to_steal_kswapd", "scan_to_steal_direct", "sum_high_over_fC",
                   "turnovers_per_min", "bite_p50_pages", "bite_max_over_oldest", "evicted_before_read_pages",
                   "readahead_beyond_share", "controller_bite_over_fC", "oldest_share_min",
                   "oldest_share_below_quarter", "reread_burst_ratio", "reread_burst_ratio_aging")


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (kernel, MGLRU, mechanism, capacity, and the dimensions that vary: ``dims``)
    over its retained cells: ``cells``, ``retained``, the miss demand, and for each of
    SUMMARY_FIGURES its ``_median``, ``_min`` and ``_max`` (None when no retained cell has it)."""
    import statistics

    from moetrace.reports.figures import mechanism_order

    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["mglru"], r["mechanism_spec"], r["capacity"], r.get("dims") or ""),
                          []).append(r)
    out = []
    for (kernel, mglru, mech, cap, dims), rs in groups.items():
        kept = [r for r in rs if r.get("retained") in (True, "True")]
        s: dict[str, Any] = {"kernel": kernel, "release": next((r.get("release") for r in rs if r.get("release")), None),
                             "mglru": mglru, "mechanism": mech, "capacity": cap, **({"dims": dims} if dims else {}),
                             "cells": len(rs),
                             "retained": len(kept),
                             "miss_bytes_per_iteration": next((r["miss_bytes_per_iteration"] for r in kept
                                                               if r.get("miss_bytes_per_iteration") is not None), None),
                             "pool_fits_any": any(r.get("pool_fits") in (True, "True") for r in kept),
                             "added_pages_equal_pgpgin": sum(r.get("added_pages_equal_pgpgin") in (True, "True")
                                                             for r in kept),
                             "added_pages_within_skipped_runs": sum(
                                 r.get("added_pages_equal_pgpgin") not in (True, "True")
                                 and r.get("added_pages_within_skipped_runs") in (True, "True") for r in kept)}
        for f in SUMMARY_FIGURES:
            vals = [float(r[f]) for r in kept if r.get(f) not in (None, "")]
            s[f"{f}_median"] = statistics.median(vals) if vals else None
            s[f"{f}_min"] = min(vals) if vals else None
            s[f"{f}_max"] = max(vals) if vals else None
        out.append(s)
    kernels = list(dict.fromkeys(s["kernel"] for s in out))
    return sorted(out, key=lambda s: (kernels.index(s["kernel"]), mechanism_order(s["mechanism"]), s["capacity"],
                                      s.get("dims", ""), s["mglru"] != "on"))


def _oracle(s: dict[str, Any]) -> str:
    """'3/3', or '2/3 (+1 within skipped runs)' where the kernel skipped probe runs and counted them."""
    extra = s.get("added_pages_within_skipped_runs") or 0
    return f"{s['added_pages_equal_pgpgin']}/{s['retained']}" + (f" (+{extra} within skipped runs)" if extra else "")


def _fmt(v: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v / scale:.{digits}f}"


def summary_markdown(summary: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table (MB = 10^6 B, as the paper's GB)."""
    head = ("| kernel | MGLRU | mechanism | locked | C at loop entry MiB | pool resident MiB | cells kept | "
            "device MB/it (range) | miss MB/it | amplification (range) | at C loop entry | at pool resident | "
            "scan/steal | evictions/page | eviction age ms | gens born | file pages in oldest gen | "
            "re-reads LRU keeps | re-reads evicted <= 1 it after access | from oldest gen | dwell at eviction s | "
            "activations/it | added x 4 = pgpgin |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summary:
        lines.append(
            f"| {s['kernel']} | {s['mglru']} | {s['mechanism']}{' ' + s['dims'] if s.get('dims') else ''} | "
            f"{_fmt(s['locked_fraction_median'])} | "
            f"{_fmt(s['effective_capacity_bytes_median'], 2 ** 20, 0)} | "
            f"{_fmt(s['pool_resident_bytes_median'], 2 ** 20, 0)} | {s['retained']}/{s['cells']} | "
            f"{_fmt(s['device_bytes_per_iteration_median'], 1e6)} "
            f"({_fmt(s['device_bytes_per_iteration_min'], 1e6)}-{_fmt(s['device_bytes_per_iteration_max'], 1e6)}) | "
            f"{_fmt(s['miss_bytes_per_iteration'], 1e6)} | {_fmt(s['amplification_median'])} "
            f"({_fmt(s['amplification_min'])}-{_fmt(s['amplification_max'])}) | "
            f"{_fmt(s['amplification_at_effective_median'])} | {_fmt(s['amplification_at_resident_median'])} | "
            f"{_fmt(s['scan_to_steal_median'])} | "
            f"{_fmt(s['evictions_per_page_median'])} | {_fmt(s['eviction_age_ms_median_median'], 1, 0)} | "
            f"{_fmt(s['generations_born_median'], 1, 0)} | {_fmt(s['file_pages_in_oldest_generation_share_median'])} | "
            f"{_fmt(s['excess_share_of_rereads_median'])} | "
            f"{_fmt(s['rereads_evicted_within_one_iteration_share_median'])} | "
            f"{_fmt(s['evicted_from_oldest_share_median'])} | {_fmt(s['dwell_at_eviction_ms_p50_median'], 1e3, 1)} | "
            f"{_fmt(s['activations_per_iteration_median'], 1, 0)} | {_oracle(s)} |")
    return "\n".join(lines) + "\n"


def csv_text(rows: list[dict[str, Any]], empty_header: str) -> str:
    """Rows as CSV text, a column per key in the order first met (``empty_header`` alone when
    there are none)."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)) or [empty_header])
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def write_tables(out: str | os.PathLike, rows: list[dict[str, Any]], pairs: list[dict[str, Any]] | None = None,
                 summary: list[dict[str, Any]] | None = None) -> dict[str, Path]:
    """A matrix's tables in ``out``: matrix_cells.csv (``rows``, a row per finished cell),
    matrix_summary.csv, matrix_summary.md (the ``summary`` of the rows, the findings, ``pairs``:
    :func:`pair_checks`; each computed here when None) and matrix_fig3.png (when a cell was
    retained), each written aside, then moved into place. Returns their paths."""
    out = Path(out)
    summary = summarize(rows) if summary is None else summary
    if pairs is None and (out / "matrix.json").is_file():
        pairs = pair_checks(out)
    pmd = pairs_markdown(pairs or [])
    files: dict[str, tuple[Path, str | bytes]] = {
        "cells": (out / "matrix_cells.csv", csv_text(rows, "condition")),
        "csv": (out / "matrix_summary.csv", csv_text(summary, "kernel")),
        "md": (out / "matrix_summary.md", summary_markdown(summary) + "".join(f"\n- {f}" for f in matrix_findings(
            summary)) + "\n" + (f"\n`check` per pair (base -> candidate):\n\n{pmd}" if pmd else ""))}
    if summary:
        files["fig3"] = (out / "matrix_fig3.png", fig3_png(summary))
    for path, data in files.values():
        with atomic_write(path) as tmp:
            if isinstance(data, bytes):
                tmp.write_bytes(data)
            else:
                tmp.write_text(data)
    return {key: path for key, (path, _) in files.items()}


def fig3_png(summary: list[dict[str, Any]]) -> bytes:
    """Fig. 3 (middle) with one panel per kernel, as PNG bytes."""
    from moetrace.reports.figures import new_figure, plot_mechanism_matrix, png_bytes

    kernels = list(dict.fromkeys(s["kernel"] for s in summary))
    fig, axes = new_figure(w=4.2 * len(kernels), h=3.6, ncols=len(kernels))
    axes = list(axes) if len(kernels) > 1 else [axes]
    for ax, k in zip(axes, kernels):
        plot_mechanism_matrix(summary, ax, k)
    top = max(ax.get_ylim()[1] for ax in axes)
    handles: dict[str, Any] = {}
    for ax in axes:  # one scale: the kernels side by side; one legend, beside the panels
        ax.set_ylim(0, top)
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    if handles:
        fig.legend(list(handles.values()), list(handles), fontsize=7, loc="outside lower center",
                   ncols=len(handles), frameon=False)
    return png_bytes(fig)


#: a group whose median device bytes exceed its miss demand by more than this is called amplified
AMPLIFIED = 1.10


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def _pct_range(vals: list[float]) -> str:
    lo, hi = _pct(min(vals)), _pct(max(vals))
    return lo if lo == hi else f"{lo[:-2]}-{hi}"


def matrix_findings(summary: list[dict[str, Any]]) -> list[str]:
    """The matrix's answer in words, from its summary: per kernel, which MGLRU x mechanism groups
    read more than AMPLIFIED x their miss demand (with scan-to-steal, and why the pages were read
    again), which did not, and MGLRU on against off for each mechanism."""
    out = []
    for kernel in dict.fromkeys(s["kernel"] for s in summary):
        rows = [s for s in summary if s["kernel"] == kernel and s["amplification_median"] is not None]
        if not rows:
            out.append(f"{kernel}: no retained cell with an amplification yet.")
            continue
        amp = [s for s in rows if s["amplification_median"] > AMPLIFIED]
        calm = [s for s in rows if s not in amp]
        for s in amp:
            out.append(
                f"{kernel}, MGLRU {s['mglru']}, {s['mechanism']}: device bytes {s['amplification_median']:.2f}x the "
                f"miss demand (range {s['amplification_min']:.2f}-{s['amplification_max']:.2f}, {s['retained']} "
                f"cells), scan-to-steal {_fmt(s['scan_to_steal_median'])}; of the re-read pages "
                f"{_pct(s['excess_share_of_rereads_median'])} were ones a global LRU of C would have kept, "
                f"{_pct(s['rereads_evicted_within_one_iteration_share_median'])} were evicted within one iteration "
                f"of their last access, {_pct(s['evicted_from_oldest_share_median'])} of evictions came from the "
                f"oldest generation (generation age at eviction {_fmt(s['eviction_age_ms_median_median'], 1, 0)} ms, "
                f"{_fmt(s['generations_born_median'], 1, 0)} generations born in the window).")
        if calm:
            worst = max(calm, key=lambda s: s["amplification_median"])
            out.append(f"{kernel}: no amplification (median <= {AMPLIFIED:.2f}x miss demand) in "
                       + ", ".join(f"MGLRU {s['mglru']} {s['mechanism']} ({s['amplification_median']:.2f}x)"
                                   for s in calm)
                       + f"; the highest {worst['amplification_median']:.2f}x, scan-to-steal "
                         f"{_fmt(worst['scan_to_steal_median'])}.")
        for mech in dict.fromkeys(s["mechanism"] for s in rows):
            on = next((s for s in rows if s["mechanism"] == mech and s["mglru"] == "on"), None)
            off = next((s for s in rows if s["mechanism"] == mech and s["mglru"] == "off"), None)
            if on and off and on["device_bytes_per_iteration_median"] and off["device_bytes_per_iteration_median"]:
                r = on["device_bytes_per_iteration_median"] / off["device_bytes_per_iteration_median"]
                out.append(f"{kernel}, {mech}: MGLRU on read {r:.2f}x what MGLRU off read per iteration "
                           f"({_fmt(on['device_bytes_per_iteration_median'], 1e6)} against "
                           f"{_fmt(off['device_bytes_per_iteration_median'], 1e6)} MB), holding "
                           f"{_fmt(on['pool_resident_bytes_median'], 2 ** 20, 0)} against "
                           f"{_fmt(off['pool_resident_bytes_median'], 2 ** 20, 0)} MiB of the pool resident.")
        out += generation_findings(kernel, rows)
    return out + mechanism_findings(summary)


#: the paper's §5 amplification: device bytes over miss demand, with scan-to-steal above 2
PAPER_AMPLIFICATION, PAPER_SCAN_TO_STEAL = 1.5, 2.0


def _group(s: dict[str, Any]) -> str:
    return (f"{s.get('release') or s['kernel']} MGLRU {s['mglru']} {s['mechanism']} {s['capacity']}"
            + (f" {s['dims']}" if s.get("dims") else ""))


def _bite_over_oldest(s: dict[str, Any]) -> float | None:
    """A group's largest reclaim pass over the oldest generation's file pages (f x C): the
    controller's bite where it bit, and Σhigh / (f x C) where kswapd did at least half the
    reclaim (None: neither)."""
    passes = [s.get("controller_bite_over_fC_median")]
    if (s.get("kswapd_share_median") or 0) >= 0.5:
        passes.append(s.get("sum_high_over_fC_median"))
    return max((v for v in passes if v is not None), default=None)


def mechanism_findings(summary: list[dict[str, Any]]) -> list[str]:
    """Issue 34's question in words, for the groups the guest's sampler measured: which read more
    than PAPER_AMPLIFICATION x their miss demand with scan-to-steal above PAPER_SCAN_TO_STEAL (the
    paper's §5), and which were in hypothesis M1's regime (a pass at least the oldest generation)."""
    rows = [s for s in summary if s.get("kswapd_share_median") is not None and s.get("amplification_median") is not None]
    if not rows:
        return []

    def s2s(s):
        return max(v for v in (s.get("scan_to_steal_kswapd_median"), s.get("scan_to_steal_direct_median"), 0.0)
                   if v is not None)

    hit = [s for s in rows if s["amplification_median"] > PAPER_AMPLIFICATION and s2s(s) > PAPER_SCAN_TO_STEAL]
    m1 = [s for s in rows if (_bite_over_oldest(s) or 0) >= 1]
    out = [("The paper's §5 amplification (above "
            f"{PAPER_AMPLIFICATION:g}x the miss demand with scan-to-steal above {PAPER_SCAN_TO_STEAL:g}): "
            + ("; ".join(f"{_group(s)} ({s['amplification_median']:.2f}x, scan-to-steal {s2s(s):.2f})" for s in hit)
               if hit else f"in none of the {len(rows)} measured groups (the highest "
               f"{max(s['amplification_median'] for s in rows):.2f}x, scan-to-steal up to "
               f"{max(s2s(s) for s in rows):.2f})") + ".")]
    if m1:
        out.append("In M1's regime (a reclaim pass at least the oldest generation: the controller's bite, or "
                   "Σhigh with kswapd doing half the reclaim, over f x C >= 1): "
                   + "; ".join(f"{_group(s)}: pass {_bite_over_oldest(s):.2f} f x C, {s['amplification_median']:.2f}x, "
                               f"scan-to-steal {s2s(s):.2f}" for s in m1) + ".")
    else:
        out.append(f"No group reached M1's regime: no reclaim pass as large as the oldest generation "
                   f"(kswapd share {_pct_range([s['kswapd_share_median'] for s in rows])}).")
    return out + m2_findings(summary)


#: M2's test: f at or below a quarter in at least a tenth of the window's samples (not a moment at
#: its start), and re-reads per iteration after a min_seq advance at least twice the other
#: iterations'
M2_OLDEST_SHARE, M2_TIME_SHARE, M2_BURST = 0.25, 0.1, 2.0


def _x_range(vals: list[float]) -> str:
    lo, hi = f"{min(vals):.2f}", f"{max(vals):.2f}"
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def _quarter_time(s: dict[str, Any]) -> float:
    """A group's share of samples with f at or below a quarter (its lowest f alone, as 1 or 0, for
    rows from before that figure)."""
    v = s.get("oldest_share_below_quarter_median")
    return float(v) if v is not None else float(s["oldest_share_min_min"] <= M2_OLDEST_SHARE)


def m2_findings(summary: list[dict[str, Any]]) -> list[str]:
    """Hypothesis M2 in words (protected folios pile up until f falls to a quarter, then aging
    sweeps the hot set): the groups whose f stayed at or below M2_OLDEST_SHARE for M2_TIME_SHARE
    of the window with re-read bursts after the min_seq advances (ratio above M2_BURST); else
    where f fell and what followed the advances."""
    rows = [s for s in summary if s.get("oldest_share_min_min") is not None and s.get("amplification_median") is not None]
    if not rows:
        return []
    fell = [s for s in rows if _quarter_time(s) >= M2_TIME_SHARE]
    hit = [s for s in fell if (s.get("reread_burst_ratio_median") or 0) > M2_BURST]
    head = (f"M2 (f at or below {M2_OLDEST_SHARE:g} in {M2_TIME_SHARE:.0%} of the samples or more, then re-reads per "
            f"iteration after a min_seq advance above {M2_BURST:g}x the other iterations'): ")
    if hit:
        return [head + "; ".join(f"{_group(s)}: f at or below a quarter in {_quarter_time(s):.0%} of the samples, "
                                 f"bursts {s['reread_burst_ratio_median']:.2f}x, {s['amplification_median']:.2f}x the "
                                 "miss demand" for s in hit) + "."]
    bursts = [s["reread_burst_ratio_median"] for s in fell if s.get("reread_burst_ratio_median") is not None]
    parts = []
    if fell:
        amp = [s["amplification_median"] for s in fell]
        parts.append(f"f stayed at or below a quarter in {_pct_range([_quarter_time(s) for s in fell])} of the samples "
                     f"in {len(fell)} ({', '.join(_group(s) for s in fell)}), "
                     + (f"with re-reads after an advance {_x_range(bursts)} the others'" if bursts
                        else "with no advance between two measured iterations")
                     + f" and {_x_range(amp)} the miss demand")
    rest = [s for s in rows if s not in fell]
    if rest:
        most = max(_quarter_time(s) for s in rest)
        parts.append(f"{'in the other ' + str(len(rest)) if fell else 'in all of them'} f "
                     + (f"was at or below a quarter in at most {_pct(most)} of the samples" if most > 0
                        else "never fell to a quarter")
                     + f" (its lowest {min(s['oldest_share_min_min'] for s in rest):.2f})")
    return [head + f"in none of the {len(rows)} groups with lru_gen samples: " + "; ".join(parts) + "."]


def generation_findings(kernel: str, rows: list[dict[str, Any]]) -> list[str]:
    """What the generations did under MGLRU on, in words: generations born in the measured
    windows, where the evictions came from, and the share of the file pages the oldest
    generation held (the rest, promoted out of it, never reached eviction)."""
    on = [s for s in rows if s["mglru"] == "on" and s.get("generations_born_median") is not None]
    if not on:
        return []
    born = sorted({int(s["generations_born_median"]) for s in on})
    oldest = [s["evicted_from_oldest_share_median"] for s in on
              if s.get("evicted_from_oldest_share_median") is not None]
    share = [s["file_pages_in_oldest_generation_share_median"] for s in on
             if s.get("file_pages_in_oldest_generation_share_median") is not None]
    text = (f"{kernel}, MGLRU on: {'/'.join(map(str, born))} generations born in the measured windows "
            f"({len(on)} mechanisms)")
    if oldest:
        text += f"; {_pct_range(oldest)} of evictions from the oldest generation"
    if share:
        text += (f"; the oldest generation held {_pct_range(share)} of the memcg's file pages, "
                 f"the rest sat in younger generations that no eviction reached")
    return [text + "."]


def pair_checks(out: str | os.PathLike, thresholds=None) -> list[dict[str, Any]]:
    """`check` between the retained repeats of a matrix's pairs at one mechanism and C: MGLRU off
    (base) against on, and each kernel after the first of the spec against the first (same MGLRU):
    per pair the verdict, the metrics that regressed or improved, and the test each used (a Welch
    t-test over the repeats; one cell a side: its per-iteration samples)."""
    from moetrace.analyses import compare as C
    from moetrace.run.handle import open_run
    from moetrace.run.metadata import retained_matrix_cells

    out = Path(out)
    meta, retained = retained_matrix_cells(out)
    units: dict[tuple[str, str, str, str], list] = {}
    for c in retained:
        key = (c["kernel"], c["mglru"], c["mechanism"] + (f" {c['dims']}" if c.get("dims") else ""),
               c["capacity_label"])
        units.setdefault(key, []).append(C.unit_metrics(open_run(out / c["dir"] / "cell", unrecorded=True)))
    kernels = meta["spec"]["kernels"]
    pairs = [((k, "off", m, cap), (k, "on", m, cap)) for (k, g, m, cap) in units if g == "on"]
    pairs += [((kernels[0], g, m, cap), (k, g, m, cap)) for (k, g, m, cap) in units if k != kernels[0]]
    rows = []
    for base, cand in pairs:
        if base not in units or cand not in units:
            continue
        df = C.compute_comparison(units[base], units[cand], thresholds)
        m = df[df["metric"].isin(list(C.METRICS))]
        dev = m.loc[m["metric"] == "device_bytes_per_iteration", "ratio"]
        rows.append({"base": f"{base[0]} MGLRU {base[1]}", "candidate": f"{cand[0]} MGLRU {cand[1]}",
                     "mechanism": base[2], "capacity": base[3], "base_n": len(units[base]),
                     "cand_n": len(units[cand]), "verdict": "regression" if C.regressed(df) else "no regression",
                     "regressed": ", ".join(C.regressed(df)),
                     "improved": ", ".join(m.loc[m["verdict"] == "improvement", "metric"]),
                     "device_ratio": float(dev.iloc[0]) if len(dev) and dev.notna().iloc[0] else None,
                     "tests": "; ".join(dict.fromkeys(m["test"].dropna()))})
    return rows


def pairs_markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = ["| base | candidate | mechanism | C | cells | verdict | regressed | improved | device ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['base']} | {r['candidate']} | {r['mechanism']} | {r['capacity']} | {r['base_n']}/"
                     f"{r['cand_n']} | {r['verdict']} | {r['regressed'] or '-'} | {r['improved'] or '-'} | "
                     f"{_fmt(r['device_ratio'])} |")
    return "\n".join(lines) + "\n"


# -- the matrix's report page ------------------------------------------------------------------

@dataclass
class MatrixInputs:
    """What a matrix report shows, computed by moetrace.lab.matrix (the report imports no lab code)."""

    path: Path
    cells: pd.DataFrame  # a row per finished cell (lab.matrix.matrix_rows)
    summary: pd.DataFrame  # a row per kernel x MGLRU x mechanism x C (:func:`summarize`)
    findings: list[str]
    fig3: bytes | None
    detail: Path | None  # the cell directory whose per-expert detail follows (None: none recorded)
    pairs: pd.DataFrame | None = None  # `check` per MGLRU and kernel pair (:func:`pair_checks`)


def build_matrix_report(m: MatrixInputs, out: str | os.PathLike, *, sections: Iterable[str] | None = None,
                        force: bool = False, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The §5 matrix: the findings in words, Fig. 3, the summary over repeats, every cell, then
    the full report of one recorded cell (``m.detail``; ``sections``: its report's sections,
    default all)."""
    from moetrace.reports.document import Report, prepare_out, staged, table_json, write_report
    from moetrace.reports.report import SECTIONS, check_sections, run_detail
    from moetrace.run.handle import open_run

    sections = check_sections(SECTIONS if sections is None else sections)
    out = Path(out)
    prepare_out(out, force)
    with staged(out) as stage:
        rep = Report(stage, f"moetrace matrix report: {m.path.name}")
        rep.h(2, "The §5 matrix: MGLRU x capacity mechanism", "matrix")
        for f in m.findings:  # the panel at the top of the page
            rep.finding(f)
        if not m.findings:
            rep.p("No finished cell yet.")
        rep.summary["findings"] = m.findings
        if m.fig3:
            rep.figure("fig3", m.fig3, "Fig. 3 (middle): device MB per iteration, MGLRU on (left) and off (right) "
                                       "per mechanism, median and range over the repeats; dotted: miss demand; "
                                       "numbers: kswapd scan-to-steal")
        rep.table("matrix_summary", m.summary, "Per kernel x MGLRU x mechanism: medians and ranges over the "
                                               "retained repeats", None)
        if m.pairs is not None and len(m.pairs):
            rep.table("matrix_pairs", m.pairs, "`check` per pair: MGLRU off -> on, and the first kernel -> each "
                                               "other (same MGLRU), over the retained repeats", None)
            rep.summary["pairs"] = json.loads(table_json(m.pairs))
        rep.table("matrix_cells", m.cells, "Every finished cell", None)
        rep.summary["cells"] = len(m.cells)
        from moetrace.reports.bites import section_why

        section_why(rep, m.path, m.cells)
        if m.detail is None:
            rep.summary["kind"] = "matrix"
            return write_report(rep, ("matrix",), final=out)
        run = open_run(m.detail)
        rep.h(2, f"Cell {m.detail.parent.parent.name}/{m.detail.parent.name}: per-expert detail")
        rep.p("The retained cell with the highest amplification; `moetrace report <matrix>/cells/<condition>/"
              "<cell>/cell` reports any other.")
        rep.summary["detail_cell"] = str(m.detail.relative_to(m.path))
        run_detail(rep, run, sections, progress or (lambda s: None))
        rep.summary["kind"] = "matrix"
        return write_report(rep, ("matrix",) + tuple(sections), final=out)
