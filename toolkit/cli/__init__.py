"""The `moetrace` command: a click group, one module per subcommand, heavy imports lazy.

Subcommands are registered by name -> "module:attribute" so `moetrace --help`
and `moetrace trace parse` import only what they run.
"""

from __future__ import annotations

import importlib
import sys

import click

from moetrace.version import __version__


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy:
            mod, attr = self.lazy[name].rsplit(":", 1)
            return getattr(importlib.import_module(mod, __name__), attr)
        return super().get_command(ctx, name)


@click.group(
    cls=LazyGroup,
    lazy={
        "trace": ".trace:trace",
        "plan": ".plan:plan",
        "sim": ".sim:sim",
        "pool": ".pool:pool",
        "model": ".model:model",
        "replay": ".replay:replay",
        "cell": ".cell:cell",
        "sweep": ".sweep:sweep",
        "demo": ".demo:demo",
        "doctor": ".doctor:doctor",
        "record": ".record:record",
        "report": ".report:report",
        "flame": ".report:flame",
        "check": ".check:check",
        "calibrate": ".calibrate:calibrate",
        "lab": ".lab:lab",
        "watch": ".watch:watch",
        "engine": ".engine:engine",
    },
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, prog_name="moetrace")
def cli() -> None:
    """moetrace: what does the kernel do with MoE expert weights served from the page cache?

    \b
    Offline (no root):  trace parse|import|synth|stats, plan compile|inspect, sim
    Pools:              pool create|verify|map (a model file's experts as extents)
    Models:             model synth (a tiny MoE GGUF that llama.cpp runs), model route (its routing per token)
    Engines (root):     engine cell|sweep (llama.cpp under a memory wall of C, recorded per token)
    Replay:             replay (also the `replay` command)
    Capacity (root):    cell, sweep
    Kernel:             doctor (what this kernel can trace, and why not)
    Recording (root):   record -- CMD (eBPF probes attached while CMD runs)
    Reports:            report RUN|CELL|SWEEP (HTML, Markdown, tables), flame RUN [--diff RUN]
    Regressions:        check BASE CAND (verdict; exit 0 same, 1 regression, 2 cannot compare, 3 inconclusive),
                        calibrate DIR (what check says of identical cells here)
    Live host (root):   watch (the pool's page-cache figures and alarms every interval)
    Kernel lab:         lab kernels (MGLRU, kprobes, BTF, signatures per kernel), lab setup
    End to end:         demo
    """


def main() -> None:
    """Console entry point: click handles MoetraceError (one line, no traceback)."""
    try:
        cli.main(prog_name="moetrace")
    except KeyboardInterrupt:
        sys.stderr.write("moetrace: interrupted\n")
        sys.exit(130)
