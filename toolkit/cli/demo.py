"""`moetrace demo`: the whole pipeline on an embedded default, end to end."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
from pathlib import Path

import click

from moetrace.reports.demo import (demo_markdown, fmt_gb, fmt_ratio, locality_headline, recorded_summary,
                                   report_markdown, sim_table, watch_summary)


def _run(args: list[str], json_out: Path | None = None) -> dict | None:
    """Run one moetrace command in-process; with json_out, keep its --json output."""
    from moetrace.cli import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cli.main(args=[str(a) for a in args], prog_name="moetrace", standalone_mode=False)
    if json_out is None:
        return None
    text = buf.getvalue()
    json_out.write_text(text)
    return json.loads(text)


@click.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="demo-out", show_default=True,
              help="Directory for everything the demo writes (created; files in it are replaced).")
@click.option("--preset", default="kimi-k3", show_default=True,
              help="Geometry preset of the generated trace.")
@click.option("--steps", default=300, show_default=True, help="Engine iterations to generate.")
@click.option("--seed", default=0, show_default=True, help="Random seed of the generator.")
@click.option("--capacity/--no-capacity", default=True, show_default=True,
              help="Run step 6 (pool + capacity sweep under a memory limit; needs root).")
@click.option("--engine/--no-engine", "engine", default=True, show_default=True,
              help="Run step 8 (llama.cpp on a tiny MoE under a memory limit; needs root and the set-up's engine).")
def demo(out_dir, preset, steps, seed, capacity, engine):
    """Run the pipeline on a generated trace and write every artifact to --out.

    \b
    1. trace synth    a router trace with the paper's locality and speculation
    2. trace parse    the typed table and its accounting
    3. trace stats    Zipf slope, W1/W8/W64 reuse, concentration, coverage
    4. plan compile   plan.bin with oracle prefetch hints; plan inspect
    5. sim            LRU / LFU / static / Belady under fair windows -> sim.png
    6. pool create + sweep --record (root): a 256 MiB pool and four capacity
       cells under a cgroup memory limit (192, 96, 48, 16 MiB: a simulated LRU
       hit rate of 92 % down to 13 %), each recorded with the eBPF probes ->
       sweep/cells/*/run/, and `moetrace watch` of one more replay at 48 MiB
       -> watch.jsonl
    7. report: `moetrace report` of the sweep -> report/report.html (findings
       first, Table 2, Fig. 2, the cells, per-expert amplification, hit path,
       age, reclaim, flame graph, timeline; every cell's report under cells/)
    8. engine (root): llama.cpp on a synthesized MoE under a wall of half its
       expert pool, stock vs readahead off -> engine/report/report.html
    Everything lands in --out (JSON beside each step, REPORT.md last).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    say = lambda s: click.echo(click.style(s, bold=True))  # noqa: E731

    n = (7 if capacity else 5) + (1 if engine else 0)
    trace = out / "trace.jsonl"
    say(f"[1/{n}] trace synth --preset {preset} --steps {steps}")
    syn = _run(["trace", "synth", "--preset", preset, "--steps", steps, "--seed", seed,
                "--spec-accept-rate", "0.1", "--spec-fallback-rate", "0.05", "--prefill-records", 4,
                "-o", trace, "--json"], out / "synth.json")
    click.echo(f"      {trace} ({os.path.getsize(trace) / 1e6:.1f} MB)")

    say(f"[2/{n}] trace parse")
    acc = _run(["trace", "parse", trace, "--geometry", preset, "-o", out / "typed.parquet", "--json"],
               out / "parse.json")
    sk = acc["steps_by_kind"]
    click.echo(f"      {acc['steps']} steps: {sk['normal']} normal, {sk['spec_accept']} spec_accept, "
               f"{sk['spec_fallback']} spec_fallback -> {acc['accepted_tokens']} accepted tokens")

    say(f"[3/{n}] trace stats")
    st = _run(["trace", "stats", out / "typed.parquet", "--json"], out / "stats.json")
    summary = locality_headline(st)
    click.echo("      " + ", ".join(f"{k} {v}" for k, v in summary.items()))

    say(f"[4/{n}] plan compile --hints oracle; plan inspect")
    plan = out / "plan.bin"
    _run(["plan", "compile", out / "typed.parquet", "--geometry", preset, "--hints", "oracle", "-o", plan,
          "--json"], out / "plan-compile.json")
    ins = _run(["plan", "inspect", plan, "--json"], out / "plan.json")
    click.echo(f"      {plan}: {ins.get('iterations')} iterations, {ins.get('passes')} passes, "
               f"{ins.get('reads')} reads, {fmt_gb(ins.get('logical_bytes'))} logical")

    say(f"[5/{n}] sim (fair windows: warm 60%, score 40%)")
    sim = _run(["sim", plan, "--budgets", "8,16,32,64", "--plot", out / "sim.png", "--json"], out / "sim.json")
    rows = sim["rows"] if isinstance(sim, dict) and "rows" in sim else sim
    table = sim_table(rows)
    click.echo(table)

    sweep_md = ""
    report_doc = None
    if capacity:
        say(f"[6/{n}] pool create + sweep under a cgroup memory limit")
        sweep_md = _capacity_step(out, seed)
        if (out / "sweep" / "results.parquet").is_file():
            say(f"[7/{n}] report: findings, Table 2, Fig. 2, amplification, hit path, age, reclaim, flame graph")
            report_doc = _report_step(out)
            sweep_md += report_markdown(out)

    if engine:
        say(f"[{n}/{n}] engine: llama.cpp on a tiny MoE under a wall of half its expert pool, stock vs readahead off")
        sweep_md += _engine_step(out)

    (out / "REPORT.md").write_text(demo_markdown(f"moetrace demo ({preset}, {steps} steps, seed {seed})", acc,
                                                 summary, ins, table, sweep_md))
    click.echo(f"done in {time.monotonic() - t0:.1f} s; artifacts in {out}/ (REPORT.md, sim.png, plan.bin, *.json)")
    if report_doc is not None:
        click.echo(f"report: {report_doc['html']}")


def _report_step(out: Path) -> dict:
    """`moetrace report` of the recorded sweep into OUT/report."""
    from moetrace.reports.report import build_report

    shutil.rmtree(out / "report", ignore_errors=True)
    doc = build_report(out / "sweep", out / "report")
    s = doc["summary"]
    al = s.get("alarm") or {}
    click.echo(f"      {doc['html']} (cell {s.get('detail_cell')}: amplification {fmt_ratio(s.get('amplification'))}, "
               f"scan-to-steal {fmt_ratio(al.get('scan_to_steal'))}, alarm {al.get('alarm')})")
    return doc






def _engine_step(out: Path) -> str:
    """Step 8: the tiny MoE (`model synth`), llama.cpp decoding it under a cgroup wall of half its
    expert pool with the stock loader and with readahead off (`engine sweep`, one cell each), the
    engine report; its findings as REPORT.md's section."""
    from moetrace.engines.llamacpp import find_engine
    from moetrace.reports.report import build_report

    if os.geteuid() != 0:
        click.echo("      skipped: engine cells need root (memory cgroups); run as root, or pass --no-engine")
        return "\n## Engine\n\nSkipped: not root.\n"
    if find_engine() is None:
        click.echo("      skipped: no llama.cpp unpacked (bash scripts/engine-setup.sh; the set-up runs it)")
        return "\n## Engine\n\nSkipped: no engine (scripts/engine-setup.sh).\n"
    t0 = time.monotonic()
    work = out / "engine"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    model = work / "tiny.gguf"
    _run(["model", "synth", model, "--json"], work / "synth.json")
    _engine_sweep(work, model)
    doc = build_report(work / "sweep", work / "report")
    model.unlink(missing_ok=True)  # 388 MiB of test data: keep the results, not the model
    for f in doc["findings"]:
        click.echo(f"      {f}")
    click.echo(f"      {doc['html']} ({time.monotonic() - t0:.0f} s with the model's synthesis)")
    return "\n## Engine: llama.cpp under a wall of half its expert pool\n\n" + "\n".join(
        f"- {f}" for f in doc["findings"]) + "\n\n![engine](engine/sweep/engine_fig.png)\n"


def _engine_sweep(work: Path, model: Path):
    """`engine sweep` of the two loaders at 192 MiB, one cell each (exit 3 when one is not retained:
    the report says why)."""
    from moetrace.capacity.enginecell import EngineCellSpec
    from moetrace.capacity.enginesweep import run_engine_sweep

    base = EngineCellSpec(model=str(model), capacity_bytes=192 << 20, tokens=32, warmup_tokens=8, name="demo-engine")
    return run_engine_sweep(base, [192 << 20], 1, ["stock", "random"], work / "sweep",
                            say=lambda s: click.echo(f"      {s}"))


def _capacity_step(out: Path, seed: int) -> str:
    """Step 6: a 256 MiB pool (32 layers x 128 experts x 64 KiB), a 60-step plan for it whose
    simulated LRU hit rate bends from 13 % to 92 % over the four capacities, and a sweep of them
    under the cgroup wall. Returns the report section."""
    if os.geteuid() != 0:
        click.echo("      skipped: capacity cells need root (memory cgroups, drop_caches); run as root, "
                   "or pass --no-capacity")
        return "\n## Capacity sweep\n\nSkipped: not root.\n"
    work = out / "capacity"
    work.mkdir(exist_ok=True)
    pool = work / "pool"
    geo = ["--layers", 32, "--experts", 128, "--k", 8]
    _run(["pool", "create", pool, *geo, "--expert-bytes", "64KiB", "--force", "--json"], work / "pool.json")
    # reuse of the previous token's experts 20 %, within 8 tokens 60 %, within 64 tokens 85 %: the LRU
    # hit rate climbs with C (13 % at 16 MiB, 49 % at 48, 74 % at 96, 92 % at 192) instead of jumping
    # from all-miss to all-hit
    _run(["trace", "synth", *geo, "--steps", 60, "--reuse", 0.2, "--reuse-8", 0.6, "--reuse-64", 0.85,
          "--seed", seed, "-o", work / "trace.jsonl", "--json"], work / "synth.json")
    plan = work / "plan.bin"
    _run(["plan", "compile", work / "trace.jsonl", *geo, "--expert-bytes", "64KiB", "-o", plan, "--json"],
         work / "plan-compile.json")
    click.echo(f"      pool {pool}: 32 layers x 128 experts x 64 KiB = 256 MiB; plan of 60 iterations")
    shutil.rmtree(out / "sweep", ignore_errors=True)  # a fresh sweep each demo (one into its directory resumes)
    res = _run(["sweep", "--plan", plan, "--pool", pool, "--capacities", "192MiB,96MiB,48MiB,16MiB", "--repeats", 1,
                # headroom: the replay's own memory and the ~26 MiB of library files it reads, charged to
                # the same scope (the effective capacity column of Table 2 says what the pool had)
                "--mechanism", "cgroup", "--headroom", "64MiB", "--record", "--out", out / "sweep", "--json"],
               work / "sweep.json")
    rows = res.get("capacity") or res.get("table") or []
    lines = ["      C         LRU hits  iteration   device/iter   miss/iter   amp"]
    for r in rows:
        amp, hr = r.get("amplification"), r.get("lru_hit_rate")
        lines.append(f"      {r['capacity_bytes'] / 2**20:>5.0f} MiB {'NA' if hr is None else f'{100 * hr:.0f} %':>8} "
                     f"{r['iteration_time_median_ns'] / 1e6:>8.1f} ms "
                     f"{(r['device_bytes_per_iteration'] or 0) / 2**20:>9.1f} MiB {(r['miss_bytes_per_iteration'] or 0) / 2**20:>7.1f} MiB "
                     f"{'NA' if amp is None else f'{amp:.2f}':>5}")
    text = "\n".join(lines) + "\n" + recorded_summary(out / "sweep")
    click.echo(text)
    try:
        watched = _watch_step(out, pool, plan)
    finally:
        shutil.rmtree(pool, ignore_errors=True)  # 256 MiB of test data: keep the results, not the pool
    return ("\n## Capacity sweep (cgroup wall)\n\n```\n" + text + "\n```\n\n![capacity](sweep/fig2.png)\n" + watched)


def _watch_step(out: Path, pool: Path, plan: Path) -> str:
    """`moetrace watch` on one more replay of the smallest cell's capacity (48 MiB + 64 MiB of
    headroom behind a cgroup wall): its intervals in OUT/watch.jsonl, summed; the section."""
    import signal
    import subprocess
    import sys

    from moetrace.capacity.scope import Scope, remove_stale_scopes

    click.echo(click.style("      watch: the same pool at 48 MiB, live (moetrace watch --json 0.5)", bold=True))
    remove_stale_scopes("demo-watch")
    scope = Scope("demo-watch").create((48 + 64) << 20)
    w = None
    try:
        with open(out / "watch.jsonl", "w") as fh, open(out / "watch.log", "w") as log:
            w = subprocess.Popen([sys.executable, "-m", "moetrace.cli", "watch", "--pool", str(pool), "--cgroup",
                                  str(scope.path), "--json", "0.5"], stdout=fh, stderr=subprocess.PIPE, text=True)
            for line in w.stderr:
                log.write(line)
                if "watching every" in line:
                    break
            subprocess.run(["sh", "-c", f'echo $$ > {scope.path}/cgroup.procs && exec "$@"', "sh", sys.executable,
                            "-m", "moetrace.cli.replay", str(plan), "--pool", str(pool), "--warmup", "0",
                            "--passes", "2", "--run-dir", str(out / "capacity" / "watched-replay")],
                           check=True, stdout=subprocess.DEVNULL)
            time.sleep(1.0)  # one more interval: the last bios read
            w.send_signal(signal.SIGTERM)
            log.write(w.stderr.read())
            w.wait(60)
    finally:
        if w is not None and w.poll() is None:
            w.kill()
            w.wait()
        scope.remove(kill=True)
    line, section = watch_summary([json.loads(x) for x in (out / "watch.jsonl").read_text().splitlines() if x.strip()])
    click.echo(line)
    return section










