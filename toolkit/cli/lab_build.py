"""`moetrace lab build`: a kernel tree (+ patches, + a config fragment) to a lab image."""

from __future__ import annotations

import sys
import time

import click

from moetrace.cli.common import emit_json


@click.command()
@click.argument("src", type=click.Path(exists=True))
@click.option("--patch", "patches", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A patch to apply (patch -p1, from the tree's top) for this image only; repeat for several, "
                   "applied in order.")
@click.option("--config-fragment", "fragments", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Config symbols (CONFIG_X=y, '# CONFIG_X is not set') merged after the lab's own; repeatable.")
@click.option("--jobs", "-j", type=click.IntRange(1), default=None, help="make -j.  [default: the CPUs here]")
@click.option("--cache", "cache", type=click.Path(file_okay=False), default=None,
              help="Where trees and images live.  [default: $MOETRACE_LAB_BUILD_CACHE, else "
                   "/var/cache/moetrace/lab-build as root, else ~/.cache/moetrace/lab-build]")
@click.option("--list", "list_only", is_flag=True, help="List the images in the cache (SRC is then ignored).")
@click.option("--json", "as_json", is_flag=True, help="Print build.json (with --list: every image's).")
def build(src, patches, fragments, jobs, cache, list_only, as_json):
    """Build SRC into a kernel image the lab boots, and print its path.

    \b
    SRC: a kernel tree (a git checkout: HEAD + uncommitted changes), a source tarball,
    or Debian's linux-source-*.deb. It is unpacked once into the cache; the image is
    the tree's defconfig + the lab's needs (BTF, BPF, kprobes, MGLRU, memcg, THP,
    swap, virtio, 9p, ext4, overlay built in: no modules) + your fragments, with
    CONFIG_LOCALVERSION=-mt<key>. Images are cached by the digest of source, patches
    and fragments; two images of one tree share its objects, so a second build that
    differs by a patch recompiles only what it touches (minutes, not the first
    build's hour on 2 cores). The image's dir holds bzImage, config, build.log and
    build.json (build time, image size, release, what the lab lacks in it).
    Exit status: 0 built (or cached), 1 failed or the image lacks what the lab needs.
    Examples:
      apt-get download linux-source-6.12=6.12.95-1~bpo12+1
      moetrace lab build linux-source-6.12_6.12.95-1~bpo12+1_all.deb
      moetrace lab build linux-source-6.12_*.deb --patch examples/mglru-6.8-priority.patch
      moetrace lab run --kernel "$(moetrace lab build ~/src/linux)" --out /tmp/l -- uname -r
    """
    from pathlib import Path

    from moetrace.lab import build as B

    if list_only:
        docs = B.list_images(Path(cache) if cache else None)
        if as_json:
            emit_json(docs)
        for d in ([] if as_json else docs):
            click.echo(f"{d['image']}\t{d.get('release')}\t{len(d.get('patches', []))} patch(es)\t"
                       f"{d.get('build_s')} s\t{d.get('source', {}).get('path')}")
        return
    say = lambda text: click.echo(f"lab build: {text}", err=True)  # noqa: E731
    res = B.build_image(src, list(patches), list(fragments), jobs=jobs, cache=Path(cache) if cache else None,
                        on_phase=say, on_step=_step_printer(say))
    d = res.doc
    if as_json:
        emit_json({**d, "image": str(res.image), "cached": res.cached})
    else:
        say(("cached: " if res.cached else f"built in {d['build_s']:.0f} s ({d['steps']} steps): ")
            + f"{d['release']}, {d['image_bytes'] >> 20} MiB")
        click.echo(str(res.image))
    for n in d.get("lacks") or []:
        say(f"lacks: {n}")
    sys.exit(1 if d.get("lacks") else 0)


def _step_printer(say):
    """A line every 30 s (steps, and the ETA when the step count of a whole build is known)."""
    t0 = time.monotonic()
    last = [t0]

    def on_step(n: int, total: int | None) -> None:
        now = time.monotonic()
        if now - last[0] < 30:
            return
        last[0] = now
        el = now - t0
        if total and 100 <= n < total:
            eta = el / n * (total - n)
            say(f"{n} of ~{total} steps, {el / 60:.0f} min elapsed, about {eta / 60:.0f} min to go")
        else:
            say(f"{n} steps, {el / 60:.0f} min elapsed")
    return on_step
