"""The reclaim bite of a lab cell, read from its directory, and the matrix report's "why" section.

:func:`cell_bites` gathers what a lab (or matrix cell) directory holds — the guest's sampler
files (``sampler/``, moetrace.run.sampler), the cell's measured window (``cell/snapshots``),
the recording's vmscan, page-stream and read-call tables when it has them — and hands them to
:func:`moetrace.analyses.bites.compute_bites`. :func:`bite_columns` is its matrix row (absent
without sampler files, so older matrices load as before). :func:`section_why` writes the
report's "why" section: per condition, the bites against the oldest generation over time, f(t)
and min_seq's turnovers, scan-to-steal per pass, and the pages each expert read again after
each bite.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

    from moetrace.analyses.bites import Bites
    from moetrace.reports.document import Report


@dataclass
class CellFiles:
    """Where a lab directory keeps what the bite analysis reads (None: absent)."""

    lab: Path
    sampler: Path | None
    cell: Path | None  # the cell directory (cell.json, snapshots/)
    run: Path | None  # the recording (manifest.json)


def cell_files(lab_dir: str | os.PathLike) -> CellFiles:
    """The sampler, cell and run directories of a lab directory (a matrix cell's: ``cell/`` and
    ``cell/run``; a plain ``lab run``: ``run/`` beside ``sampler/``)."""
    from moetrace.run.sampler import find_sampler

    d = Path(lab_dir)
    cell = d / "cell" if (d / "cell" / "cell.json").is_file() else None
    run = next((r for r in (d / "cell" / "run", d / "run") if (r / "manifest.json").is_file()), None)
    return CellFiles(d, find_sampler(d), cell, run)


def _window_s(f: CellFiles, t0_ns: int) -> tuple[float | None, float | None]:
    """The window measured, in sampler seconds: the cell's (loop entry -> post snapshots), else
    the recording's armed interval (its probes counted only inside), else open."""
    pairs = []
    if f.cell is not None:
        pairs.append((f.cell / "snapshots" / "loop_entry.json", f.cell / "snapshots" / "post.json", "monotonic_ns",
                      "monotonic_ns"))
    if f.run is not None:
        pairs.append((f.run / "manifest.json", f.run / "manifest.json", "interval.armed_ns", "interval.disarmed_ns"))
    for pa, pb, ka, kb in pairs:
        try:
            a, b = _dotted(json.loads(pa.read_text()), ka), _dotted(json.loads(pb.read_text()), kb)
        except (OSError, ValueError):
            continue
        if isinstance(a, int) and isinstance(b, int):
            return (a - t0_ns) / 1e9, (b - t0_ns) / 1e9
    return None, None


def _manifest(run: Path | None) -> dict[str, Any]:
    try:
        return json.loads((run / "manifest.json").read_text()) if run is not None else {}
    except (OSError, ValueError):
        return {}


def _dotted(doc: Any, key: str) -> Any:
    for k in key.split("."):
        doc = doc.get(k) if isinstance(doc, dict) else None
    return doc


def _memcg_path(cell: Path | None) -> str | None:
    """The cell's memcg as lru_gen names it ("/" + its scope's name), as cell_window reads it."""
    if cell is None:
        return None
    try:
        scope = (json.loads((cell / "cell.json").read_text()).get("scope") or {}).get("path")
    except (OSError, ValueError):
        return None
    return "/" + Path(scope).name if scope else None


def _table(run: Path | None, name: str, columns: list[str] | None = None) -> pd.DataFrame | None:
    import pandas as pd

    if run is None or not (run / f"{name}.parquet").is_file():
        return None
    try:
        return pd.read_parquet(run / f"{name}.parquet", columns=columns)
    except (OSError, ValueError, KeyError):
        return None


