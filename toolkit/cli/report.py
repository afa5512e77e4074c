"""`moetrace report`: the HTML / Markdown report of a run, cell or sweep, and `moetrace flame`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from moetrace.cli.common import emit_json


class SectionsOption(click.Option):
    """`--only`, whose help names the report's sections (moetrace.reports.report.SECTIONS, the one
    list) when it is shown: a new section is added there alone, and nothing loads pandas before."""

    def get_help_record(self, ctx: click.Context):
        from moetrace.reports.report import SECTIONS

        record = super().get_help_record(ctx)
        return None if record is None else (record[0], record[1].replace("{sections}", ", ".join(SECTIONS)))


@click.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Report directory (default: PATH/report). An existing report there is replaced.")
@click.option("--only", "only", default=None, metavar="SECTION,...", cls=SectionsOption,
              help="Sections to build, comma-separated (default: every one: {sections}).")
@click.option("--cell", default=None, help="Sweep only: the cell to detail (default: the most informative: the "
                                           "largest amplification when a cell amplifies, else the middle of the "
                                           "curve).")
@click.option("--cell-reports/--no-cell-reports", default=True, show_default=True,
              help="Sweep only: write every other recorded cell's report under cells/NAME/ (linked from the "
                   "strip of cells; ~5 s a cell).")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The plan the replay ran, when it is no longer where the manifest says (for the simulated "
                   "miss demand per expert).")
@click.option("--force", is_flag=True, help="Write into a non-empty --out that holds no earlier report.")
@click.option("--json", "as_json", is_flag=True, help="Print the report's headline figures as JSON.")
def report(path, out_dir, only, cell, cell_reports, plan_path, force, as_json):
    """Analyse a run, cell or sweep and write one self-contained HTML page, its Markdown
    twin, and every table as Parquet and JSON. No root, no kernel.

    \b
    PATH is a `record --out` run directory, a `cell --out` cell directory, or a
    `sweep --out` directory (Table 2, Fig. 2, the cells, then the per-expert
    detail of one cell). Every report opens with its findings (printed here
    too), each number linked to the table it comes from. Sections:
      amp      re-read amplification per iteration and per (layer, expert), re-reads
               within one iteration, observed vs simulated hit rate, the totals
               against /proc, the paper's alarm (amplification with scan/steal > 2)
      hitpath  read calls by class, latency quantiles, ns per KiB, where the time goes
      age      LRU dwell before eviction; MGLRU generations and aging cadence
      reclaim  who reclaimed, scan-to-steal, PSI, refault windows and thrash state
      flame    flame.svg (hover, click to zoom, search) and speedscope JSON
      timeline timeline.json for ui.perfetto.dev
    Example:
      moetrace report demo-out/sweep && xdg-open demo-out/sweep/report/report.html
    """
    from moetrace.progress import bar, progress_enabled
    from moetrace.reports.report import build_report

    sections = {} if only is None else {"sections": [s for s in only.split(",") if s.strip()]}
    enabled = progress_enabled(as_json)
    with bar(None, desc="report", unit="section", enabled=enabled) as b:
        def step(name: str) -> None:
            b.set_description(f"report: {name}")
            b.update(1)

        if (Path(path) / "matrix.json").is_file():
            from moetrace.lab.matrix import report_matrix

            doc = report_matrix(path, out_dir, cell, force=force, progress=step, **sections)
        else:
            doc = build_report(path, out_dir, cell=cell, plan=plan_path, force=force, progress=step,
                               cell_reports=cell_reports, **sections)
    if as_json:
        emit_json(doc)
        return
    s = doc["summary"]
    click.echo(f"report: {doc['html']}")
    click.echo(f"        {doc['markdown']}, {len(doc['tables'])} tables, {len(doc['figures'])} figures"
               + (f", {', '.join(doc['files'].values())}" if doc["files"] else ""))
    for f in doc.get("findings") or []:
        click.echo(f"  - {f}")


@click.command()
@click.argument("run_path", type=click.Path(exists=True, file_okay=False))
@click.option("--diff", "other", type=click.Path(exists=True, file_okay=False), default=None,
              help="A second run or cell: draw a differential flame graph (red: more of the samples in "
                   "RUN_PATH, blue: fewer; frames on one side only are marked).")
@click.option("-o", "--out", "out_path", type=click.Path(dir_okay=False), required=True,
              help="The SVG to write.")
@click.option("--speedscope", "speedscope_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the stacks as speedscope JSON.")
@click.option("--json", "as_json", is_flag=True, help="Print the frames' shares (and with --diff the deltas) as JSON.")
def flame(run_path, other, out_path, speedscope_path, as_json):
    """Draw the sampled stacks of a run (or cell) as an interactive flame graph SVG.

    \b
    With --diff OTHER: the differential flame graph of RUN_PATH against OTHER, e.g.
    a pagecache run against a pinned run of the same plan and capacity.
    Example:
      moetrace flame cells/256MiB-r0 --diff pinned/cells/256MiB-r0 -o pagecache-vs-pinned.svg
    """
    from moetrace.errors import InputError
    from moetrace.reports import flame as FL
    from moetrace.run.handle import open_run

    def stacks_of(p):
        r = open_run(p)
        if "stacks" not in r.tables or r.tables["stacks"].empty:
            raise InputError("the run has no sampled stacks", path=str(r.path),
                             hint="record with the stacks probe (moetrace record --probes ...,stacks)")
        return r, FL.folded_from_table(r.tables["stacks"])

    ra, a = stacks_of(run_path)
    if other:
        rb, b = stacks_of(other)
        svg = FL.diff_flame_svg(b, a, label_a=rb.name, label_b=ra.name,
                                title=f"{ra.name} against {rb.name}")
        table = FL.compute_flame_diff(b, a)
    else:
        svg = FL.flame_svg(a, title=f"{ra.name}: sampled stacks")
        table = None
    Path(out_path).write_text(svg)
    if speedscope_path:
        Path(speedscope_path).write_text(json.dumps(FL.speedscope_json(a, ra.name)))
    if as_json:
        from moetrace.reports.document import table_json

        emit_json({"svg": out_path, "frames": json.loads(table_json(table)) if table is not None else None})
        return
    click.echo(f"flame: {out_path}" + (f" ({ra.name} against {rb.name})" if other else ""))
    if table is not None:
        for side, label in (("a", rb.name), ("b", ra.name)):
            only = table[(table["only_in"] == side) & (table["depth"] >= 0)]
            click.echo(f"       frames only in {label}: {len(only)}")
    sys.stdout.flush()
