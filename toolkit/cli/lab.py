"""`moetrace lab`: other kernels for the same recording (the kernel lab). So far: `lab kernels`
(what each installed kernel offers moetrace) and `lab setup` (install the lab kernels)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

from moetrace.cli.common import emit_json, executor_options, slurm_params
from moetrace.cli.lab_build import build as lab_build


@click.group()
def lab() -> None:
    """The kernel lab: other kernels (Debian 6.1 and 6.12 with MGLRU) for the same recording.

    \b
    kernels   the kernels on this host: MGLRU built / default, kprobes, BTF, headers,
              and the signatures of the functions the mglru and mlock probes attach to
    setup     install QEMU, busybox and the two lab kernels with their headers (root)
    run       boot a kernel under QEMU, run one command in it, bring back what it wrote
    matrix    the paper's §5 matrix: cells over kernels x MGLRU x mechanisms x capacities,
              each in a fresh boot, resumable
    sample    run a command while sampling vmstat, MemFree, lru_gen and the watermarks
    build     a kernel tree (+ patches, + a config fragment) to an image the lab boots
    """


lab.add_command(lab_build)


@lab.command()
@click.argument("images", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--modules", "modules", type=click.Path(exists=True, file_okay=False), default=None,
              help="With IMAGE: its modules (the INSTALL_MOD_PATH of `make modules_install`).")
@click.option("--json", "as_json", is_flag=True, help="Print every fact as JSON.")
def kernels(images, modules, as_json):
    """List the running kernel and every /boot/vmlinuz-* with what matters to moetrace, or
    the kernel IMAGEs given (a bzImage you built: its release from the image's header, its
    config beside it or in its tree), each with what the lab needs and it lacks.

    \b
    Read without booting: the kernel config, BTF from the image (the vmlinux inside the
    bzImage; /sys/kernel/btf/vmlinux for the running kernel), /lib/modules/R/build.
    Examples:
      moetrace lab kernels --json | jq '.[] | {release, mglru_default, functions, lacks}'
      moetrace lab kernels linux/arch/x86/boot/bzImage --modules /var/tmp/mods
    """
    from moetrace.lab.kernels import LAB_FUNCTIONS, kernel_facts, list_kernels
    from moetrace.lab.run import image_release

    if images:
        ks = [kernel_facts(image_release(i) or Path(i).name, image=i, modules=modules) for i in images]
    else:
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
        for n in k.lacks:
            click.echo(f"  lacks: {n}")


@lab.command()
def setup():
    """Install what the lab needs (root): qemu-system-x86, busybox-static, Debian's
    linux-image-6.1.0-47-amd64-unsigned + headers, 6.12.95 from bookworm-backports (an
    apt source added, nothing else upgraded), and the newest kernel Debian serves (sid, else
    trixie-backports) unpacked under /var/lib/moetrace/lab, never installed. Idempotent;
    `make setup` runs it."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "lab-setup.sh"
    if not script.is_file():
        raise click.ClickException(f"{script} is missing: run from a moetrace checkout")
    sys.exit(subprocess.run(["bash", str(script)]).returncode)


@lab.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--kernel", required=True, help="6.1, 6.12, newest (the newest Debian kernel the lab set-up unpacked; or its version, 7.2), a release under /boot, or a kernel image path.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="The lab directory: the guest's only writable place (/tmp/lab inside); lab.json, stdout, "
                   "stderr land here.")
@click.option("--memory", default="2G", show_default=True, help="Guest memory (QEMU -m).")
@click.option("--cpus", type=click.IntRange(1), default=None,
              help="Guest vCPUs.  [default: 2 under KVM, 1 under TCG, whose vCPUs all run on one host "
                   "thread: a second one only slows the guest]")
@click.option("--mglru", type=click.Choice(["on", "off", "keep"]), default="keep", show_default=True,
              help="Switch MGLRU in the guest before the command (keep: the kernel's default).")
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True,
              help="Seconds before a running guest is killed (reported, exit 1).")
