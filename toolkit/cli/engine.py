"""`moetrace engine cell|sweep`: Algorithm 1 with a real engine (llama.cpp) in place of the replay
(moetrace.capacity.enginecell, moetrace.capacity.enginesweep)."""

from __future__ import annotations

import contextlib
import sys

import click

from moetrace.cli.common import BYTES, emit_json

CELL_KEYS = ("retained", "reasons", "label", "capacity_bytes", "measured_tokens", "decode_ms_per_token",
             "device_bytes_per_token", "miss_bytes_per_token", "amplification", "unneeded_share", "added_by_cause",
             "load_populate_pages", "scope_removed")


def engine_options(f):
    """Options shared by `engine cell` and `engine sweep`."""
    opts = [
        click.option("--model", "model", required=True, type=click.Path(exists=True, dir_okay=False),
                     help="The GGUF model llama.cpp serves (moetrace model synth writes a tiny one)."),
        click.option("--tokens", type=click.IntRange(2), default=64, show_default=True,
                     help="Tokens to generate (one decode each)."),
        click.option("--warmup-tokens", type=click.IntRange(0), default=16, show_default=True,
                     help="Tokens before the measured ones (they warm the cache; not in the figures)."),
        click.option("--read-ahead-kb", type=click.IntRange(0), default=None,
                     help="The model disk's read_ahead_kb for the cell (restored after).  [default: as it is]"),
        click.option("--headroom", "headroom", type=BYTES, default="32MiB", show_default=True,
                     help="Memory above C for the engine's own (llama.cpp on the tiny model: ~5 MiB)."),
        click.option("--load-mode", type=click.Choice(["mmap", "mmap+mlock", "none"]), default="mmap",
                     show_default=True, help="llama.cpp's -lm (none: the weights copied to anonymous memory)."),
        click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="Decode threads."),
        click.option("--timeout", "timeout_s", type=float, default=1800.0, show_default=True,
                     help="Seconds a cell may run."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@contextlib.contextmanager
def _interruptible():
    """SIGINT / SIGTERM end the cell with its scope removed and read_ahead_kb put back (exit 130 / 143)."""
    from moetrace.capacity.cell import interrupt_handlers
    from moetrace.errors import CellInterrupted

    try:
        with interrupt_handlers():
            yield
    except CellInterrupted as e:
        click.echo(f"moetrace engine: {e}; the scope was removed and read_ahead_kb put back", err=True)
        sys.exit(e.exit_code)


def _spec(model, capacity, tokens, warmup_tokens, read_ahead_kb, headroom, load_mode, threads, timeout_s,
          loader="stock", name="engine-cell"):
    from moetrace.capacity.enginecell import EngineCellSpec

    spec = EngineCellSpec(model=model, capacity_bytes=capacity or 1, tokens=tokens, warmup_tokens=warmup_tokens,
                          loader=loader, load_mode=load_mode, read_ahead_kb=read_ahead_kb, headroom_bytes=headroom,
                          threads=threads, name=name, timeout_s=timeout_s)
    spec.validate()
    return spec


@click.group()
def engine() -> None:
    """Engine cells and sweeps: llama.cpp serving a model file under a memory wall of C."""


@engine.command("cell")
@engine_options
@click.option("--capacity", required=True, type=BYTES, help="The capacity C, e.g. 192MiB.")
@click.option("--loader", type=click.Choice(["stock", "random"]), default="stock", show_default=True,
              help="stock: llama.cpp as shipped (MAP_POPULATE, WILLNEED, the fault path's readahead); random: "
                   "MADV_RANDOM on its mapping after the load (one page per fault).")
@click.option("--name", default="engine-cell", show_default=True, help="Scope name (the cgroup moetrace-NAME).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="The cell directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the cell's figures as JSON.")
def cell(model, tokens, warmup_tokens, read_ahead_kb, headroom, load_mode, threads, timeout_s, capacity, loader,
         name, out_dir, as_json):
    """One engine cell: llama.cpp decodes --tokens tokens from --model under a cgroup wall of
    C + headroom that only the engine joins (before it loads the model), recorded by `moetrace
    record --pool MODEL`. The model's pages are dropped first; --read-ahead-kb is set on its disk
    for the cell and put back. Figures over the measured tokens: decode time, device bytes and the
    routed miss demand (LRU of C over the engine's own routing) per token, their ratio (the
    amplification), and the expert pages no routed expert needed, by cause (readahead, demand,
    populate at load). Writes engine_cell.json, route.jsonl, run/, engine_tokens.parquet and
    engine_experts.parquet; `moetrace report DIR` reads them. Needs root and the set-up's engine.
    Exit status 0 when retained, 3 when not.

    \b
    Example:
      moetrace model synth /var/tmp/tiny.gguf
      moetrace engine cell --model /var/tmp/tiny.gguf --capacity 192MiB --out /var/tmp/ec-stock
      moetrace engine cell --model /var/tmp/tiny.gguf --capacity 192MiB --loader random --out /var/tmp/ec-random
    """
    from moetrace.capacity.enginecell import run_engine_cell
    from moetrace.kernel.features import private_mounts

    private_mounts()
    spec = _spec(model, capacity, tokens, warmup_tokens, read_ahead_kb, headroom, load_mode, threads, timeout_s,
                 loader, name)
    with _interruptible():
        res = run_engine_cell(spec, out_dir)
    res["capacity_bytes"] = capacity
    if as_json:
        emit_json({k: res.get(k) for k in CELL_KEYS} | {"cell_dir": out_dir})
    else:
        _print_cell(res, out_dir)
    sys.exit(0 if res["retained"] else 3)


def _print_cell(res: dict, out_dir: str) -> None:
    from moetrace.inputs.geometry import format_bytes

    def b(x):
        return "NA" if x is None else format_bytes(int(x))

    click.echo(f"engine cell {out_dir}: C={b(res['capacity_bytes'])} {res['label']} "
               f"{'retained' if res['retained'] else 'NOT retained'}")
    if res.get("device_bytes_per_token") is not None:
        amp, un = res.get("amplification"), res.get("unneeded_share")
        click.echo(f"  {res['decode_ms_per_token']:.1f} ms per token, device {b(res['device_bytes_per_token'])} per token, "
                   f"routed miss demand {b(res['miss_bytes_per_token'])}, amplification "
                   f"{'NA' if amp is None else f'{amp:.2f}'}, pages no routed expert needed "
                   f"{'NA' if un is None else f'{100 * un:.0f} %'}")
    for r in res["reasons"]:
        click.echo(f"  reason: {r}")
    for n in res.get("notes", []):
        click.echo(f"  note: {n}")


@engine.command("sweep")
@engine_options
@click.option("--capacities", required=True, help="Comma-separated capacities C, e.g. 96MiB,192MiB,288MiB,384MiB.")
@click.option("--loaders", default="stock,random", show_default=True, help="Comma-separated loaders (stock, random).")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True, help="Cells per loader and C.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the randomized cell order.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Sweep directory: cells/<loader>/<C>-r<i>/, engine_results/capacity .csv/.parquet, engine_fig.png.")
@click.option("--json", "as_json", is_flag=True, help="Print the per-capacity table as JSON.")
def sweep(model, tokens, warmup_tokens, read_ahead_kb, headroom, load_mode, threads, timeout_s, capacities, loaders,
          repeats, seed, out_dir, as_json):
    """Engine cells over loaders x capacities x repeats, in a seeded random order (the engine's
    Table 2 / Fig. 2: decode time and device bytes per token against C, stock and readahead-limited
    side by side). Running it again into the same --out runs only the cells not yet retained.
    `moetrace check OUT/cells/stock OUT/cells/random` compares the loaders; `moetrace report OUT`
    writes the report.

    \b
    Example:
      moetrace engine sweep --model /var/tmp/tiny.gguf --capacities 96MiB,192MiB,288MiB,384MiB \\
          --repeats 3 --out /var/tmp/engine-sweep
    """
    from moetrace.capacity.enginesweep import capacity_table, run_engine_sweep
    from moetrace.capacity.sweep import parse_capacities
    from moetrace.kernel.features import private_mounts

    private_mounts()
    caps = [b for _label, b in parse_capacities(capacities)]
    base = _spec(model, caps[0] if caps else None, tokens, warmup_tokens, read_ahead_kb, headroom, load_mode,
                 threads, timeout_s)
    with _interruptible():
        res = run_engine_sweep(base, caps, repeats, [x.strip() for x in loaders.split(",") if x.strip()], out_dir,
                               seed=seed, say=lambda s: click.echo(f"moetrace engine sweep: {s}", err=True))
    cap = capacity_table(res)
    if as_json:
        emit_json({"sweep_dir": out_dir, "capacity": cap.to_dict(orient="records")})
    else:
        click.echo(cap.to_string(index=False))
    sys.exit(0 if res["retained"].all() else 3)
