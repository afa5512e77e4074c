"""`moetrace lab`: other kernels for the same recording (the kernel lab). So far: `lab kernels`
(what each installed kernel offers moetrace) and `lab setup` (install the lab kernels)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

from moetrace.cli.common import emit_json


@click.group()
def lab() -> None:
    """The kernel lab: other kernels (Debian 6.1 and 6.12 with MGLRU) for the same recording.

    \b
    kernels   the kernels on this host: MGLRU built / default, kprobes, BTF, headers,
              and the signatures of the functions the mglru and mlock probes attach to
    setup     install QEMU, busybox and the two lab kernels with their headers (root)
    """


@lab.command()
@click.option("--json", "as_json", is_flag=True, help="Print every fact as JSON.")
def kernels(as_json):
    """List the running kernel and every /boot/vmlinuz-* with what matters to moetrace.

    \b
    Read without booting: the kernel config, BTF from the image (the vmlinux inside the
    bzImage; /sys/kernel/btf/vmlinux for the running kernel), /lib/modules/R/build.
    Example:
      moetrace lab kernels --json | jq '.[] | {release, mglru_default, functions}'
    """
    from moetrace.lab.kernels import LAB_FUNCTIONS, list_kernels

    ks = list_kernels()
    if as_json:
        emit_json([k.as_dict() for k in ks])
        return
    for k in ks:
        yn = lambda v: "?" if v is None else ("yes" if v else "no")  # noqa: E731
        click.echo(click.style(f"{k.release}", bold=True) + (" (running)" if k.running else ""))
        click.echo(f"  MGLRU built {yn(k.mglru_built)}, default {k.mglru_default or '-'}"
                   + (f", now {k.mglru_now}" if k.mglru_now else "")
                   + f"; kprobes {yn(k.kprobes)}; BTF {yn(k.btf)}; BPF {yn(k.bpf)}; headers {k.headers}")
        for f in LAB_FUNCTIONS:
            sig = k.functions.get(f) if k.functions else None
            if k.functions:
                click.echo(f"    {f:<22} {sig if sig else '-'}")
        for n in k.notes:
            click.echo(f"  note: {n}")


@lab.command()
def setup():
    """Install what the lab needs (root): qemu-system-x86, busybox-static, Debian's
    linux-image-6.1.0-47-amd64-unsigned + headers, and 6.12.95 from bookworm-backports (an
    apt source added, nothing else upgraded). Idempotent; `make setup` runs it."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "lab-setup.sh"
    if not script.is_file():
        raise click.ClickException(f"{script} is missing: run from a moetrace checkout")
    sys.exit(subprocess.run(["bash", str(script)]).returncode)