@click.option("--pool", "pool", type=click.Path(exists=True, file_okay=False),
              help="A pool directory to put on a virtio-blk ext4 image, mounted read-only at the same path in "
                   "the guest (its reads then go through the guest's page cache and block layer, not 9p).")
@click.option("--memcg", default=None, metavar="SIZE",
              help="Make a cgroup v2 memory cgroup /sys/fs/cgroup/lab with this memory.max (e.g. 80M) in the "
                   "guest; its path is in $MOETRACE_LAB_CGROUP (for record --cgroup).")
@click.option("--accel", type=click.Choice(["auto", "kvm", "tcg"]), default="auto", show_default=True,
              help="KVM, TCG (emulated: every vCPU on one host thread, ~20x slower, works everywhere), or auto: KVM "
                   "when /dev/kvm opens, and TCG when it cannot or the guest does not reach COMMAND in 20 s "
                   "(a nested KVM hangs stock kernels); a KVM that hung is remembered per kernel pair.")
@click.option("--modules", "modules", type=click.Path(exists=True, file_okay=False), default=None,
              help="The guest's modules for a kernel image of your own: the INSTALL_MOD_PATH of `make "
                   "modules_install` (or a directory holding modules.dep). Not needed when the image builds "
                   "virtio, 9p, overlay and ext4 in.")
