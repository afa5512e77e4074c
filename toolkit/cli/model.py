"""`moetrace model`: model files for the engines (a tiny MoE GGUF that llama.cpp runs)."""

from __future__ import annotations

import click

from moetrace.cli import LazyGroup
from moetrace.cli.common import emit_json


@click.group(cls=LazyGroup)
def model() -> None:
    """Model files: `synth` writes a tiny random-weight MoE GGUF (qwen3moe) that llama.cpp runs;
    `moetrace pool map` gives any model file's experts their extents."""


@model.command()
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--layers", default=8, show_default=True, help="Transformer layers, each with routed experts.")
@click.option("--experts", default=64, show_default=True, help="Routed experts per layer.")
@click.option("--k", default=8, show_default=True, help="Experts per token (expert_used_count).")
@click.option("--n-embd", default=256, show_default=True, help="Hidden size.")
@click.option("--n-ff-exp", default=512, show_default=True, help="Each expert's FFN size.")
@click.option("--head-dim", default=64, show_default=True, help="Attention head size (heads = n_embd / head_dim).")
@click.option("--vocab", default=452, show_default=True, help="Vocabulary: 3 specials, 256 bytes, then pieces.")
@click.option("--dtype", type=click.Choice(["f16", "f32"]), default="f16", show_default=True,
              help="The weights' type (norms and the router are F32).")
@click.option("--alignment", default=4096, show_default=True,
              help="general.alignment: 4096 starts every tensor on a page; 32 (GGUF's default) lets experts "
                   "share pages.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights (the file is deterministic).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the model's map summary as JSON.")
def synth(out, layers, experts, k, n_embd, n_ff_exp, head_dim, vocab, dtype, alignment, seed, force, as_json):
    """Write a tiny MoE GGUF to OUT. The defaults are 388 MiB: 8 layers x 64 experts, each
    768 KiB (192 pages), top-8, F16, in ~7 s.

    \b
    Example:
      moetrace model synth /var/tmp/tiny-moe.gguf && moetrace pool map /var/tmp/tiny-moe.gguf
    """
    import os

    from moetrace.errors import UsageError
    from moetrace.inputs.modelmap import map_gguf
    from moetrace.inputs.modelsynth import ModelSpec, synth_model

    if os.path.exists(out) and not force:
        raise UsageError(f"{out} exists", hint="pass --force to replace it")
    spec = ModelSpec(layers=layers, experts=experts, k=k, n_embd=n_embd, n_ff_exp=n_ff_exp, head_dim=head_dim,
                     vocab=vocab, dtype=dtype, alignment=alignment, seed=seed)
    size = synth_model(out, spec)
    s = map_gguf(out).summary()
    if as_json:
        emit_json({"path": out, "bytes": size, **s})
        return
    click.echo(f"{out}: {size / 2**20:.1f} MiB, {s['arch']}, {s['layers']} layers x {s['experts']} experts, "
               f"top-{s['experts_per_token']}, {s['expert_bytes'][0] // 1024} KiB per expert in "
               f"{s['extents_per_expert'][0]} extents; {s['shared_pages']} pages shared between owners")


@model.command()
@click.argument("model_path", metavar="MODEL", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False), help="The router trace (JSON Lines).")
@click.option("-n", "--tokens", default=64, show_default=True, help="Tokens to generate (one decode each).")
@click.option("--prompt", default="the a b", show_default=True, help="The prompt (its routing: phase prefill).")
@click.option("--load-mode", type=click.Choice(["auto", "none", "mmap", "mlock", "mmap+mlock", "dio"]),
              default="mmap", show_default=True, help="How llama.cpp loads the weights (its -lm).")
@click.option("--threads", default=1, show_default=True, help="Decode threads.")
@click.option("--no-repack", is_flag=True, help="Keep quantized experts in the mapping (no repacking).")
@click.option("--advise", type=click.Choice(["normal", "random", "sequential"]), default=None,
              help="madvise the model's mappings after the load (random: no readahead on the fault path).")
@click.option("--cold", is_flag=True,
              help="Drop the model's pages from the page cache before every pass (process_madvise "
                   "MADV_PAGEOUT on the engine's mappings, then FADV_DONTNEED): each token reads what it routes.")
@click.option("--cgroup", type=click.Path(file_okay=False, exists=True), default=None,
              help="A cgroup directory the engine joins before it loads the model (this driver stays out).")
@click.option("--warmup-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="Under `moetrace record`: the first N tokens' epochs are phase warmup, the rest measured.")
@click.option("--json", "as_json", is_flag=True, help="Print the logger's summary as JSON.")
def route(model_path, out, tokens, prompt, load_mode, threads, no_repack, advise, cold, cgroup, warmup_tokens,
          as_json):
    """Generate TOKENS tokens from MODEL with llama.cpp (the set-up's engine, greedy, no warm-up)
    and write each decode's routing as moetrace's router trace: per (step, layer) the experts in
    the router's rank order, with the decode's start and duration (`t_ns`, `decode_ns`). `trace
    stats`, `plan compile` and `sim` read it as they read any trace.

    \b
    Under `moetrace record` each pass is an epoch of its own (load, prefill, then one per token:
    phase warmup for the first --warmup-tokens, then measured): the run's expert_epochs table is
    per token.

    \b
    Examples:
      moetrace model synth m.gguf && moetrace model route m.gguf -o r.jsonl -n 64 && moetrace trace stats r.jsonl
      moetrace record --pool m.gguf --probes pagecache -- moetrace model route m.gguf -o r.jsonl --cold --advise random
    """
    from moetrace.engines.llamacpp import log_routing

    s = log_routing(model_path, out, cold=cold, cgroup=cgroup, warmup_tokens=warmup_tokens, tokens=tokens, prompt=prompt, load_mode=load_mode, threads=threads,
                    repack=not no_repack, advise=advise)
    if as_json:
        emit_json({"out": out, **s})
        return
    ms = s["eval_ms"] / s["n_eval"] if s.get("n_eval") else float("nan")
    click.echo(f"{out}: {s['tokens']} tokens x {s['layers']} layers routed ({s['prompt_tokens']} prompt tokens "
               f"as prefill), {ms:.2f} ms per token, load mode {s['load_mode']}")