def _evicted(run: Path | None, t0_ns: int, window: tuple[float | None, float | None],
             notes: list[str]) -> pd.DataFrame | None:
    """The pool pages' lifetimes that ended inside the window, each with whether a read of it
    completed first (the page and read-call streams: ``record --stream-events`` with the
    pagecache and reads probes); None without both streams, or when no read call read the pool
    (an mmap replay: its pages are copied by faults, not calls). Lost stream records go to
    ``notes`` (the count is then a bound, not exact)."""
    from moetrace.analyses.bites import compute_evicted_before_read, in_window

    pe = _table(run, "page_events", ["ts_ns", "expert_id", "kind", "first_page_index", "pages"])
    rc = _table(run, "read_calls", ["ts_ns", "latency_ns", "offset_bytes", "ret", "expert_id"])
    if pe is None or rc is None:
        return None
    try:
        man = json.loads((run / "manifest.json").read_text())
        pool = man.get("pool") or {}
        geo = pool.get("geometry") or {}
        n_total = int(geo["n_layers"]) * int(geo["n_experts"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (rc["expert_id"].notna() & (rc["ret"] > 0)).any():
        notes.append("no read call read the pool (mmap?): pages evicted before a read not measured")
        return None
    for probe in ("pagecache", "reads"):
        st = (((man.get("lost") or {}).get(probe) or {}).get("stream") or {})
        lost = int(st.get("lost_kernel") or 0) + int(st.get("lost_user") or 0)
        if lost:
            notes.append(f"the {probe} stream lost {lost} records: pages evicted before a read is not exact")
    extent = int(pool["extent_bytes"]) if pool.get("layout") != "files" and pool.get("extent_bytes") else None
    ev = compute_evicted_before_read(pe, rc, extent, n_experts_total=n_total)
    at = ev.assign(_t=(ev["delete_ns"].astype("int64") - t0_ns) / 1e9)
    return in_window(at, *window, "_t").drop(columns=["_t"]).reset_index(drop=True)


def cell_bites(lab_dir: str | os.PathLike, capacity_bytes: int | None) -> Bites | None:
    """The bite analysis of one lab directory over its cell's measured window (the whole
    sampling without a cell); None when it holds no sampler files. InputError when one is
    damaged."""
    from moetrace.analyses.bites import compute_bites, compute_passes, epoch_rereads
    from moetrace.run.sampler import read_samples

    f = cell_files(lab_dir)
    if f.sampler is None:
        return None
    s = read_samples(f.sampler)
    window = _window_s(f, s.t0_ns)
    wakes, batches = _table(f.run, "vmscan_wakes"), _table(f.run, "vmscan_batches")
    probe = None
    if wakes is not None and batches is not None:  # the last pass ends where the probes were disarmed
        probe = compute_passes(wakes, batches, s.t0_ns, _dotted(_manifest(f.run), "interval.disarmed_ns"))
    memcg = _memcg_path(f.cell)
    if memcg is not None and (s.lru_gen is None or not (s.lru_gen["memcg_path"] == memcg).any()):
        memcg = None  # the cell's memcg is not in lru_gen (a balloon cell's replay runs in the root)
    notes: list[str] = []
    ep, ee = _table(f.run, "epochs"), _table(f.run, "expert_epochs")
    per_epoch = epoch_rereads(ep, ee, s.t0_ns) if ep is not None and ee is not None and "re_added_pages" in ee else None
    b = compute_bites(s.vmstat, s.memfree, s.lru_gen, dict(s.zoneinfo) if s.zoneinfo else None, capacity_bytes,
                      window=window, probe_passes=probe, memcg_path=memcg,
                      evicted=_evicted(f.run, s.t0_ns, window, notes), per_epoch=per_epoch)
    b.summary.notes += notes
    return b


def bite_columns(cell_dir: Path, capacity_bytes: int) -> dict[str, float | None]:
    """A matrix row's bite columns (moetrace.analyses.bites.MATRIX_COLUMNS): {} when the cell
    has no sampler files (a cell run before the sampler: its row as before); all None and
    ``bites_error`` when they are damaged."""
    from moetrace.analyses.bites import MATRIX_COLUMNS
    from moetrace.errors import InputError

    try:
        b = cell_bites(cell_dir, capacity_bytes)
    except InputError as e:
        return {**{c: None for c in MATRIX_COLUMNS}, "bites_error": e.format_message()}
    return {} if b is None else b.columns()


# -- the matrix report's "why" section ---------------------------------------------------------------

def cell_rereads(lab_dir: str | os.PathLike, bites: Bites) -> pd.DataFrame:
    """Per pass of ``bites``, the pages each expert read again before the next pass
    (analyses.bites.compute_rereads_after_passes over the recording's epochs); empty without
    the recording's per-epoch tables."""
    import pandas as pd

    from moetrace.analyses.bites import compute_rereads_after_passes
    from moetrace.run.sampler import read_samples

    f = cell_files(lab_dir)
    ep, ee = _table(f.run, "epochs"), _table(f.run, "expert_epochs")
    if f.sampler is None or ep is None or ee is None or "re_added_pages" not in ee:
        return pd.DataFrame(columns=["pass", "expert_id", "layer", "expert", "re_added_pages"])
    return compute_rereads_after_passes(bites.passes, ep, ee, read_samples(f.sampler).t0_ns)


def passes_table(bites: Bites, rereads: pd.DataFrame, top: int = 3) -> pd.DataFrame:
    """A row per pass: when, what it freed against the oldest generation, its scan-to-steal, and
    the re-reads that followed it (pages, experts, the ``top`` experts by pages)."""
    import pandas as pd

    p = bites.passes
    cols = ["pass", "start_s", "passes", "freed_per_pass_pages", "oldest_file_pages_at_start", "bite_over_oldest",
            "oldest_share_at_start", "scan_to_steal", "order"]
    out = p[[c for c in cols if c in p]].copy()
    by = rereads.groupby("pass") if len(rereads) else None
    pages = by["re_added_pages"].sum() if by is not None else pd.Series(dtype="Int64")
    experts = by["expert_id"].nunique() if by is not None else pd.Series(dtype="Int64")
    out["re_added_pages_after"] = pd.array(out["pass"].map(pages).fillna(0).astype("int64"), dtype="Int64")
    out["experts_re_read_after"] = pd.array(out["pass"].map(experts).fillna(0).astype("int64"), dtype="Int64")
    tops = {k: ", ".join(f"L{int(r.layer)}E{int(r.expert)} {int(r.re_added_pages)}"
                         for r in g.nlargest(top, "re_added_pages").itertuples())
            for k, g in (rereads.groupby("pass") if len(rereads) else [])}
    out["top_experts_re_read"] = out["pass"].map(tops).fillna("").astype("string")
    return out.reset_index(drop=True)


def plot_bites(bites: Bites, rereads: pd.DataFrame, title: str) -> bytes:
    """Four panels over the sampler's time: each kswapd pass's bite (pages freed) against the
    oldest generation's file pages at its start; f(t) with min_seq (turnovers) and max_seq;
    scan-to-steal per pass; the pages read again after each bite (top experts stacked)."""
    from moetrace.reports.figures import new_figure, png_bytes

    p, g = bites.passes, bites.generations
    fig, ax = new_figure(w=8.0, h=9.0, nrows=4, sharex=True)
    t = p["start_s"].astype(float).to_numpy()
    freed = p["freed_per_pass_pages"].astype("Float64").astype(float).to_numpy()
    ax[0].vlines(t[freed > 0], 1, freed[freed > 0], color="#d62728", label="pages freed by the pass")
    ax[0].plot(t, p["oldest_file_pages_at_start"].astype("Float64").astype(float).to_numpy(), "o", ms=3,
               color="#1f77b4", label="oldest generation's file pages at its start")
    if (freed > 0).any():
        ax[0].set_yscale("log")
    ax[0].set_ylabel("pages (log)")
    ax[0].set_title(title, fontsize=10)
    ax[0].legend(fontsize=7)
    if len(g):
        ax[1].plot(g["t"], g["oldest_share"].astype(float), color="#2ca02c", label="f(t): oldest generation's share")
        ax[1].set_ylim(0, 1.05)
        tw = ax[1].twinx()
        tw.step(g["t"], g["min_seq"].astype(float), where="post", color="#9467bd", label="min_seq")
        tw.step(g["t"], g["max_seq"].astype(float), where="post", color="#8c564b", ls="--", label="max_seq")
        tw.set_ylabel("seq")
        tw.legend(fontsize=7, loc="lower right")
    ax[1].set_ylabel("f")
    ax[1].legend(fontsize=7, loc="lower left")
    ax[2].plot(t, p["scan_to_steal"].astype("Float64").astype(float).to_numpy(), "s", ms=3, color="#ff7f0e")
    ax[2].axhline(2.0, color="#999", ls=":", lw=1)
    ax[2].set_ylabel("scan / steal per pass")
    _plot_rereads(ax[3], p, rereads)
    ax[3].set_xlabel("s since the sampler started")
    if not len(p):
        ax[0].text(0.5, 0.5, "no kswapd pass in the window", transform=ax[0].transAxes, ha="center")
    return png_bytes(fig)


def _plot_rereads(ax, passes: pd.DataFrame, rereads: pd.DataFrame, top: int = 5) -> None:
    """Bars at each pass's start: the pages read again until the next pass, the ``top`` experts
    over the window stacked, the rest as one."""
    ax.set_ylabel("pages read again after")
    if not len(rereads) or not len(passes):
        ax.text(0.5, 0.5, "no re-reads (or no per-iteration recording)", transform=ax.transAxes, ha="center")
        return
    start = passes.set_index("pass")["start_s"].astype(float)
    best = rereads.groupby("expert_id")["re_added_pages"].sum().nlargest(top).index
    bottom = start * 0.0
    width = max(float(start.diff().median() or 1.0) * 0.6, 0.05) if len(start) > 1 else 0.5
    for e in [*best, None]:
        sel = rereads[~rereads["expert_id"].isin(best)] if e is None else rereads[rereads["expert_id"] == e]
        v = sel.groupby("pass")["re_added_pages"].sum().reindex(start.index, fill_value=0).astype(float)
        r = sel.iloc[0] if len(sel) else None
        label = "other experts" if e is None else (f"L{int(r['layer'])}E{int(r['expert'])}" if r is not None else str(e))
        ax.bar(start.to_numpy(), v.to_numpy(), width=width, bottom=bottom.to_numpy(), label=label, align="edge")
        bottom = bottom + v
    ax.legend(fontsize=7, ncols=3)


#: the per-cell columns of the "why" section's table (BiteSummary's fields)
WHY_COLUMNS = ("pass_source", "passes", "kswapd_share", "scan_to_steal_kswapd", "scan_to_steal_direct",
               "pass_scan_to_steal_p50", "sum_high_bytes", "oldest_share_median", "sum_high_over_fC",
               "sum_high_over_oldest", "turnovers_per_min", "max_seq_advances", "generation_lifetime_s_median",
               "bite_p50_pages", "bite_max_over_oldest", "overshoot_kb_median", "evicted_before_read_pages",
               "oldest_share_min", "oldest_share_below_quarter", "min_seq_advances", "reread_burst_ratio",
               "reread_burst_ratio_aging")


def condition_bites(matrix_dir: Path, rows: pd.DataFrame) -> list[tuple[dict[str, Any], Bites]]:
    """The cells of one condition whose sampler files exist, each with its bites (a damaged
    cell is left out: its row's ``bites_error`` says why)."""
    from moetrace.errors import InputError

    out = []
    import pandas as pd

    for r in rows.to_dict("records"):
        cap = r.get("capacity_bytes")
        try:
            b = cell_bites(matrix_dir / str(r["cell_dir"]), None if cap is None or pd.isna(cap) else int(cap))
        except InputError:
            continue
        if b is not None:
            out.append((r, b))
    return out


def section_why(rep: Report, matrix_dir: Path, cells: pd.DataFrame) -> None:
    """The matrix report's "why": per condition, its cells' bite figures and, for the cell with
    the most kswapd passes (retained first), the passes over time against the oldest generation,
    f(t), turnovers, scan-to-steal per pass and the re-reads that followed each bite."""
    import pandas as pd

    rep.h(2, "Why: kswapd's bites against the oldest generation", "why")
    rep.p("Per kswapd pass, the pages it freed against the file pages of the oldest MGLRU generation when it "
          "started (hypothesis M1: a pass that asks for Σhigh, the zones' high watermarks summed, bites through "
          "min_seq into folios just read); f is the oldest generation's share of the memcg's file pages, "
          "Σhigh / (f·C) above 1 puts a cell in M1's regime. Hypothesis M2: on long runs protected folios pile up "
          "until f falls to a quarter, then aging sweeps the hot set; its figures are f's lowest, the share of "
          "samples with f at or below a quarter, and the re-reads per replay iteration in the iterations that ran "
          "from each min_seq advance (aging: max_seq) to 2 s after it against the other iterations (a burst ratio well above 1: re-reads "
          "follow the advances). From the guest's sampler (vmstat 1 Hz, MemFree 10 Hz, "
          "lru_gen 1 Hz, zoneinfo) and, when recorded, the vmscan probe's passes.")
    if cells is None or cells.empty or "cell_dir" not in cells:
        rep.p("Not measured: no finished cell.")
        return
    summary = []
    for cond, rows in cells.groupby("condition", sort=False):
        measured = condition_bites(matrix_dir, rows)
        if not measured:
            rep.p(f"{cond}: not measured (its cells ran without the sampler).")
            continue
        for r, b in measured:
            d = b.summary.as_dict()
            summary.append({"condition": cond, "cell": Path(str(r["cell_dir"])).name, "retained": r.get("retained"),
                            **{c: d[c] for c in WHY_COLUMNS}})
        r, b = max(measured, key=lambda rb: (rb[0].get("retained") in (True, "True"), rb[1].summary.passes or 0))
        name = f"why_{cond}".replace(".", "_")
        rer = cell_rereads(matrix_dir / str(r["cell_dir"]), b)
        rep.h(3, f"{cond}: {Path(str(r['cell_dir'])).name}")
        how = ("the vmscan probe's passes" if b.summary.pass_source == "vmscan" else
               "no vmscan probe: a pass is a vmstat interval in which pageoutrun stepped, its bite the mean per step")
        rep.figure(name, plot_bites(b, rer, f"{cond} {Path(str(r['cell_dir'])).name}"),
                   f"{cond}: each kswapd pass's bite against the oldest generation, f(t) and min_seq / max_seq, "
                   f"scan-to-steal per pass, the pages read again after each bite (top experts); {how}", wide=True)
        rep.table(f"{name}_passes", passes_table(b, rer), f"{cond}: every kswapd pass of the cell above and the "
                  "re-reads that followed it", fold=True)
        if len(b.advances):
            rep.table(f"{name}_advances", b.advances, f"{cond}: every min_seq advance (a generation evicted whole) "
                      "and max_seq advance (aging) of the cell above, with the pages read again in the replay "
                      "iterations that ran from it to 2 s after (hypothesis M2: re-read bursts after each)", fold=True)
        for n in b.summary.notes:
            rep.p(f"{cond}: {n}")
    if summary:
        rep.table("why_cells", pd.DataFrame(summary), "Per measured cell: kswapd's share of reclaim, scan-to-steal, "
                                                      "Σhigh against f·C, turnovers and the bites", None)
        rep.summary["why_cells"] = len(summary)
