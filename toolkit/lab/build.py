"""`moetrace lab build`: a kernel developer's tree to a lab image (README.md, "Kernel lab").

SRC is a kernel tree (a git checkout: its HEAD and uncommitted changes; any other directory:
its files), a source tarball (``linux-*.tar.xz``) or Debian's ``linux-source-*`` package. It is
unpacked once into a work tree in the build cache, keyed by its digest. Each build:

1. applies the ``--patch`` files in order (``patch -p1``), recording that it did in the tree's
   tree.json before it starts, so a build stopped half-way reverts them at the next one;
2. configures: the tree's ``defconfig``, then :data:`LAB_FRAGMENT` (what the lab needs: BTF,
   BPF, kprobes, MGLRU, memcg, virtio, 9p, ext4 and overlay built in, so the guest needs no
   modules), then the user's ``--config-fragment`` files, merged with the tree's own
   ``scripts/kconfig/merge_config.sh`` and checked symbol by symbol (one that did not stick is
   an error naming it); CONFIG_LOCALVERSION names the image (``-mt<key>``);
3. runs ``make bzImage`` (its output in build.log, progress and an ETA from the last build's
   step count), copies ``bzImage`` and its ``config`` into ``CACHE/images/<key>/`` with
   build.json, and reverts the patches.

The key is a digest of the source, the patches, the fragments and :data:`RECIPE`: the same
inputs are built once (a cache hit returns at once). Two images of one tree share its objects,
so a second build that differs by a patch recompiles only what the patch touches.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moetrace.errors import InputError, MoetraceError, UsageError
from moetrace.jsonutil import write_json
from moetrace.kernel.kconfig import parse_config

BUILD_SCHEMA = "moetrace.lab-build/1"
#: bump when the way an image is made changes (the key then changes: nothing stale is reused)
RECIPE = 1
#: the lab's needs on top of the tree's defconfig (x86_64). The memory-management choices follow
#: Debian's 6.12 config (/boot/config-6.12.95+deb12-amd64): HZ 250, voluntary preemption, THP
#: always, MGLRU on with its page-table walks, so an image of Debian's tree behaves like the
#: packaged kernel where the lab measures.
LAB_FRAGMENT = """\
CONFIG_LOCALVERSION_AUTO=n
CONFIG_DEBUG_INFO=y
CONFIG_DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT=y
CONFIG_DEBUG_INFO_REDUCED=n
CONFIG_DEBUG_INFO_BTF=y
CONFIG_BPF=y
CONFIG_BPF_SYSCALL=y
CONFIG_BPF_JIT=y
CONFIG_BPF_EVENTS=y
CONFIG_PERF_EVENTS=y
CONFIG_KPROBES=y
CONFIG_KPROBE_EVENTS=y
CONFIG_FTRACE=y
CONFIG_FUNCTION_TRACER=y
CONFIG_FTRACE_SYSCALLS=y
CONFIG_UPROBES=y
CONFIG_UPROBE_EVENTS=y
CONFIG_DYNAMIC_FTRACE=y
CONFIG_DEBUG_FS=y
CONFIG_MEMCG=y
CONFIG_CGROUPS=y
CONFIG_PSI=y
CONFIG_SWAP=y
CONFIG_TRANSPARENT_HUGEPAGE=y
CONFIG_TRANSPARENT_HUGEPAGE_ALWAYS=y
CONFIG_LRU_GEN=y
CONFIG_LRU_GEN_ENABLED=y
CONFIG_HZ_250=y
CONFIG_PREEMPT_VOLUNTARY=y
CONFIG_VIRTIO=y
CONFIG_VIRTIO_PCI=y
CONFIG_VIRTIO_BLK=y
CONFIG_NET_9P=y
CONFIG_NET_9P_VIRTIO=y
CONFIG_9P_FS=y
CONFIG_EXT4_FS=y
CONFIG_OVERLAY_FS=y
CONFIG_TMPFS=y
CONFIG_DEVTMPFS=y
CONFIG_BLK_DEV_INITRD=y
CONFIG_RD_GZIP=y
CONFIG_SERIAL_8250=y
CONFIG_SERIAL_8250_CONSOLE=y
"""
#: what `make` prints per build step (``  CC      mm/vmscan.o``): counted for progress
STEP = re.compile(r"^\s{2}[A-Z][A-Z0-9_]*(?:\s+\[[A-Z]+\])?\s+\S")
#: steps of a first build when no build of the tree has been counted yet (measured: Debian's
#: 6.12.95 tree, x86_64 defconfig + LAB_FRAGMENT)
FIRST_BUILD_STEPS = 3200
TOOLS = ("make", "gcc", "flex", "bison", "bc", "pahole", "patch", "perl")


def cache_dir() -> Path:
    """$MOETRACE_LAB_BUILD_CACHE, else /var/cache/moetrace/lab-build as root, else
    ~/.cache/moetrace/lab-build (outside any repository: trees and images are large)."""
    env = os.environ.get("MOETRACE_LAB_BUILD_CACHE")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/cache/moetrace/lab-build")
    return Path.home() / ".cache" / "moetrace" / "lab-build"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Source:
    """What SRC is: ``kind`` git / dir / tarball / deb, and the digest that names its work tree."""

    path: Path
    kind: str
    digest: str

    @property
    def label(self) -> str:
        return f"{self.path} ({self.kind} {self.digest[:12]})"


def resolve_source(src: str | os.PathLike) -> Source:
    """SRC as a :class:`Source`; UsageError naming what it is not."""
    p = Path(src).resolve()
    if p.is_dir():
        if (p / ".git").exists():
            return Source(p, "git", _git_digest(p))
        if not (p / "Makefile").is_file() or not (p / "mm").is_dir():
            raise UsageError(f"{p} is not a kernel tree (no Makefile and mm/)",
                             hint="give the top of a kernel source tree, a linux-*.tar.xz or a linux-source-*.deb")
        return Source(p, "dir", _dir_digest(p))
    if not p.is_file():
        raise UsageError(f"no kernel source {p}", hint="give a kernel tree, a tarball or Debian's linux-source-*.deb "
                                                        "(apt-get download linux-source-6.12)")
    if p.name.endswith(".deb"):
        return Source(p, "deb", sha256_file(p))
    if re.search(r"\.tar(\.(xz|gz|bz2|zst))?$", p.name):
        return Source(p, "tarball", sha256_file(p))
    raise UsageError(f"{p}: not a kernel tree, tarball (.tar.xz/.gz/.bz2) or .deb")


def _git_digest(p: Path) -> str:
    """HEAD and the uncommitted changes of a git tree (untracked files are not part of it)."""
    head = subprocess.run(["git", "-C", str(p), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        raise UsageError(f"{p}: git rev-parse HEAD failed: {head.stderr.strip()}")
    diff = subprocess.run(["git", "-C", str(p), "diff", "HEAD", "--binary"], capture_output=True)
    return hashlib.sha256(head.stdout.encode() + b"\0" + diff.stdout).hexdigest()


_BUILD_OUTPUT = re.compile(r"(\.o|\.a|\.ko|\.cmd|\.mod|\.mod\.c|\.order|\.symvers)$")


def _dir_digest(p: Path) -> str:
    """A plain tree: every file's path, size and mtime (not its bytes: a tree is ~1 GB)."""
    if (p / ".config").exists() or (p / "vmlinux").exists():
        raise UsageError(f"{p} holds an in-tree build (.config / vmlinux)",
                         hint=f"`make -C {p} mrproper` first, or give a tarball of it")
    h = hashlib.sha256()
    for root, dirs, files in os.walk(p):
        dirs.sort()
        for f in sorted(files):
            if _BUILD_OUTPUT.search(f):
                continue
            st = os.stat(os.path.join(root, f))
            h.update(f"{os.path.relpath(os.path.join(root, f), p)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def unpack(source: Source, dest: Path, on_phase: Callable[[str], None] = lambda s: None) -> None:
    """The source's files into ``dest`` (made here; removed again when unpacking fails)."""
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if source.kind == "git":
            on_phase(f"exporting {source.path} (HEAD and uncommitted changes)")
            _git_export(source.path, tmp)
        elif source.kind == "dir":
            on_phase(f"linking {source.path}'s files")
            subprocess.run(["cp", "-al", f"{source.path}/.", str(tmp)], check=True)
        else:
            on_phase(f"unpacking {source.path.name}")
            _unpack_archive(source, tmp)
        os.replace(_kernel_top(tmp), dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _git_export(repo: Path, dest: Path) -> None:
    arch = subprocess.Popen(["git", "-C", str(repo), "archive", "--format=tar", "HEAD"], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=arch.stdout, check=True)
    if arch.wait() != 0:
        raise MoetraceError(f"git archive of {repo} failed")
    diff = subprocess.run(["git", "-C", str(repo), "diff", "HEAD", "--binary"], capture_output=True, check=True)
    if diff.stdout:
        subprocess.run(["git", "apply", "--whitespace=nowarn"], input=diff.stdout, cwd=dest, check=True)


def _unpack_archive(source: Source, dest: Path) -> None:
    """A tarball, or the tarball inside Debian's linux-source package (usr/src/linux-source-*.tar.*)."""
    if source.kind == "tarball":
        subprocess.run(["tar", "-xf", str(source.path), "-C", str(dest)], check=True)
        return
    listing = subprocess.run(["dpkg-deb", "-c", str(source.path)], capture_output=True, text=True)
    inner = [ln.split()[-1] for ln in listing.stdout.splitlines() if re.search(r"usr/src/linux-source-[^/]*\.tar", ln)]
    if listing.returncode != 0 or not inner:
        raise InputError("no usr/src/linux-source-*.tar.* inside (not a linux-source package)", path=str(source.path))
    deb = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(source.path)], stdout=subprocess.PIPE)
    with tarfile.open(fileobj=deb.stdout, mode="r|") as tf:
        for member in tf:
            if member.name == inner[0]:
                with tf.extractfile(member) as fh, open(dest / "src.tar", "wb") as out:
                    shutil.copyfileobj(fh, out, 1 << 20)
                break
    deb.stdout.close()
    deb.wait()
    subprocess.run(["tar", "-xf", str(dest / "src.tar"), "-C", str(dest)], check=True)
    (dest / "src.tar").unlink()


