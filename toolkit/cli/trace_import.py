"""`moetrace trace import`: router traces from llama.cpp, vLLM, SGLang and plain tables."""

from __future__ import annotations

import click

from moetrace.cli.common import emit_json

_FORMATS = ("auto", "jsonl", "llamacpp", "vllm", "sglang", "csv", "parquet")


@click.command("import")
@click.argument("in_files", metavar="IN...", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False),
              help="Engine JSONL to write (atomically).")
@click.option("--format", "fmt", type=click.Choice(_FORMATS), default="auto", show_default=True,
              help="Input format; auto decides by extension and content.")
@click.option("--keep-warmup", is_flag=True, help="Keep a leading block of identical routes (dropped by default).")
@click.option("--warmup-min-repeats", type=click.IntRange(min=2), default=16, show_default=True, metavar="N",
              help="A leading run of at least N identical steps is warm-up junk.")
@click.option("--k", type=int, help="Experts per token (reshapes flat arrays, splits layer-less tables; "
                                    "default: inferred).")
@click.option("--layers", type=int, help="Routed layers (bounds layer ids; reshapes 2-D arrays and splits "
                                         "tables that have no layer column).")
@click.option("--experts", type=int, help="Experts per layer; a larger expert id is an error.")
@click.option("--geometry", "geometry_name", metavar="PRESET",
              help="Take k, layers and experts from a preset (kimi-k3, deepseek-v3, qwen3-30b-a3b, olmoe).")
@click.option("--key", help="Array name inside an .npz (default: detected).")
@click.option("--prompt-tokens", type=click.IntRange(min=0), metavar="N",
              help="Leading rows of a vLLM/SGLang array that are the prompt (default: from the file, else 0).")
@click.option("--include-prefill", is_flag=True,
              help="Keep prompt tokens as steps (one per token) instead of excluding them.")
@click.option("--max-batch", type=click.IntRange(min=1), metavar="N",
              help="Engine logs without phase or request ids: a forward pass of more than N rows is prefill "
                   "(default: the most common row count, the steady decode batch).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def import_(in_files, out, fmt, keep_warmup, warmup_min_repeats, k, layers, experts, geometry_name, key,
            prompt_tokens, include_prefill, max_batch, as_json):
    """Convert another tool's router trace into engine JSONL.

    \b
    Formats:
      jsonl     JSON Lines engine routing logs (vLLM/SGLang logging hooks): a
                "type": "meta" line, then one "type": "route" line per token
                row of each forward pass (req_id, token_idx, layer, topk_ids);
                one file per layer (give them all: merged by forward pass) or
                all layers in one; canonical step/layer/experts JSONL too
      llamacpp  eval-callback ffn_moe_topk-<il> tensors: a CSV (token, layer,
                expert) or the raw llama-eval-callback log
      vllm      routed experts (--enable-return-routed-experts): int array
                (tokens, layers, k) as .npy/.npz, or the response .json
      sglang    expert-distribution recorder per_token dump (.pt), or a
                return_routed_experts response .json; stat/per_pass dumps hold
                only counts (use `moetrace trace stats --counts`)
      csv, parquet  step|token|pos, layer|il, expert|expert_id
                [, rank, weight, pass] with a header, or an experts list column

    \b
    A leading block of at least N identical steps (warm-up junk: dummy
    profiling passes) is dropped and reported; --keep-warmup keeps it. In an
    engine log each forward pass is a step; requests come from req_id when it
    varies, else from the decode batch slot (the summary says which), and
    prompt (prefill) rows are excluded.
    The output is validated with the canonical typed parser before writing.

    \b
    Examples:
      moetrace trace import routes.csv -o trace.jsonl
      moetrace trace import layer_*.jsonl -o trace.jsonl
      moetrace trace import --format vllm routed.npy --prompt-tokens 57 -o trace.jsonl --json
    """
    from moetrace.inputs.importers import import_to_jsonl

    if geometry_name:
        from moetrace.inputs.geometry import preset

        g = preset(geometry_name)
        k = k or g.k
        layers = layers or g.n_layers
        experts = experts or g.n_experts
    tt = import_to_jsonl(list(in_files), out, fmt, key=key, prompt_tokens=prompt_tokens,
                         include_prefill=include_prefill, keep_warmup=keep_warmup,
                         warmup_min_repeats=warmup_min_repeats, k=k, n_layers=layers, n_experts=experts,
                         max_batch=max_batch)
    in_file = in_files[0] if len(in_files) == 1 else f"{in_files[0]} (+{len(in_files) - 1} files)"
    summary = _summary(tt, in_files, out)
    _echo_warmup(tt.stats["warmup"], in_file, summary["rows_unit"])
    for note in summary["notes"]:
        click.echo(f"moetrace: note: {note}", err=True)
    for w in summary["warnings"]:
        click.echo(f"moetrace: warning: {w}", err=True)
    if as_json:
        emit_json(summary)
        return
    _echo_summary(summary, tt, in_file, out)


