"""Ask the running kernel what it can do: tracefs, tracepoints, kallsyms, kprobes, BTF,
MGLRU, privileges, cgroup memory, PSI.

Never by version number (a release string says nothing of backports or config): every answer comes from a file the kernel
exposes (a tracepoint format file, a kallsyms line, a sysfs knob). Every reader takes
``root=`` ("/" by default), the directory under which ``proc/``, ``sys/`` and ``lib/``
are looked up, so tests pass a fake tree; mount points read from ``<root>/proc/mounts``
are resolved under ``root`` too.

* :func:`tracefs_path`, :func:`debugfs_path`   found through /proc/mounts (``mount=True`` mounts)
* :func:`tracepoint_format`, :func:`has_tracepoint`   events/<category>/<event>/format
  (:meth:`Features.tracepoint_fields`: the same field names from the kernel's BTF, read
  without touching tracefs, whose format files wait on the kernel's event_mutex)
* :func:`kallsyms_has`, :func:`kallsyms_count`, :func:`kprobes_available`
* :func:`btf_available`, :func:`mglru_state`
* :func:`privileges`, :func:`bpf_usable`, :func:`cgroup_memory`, :func:`psi_available`
* :class:`Features`   one cached view of all of the above, with the reason for every "no"
  (what :func:`moetrace.record.spec.resolve` consumes)

Answers are cached per process (keyed by root and the tracefs location), and on the live
system the formats read and what BTF said also for the rest of the boot (:data:`BOOT_CACHE`);
call :func:`clear_cache` after changing the system (tests, or after a mount).
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import errno
import os
import re
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from moetrace.kernel.syscalls import libc

log = logging.getLogger("moetrace.kernel.features")

TRACEFS_MOUNT = "/sys/kernel/tracing"
DEBUGFS_MOUNT = "/sys/kernel/debug"
TRACEFS_MOUNT_CMD = f"mount -t tracefs nodev {TRACEFS_MOUNT}"
DEBUGFS_MOUNT_CMD = f"mount -t debugfs nodev {DEBUGFS_MOUNT}"

# Capability bit numbers (include/uapi/linux/capability.h).
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39


# Notes about what this process mounted (the run manifest records them).
_MOUNT_NOTES: list[str] = []
_MOUNTED: list[str] = []  # mount points this process mounted (unmount_ours() removes them)
#: private_mounts(): whether this process's mounts go into a mount namespace of its own, and
#: whether it is in one yet (entered before its first mount)
_NS: dict[str, Any] = {"private": False, "entered": False, "why_not": None}
_CLONE_NEWNS, _MS_REC, _MS_SLAVE = 0x00020000, 0x4000, 0x80000


def private_mounts(on: bool = True, dedicated: bool = False) -> None:
    """Mount (debugfs / tracefs for libbpf) in a mount namespace of this process's own, entered
    right before its first mount: what it mounts is then seen by no other process and goes
    away with it and its children, even when it is SIGKILLed (which no unmount can follow).
    The namespace is a slave of the host's: mounts made outside still appear inside. For
    the recorder and cells (the recorded command inherits the namespace); not for
    `doctor --mount`, which mounts for the user to keep. Only in a process that is a moetrace
    program (the moetrace command, ``python -m moetrace...``, ``python -c``), never in one
    hosting it (pytest, a notebook: a click command run in-process), whose namespace would
    change for good: there the mounts are made and unmounted as before. ``dedicated``: this
    process is one a moetrace job was started in (submitit's job process on a Slurm node),
    whose namespace nobody else shares."""
    _NS["private"] = on and (dedicated or own_process())


def own_process() -> bool:
    """True when this process is a moetrace program (the moetrace command, ``python -m
    moetrace...``, ``python -c``), not one hosting it (pytest, a notebook)."""
    import sys

    f = getattr(sys.modules.get("__main__"), "__file__", None)
    if f is None:  # python -c, stdin
        return True
    p = Path(f).resolve()
    return p.name == "moetrace" or Path(__file__).resolve().parents[1] in p.parents


def _enter_private_namespace() -> str | None:
    """unshare(CLONE_NEWNS) + make / a recursive slave; None when done, else why not (then
    mounts are made as before, in the host's namespace, and unmounted at the end)."""
    if threading.active_count() > 1:  # a mount namespace belongs to the calling thread only
        return "other threads are running"
    if libc.unshare(_CLONE_NEWNS) != 0:
        return f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}"
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None) != 0:
        # a new namespace whose mounts would still propagate out: say so, unmount at the end
        return f"mount --make-rslave /: {os.strerror(ctypes.get_errno())}"
    _NS["entered"] = True
    return None


@dataclass(frozen=True)
class FieldSpec:
    """One field of a tracepoint format file.

    ``type`` is the C type as the format file states it, with an array suffix moved
    from the name onto the type (``char rwbs[10]`` -> name "rwbs", type "char[10]");
    ``__data_loc char[] cmd`` keeps type "__data_loc char[]"."""

    name: str
    type: str
    offset: int
    size: int
    signed: bool


