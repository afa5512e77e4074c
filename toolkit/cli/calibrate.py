"""`moetrace calibrate DIR`: what `check` says of identical cells on this machine (A/A pairs)."""

from __future__ import annotations

import click

from moetrace.cli.common import emit_json


@click.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--thresholds", "thresholds_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The thresholds to calibrate (TOML, as `check --thresholds`); default: check's own.")
@click.option("--write-thresholds", "write_path", type=click.Path(dir_okay=False), default=None,
              help="Write a thresholds TOML that keeps 95 % of these A/A pairs quiet, for `check --thresholds`.")
@click.option("--only", "only", multiple=True, metavar="GLOB",
              help="Only the groups whose label matches (repeatable): calibrate on one half of a matrix "
                   "(--only '6.12-*') and try the thresholds on the other (--thresholds).")
@click.option("--machine-file/--no-machine-file", "machine_file", default=True, show_default=True,
              help="Write the spread between identical cells, per host and mechanism, into the per-machine file "
                   "that check reads with one cell a side (root: /var/lib/moetrace/thresholds.toml, else "
                   "~/.local/state/moetrace/thresholds.toml; $MOETRACE_MACHINE_THRESHOLDS names another).")
@click.option("--json", "as_json", is_flag=True, help="Print the calibration as JSON.")
def calibrate(path, thresholds_path, write_path, only, machine_file, as_json):
    """Pair every two identical cells of PATH (a `lab matrix` directory: the repeats of each
    kernel x MGLRU x mechanism x C; a sweep: the cells of one capacity; or a directory of
    identical cells) and check each pair both ways round as one cell a side, as a kernel
    developer would check one cell against another.

    \b
    Prints per metric: the A/A pairs, how many `check` called a regression (a check you can
    trust calls none: >= 95 % of pairs quiet), the A/A ratio's 95th percentile (the threshold
    that keeps 95 % quiet), the spread between repeats and from it the smallest change a check
    of 3 repeats a side detects (80 % power, alpha 0.05).
    The suggested thresholds put each metric at the lowest A/A quantile (95th, 97.5th, 99th,
    largest) that keeps >= 97.5 % of the pairs quiet together. Held out, it says how such
    thresholds fare on A/A pairs they were not fitted on: one half of each group's repeats (fitted
    on the other half), one whole group (fitted on the others: a condition never seen), and, in
    groups of 6 or more, 3 cells against 3 (the cell-level test a check of repeats runs).
    The spread between identical cells per host and mechanism (cell.json host and mechanism):
    limit (the relative move a one-cell check must pass to call a regression: the widest A/A
    move seen or Z = 3.09 x sqrt(2) x cv, the larger), cv (sd of ln value: the repeats that
    would decide), floor (an absolute move no larger is none); written, for cells that name
    their host, into the per-machine file check finds by itself (replacing that host and
    mechanism's entry) and into --write-thresholds.
    Example:
      moetrace calibrate /var/tmp/matrix --only '6.12-*' --write-thresholds lab-thresholds.toml
      moetrace calibrate /var/tmp/matrix --only '6.1-*' --thresholds lab-thresholds.toml
      moetrace check base-cell cand-cell --thresholds lab-thresholds.toml
    """
    from moetrace.analyses.compare import load_thresholds
    from moetrace.reports.calibration import calibrate as run_calibration
    from moetrace.reports.calibration import held_out, save_machine_spread, split_summary, suggest, \
        suggested_thresholds

    th = load_thresholds(thresholds_path)
    cal = run_calibration(path, th, list(only))
    sug, q, share = suggest(cal, th)
    cal["suggested"] = {"quantile": q, "quiet_share": share, "thresholds": sug.per_metric}
    cal["held_out"] = held_out(cal, th)
    cal["cell_level"] = split_summary(cal, th)
    if write_path:
        from moetrace.atomic import atomic_write

        with atomic_write(write_path) as tmp:
            tmp.write_text(suggested_thresholds(cal, th))
        cal["thresholds_written"] = str(write_path)
    cal["machine_file"] = save_machine_spread(cal) if machine_file else None
    if as_json:
        emit_json(cal)
        return
    _echo(cal, q, share)
    _echo_held_out(cal["held_out"])
    _echo_spread(cal)
    if write_path:
        click.echo(f"thresholds: {write_path}", err=True)


