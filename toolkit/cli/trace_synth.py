"""`moetrace trace synth`: write a synthetic router trace in engine JSONL format."""

from __future__ import annotations

import click

from moetrace.inputs.geometry import PRESETS


@click.command("synth")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="Output JSONL. With --domains N and no --domain, a template with {domain} "
                   "(e.g. synth_{domain}.jsonl): all N domains are written.")
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)), default=None,
              help="Geometry preset (its locality profile is the default). Default kimi-k3 "
                   "unless --layers/--experts/--k are all given.")
@click.option("--layers", type=int, default=None, help="Routed layers (overrides the preset).")
@click.option("--experts", type=int, default=None, help="Experts per layer (overrides the preset).")
@click.option("--k", "k", type=int, default=None, help="Experts per token (overrides the preset).")
@click.option("--steps", type=int, default=300, show_default=True, help="Engine iterations.")
@click.option("--zipf", type=float, default=None,
              help="Mean Zipf-Mandelbrot exponent over layers (default: the preset profile's).")
@click.option("--zipf-spread", type=float, default=1.0, show_default=True,
              help="Scale of the per-layer exponent spread around the mean (0: every layer equal).")
@click.option("--reuse", "w1", type=float, default=None,
              help="W1 target: fraction of selections reusing the previous token's experts.")
@click.option("--reuse-8", "w8", type=float, default=None, help="W8 target (within 8 tokens).")
@click.option("--reuse-64", "w64", type=float, default=None, help="W64 target (within 64 tokens).")
@click.option("--drift", "drift_sigma", type=float, default=None,
              help="Popularity drift: std of the log-popularity factor (0: static popularity).")
@click.option("--drift-tokens", type=float, default=None, help="Correlation time of the drift in tokens.")
@click.option("--domains", type=int, default=1, show_default=True, help="Number of domains.")
@click.option("--domain", type=int, default=None, help="Generate this domain (0-based).")
@click.option("--domain-overlap", type=float, default=None,
              help="Fraction of the popularity ranking shared by all domains, in [0, 1].")
@click.option("--spec-accept-rate", type=float, default=0.0, show_default=True,
              help="Fraction of steps that are speculative accepts (one width-2k record per layer).")
@click.option("--spec-fallback-rate", type=float, default=0.0, show_default=True,
              help="Fraction of steps that are failed speculations (every layer twice: 2k, then k).")
@click.option("--popularity-from", type=click.Path(dir_okay=False), default=None,
              help="Counts JSON ({key: {layer: {expert: count}}}) to take popularity from.")
@click.option("--popularity-key", default=None, help="Key in --popularity-from, e.g. olmoe_counts_arxiv.")
@click.option("--prefill-records", type=int, default=0, show_default=True,
              help="Write this many \"phase\": \"prefill\" records first (the parser skips them).")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def synth(output, preset_name, layers, experts, k, steps, zipf, zipf_spread, w1, w8, w64, drift_sigma,
          drift_tokens, domains, domain, domain_overlap, spec_accept_rate, spec_fallback_rate,
          popularity_from, popularity_key, prefill_records, seed, as_json):
    """Generate a synthetic router trace with controlled locality.

    \b
    The model (moetrace.inputs.synth): per layer and token, k distinct experts drawn
    in recency classes (previous token / 2-8 / 9-64 tokens ago / older) with
    probabilities set by the W1/W8/W64 targets, each class weighted by a
    drifting Zipf-Mandelbrot popularity. Defaults per preset reproduce the
    paper's Table 1 (kimi-k3: slope ~1, W1 34%, W8 58%, W64 81%).

    \b
    Examples:
      moetrace trace synth --preset kimi-k3 -o kimi.jsonl
      moetrace trace synth --preset kimi-k3 --domains 4 -o kimi_{domain}.jsonl
      moetrace trace synth --preset olmoe -o o.jsonl \\
          --popularity-from olmoe_mixtral_expert_counts.json --popularity-key olmoe_counts_arxiv
    """
    from dataclasses import replace

    from moetrace.errors import UsageError
    from moetrace.inputs.geometry import Geometry, preset
    from moetrace.inputs.synth import PROFILES, SynthConfig, popularity_from_counts, write_synth
    from moetrace.cli.common import emit_json, progress

    if preset_name is None and None in (layers, experts, k):
        preset_name = "kimi-k3"
    base = preset(preset_name) if preset_name else None
    try:
        geo = Geometry(layers if layers is not None else base.n_layers,
                       experts if experts is not None else base.n_experts,
                       k if k is not None else base.k,
                       base.expert_bytes if base and experts is None else 0,
                       base.name if base and layers is None and experts is None and k is None else "custom")
    except AttributeError:
        raise UsageError("give --preset or all of --layers, --experts, --k") from None
    profile = PROFILES.get(preset_name) if preset_name else None
    popularity = None
    if popularity_from or popularity_key:
        if not (popularity_from and popularity_key):
            raise UsageError("--popularity-from and --popularity-key go together")
        if domains > 1 or domain:
            raise UsageError("with --popularity-from the domain comes from --popularity-key",
                             hint="drop --domains/--domain")
        popularity = popularity_from_counts(popularity_from, popularity_key, geo)
    if prefill_records < 0:
        raise UsageError("--prefill-records must be >= 0")
    if domain is None and domains > 1:
        if "{domain}" not in output:
            raise UsageError("--domains N without --domain writes every domain: put {domain} in -o",
                             hint="e.g. -o synth_{domain}.jsonl, or pick one with --domain i")
        todo = list(range(domains))
    else:
        todo = [domain or 0]
    cfg0 = SynthConfig(geo, steps=steps, zipf=zipf, zipf_spread=zipf_spread, w1=w1, w8=w8, w64=w64,
                       drift_sigma=drift_sigma, drift_tokens=drift_tokens, domains=domains,
                       domain_overlap=domain_overlap, spec_accept_rate=spec_accept_rate,
                       spec_fallback_rate=spec_fallback_rate, seed=seed, popularity=popularity,
                       profile=profile)
    summaries = []
    for d in todo:
        cfg = replace(cfg0, domain=d).resolved()
        path = output.replace("{domain}", str(d))
        with progress(length=steps, label=f"synth {path}") as bar:
            summaries.append(write_synth(cfg, path, prefill_records=prefill_records, on_step=bar.update))
    if as_json:
        emit_json(summaries if len(summaries) > 1 else summaries[0])
    else:
        for s in summaries:
            by = s["steps_by_kind"]
            click.echo(f"{s['path']}: {s['steps']} steps ({by['normal']} normal, {by['spec_accept']} spec "
                       f"accept, {by['spec_fallback']} fallback), {s['accepted_tokens']} accepted tokens, "
                       f"{s['records']} records" + (f" + {s['prefill_records']} prefill" if s['prefill_records'] else ""))