# -- paths ------------------------------------------------------------------------------------

def _rootkey(root: str | os.PathLike) -> str:
    return os.path.abspath(os.fspath(root))


def _p(root: str | os.PathLike, *parts: str) -> Path:
    return Path(root).joinpath(*[p.lstrip("/") for p in parts])


def _read(path: Path) -> str | None:
    try:
        with open(path, "r", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def _exists(path: Path) -> bool | None:
    """path.exists(), or None when a parent directory is not searchable (not root)."""
    try:
        os.stat(path)
        return True
    except PermissionError:
        return None
    except OSError:
        return False


def _mounts(root: str | os.PathLike) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(source, target, fstype, options) of every /proc/mounts line (octal escapes decoded)."""
    text = _read(_p(root, "proc/mounts")) or ""
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) < 4:
            continue
        dec = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), x) for x in f[:4]]
        out.append((dec[0], dec[1], dec[2], tuple(dec[3].split(","))))
    return out


def mount_notes() -> list[str]:
    """What this process mounted (e.g. "mounted tracefs at /sys/kernel/tracing"), in order."""
    return list(_MOUNT_NOTES)


#: where libbpf 1.1 reads a tracepoint's id when the directory exists (else /sys/kernel/tracing),
#: as the stock tools do (measured here: they die with misleading messages without it)
DEBUG_TRACEFS = "/sys/kernel/debug/tracing"


def ensure_tracefs() -> str | None:
    """Make tracepoint ids readable at /sys/kernel/debug/tracing.

    When absent and we are root: mount debugfs at /sys/kernel/debug (tracefs automounts
    under it; MGLRU's lru_gen file is there too), else tracefs there. What is mounted is
    recorded, said in a note, and removed by :func:`unmount_ours`. Returns the note, or
    None when nothing was mounted."""
    if _is_dir(Path(DEBUG_TRACEFS) / "events") or os.geteuid() != 0:
        return None
    note = None
    if not any(fs == "debugfs" for _s, _t, fs, _o in _mounts("/")):
        ok, note = _mount("debugfs", DEBUGFS_MOUNT)
        log.warning(note)
        if ok:
            _MOUNT_NOTES.append(note)
            _MOUNTED.append(DEBUGFS_MOUNT)
    if not _is_dir(Path(DEBUG_TRACEFS) / "events"):
        ok, note = _mount("tracefs", DEBUG_TRACEFS)
        log.warning(note)
        if ok:
            _MOUNT_NOTES.append(note)
            _MOUNTED.append(DEBUG_TRACEFS)
    clear_cache()
    return note


def _is_dir(p: Path) -> bool:
    """is_dir() that says False where a non-root user may not look (debugfs is mode 700)."""
    try:
        return p.is_dir()
    except PermissionError:
        return False


def unmount_ours(only: str | None = None) -> list[str]:
    """Unmount what this process mounted (last first); returns one note per mount point.
    ``only``: that mount point alone, if this process mounted it (the rest stays mounted).

    A mount point still in use is left mounted, and the note says so; it stays on the list, so
    a later call (the end of a test session) tries again."""
    notes = []
    busy = []
    keep = [t for t in _MOUNTED if only is not None and t != only]
    _MOUNTED[:] = [t for t in _MOUNTED if t not in keep]
    while _MOUNTED:
        target = _MOUNTED.pop()
        if target == DEBUGFS_MOUNT:  # tracefs automounted under it goes first
            subprocess.run(["umount", f"{target}/tracing"], capture_output=True, text=True, timeout=30)
        r = subprocess.run(["umount", target], capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            notes.append(f"unmounted {target} (mounted by this run)")
        else:
            notes.append(f"left {target} mounted: {(r.stderr or r.stdout).strip()}")
            busy.insert(0, target)
    _MOUNTED.extend(keep + busy)
    clear_cache()
    return notes


def _is_live_root(root: str | os.PathLike) -> bool:
    return _rootkey(root) == "/"


def _mount(fstype: str, target: str) -> tuple[bool, str]:
    """mount -t FSTYPE nodev TARGET; (ok, note or error). After :func:`private_mounts`, in this
    process's own mount namespace (the note says which)."""
    try:
        os.makedirs(target, exist_ok=True)
    except OSError as e:
        return False, f"could not mount {fstype} at {target}: {e.strerror}"
    if _NS["private"] and not _NS["entered"] and _NS["why_not"] is None:
        _NS["why_not"] = _enter_private_namespace()
    ok, note = _mount_now(fstype, target)
    if ok and _NS["entered"]:
        note += " in this run's own mount namespace (gone with it, even if killed)"
    elif ok and _NS["private"] and _NS["why_not"]:
        note += f" (not in a namespace of its own: {_NS['why_not']})"
    return ok, note


def _mount_now(fstype: str, target: str) -> tuple[bool, str]:
    try:
        r = subprocess.run(["mount", "-t", fstype, "nodev", target], capture_output=True, text=True,
                           timeout=30)
        if r.returncode == 0:
            return True, f"mounted {fstype} at {target} (`mount -t {fstype} nodev {target}`)"
        err = (r.stderr or r.stdout).strip()
    except (OSError, subprocess.SubprocessError):  # no mount(8): try mount(2)
        if libc.mount(b"nodev", target.encode(), fstype.encode(), 0, None) == 0:
            return True, f"mounted {fstype} at {target} (mount(2))"
        err = os.strerror(ctypes.get_errno())
    return False, f"could not mount {fstype} at {target}: {err}"


def tracefs_path(root: str | os.PathLike = "/", mount: bool = False) -> Path | None:
    """The tracefs directory (holding ``events/``), or None.

    Found through /proc/mounts: a ``tracefs`` mount, else ``<debugfs>/tracing`` (the
    kernel automounts tracefs there). With ``mount=True``, on the live system and as
    root, mounts it at /sys/kernel/tracing when absent and records a note
    (:func:`mount_notes`); otherwise say :data:`TRACEFS_MOUNT_CMD`."""
    for _src, target, fstype, _opts in _mounts(root):
        if fstype == "tracefs" and _is_dir(_p(root, target)):
            return _p(root, target)
    for _src, target, fstype, _opts in _mounts(root):
        if fstype == "debugfs":
            p = _p(root, target, "tracing")
            try:
                if (p / "events").is_dir():
                    return p
            except PermissionError:  # debugfs is mode 700: not root
                pass
    if mount and _is_live_root(root) and os.geteuid() == 0:
        return _mount_here("tracefs", TRACEFS_MOUNT)
    return None


def debugfs_path(root: str | os.PathLike = "/", mount: bool = False) -> Path | None:
    """The debugfs mount point, via /proc/mounts; ``mount=True`` mounts it (live, root)."""
    for _src, target, fstype, _opts in _mounts(root):
        if fstype == "debugfs":
            return _p(root, target)
    if mount and _is_live_root(root) and os.geteuid() == 0:
        return _mount_here("debugfs", DEBUGFS_MOUNT)
    return None


def _mount_here(fstype: str, target: str) -> Path | None:
    """Mount ``fstype`` at ``target`` (noted, remembered for unmounting, caches cleared);
    the mount point, or None when the mount failed (the note says why)."""
    ok, note = _mount(fstype, target)
    log.warning(note)
    if not ok:
        return None
    _MOUNT_NOTES.append(note)
    _MOUNTED.append(target)
    clear_cache()
    return Path(target)


# -- tracepoints ------------------------------------------------------------------------------

_FIELD_RE = re.compile(r"field:(?P<decl>[^;]*);\s*offset:(?P<off>\d+);\s*size:(?P<size>\d+);"
                       r"(?:\s*signed:(?P<signed>\d+);)?")


def parse_format(text: str) -> dict[str, FieldSpec]:
    """Parse a tracepoint ``format`` file: {field name: FieldSpec}, common_* fields included."""
    out: dict[str, FieldSpec] = {}
    for m in _FIELD_RE.finditer(text):
        decl = m.group("decl").strip()
        arr = ""
        am = re.search(r"(\[[^\]]*\])\s*$", decl)
        if am and not decl.startswith("__data_loc"):
            arr = am.group(1)
            decl = decl[: am.start()].rstrip()
        nm = re.search(r"([A-Za-z_][A-Za-z0-9_]*)\s*$", decl)
        if not nm:
            continue
        name = nm.group(1)
        ctype = decl[: nm.start()].strip() + arr
        out[name] = FieldSpec(name, ctype, int(m.group("off")), int(m.group("size")),
                              m.group("signed") == "1")
    return out


@functools.lru_cache(maxsize=4096)
def _format_cached(tracefs: str, category: str, event: str) -> tuple[str, dict[str, FieldSpec] | None]:
    p = Path(tracefs) / "events" / category / event / "format"
    try:
        with open(p, "r", errors="replace") as fh:
            return "ok", parse_format(fh.read())
    except FileNotFoundError:
        return "absent", None
    except PermissionError:
        return "denied", None
    except OSError as e:  # e.g. ENODEV on a tracepoint compiled out at runtime
        return f"error: {e.strerror}", None


def tracepoint_format(category: str, event: str, root: str | os.PathLike = "/") -> dict[str, FieldSpec] | None:
    """The fields of tracepoint ``category:event`` from its format file, or None when the
    tracepoint does not exist (or tracefs is not mounted / not readable)."""
    t = tracefs_path(root)
    if t is None:
        return None
    return _format_cached(str(t), category, event)[1]


def has_tracepoint(category: str, event: str, root: str | os.PathLike = "/") -> bool:
    """True when events/<category>/<event>/format exists in tracefs."""
    return tracepoint_format(category, event, root) is not None


@functools.lru_cache(maxsize=4096)
def _tracepoint_state(tracefs: str, category: str, event: str) -> str:
    """Whether events/<category>/<event>/format exists, by stat(2) alone: opening and reading a
    format file takes the kernel's event_mutex (f_start), which a perf event's release holds
    across RCU grace periods (seconds while an earlier recording's releaser closes); the lookup
    does not."""
    try:
        os.stat(Path(tracefs) / "events" / category / event / "format")
        return "ok"
    except FileNotFoundError:
        return "absent"
    except PermissionError:
        return "denied"
    except OSError as e:
        return f"error: {e.strerror}"


def _tracepoint_reason_in(t: Path, category: str, event: str) -> str | None:
    state = _tracepoint_state(str(t), category, event)
    if state == "ok":
        return None
    if state == "absent":
        return f"no tracepoint {category}:{event} (no events/{category}/{event}/format in {t})"
    if state == "denied":
        return f"could not check {category}:{event}: {t} is not readable (needs root)"
    return f"tracepoint {category}:{event}: {state}"


def tracepoint_reason(category: str, event: str, root: str | os.PathLike = "/") -> str | None:
    """None when the tracepoint exists, else why not (not mounted / absent / unreadable)."""
    t = tracefs_path(root)
    if t is None:
        return f"tracefs not mounted ({TRACEFS_MOUNT_CMD}, or `moetrace doctor --mount`)"
    return _tracepoint_reason_in(t, category, event)


#: what resolving asked the live kernel, kept for the rest of this boot: the format files read
#: (syscalls:*; BTF does not describe them), the fields BTF gave per event class, the programs'
#: context structs per probe object (by size and mtime). /run is a tmpfs (gone at reboot) and the
#: boot id and release inside say which boot; root's only (mode 0600). A later recording then
#: reads one small file instead of tracefs and BTF.
BOOT_CACHE = "/run/moetrace/kernel-answers.json"
_DISK_LOCK = threading.Lock()
_DISK: dict[str, Any] = {}  # {"key": boot key, "formats": {...}, "fields": {...}, "objects": {...}}
_SECTIONS = ("formats", "fields", "objects")


def _boot_key() -> str:
    boot = (_read(Path("/proc/sys/kernel/random/boot_id")) or "").strip()
    return f"{boot} {osrelease('/') or ''}" if boot else ""


def _disk() -> dict[str, Any]:
    if "key" not in _DISK:
        _DISK.update(key=_boot_key(), **{sec: {} for sec in _SECTIONS})
        try:
            with open(BOOT_CACHE) as fh:
                doc = json.load(fh)
            if _DISK["key"] and doc.get("key") == _DISK["key"]:
                _DISK.update({sec: dict(doc[sec]) for sec in _SECTIONS})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    return _DISK


def _disk_get(section: str, key: str) -> Any:
    return _disk()[section].get(key)


def _disk_put(section: str, key: str, value: Any) -> None:
    """Keep an answer for this boot (written at once; root only, silently not otherwise)."""
    with _DISK_LOCK:
        d = _disk()
        d[section][key] = value
        if os.geteuid() != 0 or not d["key"]:
            return
        from moetrace.atomic import atomic_write

        try:
            os.makedirs(os.path.dirname(BOOT_CACHE), mode=0o700, exist_ok=True)
            with atomic_write(BOOT_CACHE, mode=0o600) as tmp:
                tmp.write_text(json.dumps({k: d[k] for k in ("key", *_SECTIONS)}))
        except OSError as e:
            log.debug("kernel answers not kept for this boot: %s", e)


def _disk_format(category: str, event: str) -> dict[str, FieldSpec] | None:
    rows = _disk_get("formats", f"{category}:{event}")
    try:
        return None if rows is None else {r[0]: FieldSpec(*r) for r in rows}
    except TypeError:
        return None


def _remember_format(category: str, event: str, fmt: dict[str, FieldSpec]) -> None:
    _disk_put("formats", f"{category}:{event}", [[f.name, f.type, f.offset, f.size, f.signed] for f in fmt.values()])


# -- kallsyms, kprobes, BTF -------------------------------------------------------------------

@functools.lru_cache(maxsize=16)
def _kallsyms(rootkey: str) -> bytes | None:
    """/proc/kallsyms as bytes (searched, never split into a dict: parsing its ~200k lines in
    Python took 4 s under the lab's TCG)."""
    try:
        return _p(rootkey, "proc/kallsyms").read_bytes()
    except OSError:
        return None


_CLONE_SUFFIX = re.compile(rb"(?:\.[\w.]+)?")
_KALLSYMS_HEAD = re.compile(rb"\S+ \S")


def _symbol_lines(text: bytes, symbol: str) -> list[bytes]:
    """The names in kallsyms ``text`` (lines "ADDR TYPE NAME[\\t[module]]") that are ``symbol`` or
    its compiler clones (NAME.constprop.0, NAME.isra.0). Found by the name itself (bytes.find),
    not a regex anchored at every line start: that took 1.7 s under the lab's TCG."""
    name = symbol.encode()
    needle = b" " + name
    out = []
    i = text.find(needle)
    while i >= 0:
        j = i + len(needle)
        end = text.find(b"\n", j)
        end = len(text) if end < 0 else end
        rest = text[j:end].split(b"\t", 1)[0]
        head = text[text.rfind(b"\n", 0, i) + 1:i]
        if _CLONE_SUFFIX.fullmatch(rest) and _KALLSYMS_HEAD.fullmatch(head):
            out.append(name + rest)
        i = text.find(needle, j)
    return out


def kallsyms_count(symbol: str, root: str | os.PathLike = "/") -> int | None:
    """How many /proc/kallsyms lines name ``symbol`` (several = static copies: attach by name
    is ambiguous); None when kallsyms is unreadable."""
    text = _kallsyms(_rootkey(root))
    if text is None:
        return None
    name = b" " + symbol.encode()  # names hold no blanks: " NAME" then end of line or a module tab
    return text.count(name + b"\n") + text.count(name + b"\t")


def kallsyms_has(symbol: str, root: str | os.PathLike = "/") -> bool:
    """True when ``symbol`` (exact name, e.g. "inc_max_seq.constprop.0") is in /proc/kallsyms."""
    return bool(kallsyms_count(symbol, root))


def kallsyms_matching(base: str, root: str | os.PathLike = "/") -> list[str]:
    """``base`` and its compiler clones (``base.constprop.0``, ``base.isra.0``) in kallsyms."""
    text = _kallsyms(_rootkey(root)) or b""
    return sorted({n.decode(errors="replace") for n in _symbol_lines(text, base)})


def kprobes_available(root: str | os.PathLike = "/") -> bool:
    """True when kprobes can be created: tracefs ``kprobe_events`` exists or the kernel has
    the perf ``kprobe`` PMU (/sys/bus/event_source/devices/kprobe)."""
    return kprobes_reason(root) is None


def kprobes_reason(root: str | os.PathLike = "/") -> str | None:
    """None when kprobes are available, else why not."""
    if _p(root, "sys/bus/event_source/devices/kprobe").exists():
        return None
    t = tracefs_path(root)
    if t is None:
        return ("kprobes not built (no kprobe PMU in /sys/bus/event_source/devices); tracefs not "
                f"mounted, so kprobe_events could not be checked ({TRACEFS_MOUNT_CMD})")
    have = _exists(t / "kprobe_events")
    if have:
        return None
    if have is None:
        return f"could not check kprobes: {t} is not readable (needs root)"
    return "kprobes not built (no kprobe_events in tracefs, no kprobe PMU: CONFIG_KPROBES off)"


#: set to 1: function hooks take their kprobe candidate even where fentry loads (to compare the
#: two, tests/bench/bench_hooks.py; or to step around a trampoline problem)
NO_FENTRY_ENV = "MOETRACE_NO_FENTRY"


def fentry_reason(root: str | os.PathLike, func: str, privileged: bool) -> str | None:
    """None when an fentry program (a BPF trampoline) can be loaded on ``func`` here, else the
    kernel's reason. Asked by loading a two-instruction fentry program (the live kernel only:
    a fake tree answers from its files). EPERM before the verifier is a symptom; the causes are
    named where they can be read: this machine kind's ``kernel.init_private`` (a non-upstream
    patch that lets only PID 1 load fentry / fexit / fmod_ret / freplace / LSM programs,
    checked in bpf_prog_load before the verifier; found by reading the kernel's code: no log
    line, no lockdown message), else lockdown."""
    if os.environ.get(NO_FENTRY_ENV, "").strip() not in ("", "0"):
        return f"fentry turned off ({NO_FENTRY_ENV}=1): kprobes are the fallback"
    if not btf_available(root):
        return "no kernel BTF (/sys/kernel/btf/vmlinux): fentry needs the function's BTF"
    ip = (_read(_p(root, "proc/sys/kernel/init_private")) or "").strip()
    if _rootkey(root) != "/":  # a fake tree: its kallsyms stands for the BTF's functions
        if not kallsyms_count(func, root):
            return f"no BTF for function {func} (inlined, or static in several copies)"
        return _init_private_reason() if ip == "1" else None
    if not privileged:
        return "could not check fentry: loading a BPF program needs root (CAP_BPF + CAP_PERFMON)"
    from moetrace.kernel.libbpf import trial_fentry

    err, log = trial_fentry(func)
    if err == 0:
        return None
    if err == errno.ENOENT and log.startswith("no BTF"):
        return f"{log} (inlined, or static in several copies)"
    if err == errno.EPERM and not log:
        if ip == "1" and os.getpid() != 1:
            return _init_private_reason()
        lock = (_read(_p(root, "sys/kernel/security/lockdown")) or "").strip()
        return ("fentry load refused (EPERM) before the verifier ran" +
                (f"; lockdown: {lock}" if lock else "") + "; kprobes are the fallback")
    last = log.splitlines()[-1] if log else ""
    return f"fentry load refused ({errno.errorcode.get(err, err)}){': ' + last if last else ''}"


def _init_private_reason() -> str:
    return ("kernel.init_private=1: this kernel (a non-upstream patch) lets only PID 1 load fentry/fexit/"
            "LSM programs (bpf_prog_load returns EPERM before the verifier, with no log)")


def btf_available(root: str | os.PathLike = "/") -> bool:
    """True when the kernel exposes its BTF (/sys/kernel/btf/vmlinux)."""
    return _p(root, "sys/kernel/btf/vmlinux").exists()


def perf_events_available(root: str | os.PathLike = "/") -> bool:
    """True when perf events exist (software PMU for cpu-clock sampling)."""
    return (_p(root, "proc/sys/kernel/perf_event_paranoid").exists()
            and _p(root, "sys/bus/event_source/devices/software").exists())


# -- MGLRU ------------------------------------------------------------------------------------

def mglru_state(root: str | os.PathLike = "/") -> dict[str, Any] | None:
    """MGLRU from /sys/kernel/mm/lru_gen, or None when the kernel has no MGLRU.

    {"enabled_raw": "0x0007", "enabled_mask": 7, "on": bool, "min_ttl_ms": int | None,
    "debugfs_lru_gen": bool (readable <debugfs>/lru_gen)}"""
    d = _p(root, "sys/kernel/mm/lru_gen")
    if not d.is_dir():
        return None
    raw = (_read(d / "enabled") or "").strip()
    mask: int | None
    try:
        mask = int(raw, 0)
    except ValueError:
        mask = 1 if raw in ("y", "Y", "1") else (0 if raw in ("n", "N", "0") else None)
    ttl_txt = (_read(d / "min_ttl_ms") or "").strip()
    dbg = debugfs_path(root)
    return {
        "enabled_raw": raw or None,
        "enabled_mask": mask,
        "on": bool(mask),
        "min_ttl_ms": int(ttl_txt) if ttl_txt.isdigit() else None,
        "debugfs_lru_gen": bool(dbg is not None and os.access(dbg / "lru_gen", os.R_OK)),
    }


# -- the kernel release ----------------------------------------------------------------------

def osrelease(root: str | os.PathLike = "/") -> str | None:
    """The running kernel's release (/proc/sys/kernel/osrelease)."""
    t = _read(_p(root, "proc/sys/kernel/osrelease"))
    return t.strip() if t else None


# -- privileges, BPF --------------------------------------------------------------------------

def privileges(root: str | os.PathLike = "/") -> dict[str, bool]:
    """{"root", "cap_bpf", "cap_perfmon", "cap_sys_admin"} from <root>/proc/self/status
    (effective uid 0; CapEff bits). CAP_SYS_ADMIN implies what CAP_BPF/CAP_PERFMON give
    on kernels that predate them, so both are reported as held when it is."""
    text = _read(_p(root, "proc/self/status")) or ""
    capeff = 0
    euid: int | None = None
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            capeff = int(line.split()[1], 16)
        elif line.startswith("Uid:"):
            f = line.split()
            if len(f) >= 3:
                euid = int(f[2])
    if euid is None and _is_live_root(root):
        euid = os.geteuid()
    has = lambda bit: bool(capeff >> bit & 1)  # noqa: E731
    admin = has(CAP_SYS_ADMIN)
    return {"root": euid == 0, "cap_bpf": has(CAP_BPF) or admin,
            "cap_perfmon": has(CAP_PERFMON) or admin, "cap_sys_admin": admin}


_BPF_PROG_LOAD = 5
_BPF_PROG_TYPE_SOCKET_FILTER = 1


class _BpfProgLoadAttr(ctypes.Structure):
    _fields_ = [("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32),
                ("insns", ctypes.c_uint64), ("license", ctypes.c_uint64),
                ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
                ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32),
                ("prog_flags", ctypes.c_uint32), ("pad", ctypes.c_uint8 * 64)]


@functools.lru_cache(maxsize=1)
def _bpf_probe_load() -> tuple[bool, str]:
    from moetrace.kernel.syscalls import bpf_nr, sys_bpf

    if bpf_nr() is None:
        return False, f"could not check: bpf(2) syscall number unknown on {os.uname().machine}"
    # r0 = 0; exit  (BPF_ALU64|BPF_MOV|BPF_K = 0xb7, BPF_JMP|BPF_EXIT = 0x95)
    insns = (ctypes.c_uint64 * 2)(0xB7, 0x95)
    lic = ctypes.create_string_buffer(b"GPL")
    attr = _BpfProgLoadAttr(prog_type=_BPF_PROG_TYPE_SOCKET_FILTER, insn_cnt=2,
                            insns=ctypes.addressof(insns), license=ctypes.addressof(lic))
    fd = sys_bpf(_BPF_PROG_LOAD, attr)
    if fd < 0:
        return False, f"bpf(BPF_PROG_LOAD) of a trivial socket filter failed: {os.strerror(-fd)}"
    os.close(fd)
    return True, "bpf(BPF_PROG_LOAD) of a trivial socket filter works"


def bpf_usable(root: str | os.PathLike = "/") -> tuple[bool, str]:
    """Whether the bpf(2) syscall works for this process: (ok, detail).

    On the live system loads a two-instruction socket filter (and closes it); on a fake
    tree only reads /proc/sys/kernel/unprivileged_bpf_disabled with :func:`privileges`.
    Tracing programs additionally need CAP_BPF + CAP_PERFMON (or root)."""
    if _is_live_root(root):
        return _bpf_probe_load()
    priv = privileges(root)
    txt = (_read(_p(root, "proc/sys/kernel/unprivileged_bpf_disabled")) or "").strip()
    if txt == "":
        return False, "no /proc/sys/kernel/unprivileged_bpf_disabled: BPF syscall not built"
    if priv["root"] or priv["cap_bpf"] or txt == "0":
        return True, f"unprivileged_bpf_disabled={txt}, root={priv['root']}, CAP_BPF={priv['cap_bpf']}"
    return False, f"unprivileged_bpf_disabled={txt} and neither root nor CAP_BPF"


# -- cgroups, PSI -----------------------------------------------------------------------------

def cgroup_memory(root: str | os.PathLike = "/") -> dict[str, Any]:
    """Where a memory limit can be set.

    {"v1": mount point of the v1 memory controller or None,
     "v2": the cgroup2 mount point when its cgroup.controllers lists "memory", else None,
     "v2_mount": the cgroup2 mount point or None, "v2_controllers": [names],
     "preferred": "v2" | "v1" | None}  (paths as the kernel names them, not under root)"""
    v1 = v2_mount = None
    for _src, target, fstype, opts in _mounts(root):
        if fstype == "cgroup" and "memory" in opts and v1 is None:
            v1 = target
        elif fstype == "cgroup2" and v2_mount is None:
            v2_mount = target
    controllers: list[str] = []
    if v2_mount is not None:
        controllers = ((_read(_p(root, v2_mount, "cgroup.controllers")) or "").split())
    v2 = v2_mount if "memory" in controllers else None
    return {"v1": v1, "v2": v2, "v2_mount": v2_mount, "v2_controllers": controllers,
            "preferred": "v2" if v2 else ("v1" if v1 else None)}


def psi_available(root: str | os.PathLike = "/") -> bool:
    """True when /proc/pressure/memory reads (it exists but fails with EOPNOTSUPP under psi=0)."""
    t = _read(_p(root, "proc/pressure/memory"))
    return bool(t and t.startswith(("some", "full")))


# -- one cached view --------------------------------------------------------------------------

class Features:
    """A cached view of one kernel (``root``), with a reason for every "no".

    :func:`moetrace.record.spec.resolve` asks only this object, so a test can hand it a
    fake tree. The ``*_reason`` methods return None when the thing is available."""

    def __init__(self, root: str | os.PathLike = "/", mount: bool = False):
        self.root = _rootkey(root)
        self.notes: list[str] = []
        before = len(_MOUNT_NOTES)
        self.tracefs = tracefs_path(self.root, mount=mount)
        self.debugfs = debugfs_path(self.root, mount=mount)
        self.notes.extend(_MOUNT_NOTES[before:])
        self.privileges = privileges(self.root)
        self.btf = btf_available(self.root)
        self.mglru = mglru_state(self.root)
        self.osrelease = osrelease(self.root)
        self._cache: dict[Any, Any] = {}

    def _memo(self, key: Any, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def bpf(self) -> tuple[bool, str]:
        """(usable, detail) of the bpf(2) syscall."""
        return self._memo("bpf", lambda: bpf_usable(self.root))

    def tracepoint_reason(self, category: str, event: str) -> str | None:
        if self.tracefs is None:
            return f"tracefs not mounted ({TRACEFS_MOUNT_CMD}, or `moetrace doctor --mount`)"
        return _tracepoint_reason_in(self.tracefs, category, event)

    def tracepoint_format(self, category: str, event: str) -> dict[str, FieldSpec] | None:
        """The format file's fields (None: no such tracepoint, or tracefs unreadable); on the live
        system as root, kept for this boot (:data:`BOOT_CACHE`): read once per boot, not per run."""
        if self.tracefs is None:
            return None
        live = self.root == "/"
        fmt = _disk_format(category, event) if live else None
        if fmt is None:
            fmt = _format_cached(str(self.tracefs), category, event)[1]
            if fmt is not None and live:
                _remember_format(category, event, fmt)
        return fmt

    def tracepoint_fields(self, category: str, event: str, ctx_struct: str | None = None) -> frozenset[str] | None:
        """The field names of tracepoint ``category:event``'s format, without reading it where the
        kernel's BTF describes them: ``ctx_struct`` is the struct a probe's program takes as its
        context (``trace_event_raw_<class>``, from the object's BTF), and vmlinux's own copy of
        it lists the running kernel's fields (:meth:`Btf.tracepoint_fields`). The syscalls:*
        events share one generic struct (their fields come from syscall metadata, not BTF):
        those, and any struct this kernel's BTF lacks, come from the format file."""
        if ctx_struct and ctx_struct.startswith("trace_event_raw_") and category != "syscalls":
            names = self._class_fields(ctx_struct)
            if names is not None:
                return frozenset(names)
        fmt = self.tracepoint_format(category, event)
        return None if fmt is None else frozenset(fmt)

    def _class_fields(self, ctx_struct: str) -> list[str] | None:
        """:meth:`Btf.tracepoint_fields` of the kernel's BTF (kept for this boot when live)."""
        live = self.root == "/"
        names = _disk_get("fields", ctx_struct) if live else None
        if names is None:
            b = self.vmlinux_btf()
            found = b.tracepoint_fields(ctx_struct) if b is not None else None
            if found is None:
                return None
            names = list(found)
            if live:
                _disk_put("fields", ctx_struct, names)
        return names

    def program_contexts(self, obj: str | os.PathLike) -> dict[str, str]:
        """{program: the struct it takes as context} of a compiled probe object
        (:func:`moetrace.kernel.btf.object_ctx_structs`); kept for this boot when live, by the
        object's path, size and mtime."""
        from moetrace.kernel.btf import object_ctx_structs

        if self.root != "/":
            return object_ctx_structs(obj)
        try:
            st = os.stat(obj)
        except OSError:
            return {}
        key = f"{os.fspath(obj)} {st.st_size} {st.st_mtime_ns}"
        ctx = _disk_get("objects", key)
        if ctx is None:
            ctx = object_ctx_structs(obj)
            if ctx:
                _disk_put("objects", key, ctx)
        return ctx

    def vmlinux_btf(self):
        """The kernel's BTF (:class:`moetrace.kernel.btf.Btf`), parsed once; None without it."""
        def load():
            from moetrace.errors import MoetraceError
            from moetrace.kernel import btf

            if self.root == "/":
                return btf.vmlinux()
            try:
                return btf.load(_p(self.root, "sys/kernel/btf/vmlinux"))
            except (MoetraceError, OSError):
                return None
        return self._memo("vmlinux_btf", load) if self.btf else None

    def kprobes_reason(self) -> str | None:
        return self._memo("kprobes", lambda: kprobes_reason(self.root))

    def fentry_reason(self, func: str) -> str | None:
        """None when an fentry program on ``func`` loads here, else the kernel's reason."""
        privileged = bool(self.privileges.get("root") or self.privileges.get("cap_bpf"))
        return self._memo(("fentry", func), lambda: fentry_reason(self.root, func, privileged))

    def symbol_reason(self, symbol: str) -> str | None:
        """None when ``symbol`` is in kallsyms exactly once, else why it cannot be attached."""
        n = kallsyms_count(symbol, self.root)
        if n is None:
            return "could not check: /proc/kallsyms is not readable"
        if n == 0:
            clones = [s for s in kallsyms_matching(symbol, self.root) if s != symbol]
            extra = f" (present as {', '.join(clones)})" if clones else ""
            return f"symbol {symbol} not in /proc/kallsyms{extra}"
        if n > 1:
            return f"symbol {symbol} has {n} static copies in /proc/kallsyms (attach by name is ambiguous)"
        return None

    def perf_event_reason(self, target: str) -> str | None:
        if not perf_events_available(self.root):
            return "perf events not available (no software PMU / perf_event_paranoid)"
        return None

    def debugfs_reason(self, relpath: str) -> str | None:
        if relpath.startswith("lru_gen") and self.mglru is None:
            return "MGLRU not built (no /sys/kernel/mm/lru_gen)"
        if self.debugfs is None:
            return f"debugfs not mounted ({DEBUGFS_MOUNT_CMD})"
        p = self.debugfs / relpath
        have = _exists(p)
        if have is None:
            return f"could not check {relpath}: {self.debugfs} is not readable (needs root)"
        if have:
            return None if os.access(p, os.R_OK) else f"could not read {p} (needs root)"
        return f"no {relpath} in debugfs ({self.debugfs})"


def clear_cache() -> None:
    """Forget cached answers (after a mount, or between tests)."""
    _format_cached.cache_clear()
    _tracepoint_state.cache_clear()
    _DISK.clear()
    _kallsyms.cache_clear()
    _bpf_probe_load.cache_clear()
