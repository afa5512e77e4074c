"""The findings panel: what a report found, in words, at the top of the page.

Every number a finding quotes is the string a table of the report shows (:meth:`Report.fig`),
linked to that table: a finding cannot disagree with its evidence. The panel answers, in order:
the hosts (a sweep whose cells come from several), the capacity response (a sweep; per host),
whether a cell amplifies and where, re-reads within an iteration, reclaim health, the hit path's
cost, generation age, and the alarm verdict.
"""

from __future__ import annotations

import pandas as pd

from moetrace.reports.document import Report, is_na

#: amplification below this is LRU-like (the kernel read what an LRU of C would have missed)
AMPLIFIES = 1.1


def _row(rep: Report, table: str, column: str, value: str) -> int | None:
    """The position of the first row whose ``column`` shows ``value`` (None: no such row)."""
    df = rep.shown.get(table)
    if df is None or column not in df:
        return None
    hit = [i for i, v in enumerate(df[column]) if v == value]
    return hit[0] if hit else None


def hosts(rep: Report, results: pd.DataFrame) -> None:
    """A sweep whose retained cells come from several hosts (cells as jobs): which hosts, how many
    cells each, and that Table 2 pools repeats per host only."""
    from moetrace.analyses.capacity_response import cell_hosts

    counts = cell_hosts(results)
    if len(counts) > 1:
        rep.finding(f"Cells from {len(counts)} hosts: "
                    + ", ".join(f"{h} ({n} cell{'s' if n != 1 else ''})" for h, n in counts.items())
                    + "; repeats pooled per host (Table 2 and Fig. 2 per host).")


def _host_blocks(t2: pd.DataFrame) -> list[tuple[str | None, list[int]]]:
    """(host, its rows of Table 2) per host, or (None, every row) when Table 2 is not per host."""
    if "host" not in t2:
        return [(None, list(range(len(t2))))]
    return [(h, [i for i, v in enumerate(t2["host"]) if v == h]) for h in dict.fromkeys(t2["host"])]


def capacity_response(rep: Report, t2: pd.DataFrame) -> None:
    """Table 2 in a sentence (one per host when it is per host): the range of C, the LRU hit
    rate, iteration time and device reads from the largest C to the smallest."""
    if t2.empty:
        return
    f = rep.fig
    for host, rows in _host_blocks(t2):
        hi, lo = rows[0], rows[-1]
        kept = int(t2["retained"].iloc[rows].sum())
        parts = [f"Capacity response{f' on {host}' if host else ''}: ", str(len(rows)),
                 " capacity: C = " if len(rows) == 1 else " capacities from C = ", f("table2", lo, "C"),
                 *([] if len(rows) == 1 else [" to ", f("table2", hi, "C")]), " (", str(kept),
                 " cell retained). " if kept == 1 else " cells retained). "]
        if len(rows) == 1:  # one capacity (on this host): its figures, no range
            if t2["lru_hit_rate"].iloc[rows].notna().any():
                parts += ["The simulated LRU hit rate is ", f("table2", lo, "LRU hit rate"), "; "]
            rep.finding(*parts, "iteration time ", f("table2", lo, "iteration"), ", device reads ",
                        f("table2", lo, "device / iteration"), " per iteration.")
            continue
        if t2["lru_hit_rate"].iloc[rows].notna().any():
            parts += ["The simulated LRU hit rate goes from ", f("table2", lo, "LRU hit rate"), " to ",
                      f("table2", hi, "LRU hit rate"), "; "]
        parts += ["iteration time from ", f("table2", hi, "iteration"), " to ", f("table2", lo, "iteration"),
                  ", device reads from ", f("table2", hi, "device / iteration"), " to ",
                  f("table2", lo, "device / iteration"), " per iteration."]
        rep.finding(*parts)