def _kernel_top(d: Path) -> Path:
    """The directory holding the tree's Makefile (a tarball's one top folder, or ``d``)."""
    if (d / "Makefile").is_file():
        return d
    subs = [s for s in d.iterdir() if s.is_dir()]
    if len(subs) == 1 and (subs[0] / "Makefile").is_file():
        return subs[0]
    raise InputError("no kernel Makefile at the top of the unpacked source", path=str(d))


# ---------------------------------------------------------------------------
# patches: applied for one build, recorded before, reverted after


@dataclass(frozen=True)
class Patch:
    path: Path
    digest: str


def read_patches(paths: list[str | os.PathLike]) -> list[Patch]:
    out = []
    for p in paths:
        pp = Path(p).resolve()
        if not pp.is_file():
            raise UsageError(f"no patch file {pp}")
        out.append(Patch(pp, sha256_file(pp)))
    return out


def _patch(tree: Path, patch: Path, reverse: bool = False, dry_run: bool = False) -> subprocess.CompletedProcess:
    argv = ["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-i", str(patch)]
    argv += ["-R"] if reverse else []
    argv += ["--dry-run"] if dry_run else []
    return subprocess.run(argv, cwd=tree, capture_output=True, text=True)


def _tree_state(tree_dir: Path) -> dict[str, Any]:
    f = tree_dir / "tree.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _save_state(tree_dir: Path, state: dict[str, Any]) -> None:
    write_json(tree_dir / "tree.json", state)