def _summary(tt, in_files, out) -> dict:
    """The JSON summary of an import (moetrace.inputs.importers.Imported)."""
    st, wu = tt.stats, tt.stats["warmup"]
    summary = {
        "input": str(in_files[0]) if len(in_files) == 1 else [str(x) for x in in_files],
        "output": str(out),
        "format": st["format"],
        "rows_read": st.get("rows_read", 0),
        "rows_unit": st.get("rows_unit", "rows"),
        "prefill_excluded": st.get("prefill_excluded", 0),
        "placeholder_layers_dropped": st.get("placeholder_layers_dropped", []),
        "warmup_steps_dropped": wu["steps_dropped"],
        "warmup_rows_dropped": wu["rows_dropped"],
        "warmup": wu,
        "records_written": tt.records_written,
        "steps": tt.n_steps,
        "requests": tt.n_requests,
        "layers": tt.n_layers,
        "experts": tt.n_experts,
        "k": tt.k,
        "accounting": tt.accounting,
        "notes": st.get("notes", []) + tt.accounting.get("notes", []),
        "warnings": tt.accounting.get("warnings", []),
    }
    for extra in ("array", "array_shape", "passes_skipped", "source", "meta", "requests_from", "segments",
                  "max_batch", "forward_passes", "decode_passes"):
        if extra in st:
            summary[extra] = st[extra]
    return summary


def _echo_warmup(wu: dict, in_file: str, rows_unit: str) -> None:
    """Say on stderr what warm-up was dropped (or kept)."""
    if wu["steps_dropped"] and wu.get("unit") == "forward passes":
        click.echo(f"moetrace: {in_file}: dropped warm-up: {wu['steps_dropped']} leading forward passes "
                   f"({wu['rows_dropped']} token rows); --keep-warmup keeps them", err=True)
        for b in wu["blocks"]:
            click.echo(f"moetrace:   passes {b['first_pass']}-{b['first_pass'] + b['passes'] - 1} (from line "
                       f"{b['line']}): {b['reason']}", err=True)
    elif wu["steps_dropped"]:
        click.echo(f"moetrace: {in_file}: dropped warm-up: {wu['steps_dropped']} leading steps of identical "
                   f"routes ({wu['rows_dropped']} {rows_unit}, {len(wu['blocks'])} block(s)); "
                   f"--keep-warmup keeps them", err=True)
    elif wu.get("candidates"):
        click.echo(f"moetrace: {in_file}: kept a leading block of identical routes "
                   f"({sum(c['passes'] if isinstance(c, dict) else c[1] for c in wu['candidates'])} "
                   f"{wu.get('unit', 'steps')}) because of --keep-warmup", err=True)


def _echo_summary(summary: dict, tt, in_file: str, out) -> None:
    st, wu, n = tt.stats, tt.stats["warmup"], tt.records_written
    click.echo(f"{in_file} ({summary['format']}) -> {out}")
    click.echo(f"  read             {summary['rows_read']} {summary['rows_unit']}")
    if summary["prefill_excluded"]:
        click.echo(f"  prefill excluded {summary['prefill_excluded']} {st.get('prefill_unit', 'rows')}")
    if summary["placeholder_layers_dropped"]:
        click.echo(f"  placeholder layers dropped {summary['placeholder_layers_dropped']} (renumbered from 0)")
    click.echo(f"  warm-up dropped  {wu['steps_dropped']} {wu.get('unit', 'steps')} ({wu['rows_dropped']} "
               f"{wu.get('rows_unit', summary['rows_unit'])})")
    click.echo(f"  written          {n} records: {tt.n_steps} steps x {tt.n_layers} layers, k={tt.k}, "
               f"{tt.n_experts} experts")
    if tt.n_requests > 1 or "requests_from" in summary:
        click.echo(f"  requests         {tt.n_requests} (from {summary.get('requests_from', 'the records')}"
                   + (f"; {summary['segments']} batch segments" if summary.get("segments") else "") + ")")
    click.echo(f"  accepted tokens  {tt.accounting['accepted_tokens']}")