def amplification(rep: Report, t2: pd.DataFrame) -> None:
    """Does any C read more than an LRU of C would have missed?"""
    amp = t2["amplification"].astype("Float64")
    if not amp.notna().any():
        rep.finding("Amplification: no capacity had a miss demand to compare with (the pool fits, or no "
                    "plan to simulate).")
        return
    top, low = int(amp.idxmax()), int(amp.idxmin())
    f = rep.fig

    def on(i: int) -> str:  # the host of row i when Table 2 is per host
        return f" on {t2['host'].iloc[i]}" if "host" in t2 else ""

    if float(amp.max()) > AMPLIFIES:
        rep.finding("Amplification: at C = ", f("table2", top, "C"), on(top), " the kernel read ",
                    f("table2", top, "amplification"), " x the LRU miss demand (",
                    f("table2", top, "device / iteration"), " against ", f("table2", top, "miss / iteration"),
                    " per iteration): traffic an LRU of the same size would not have caused.", cls="alarm")
        return
    parts = ["No capacity amplifies: device reads / LRU miss demand stay between ", f("table2", low, "amplification"),
             " (C = ", f("table2", low, "C"), on(low), ") and ", f("table2", top, "amplification"), " (C = ",
             f("table2", top, "C"), on(top), "): the kernel served this pool like an LRU of C, or better."]
    small = int(t2["capacity_bytes"].astype("int64").idxmin())  # the smallest C: where the room beside C weighs most
    if not is_na(amp.iloc[small]) and float(amp.iloc[small]) < 1 / AMPLIFIES and "effective C" in rep.shown["table2"]:
        if rep.shown["table2"]["effective C"].iloc[small] != "NA":
            parts += [" Below 1 the pool had more room than C: at C = ", f("table2", small, "C"), on(small),
                      " its pages could occupy ", f("table2", small, "effective C"),
                      " (the scope's headroom less the replay's own memory)."]
    rep.finding(*parts, cls="ok")


def featured(rep: Report, name: str, why: str, others_linked: bool) -> None:
    rep.finding(f"Detailed below: cell {name}, {why}."
                + (" Every other cell's report is one click away in the strip of cells." if others_linked else ""))


def rereads(rep: Report, summary: dict) -> None:
    """Re-reads in the detailed run: how many within one iteration, and where most of them were."""
    if "amp_summary" not in rep.shown:
        return
    f = rep.fig
    n_in = summary.get("in_iteration_re_added_pages")
    parts = ["Re-reads (", f("amp_summary", 5, "value"), " pages re-added in the measured pass): "]
    if n_in == 0:
        parts.append("none within one iteration: every page read again was evicted in an earlier iteration, "
                     "as an LRU too small for the working set would.")
    elif n_in is not None:
        parts += [f("amp_summary", 6, "value"), " pages were read twice within one iteration: evicted before "
                  "the iteration was over."]
    else:
        parts.append("re-reads within an iteration were not measured (no page-event stream).")
    if summary.get("measured_re_added_pages"):
        lay = rep.shown.get("amp_layers")
        ex = rep.shown.get("amp_experts")
        if lay is not None and len(lay) and ex is not None and len(ex):
            parts += [" Most in layer ", f("amp_layers", 0, "layer"), " (", f("amp_layers", 0, "re_added_pages"),
                      " pages); the most re-read expert is L", f("amp_experts", 0, "layer"), "/E",
                      f("amp_experts", 0, "expert"), " (", f("amp_experts", 0, "re_added_pages"), " pages)."]
    rep.finding(*parts)


def reclaim(rep: Report) -> None:
    """Who reclaimed, how hard it scanned, whether anyone outside evicted pool pages."""
    k = rep.shown.get("reclaim_kinds")
    if k is None or not len(k):
        return
    kinds = rep.tables["reclaim_kinds"]
    if not int(kinds["reclaimed_pages"].sum()):
        rep.finding("Reclaim: nothing was reclaimed while recording (the pool's pages stayed).")
        return
    i = int(kinds["reclaimed_pages"].astype("int64").idxmax())
    f = rep.fig
    parts = ["Reclaim: ", f("reclaim_kinds", i, "kind"), " reclaimed ", f("reclaim_kinds", i, "reclaimed_share"),
             " of the pages (", f("reclaim_kinds", i, "reclaimed_pages"), "), scanning ",
             f("reclaim_kinds", i, "scan_to_steal"), " pages per page reclaimed"]
    s2s = kinds["scan_to_steal"].astype("Float64").iloc[i]
    parts.append(": healthy (the paper's alarm needs above 2)." if not is_na(s2s) and float(s2s) <= 2
                 else ": above 2, the scanning the paper's alarm watches for.")
    rep.finding(*parts)