def revert_applied(tree_dir: Path) -> None:
    """Revert what tree.json says is applied (a build stopped part-way left it), newest first."""
    state = _tree_state(tree_dir)
    for rec in reversed(state.get("applied", [])):
        r = _patch(tree_dir / "src", Path(rec["copy"]), reverse=True)
        if r.returncode != 0:
            raise MoetraceError(f"could not revert {rec['path']} in {tree_dir / 'src'}:\n{r.stdout[-2000:]}",
                                hint=f"remove the work tree ({tree_dir}) and build again")
        state["applied"] = state["applied"][:-1]
        _save_state(tree_dir, state)


def apply_patches(tree_dir: Path, patches: list[Patch]) -> None:
    """Each patch, checked first with --dry-run (an error quotes patch's output and names the file)."""
    state = _tree_state(tree_dir)
    state.setdefault("applied", [])
    for p in patches:
        copy = tree_dir / "patches" / f"{p.digest[:16]}.patch"  # revertible even if the user's file changes
        copy.parent.mkdir(exist_ok=True)
        shutil.copyfile(p.path, copy)
        dry = _patch(tree_dir / "src", copy, dry_run=True)
        if dry.returncode != 0:
            raise InputError(f"does not apply to {tree_dir / 'src'}:\n{dry.stdout[-2000:]}", path=str(p.path),
                             hint="make it against the same source (patch -p1 from the tree's top)")
        state["applied"].append({"path": str(p.path), "copy": str(copy), "digest": p.digest})
        _save_state(tree_dir, state)
        r = _patch(tree_dir / "src", copy)
        if r.returncode != 0:
            raise MoetraceError(f"{p.path} failed to apply:\n{r.stdout[-2000:]}")


# ---------------------------------------------------------------------------
# configuration


