"""`moetrace pool`: create and verify expert pools on disk."""

from __future__ import annotations

import dataclasses

import click

from moetrace.cli import LazyGroup
from moetrace.cli.common import BYTES, emit_json


@click.group(cls=LazyGroup)
def pool() -> None:
    """Expert pools: one file per (layer, expert), one file per layer, or one pool file of
    page-aligned extents; or a model file (GGUF, safetensors) mapped by `pool map`."""


@pool.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--geometry", "geometry_name", default="kimi-k3", show_default=True, metavar="PRESET",
              help="Geometry preset (kimi-k3, deepseek-v3, qwen3-30b-a3b, olmoe).")
@click.option("--layers", type=int, help="Routed layers (scales the preset down).")
@click.option("--experts", type=int, help="Experts per layer (scales the preset down).")
@click.option("--k", type=int, help="Experts per token.")
@click.option("--expert-bytes", type=BYTES, help="Bytes per expert, e.g. 256KiB (default: the preset's).")
@click.option("--layout", type=click.Choice(["files", "layers", "pool"]), default="files", show_default=True,
              help="files: one file per expert; layers: one file per layer (L000.bin ...), its experts at "
                   "page-aligned fixed-size extents (read at offsets, as an engine reads a layer's tensor); "
                   "pool: one file of such extents for every expert.")
@click.option("--seed", default=0, show_default=True, help="Seed of the incompressible fill.")
@click.option("--force", is_flag=True, help="Replace a pool already in DIRECTORY.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest summary as JSON.")
def create(directory, geometry_name, layers, experts, k, expert_bytes, layout, seed, force, as_json):
    """Create a pool of incompressible bytes with a manifest (pool.json).

    \b
    A preset may be scaled down (fewer layers or experts, smaller experts);
    the manifest records what it was scaled from. On a terminal a progress
    bar of bytes written goes to stderr (not with --json or CI=true;
    MOETRACE_PROGRESS=0/1 turns it off/on).
    Example (a ~2 GiB scaled Kimi-K3 pool):
      moetrace pool create /var/tmp/pool --geometry kimi-k3 --experts 88 --expert-bytes 256KiB
    """
    from moetrace.inputs.geometry import Geometry, format_bytes, preset
    from moetrace.inputs.pool import create_pool
    from moetrace.progress import bar, progress_enabled

    base = preset(geometry_name)
    changes = {key: val for key, val in (("n_layers", layers), ("n_experts", experts), ("k", k),
                                         ("expert_bytes", expert_bytes)) if val is not None}
    if k is None and experts is not None and experts < base.k:
        changes["k"] = experts  # k does not shape a pool; keep the geometry valid
    geo = dataclasses.replace(base, **changes)
    geo = Geometry(geo.n_layers, geo.n_experts, geo.k, geo.expert_bytes, geo.name)
    scaled = None
    if changes:
        scaled = {"preset": base.name, "n_layers": base.n_layers, "n_experts": base.n_experts,
                  "expert_bytes": base.expert_bytes}
    total = geo.pool_bytes
    # a tqdm bar of bytes written, on stderr when it is a terminal (not with --json, CI=true or
    # MOETRACE_PROGRESS=0; MOETRACE_PROGRESS=1 forces it): see moetrace.progress
    # (unit "iB" with divisor 1024: tqdm prints the rate as MiB/s, matching format_bytes)
    with bar(total, desc=f"pool {format_bytes(total)}", unit="iB", enabled=progress_enabled(as_json),
             unit_scale=True, unit_divisor=1024) as b:
        p = create_pool(directory, geo, layout=layout, scaled_from=scaled, seed=seed, force=force,
                        progress=b.update)
    info = {"directory": str(p.root), "geometry": geo.to_dict(), "layout": layout,
            "experts": geo.n_total, "extent_bytes": p.extent_bytes, "data_bytes": p.data_bytes,
            "scaled_from": scaled, "files": len(p.files)}
    if as_json:
        emit_json(info)
    else:
        click.echo(f"created {p.root}: {geo.n_layers} layers x {geo.n_experts} experts x "
                   f"{format_bytes(geo.expert_bytes)} = {format_bytes(p.data_bytes)} ({layout} layout)"
                   + (f", scaled from {base.name}" if scaled else ""))


@pool.command()
@click.argument("directory", type=click.Path(file_okay=False, exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify(directory, as_json):
    """Check the manifest (schema, checksum, paths inside the pool) and every file's size."""
    from moetrace.errors import MoetraceError
    from moetrace.inputs.pool import open_pool, verify_pool

    p = open_pool(directory)
    problems = verify_pool(p)
    if as_json:
        emit_json({"directory": str(p.root), "ok": not problems, "problems": problems,
                   "experts": p.n_total, "layout": p.layout})
    elif not problems:
        click.echo(f"{p.root}: ok ({p.n_total} experts, {p.layout} layout)")
    if problems:
        if not as_json:
            for line in problems[:20]:
                click.echo(f"  {line}", err=True)
        raise MoetraceError(f"{p.root}: {len(problems)} problem(s)",
                            hint="recreate it with `moetrace pool create --force`")


@pool.command("map")
@click.argument("model", type=click.Path(exists=True))
@click.option("--out", "out", type=click.Path(dir_okay=False),
              help="Write the extents (file, layer, expert, kind, tensor, offset, length) as Parquet.")
@click.option("--experts-out", type=click.Path(dir_okay=False),
              help="Write per (layer, expert) its extents, bytes, own pages and shared pages as Parquet.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary (and the shared pages) as JSON.")
def map_(model, out, experts_out, as_json):
    """Give each (layer, expert) of MODEL its byte extents: a GGUF file (three stacked expert
    tensors per layer: three extents each) or an HF safetensors checkpoint (a file, its
    index.json, or a directory of shards; per-expert or fused expert tensors). Everything else
    is one non_expert row. A page holding bytes of two owners is listed as shared, never given
    to one.

    \b
    Example:
      moetrace model synth /var/tmp/m.gguf --alignment 32 && moetrace pool map /var/tmp/m.gguf
    """
    from moetrace.atomic import atomic_write
    from moetrace.inputs.modelmap import expert_table, map_model, page_owners

    m = map_model(model)
    s = m.summary()
    for path, df in ((out, m.extents), (experts_out, expert_table(m) if experts_out else None)):
        if path:
            with atomic_write(path, what="table") as tmp:
                df.to_parquet(tmp, index=False)
    if as_json:
        emit_json({**s, "shared": page_owners(m).to_dict("records")})
        return
    kib = ", ".join(f"{b / 1024:g}" for b in s["expert_bytes"])
    click.echo(f"{model}: {s['format']}{' ' + s['arch'] if s['arch'] else ''}, {s['layers']} layers x "
               f"{s['experts']} experts"
               + (f", top-{s['experts_per_token']}" if s["experts_per_token"] else "")
               + (f", alignment {s['alignment']}" if s["alignment"] else ""))
    click.echo(f"  experts: {s['expert_pool_bytes'] / 2**20:.1f} MiB, {kib} KiB each in "
               f"{'/'.join(map(str, s['extents_per_expert']))} extents; non-expert weights "
               f"{s['non_expert_bytes'] / 2**20:.1f} MiB")
    click.echo(f"  pages shared between owners: {s['shared_pages']} ({s['shared_pages_expert_expert']} expert-expert, "
               f"{s['shared_pages_expert_other']} expert-other; counted as shared, not in either expert)")