def outside_evictors(rep: Report) -> None:
    cells = rep.tables.get("sweep_cells")
    if cells is None or "outside_evicted_pages" not in cells:
        return
    out = cells["outside_evicted_pages"].astype("Int64").fillna(0)
    if not int(out.sum()):
        rep.finding("Outside evictors: no pool page was evicted by another process (fadvise, madvise, "
                    "truncation) in any cell.")
        return
    i = int(out.idxmax())
    rep.finding("Outside evictors: another process evicted pool pages in ", str(int((out > 0).sum())),
                " cell(s), most in ", rep.fig("sweep_cells", i, "cell"), " (",
                rep.fig("sweep_cells", i, "outside evicted pages"), " pages).")


def hit_path(rep: Report) -> None:
    h = rep.shown.get("hitpath_summary")
    if h is None:
        return
    f = rep.fig
    rep.finding("Hit path: ", f("hitpath_summary", 1, "value"), " of ", f("hitpath_summary", 0, "value"),
                " pool read calls were served from the page cache alone at ", f("hitpath_summary", 3, "value"),
                " ns per KiB; calls that read the device cost ", f("hitpath_summary", 4, "value"), " ns per KiB.")


def generation_age(rep: Report, summary: dict) -> None:
    ev = (summary.get("mglru") or {}).get("evictions")
    if ev and ev.get("age_ms_median") is not None:
        rep.finding(f"Generation age: the pages evicted came from generations {ev['age_ms_median']:.3g} ms old "
                    f"(median; p90 {ev['age_ms_p90']:.3g} ms) over {ev['folios']:,} folios.")
        return
    q = rep.shown.get("age_dwell_quantiles")
    i = _row(rep, "age_dwell_quantiles", "kind", "insertion_to_eviction")
    state = summary.get("mglru_state") or "not on this kernel"
    if q is not None and i is not None:
        rep.finding(f"Generation age: MGLRU {state}, so no generations; on the classic LRU an evicted page had "
                    "been on it for ", rep.fig("age_dwell_quantiles", i, "p50_ns"), " (median; p99 ",
                    rep.fig("age_dwell_quantiles", i, "p99_ns"), ").")
    else:
        rep.finding(f"Generation age: MGLRU {state}; no dwell recorded (the lru probe was not on).")


def alarm(rep: Report, summary: dict) -> None:
    """The paper's alarm verdict, over every cell of a sweep or for the one run."""
    cells = rep.tables.get("sweep_cells")
    if cells is not None and "alarm" in cells and len(cells):
        raised = cells[cells["alarm"].fillna(False).astype(bool)]
        rule = "amplification > 1.02 and scan-to-steal > 2"
        if len(raised):
            i = int(raised.index[0])
            rep.finding(f"Alarm ({rule}): RAISED in {len(raised)} of {len(cells)} cells, first at ",
                        rep.fig("sweep_cells", i, "cell"), ".", cls="alarm")
        else:
            known = int(cells["alarm"].notna().sum())
            rep.finding(f"Alarm ({rule}): not raised in any cell ({known} of {len(cells)} with both figures).",
                        cls="ok")
        return
    al = summary.get("alarm")
    if al:
        verdict = "RAISED" if al["alarm"] else ("unknown" if al["alarm"] is None else "not raised")
        rep.finding(f"Alarm ({al['rule']}): {verdict}.", cls="alarm" if al["alarm"] else "ok")


def run_findings(rep: Report, summary: dict) -> None:
    """The findings of one run or cell (its sections already built)."""
    if "amp_summary" in rep.shown and summary.get("amplification") is not None:
        f = rep.fig
        amp = float(summary["amplification"])
        word = ("above the LRU's miss demand: the kernel read pages an LRU of C would have kept"
                if amp > AMPLIFIES else "LRU-like")
        rep.finding("At C = ", f("amp_summary", 0, "value"), " the kernel read ", f("amp_summary", 1, "value"),
                    " from the device in the measured pass, ", f("amp_summary", 4, "value"),
                    f" x the LRU miss demand: {word}.", cls="alarm" if amp > AMPLIFIES else "")
    detail(rep, summary)


def detail(rep: Report, summary: dict) -> None:
    """The findings of the detailed run's sections (a sweep's featured cell, or the run itself)."""
    rereads(rep, summary)
    reclaim(rep)
    outside_evictors(rep)
    hit_path(rep)
    generation_age(rep, summary)
    alarm(rep, summary)