def unmet(config_text: str, wanted: dict[str, str]) -> list[str]:
    """The fragment's symbols the resulting .config does not hold as asked."""
    got = parse_config(config_text)
    return [f"{k}={v} (got {got.get(k, 'n')})" for k, v in wanted.items() if got.get(k, "n") != v]


def configure(src: Path, fragments: list[tuple[str, str]], localversion: str, make: list[str], log) -> str:
    """defconfig + the fragments (name, text) merged in order + LOCALVERSION; the .config text.
    MoetraceError listing each symbol that did not stick (a dependency is missing or off)."""
    frag_dir = src / ".moetrace-fragments"
    frag_dir.mkdir(exist_ok=True)
    paths = []
    for i, (name, text) in enumerate(fragments + [("localversion", f'CONFIG_LOCALVERSION="{localversion}"\n')]):
        f = frag_dir / f"{i:02d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"
        f.write_text(text)
        paths.append(f)
    _run(make + ["defconfig"], src, log)
    _run(["bash", "scripts/kconfig/merge_config.sh", "-m", ".config", *map(str, paths)], src, log)
    _run(make + ["olddefconfig"], src, log)
    text = (src / ".config").read_text()
    wanted: dict[str, str] = {}
    for _, t in fragments:
        wanted.update(parse_config(t))
    bad = unmet(text, wanted)
    if bad:
        raise MoetraceError("these config symbols did not stick (a dependency is off, or the tree lacks them): "
                            + ", ".join(bad), hint=f"see `make menuconfig` in {src}, or change the fragment")
    return text


