"""`moetrace check BASE CAND`: a regression verdict between two runs, cells, sweeps or sets of repeats."""

from __future__ import annotations

import sys

import click

from moetrace.cli.common import emit_json


@click.command()
@click.argument("base", type=click.Path(exists=True, file_okay=False))
@click.argument("cand", type=click.Path(exists=True, file_okay=False))
@click.option("--thresholds", "thresholds_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="TOML: alpha = 0.05 and [metrics.NAME] threshold = 0.10 (relative); defaults for the rest.")
@click.option("--json", "as_json", is_flag=True, help="Print the verdict and every comparison table as JSON.")
@click.option("--html", "html_dir", type=click.Path(file_okay=False), default=None,
              help="Also write report.html / REPORT.md / tables into this directory.")
@click.option("--mixed-hosts", is_flag=True,
              help="Pool a side's repeats from different hosts (cell.json host) instead of refusing them; "
                   "a note says it did.")
def check(base, cand, thresholds_path, as_json, html_dir, mixed_hosts):
    """Compare CAND against BASE metric by metric and say whether it regressed.

    \b
    BASE / CAND: a run (record --out), a cell (cell --out), a sweep (sweep --out:
    cells of one capacity are repeats, capacities matched) or a directory of runs
    or cells (repeats). Both must replay the same plan on the same pool geometry.
    Metrics: iteration time, device bytes per iteration, amplification, re-reads
    and refaults per iteration, scan-to-steal, hit-only ns/KiB and p50/p99,
    age at eviction (LRU dwell), MGLRU aging cadence. Medians with spread;
    with >= 2 repeats a side, Welch's t-test (on the logs) and a 95 % interval of
    the ratio: a metric regressed when it moved the wrong way by more than its
    threshold and the test agrees (p < alpha); a geometric-mean row sums up.
    One cell a side: a Mann-Whitney U test of the per-iteration samples where a
    metric has them (iteration time), else the threshold alone; samples within
    a cell do not see the noise between identical cells, so a metric regressed
    only beyond its spread between identical cells of that mechanism on this
    machine: the [spread] of --thresholds, else the per-machine file that
    `moetrace calibrate` writes (/var/lib/moetrace/thresholds.toml as root,
    else ~/.local/state/moetrace/thresholds.toml; $MOETRACE_MACHINE_THRESHOLDS
    names another), else check's shipped defaults (a note says which). Past the
    threshold but within the spread is inconclusive, with the cells a side that
    would decide (the fewest with which 80 % of simulated checks name the
    observed move, the cells varying by the spread's cv).
    One side's repeats must come from one host (cell.json host); --mixed-hosts
    pools them anyway. Base and candidate on different hosts are compared, with
    a note.
    Exit status: 0 no regression, 1 regression (the metrics named), 2 could not
    compare, 3 inconclusive (one cell a side: a move within the spread between
    identical cells; the repeats a side that would decide are named).
    Example:
      moetrace check lab-6.1/cells lab-6.12/cells --thresholds thresholds.toml --html check-out
    """
    from moetrace.analyses.compare import load_thresholds
    from moetrace.reports.check import check_doc, run_check, write_check_report

    th = load_thresholds(thresholds_path)
    res = run_check(base, cand, th, mixed_hosts=mixed_hosts)
    if html_dir:
        write_check_report(res, base, cand, html_dir)
    if as_json:
        emit_json(check_doc(res, base, cand))
    else:
        for g, df in res.tables.items():
            click.echo(f"== {g}")
            cols = ["metric", "base_n", "base_median", "cand_n", "cand_median", "ratio", "worse_ratio", "p_value",
                    "threshold", "spread_limit", "verdict", "repeats_to_decide"]
            cols = [c for c in cols if c not in ("spread_limit", "repeats_to_decide") or df[c].notna().any()]
            click.echo(df[cols].to_string(index=False, na_rep="NA", float_format=lambda v: f"{v:.4g}"))
            tested = df[df["test"].notna()] if "test" in df else df.iloc[:0]
            for test, g in tested.groupby("test", sort=False):
                click.echo(f"test: {test}: {', '.join(g['metric'])}")
        for n in res.notes:
            click.echo(f"note: {n}")
        click.echo(res.verdict())
    sys.exit(res.status)
