"""`moetrace doctor`: what this kernel and this process can record, and why not."""

from __future__ import annotations

import click

from moetrace.cli.common import emit_json


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the rows, attach plans and what was not checked as JSON.")
@click.option("--mount/--no-mount", default=None,
              help="--mount: mount tracefs/debugfs when absent (root) and leave them mounted; --no-mount: "
                   "check only what is mounted now. Default: mount them for the check and unmount them "
                   "again (record mounts them itself, so that is how record will run).")
@click.option("--probes-only", is_flag=True, help="Only the probe and attach-point rows.")
@click.option("--root", "root", default="/", hidden=True, type=click.Path(file_okay=False),
              help="Look up proc/, sys/, lib/ under this directory (tests: a fake tree).")
def doctor(as_json: bool, mount: bool, probes_only: bool, root: str) -> None:
    """What this kernel and this process can record: one row per capability and per
    probe attach point, yes / no / degraded with the reason and the fix.

    \b
    Asks the kernel (tracepoint format files, kallsyms, sysfs knobs), never the
    version number. Runs without root and lists what it could not check. Exit 0.
    Examples:
      moetrace doctor
      sudo moetrace doctor --mount        # mount tracefs/debugfs first
      moetrace doctor --json | jq '.plans.pagecache.status'
    """
    from moetrace.record.doctor import doctor as doctor_report

    rep = doctor_report(root, mount="temporary" if mount is None else mount, probes_only=probes_only)
    if as_json:
        emit_json(rep)
        return
    click.echo(f"kernel {rep['kernel']}")
    for note in rep["mounted"]:
        click.echo(f"note: {note}")
    width = max(len(r["name"]) for r in rep["rows"])
    section = None
    for r in rep["rows"]:
        if r["section"] != section and r["section"] != "attach":
            section = r["section"]
            click.echo("\n" + {"capability": "capabilities", "probe": "probes",
                               "background": "background reclaimers (read only)",
                               "engine": "engines (unpacked by the set-up)"}.get(section, section) + ":")
        name = ("  " + r["name"]) if r["section"] == "attach" else r["name"]
        mark = "" if r["checked"] else " (not checked)"
        click.echo(f"  {r['status']:<8} {name:<{width + 2}} {r['detail']}{mark}")
        if r["fix"]:
            click.echo(f"  {'':<8} {'':<{width + 2}} fix: {r['fix']}")
    if rep["not_checked"]:
        click.echo(f"\ncould not check: {', '.join(rep['not_checked'])}")