def _run(argv: list[str], cwd: Path, log) -> None:
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    r = subprocess.run(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise MoetraceError(f"`{' '.join(argv)}` failed in {cwd} (exit {r.returncode}); see {log.name}")


# ---------------------------------------------------------------------------
# the build


@dataclass
class BuildResult:
    image: Path
    doc: dict[str, Any]  # build.json (moetrace.run.documents.LabBuild)
    cached: bool


def image_key(source: Source, patches: list[Patch], fragments: list[tuple[str, str]]) -> str:
    doc = {"recipe": RECIPE, "source": source.digest, "patches": [p.digest for p in patches],
           "fragments": [hashlib.sha256(t.encode()).hexdigest() for _, t in fragments]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


class _Locked:
    """An exclusive flock on ``path`` for one tree's builds (a second build of it waits)."""

    def __init__(self, path: Path, on_phase: Callable[[str], None]):
        self.path, self.on_phase = path, on_phase

    def __enter__(self):
        self.fh = open(self.path, "a")
        try:
            fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.on_phase(f"waiting for another build of this tree ({self.path})")
            fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.fh.close()


def build_image(src: str | os.PathLike, patches: list[str | os.PathLike] = (), fragments: list[str | os.PathLike] = (),
                *, jobs: int | None = None, cache: Path | None = None,
                on_phase: Callable[[str], None] = lambda s: None,
                on_step: Callable[[int, int | None], None] = lambda n, total: None) -> BuildResult:
    """SRC (+ patches, + config fragments) to CACHE/images/<key>/bzImage (see the module's text)."""
    cache = Path(cache) if cache is not None else cache_dir()
    source = resolve_source(src)
    pats = read_patches(list(patches))
    frags = [("lab", LAB_FRAGMENT)] + [(Path(f).name, _read_fragment(f)) for f in fragments]
    key = image_key(source, pats, frags)
    img_dir = cache / "images" / key
    if (hit := _cached(img_dir)) is not None:
        return hit
    lacking = missing_tools()
    if lacking:
        raise UsageError(f"building a kernel needs {', '.join(lacking)}",
                         hint="apt-get install build-essential flex bison bc libelf-dev libssl-dev dwarves "
                              "(`moetrace lab setup` installs them)")
    tree_dir = cache / "trees" / source.digest[:16]
    tree_dir.mkdir(parents=True, exist_ok=True)
    with _Locked(tree_dir / "lock", on_phase):
        if (hit := _cached(img_dir)) is not None:  # built by the build we waited for
            return hit
        if not (tree_dir / "src").is_dir():
            unpack(source, tree_dir / "src", on_phase)
        revert_applied(tree_dir)
        try:
            apply_patches(tree_dir, pats)
            doc = _make_image(tree_dir, img_dir, key, source, pats, frags, jobs or os.cpu_count() or 1,
                              on_phase, on_step)
        finally:
            revert_applied(tree_dir)
    return BuildResult(img_dir / "bzImage", doc, False)


def _cached(img_dir: Path) -> BuildResult | None:
    if (img_dir / "build.json").is_file() and (img_dir / "bzImage").is_file():
        return BuildResult(img_dir / "bzImage", json.loads((img_dir / "build.json").read_text()), True)
    return None


def _read_fragment(path: str | os.PathLike) -> str:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise UsageError(f"cannot read config fragment {p}: {e.strerror}") from None
    if not parse_config(text):
        raise InputError("no CONFIG_ symbols in it (lines like CONFIG_X=y or '# CONFIG_X is not set')", path=str(p))
    return text


def _make_image(tree_dir: Path, img_dir: Path, key: str, source: Source, pats: list[Patch],
                frags: list[tuple[str, str]], jobs: int, on_phase, on_step) -> dict[str, Any]:
    src = tree_dir / "src"
    make = ["make", f"-j{jobs}", "ARCH=x86_64"]
    (tree_dir / "logs").mkdir(exist_ok=True)
    log_path = tree_dir / "logs" / f"{key}.log"
    state = _tree_state(tree_dir)
    first = not (src / "vmlinux").exists()
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        on_phase("configuring (defconfig + the lab's fragment" + (" + yours)" if len(frags) > 1 else ")"))
        config = configure(src, frags, f"-mt{key[:8]}", make, log)
        on_phase(("building (first build of this tree: about an hour on 2 cores)" if first else
                  "building (only what changed since the tree's last build)") + f"; log {log_path}")
        steps = _make_bzimage(src, make, log, (state.get("full_steps") or FIRST_BUILD_STEPS) if first else None,
                              on_step)
    build_s = time.monotonic() - t0
    if first:
        state = _tree_state(tree_dir)
        state["full_steps"] = steps
        _save_state(tree_dir, state)
    return _install(src, img_dir, log_path, config, {
        "key": key, "recipe": RECIPE, "source": {"path": str(source.path), "kind": source.kind,
                                                  "digest": source.digest},
        "patches": [{"path": str(p.path), "digest": p.digest} for p in pats],
        "fragments": [{"name": n, "digest": hashlib.sha256(t.encode()).hexdigest()} for n, t in frags],
        "jobs": jobs, "build_s": round(build_s, 1), "steps": steps, "incremental": not first,
        "kernel_version": _kernel_version(src)})


def _make_bzimage(src: Path, make: list[str], log, total: int | None, on_step) -> int:
    """`make bzImage`, its output into ``log``; the steps counted. Stopped (Ctrl-C, an error here)
    by killing its process group, which this started."""
    proc = subprocess.Popen(make + ["bzImage"], cwd=src, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    n = 0
    try:
        for line in proc.stdout:
            log.write(line)
            if STEP.match(line):
                n += 1
                on_step(n, total)
        rc = proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
    if rc != 0:
        log.flush()
        tail = Path(log.name).read_text(errors="replace").splitlines()[-25:]
        raise MoetraceError(f"make bzImage failed (exit {rc}); the end of {log.name}:\n" + "\n".join(tail))
    return n


def _kernel_version(src: Path) -> str:
    r = subprocess.run(["make", "-s", "kernelversion"], cwd=src, capture_output=True, text=True)
    return r.stdout.strip()


def _install(src: Path, img_dir: Path, log_path: Path, config: str, doc: dict[str, Any]) -> dict[str, Any]:
    """bzImage, config (beside it: `lab run --kernel IMAGE` reads it), build.log and build.json into
    ``img_dir``, made whole under another name and renamed; what the lab lacks in it checked."""
    from moetrace.lab.kernels import kernel_facts
    from moetrace.lab.run import image_release

    part = img_dir.with_name(img_dir.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    shutil.copyfile(src / "arch" / "x86" / "boot" / "bzImage", part / "bzImage")
    (part / "config").write_text(config)
    shutil.copyfile(log_path, part / "build.log")
    release = image_release(part / "bzImage") or "?"
    facts = kernel_facts(release, image=part / "bzImage")
    doc.update(schema=BUILD_SCHEMA, release=release, image_bytes=(part / "bzImage").stat().st_size,
               lacks=facts.lacks, finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    write_json(part / "build.json", doc)
    shutil.rmtree(img_dir, ignore_errors=True)
    os.replace(part, img_dir)
    return doc



def list_images(cache: Path | None = None) -> list[dict[str, Any]]:
    """build.json of every image in the cache, newest first, with its ``image`` path."""
    cache = Path(cache) if cache is not None else cache_dir()
    docs = []
    for f in sorted((cache / "images").glob("*/build.json")):
        d = json.loads(f.read_text())
        d["image"] = str(f.parent / "bzImage")
        docs.append(d)
    return sorted(docs, key=lambda d: d.get("finished", ""), reverse=True)