@click.option("--json", "as_json", is_flag=True, help="Print lab.json.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(kernel, out_dir, memory, cpus, mglru, timeout_s, pool, memcg, accel, modules, as_json, command):
    """Boot KERNEL under QEMU (KVM or TCG) with this host's root read-only, run COMMAND in the guest
    (cwd /tmp/lab = --out), power off, and exit with COMMAND's status.

    \b
    The guest mounts the host root over 9p read-only, a tmpfs over /tmp and --out at
    /tmp/lab (writable); lab.json records the guest's kernel release, MGLRU state, exit
    status and the boot-to-command time. COMMAND's stdout and stderr land in --out.
    Examples:
      moetrace lab run --kernel 6.12 --out lab1 -- moetrace doctor --json
      moetrace lab run --kernel 6.12 --mglru on --pool /var/tmp/pool --memcg 80M --out lab2 -- \\
        sh -c 'moetrace record --out /tmp/lab/run --cgroup $MOETRACE_LAB_CGROUP \\
               --probes pagecache,reclaim,mglru -- replay plan.bin --pool /var/tmp/pool --mode mmap'
      # a kernel you built (its release read from the image; its config beside it or in its tree)
      make -C linux INSTALL_MOD_PATH=/var/tmp/mods modules_install
      moetrace lab run --kernel linux/arch/x86/boot/bzImage --modules /var/tmp/mods --out lab3 -- uname -r
    """
    from moetrace.lab.run import run_in_guest

    res = run_in_guest(kernel, list(command), Path(out_dir), memory=memory, cpus=cpus, mglru=mglru,
                       timeout_s=timeout_s, pool=Path(pool) if pool else None, memcg=memcg, accel=accel,
                       modules=modules)
    if as_json:
        emit_json(res.doc)
    else:
        d = res.doc
        click.echo(f"lab: {d['kernel']} (MGLRU {d.get('mglru')}), command started {d.get('cmd_start_uptime_s')} s "
                   f"after boot, exit {res.exit_status}; host wall {d['host_wall_s']:.1f} s; {out_dir}/lab.json",
                   err=True)
    sys.exit(res.exit_status if isinstance(res.exit_status, int) else 1)


@lab.command("guest-cell", hidden=True,
             context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--settings", "settings", required=True, metavar="JSON",
              help="The cell's guest settings (moetrace.lab.guest.REQUEST_KEYS), as `lab matrix` writes them.")
@click.option("--dir", "lab_dir", default=".", show_default=True, type=click.Path(file_okay=False),
              help="The cell's lab directory (guest_settings.json and bites/ land here).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def guest_cell(settings, lab_dir, command):
    """Inside a lab guest, around a matrix cell: apply the cell's guest settings (THP, swap,
    min_ttl_ms, read_ahead_kb, the watermarks), start the sampler and the bites controller,
    run COMMAND (`moetrace cell ...`), then stop and undo everything and write
    guest_settings.json. Exits with COMMAND's status; 4 when a setting could not be applied.
    (`lab matrix` runs it; see moetrace.lab.guest.)

    \b
    Example (as the matrix writes it):
      moetrace lab guest-cell --dir /tmp/lab --settings '{"capacity_bytes": 335544320,
        "bite_fraction": 0.26, "bites_bytes": 87241523, "memcg": "/moetrace-cell"}' -- moetrace cell ...
    """
    from moetrace.lab.guest import parse_request, run_guest_cell

    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    sys.exit(run_guest_cell(parse_request(settings), argv, Path(lab_dir)))


@lab.command()
@click.argument("spec_path", metavar="SPEC.toml", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="The matrix directory (new or empty; with --resume, the one a matrix was started in).")
@click.option("--resume", is_flag=True, help="Continue the matrix in --out: finished cells are kept, a cell "
                                             "stopped part-way is run again.")
@click.option("--dry-run", is_flag=True, help="List the cells and each guest's memory; boot nothing.")
@click.option("--report", "report_only", is_flag=True,
              help="Boot nothing: write --out's tables and Fig. 3 from the cells finished so far (also while "
                   "the matrix runs elsewhere) and print the summary.")
@click.option("--json", "as_json", is_flag=True, help="Print the finished cells' rows and the summary as JSON "
                                                      "at the end.")
@executor_options(stage_pool=False)
def matrix(spec_path, out_dir, resume, dry_run, report_only, as_json, executor, slurm_partition, slurm_time,
           slurm_exclusive, slurm_options):
    """Run the §5 matrix of SPEC.toml: every (kernel, MGLRU) condition's cells, each
    Algorithm 1 recorded with the probes in a fresh boot (never a runtime MGLRU toggle),
    in a seeded random order within the condition.

    \b
    SPEC.toml:
      kernels = ["6.1", "6.12", "newest"]    # lab run --kernel names or image paths
      mglru = ["on", "off"]
      mechanisms = ["cgroup", "balloon:0.74", "balloon:0.81", "vm-memory"]
      capacities = ["192MiB", "320MiB"]
      plan = "plan.bin"                      # relative to the spec's directory
      pool = "/var/tmp/pool"
      repeats = 3                            # optional from here
      mode = "pagecache"                     # or mmap
      seed = 1
      headroom = "64MiB"; warmup = 1
      guest_base = "160MiB"                  # a guest's own need beside C + headroom
      cgroup_guest_memory = "2GiB"; timeout = 3600
      kernel_modules = {"/src/linux/arch/x86/boot/bzImage" = "/var/tmp/mods"}  # own builds
      # the guest's dimensions: a value, or a list crossed like kernels (absent: as before)
      cpus = [1, 2]                          # vCPUs (default: 1 under TCG)
      readers = 2                            # replay threads (its older name: threads)
      bite_fraction = [0.02, 0.26]           # target sum of high watermarks / C,
                                             #   or min_free_kbytes = 65536 (not both)
      window = ["8min", 2]                   # a time, or measured passes (passes = 2)
      pool_layout = ["expert", "layer"]      # a file per expert, or per layer
      read_ahead_kb = 128; min_ttl_ms = 0; swap = "512MiB"; thp = "off"
      tcg_thread = "single"                  # or multi (a value only)
    Mechanisms: cgroup (a v2 wall of C + headroom in a guest of cgroup_guest_memory),
    balloon:F (a guest sized so that the balloon locks about F of its memory and leaves
    C + headroom), vm-memory (the guest's RAM is C + headroom + guest_base, no limit
    inside: the paper's mem= boot); balloon:F and vm-memory take +lru_gen-bites:B, the
    eviction controller (bites of B x C, or of a size: balloon:0.81+lru_gen-bites:5MiB;
    MGLRU on only). Each cell lands in
    OUT/cells/<kernel>-mglru-<on|off>/<mechanism>-<C>[-<dims>]-r<i>/ (lab.json,
    guest_settings.json, the cell in cell/, done.json last; <dims>: the values of the
    dimensions that vary); OUT/matrix_cells.csv has a row per finished cell. Each cell is a
    job (OUT/jobs/<condition>__<cell>.json): --executor local boots its guest from a
    subprocess here, one at a time; --executor slurm submits every cell as a Slurm job (a
    node alone each; the nodes need the lab's kernels, QEMU and the spec's paths). A
    failed job is resubmitted once. Ctrl-C stops after cancelling the running cells'
    jobs (each cleans its guest up); --resume continues.
    Example:
      moetrace lab matrix examples/matrix.toml --out /var/tmp/matrix
      moetrace lab matrix examples/matrix.toml --out /shared/matrix --executor slurm --slurm-time 3:00:00
    """
    from moetrace.lab import matrix as M

    spec = M.load_spec(spec_path)
    cells = spec.cells()
    if dry_run:
        for c in cells:
            click.echo(f"{c.rel_dir}\tguest memory {M.guest_memory(c, spec) >> 20} MiB")
        n = len(spec.kernels) * len(spec.mglru)
        click.echo(f"{len(cells)} cells in {n} condition{'s' if n != 1 else ''}", err=True)
        return
    say = lambda text: click.echo(f"matrix: {text}", err=True)  # noqa: E731
    if report_only:
        res = M.matrix_tables(out_dir, spec)
    else:
        res = M.run_matrix(out_dir, spec, resume, executor, on_event=say, slurm=slurm_params(
            slurm_partition, slurm_time, slurm_exclusive, slurm_options, spec.timeout + 600, executor))
        if res.stopped is not None:
            say(f"{res.stopped}; --resume continues")
            sys.exit(res.stopped.exit_code)
    if as_json:
        emit_json(res.to_dict())
        return
    from moetrace.reports.matrix import summary_markdown

    kept = sum(1 for r in res.rows if r.get("retained"))
    if res.summary:
        click.echo(summary_markdown(res.summary), nl=False)
    say(f"{len(res.rows)} of {res.n_cells} cells finished, {kept} retained; {res.table} (summary: "
        "matrix_summary.md, Fig. 3: matrix_fig3.png)")


@lab.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="The sampler directory (created): vmstat.csv, memfree.csv, lru_gen.csv, zoneinfo.json, "
                   "sampler.json.")
@click.option("--vmstat-hz", type=click.FloatRange(0, 1000), default=1.0, show_default=True,
              help="/proc/vmstat samples per second (0: off).")
@click.option("--memfree-hz", type=click.FloatRange(0, 1000), default=10.0, show_default=True,
              help="MemFree / Cached samples per second (0: off).")
@click.option("--lru-gen-hz", type=click.FloatRange(0, 1000), default=1.0, show_default=True,
              help="<debugfs>/lru_gen samples per second (0: off; mounts debugfs when absent, as root).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def sample(out_dir, vmstat_hz, memfree_hz, lru_gen_hz, command):
    """Run COMMAND while sampling what the kernel's reclaim does: /proc/vmstat split kswapd /
    direct, MemFree, MGLRU's generations (lru_gen) and the zones' watermarks (Σhigh). Exits
    with COMMAND's status.

    \b
    For a lab cell (the guest is slow under TCG: the sampler keeps its files open and
    reads them with pread; sampler.json says the rates it achieved and its CPU time).
    Example:
      moetrace lab run --kernel 6.12 --out lab1 -- \\
        moetrace lab sample --out /tmp/lab/sampler -- sh -c 'cat /var/tmp/pool/* > /dev/null'
    """
    from moetrace.lab.sampler import run_sampled

    sys.exit(run_sampled(out_dir, list(command), vmstat_hz=vmstat_hz, memfree_hz=memfree_hz, lru_gen_hz=lru_gen_hz))