def _echo(cal: dict, q: float, share: float) -> None:
    from moetrace.reports.calibration import POWER, SPLIT_REPEATS

    cl = cal["cell_level"]
    click.echo(f"{cal['pairs']} A/A pairs in {cal['groups']} groups of identical cells: {cal['quiet_pairs']} "
               f"quiet ({100 * cal['quiet_share']:.0f} %)")
    click.echo(f"{'metric':28s} {'pairs':>5s} {'false':>5s} {'thr':>6s} {'A/A p95':>8s} {'cv':>7s} {'mde(3)':>7s} "
               f"{'det(3)':>7s}")
    for m, d in cal["metrics"].items():
        def f(v, pct=False):
            return "-" if v is None else (f"{100 * v:.1f}%" if pct else f"{v:.3f}")
        click.echo(f"{m:28s} {d['pairs']:5d} {d['false_regressions']:5d} {f(d['threshold'], True):>6s} "
                   f"{f(d['aa_worse_ratio_p95']):>8s} {f(d['between_repeat_cv'], True):>7s} "
                   f"{f(d['mde_3_repeats'], True):>7s} {_pct(cl['detectable_pct'], m, bool(cl['comparisons'])):>7s}")
    click.echo(f"{'group of identical cells':44s} {'cells':>5s} {'time cv':>8s} {'device cv':>9s} "
               f"{'3v3 quiet':>9s} {'det(3) time':>11s} {'det(3) dev':>10s}")
    for g, d in cal["by_group"].items():
        cv = lambda k: "-" if d.get(k) is None else f"{100 * d[k]:.1f}%"  # noqa: E731
        sg = cl["by_group"].get(g)
        q3 = f"{sg['quiet']}/{sg['comparisons']}" if sg else "-"
        det = sg["detectable_pct"] if sg else {}
        click.echo(f"{g:44s} {d['cells']:5d} {cv('iteration_time_ns_cv'):>8s} "
                   f"{cv('device_bytes_per_iteration_cv'):>9s} {q3:>9s} "
                   f"{_pct(det, 'iteration_time_ns', bool(sg)):>11s} {_pct(det, 'device_bytes_per_iteration', bool(sg)):>10s}")
    click.echo(f"suggested: each metric at its A/A {100 * q:g}th percentile or the default: "
               f"{100 * share:.1f} % of these pairs quiet")
    if cl["comparisons"]:
        click.echo(f"det(3): the smallest change check names (these thresholds) in >= {100 * POWER:.0f} % of the "
                   f"{SPLIT_REPEATS}-against-{SPLIT_REPEATS} A/A comparisons made that much worse (measured; "
                   f"mde(3) is the model's, from the spread)")
        click.echo(f"{SPLIT_REPEATS} cells against {SPLIT_REPEATS} of the same group (the cell-level test): "
                   f"{cl['comparisons']} A/A comparisons, {cl['quiet']} quiet "
                   f"({100 * cl['quiet'] / cl['comparisons']:.1f} %)")


def _pct(det: dict, m: str, have: bool) -> str:
    if not have or m not in det:
        return "-"
    return f"{det[m]}%" if det[m] is not None else ">300%"


def _echo_held_out(ho: dict) -> None:
    click.echo("held out (suggested thresholds fitted without the comparisons they are tried on):")
    for key, what, need in (("halves", "one half of each group's repeats, fitted on the other", "groups of >= 4 cells"),
                            ("groups", "one group, fitted on every other group", "two groups or more"),
                            ("splits", "3 against 3 of one group, fitted on every other group",
                             "groups of >= 6 cells and two groups or more")):
        d = ho[key]
        if not d["pairs"]:
            click.echo(f"  {what}: none (needs {need})")
            continue
        loudest = ", ".join(f"{g} {n}" for g, n in sorted(d["loud_by_group"].items(), key=lambda x: -x[1])[:3])
        click.echo(f"  {what}: {d['quiet']} of {d['pairs']} quiet ({100 * d['share']:.1f} %)"
                   + (f"; loud: {loudest}" if loudest else ""))


def _echo_spread(cal: dict) -> None:
    click.echo("between identical cells (check, one cell a side: a regression only beyond limit and floor; cv sizes "
               "the repeats that would decide):")
    for r in cal.get("spread") or []:
        click.echo(f"  {r['host']} {r['mechanism']} ({r['cells']} cells in {r['groups']} groups):")
        for m, d in r["metrics"].items():
            click.echo(f"    {m:28s} limit {100 * d['limit']:6.1f} %  cv {d['cv']:.3f}  floor {d['floor']:g}")
    mf = cal.get("machine_file")
    if mf:
        click.echo(f"written to the per-machine file {mf['path']}: {', '.join(mf['entries']) or 'nothing'}"
                   + (f" ({mf['why']})" if mf.get("why") else ""))
