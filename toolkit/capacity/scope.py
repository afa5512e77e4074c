"""Capacity mechanisms: memory scopes (cgroup v2 or v1) and the mlocked balloon.

Memory scope (paper Algorithm 1, step 2). Where the cgroup v2 hierarchy offers
the memory controller (``cgroup.controllers`` lists ``memory``), a scope is a v2
cgroup with ``memory.max`` = limit and ``memory.swap.max`` = 0. Otherwise it is a
cgroup v1 directory at the memory controller's mount (found in /proc/mounts) with
``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where present,
i.e. no swap on top of the limit). Scope directories are named ``moetrace-<name>``
and sit directly under the hierarchy root.

Ownership. Before a scope directory is made, the owner's pid and start time are
written to ``/run/moetrace/scopes/moetrace-<name>.pid``. :func:`remove_stale_scopes`
removes every ``moetrace-*`` scope whose owner is dead (a SIGKILLed cell), killing
any task still inside it, and the owner files with them.

Balloon. A child process mmaps and mlocks anonymous memory so that about C
remains for the file tier: size = MemAvailable - C - headroom (measured after the
caches are dropped). It sets PR_SET_PDEATHSIG(SIGKILL) so it dies with its parent,
its VmLck is verified against its size, and sizes that would leave the machine
less than a safe reserve (MemTotal/16 within [256 MiB, 1 GiB], + 5% of MemTotal: 1 GiB + 5%
from 16 GiB up) are refused.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetrace.errors import ScopeError, UsageError
from moetrace.kernel.procfs import read_meminfo, read_mounts, read_vmlck
from moetrace.kernel.syscalls import set_pdeathsig

PREFIX = "moetrace-"
OWNER_DIR = "/run/moetrace/scopes"
PAGE = os.sysconf("SC_PAGE_SIZE")
UNLIMITED = None


@dataclass(frozen=True)
class MemoryController:
    """Where memory scopes are made: cgroup ``version`` 1 or 2 and its hierarchy root."""

    version: int
    mount: str


def find_memory_controller(root: str | os.PathLike = "/") -> MemoryController:
    """The cgroup v2 hierarchy if it has the memory controller, else the v1 memory mount.

    ``root`` prefixes both /proc/mounts and the returned mount (fake trees in tests)."""
    mounts = read_mounts(root)
    base = Path(root)
    for m in mounts:
        if m.fstype == "cgroup2":
            ctrl = base / m.target.lstrip("/") / "cgroup.controllers"
            try:
                if "memory" in ctrl.read_text().split():
                    return MemoryController(2, str(base / m.target.lstrip("/")))
            except OSError:
                pass
    for m in mounts:
        if m.fstype == "cgroup" and "memory" in m.options:
            return MemoryController(1, str(base / m.target.lstrip("/")))
    raise ScopeError("no cgroup memory controller is mounted (neither cgroup v2 with 'memory' in "
                     "cgroup.controllers nor a cgroup v1 'memory' mount)",
                     hint="mount one (`mount -t cgroup -o memory none /sys/fs/cgroup/memory`) or use "
                          "--mechanism balloon")


def scope_name(name: str) -> str:
    """'cell' -> 'moetrace-cell' (names already prefixed are kept)."""
    if not name or "/" in name or name in (".", ".."):
        raise UsageError(f"bad scope name {name!r}", hint="use letters, digits, '-', '_' and '.'")
    return name if name.startswith(PREFIX) else PREFIX + name


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _read_int(path: Path) -> int | None:
    try:
        s = path.read_text().strip()
    except OSError:
        return None
    if s == "max":
        return None
    try:
        return int(s)
    except ValueError:
        return None


def _read_kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        f = line.split()
        if len(f) == 2:
            try:
                out[f[0]] = int(f[1])
            except ValueError:
                pass
    return out


def proc_start_time(pid: int) -> int | None:
    """The start time of ``pid`` (/proc/PID/stat field 22, clock ticks since boot); None: gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """True if ``pid`` runs (and, when given, started at ``start_time`` — no pid reuse)."""
    st = proc_start_time(pid)
    if st is None:
        return False
    if start_time is not None and st != start_time:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Scope:
    """One ``moetrace-<name>`` memory scope (cgroup v1 or v2)."""

    def __init__(self, name: str, controller: MemoryController | None = None, owner_dir: str = OWNER_DIR):
        self.controller = controller or find_memory_controller()
        self.name = scope_name(name)
        self.path = Path(self.controller.mount) / self.name
        self.owner_file = Path(owner_dir) / f"{self.name}.pid"
        self.limit_bytes: int | None = None

    @property
    def version(self) -> int:
        return self.controller.version

    def exists(self) -> bool:
        """Whether the scope directory is present."""
        return self.path.is_dir()

    # creation ---------------------------------------------------------------------------------
    def create(self, limit_bytes: int | None) -> "Scope":
        """Make the scope with a memory limit (None: unlimited, for accounting only) and no swap.

        Records this process as owner first, so a killed owner's scope is found later."""
        if self.exists():
            raise ScopeError(f"scope {self.path} already exists",
                             hint="remove it first (remove_stale_scopes / a new `moetrace cell` does)")
        self.owner_file.parent.mkdir(parents=True, exist_ok=True)
        _write(self.owner_file, f"{os.getpid()} {proc_start_time(os.getpid())}\n")
        try:
            if self.version == 2:
                self._enable_v2_memory()
            self.path.mkdir()
            self.set_limit(limit_bytes)
        except OSError as e:
            self.remove()
            raise ScopeError(f"cannot create memory scope {self.path}: {e.strerror or e}",
                             hint="cells need root and a writable cgroup hierarchy (run as root)") from e
        return self

    def _enable_v2_memory(self) -> None:
        sub = Path(self.controller.mount) / "cgroup.subtree_control"
        if "memory" not in sub.read_text().split():
            _write(sub, "+memory")

    def set_limit(self, limit_bytes: int | None) -> None:
        """Set the memory limit (bytes, None = unlimited) and forbid swap."""
        self.limit_bytes = limit_bytes
        if self.version == 2:
            _write(self.path / "memory.max", "max" if limit_bytes is None else str(int(limit_bytes)))
            sw = self.path / "memory.swap.max"
            if sw.exists():
                _write(sw, "0")
            return
        lim = "-1" if limit_bytes is None else str(int(limit_bytes))
        memsw = self.path / "memory.memsw.limit_in_bytes"
        # memsw must stay >= limit: raise it first when growing, set it after when shrinking
        if memsw.exists() and limit_bytes is None:
            _write(memsw, "-1")
        _write(self.path / "memory.limit_in_bytes", lim)
        if memsw.exists() and limit_bytes is not None:
            _write(memsw, lim)
        sw = self.path / "memory.swappiness"
        if sw.exists():
            try:
                _write(sw, "0")
            except OSError:
                pass

    # membership -------------------------------------------------------------------------------
    def add_pid(self, pid: int) -> None:
        """Move a process (all its threads) into the scope."""
        _write(self.path / "cgroup.procs", str(int(pid)))

    def preexec(self):
        """A preexec_fn for subprocess.Popen: the child joins the scope before it execs
        (so before it reads any page) and gets PR_SET_PDEATHSIG(SIGKILL)."""
        procs = str(self.path / "cgroup.procs")

        def _join() -> None:
            with open(procs, "w") as fh:
                fh.write(str(os.getpid()))
            set_pdeathsig(signal.SIGKILL)
        return _join

    def pids(self) -> list[int]:
        """Processes in the scope."""
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    # counters ---------------------------------------------------------------------------------
    def usage_bytes(self) -> int | None:
        """Current charge (memory.current / memory.usage_in_bytes)."""
        return _read_int(self.path / ("memory.current" if self.version == 2 else "memory.usage_in_bytes"))

    def peak_bytes(self) -> int | None:
        """Peak charge (memory.peak v2, absent before Linux 5.19 -> None; max_usage_in_bytes v1)."""
        return _read_int(self.path / ("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"))

    def memory_stat(self) -> dict[str, int]:
        """memory.stat as {name: value} (v1 values in bytes or pages as the kernel states)."""
        return _read_kv(self.path / "memory.stat")

    def oom_events(self) -> dict[str, int]:
        """OOM counters: v2 memory.events (oom, oom_kill, max, ...); v1 memory.oom_control
        (oom_kill, under_oom) and failcnt (hits of the limit: normal under page-cache
        pressure, not an OOM)."""
        if self.version == 2:
            return _read_kv(self.path / "memory.events")
        out = _read_kv(self.path / "memory.oom_control")
        fc = _read_int(self.path / "memory.failcnt")
        if fc is not None:
            out["failcnt"] = fc
        return out

    def oom_killed(self) -> int:
        """Number of OOM kills in the scope (v2 memory.events oom_kill; v1 oom_control oom_kill)."""
        ev = self.oom_events()
        return int(ev.get("oom_kill", 0)) + (int(ev.get("under_oom", 0)) if self.version == 1 else 0)

    def counters(self) -> dict[str, Any]:
        """JSON-able counters for a snapshot."""
        return {"path": str(self.path), "exists": self.exists(), "usage_bytes": self.usage_bytes(),
                "peak_bytes": self.peak_bytes(), "oom_events": self.oom_events(), "stat": self.memory_stat(),
                "pids": self.pids()}

    # removal ----------------------------------------------------------------------------------
    def remove(self, kill: bool = False, retries: int = 50, delay: float = 0.05) -> bool:
        """Remove the scope: SIGKILL its tasks when ``kill``, move any left over to the
        parent, force_empty (v1), rmdir; retry while the kernel still holds it. Returns
        True when the directory is gone (the owner file is removed then)."""
        parent = self.path.parent / "cgroup.procs"
        for i in range(retries):
            if not self.exists():
                break
            pids = self.pids()
            if pids and kill:
                for p in pids:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            elif pids:
                for p in pids:
                    try:
                        _write(parent, str(p))
                    except OSError:
                        pass
            if not pids and self.version == 1 and i == 0 and (self.path / "memory.force_empty").exists():
                try:
                    _write(self.path / "memory.force_empty", "0")
                except OSError:
                    pass
            try:
                self.path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno not in (errno.EBUSY, errno.ENOTEMPTY, errno.EAGAIN, errno.EINTR):
                    raise ScopeError(f"cannot remove memory scope {self.path}: {e.strerror}") from e
                time.sleep(delay * min(i + 1, 10))
        gone = not self.exists()
        if gone:
            try:
                self.owner_file.unlink()
            except FileNotFoundError:
                pass
        return gone

    def owner(self) -> tuple[int, int | None] | None:
        """(pid, start time) recorded by the creator, or None when no owner file exists."""
        try:
            f = self.owner_file.read_text().split()
        except OSError:
            return None
        try:
            return int(f[0]), (int(f[1]) if len(f) > 1 and f[1] != "None" else None)
        except (ValueError, IndexError):
            return None


def list_scopes(controller: MemoryController | None = None, owner_dir: str = OWNER_DIR) -> list[Scope]:
    """Every ``moetrace-*`` scope directory under the hierarchy root."""
    c = controller or find_memory_controller()
    try:
        names = sorted(n for n in os.listdir(c.mount) if n.startswith(PREFIX))
    except OSError:
        return []
    return [Scope(n, c, owner_dir) for n in names if (Path(c.mount) / n).is_dir()]


def remove_stale_scopes(name: str | None = None, controller: MemoryController | None = None,
                        owner_dir: str = OWNER_DIR) -> list[str]:
    """Remove scope ``name`` whoever owns it (Algorithm 1 step 1: terminate any existing
    scope of that name), and every ``moetrace-*`` scope whose recorded owner is dead or
    which has no owner file and no tasks. Tasks left inside are SIGKILLed. Returns the
    removed paths; raises ScopeError for one that will not go."""
    c = controller or find_memory_controller()
    target = scope_name(name) if name else None
    removed = []
    for s in list_scopes(c, owner_dir):
        own = s.owner()
        stale = (s.name == target
                 or (own is not None and not pid_alive(*own))
                 or (own is None and not s.pids()))
        if own is not None and own[0] == os.getpid() and s.name != target:
            stale = False
        if not stale:
            continue
        if not s.remove(kill=True):
            raise ScopeError(f"stale memory scope {s.path} cannot be removed (tasks: {s.pids()})",
                             hint=f"kill its tasks, then `rmdir {s.path}`")
        removed.append(str(s.path))
    # owner files whose scope is gone
    try:
        for f in Path(owner_dir).glob(f"{PREFIX}*.pid"):
            if not (Path(c.mount) / f.name[:-4]).exists():
                f.unlink(missing_ok=True)
    except OSError:
        pass
    return removed


# -- balloon -----------------------------------------------------------------------------------

#: the fixed part of the safe reserve: MemTotal / 16, at least 256 MiB, at most 1 GiB
RESERVE_FIXED_MIN, RESERVE_FIXED_MAX = 256 << 20, 1 << 30
#: the reserve itself, where the machine is disposable (a lab guest: `lab matrix` sets it to what a
#: guest needs to finish its cell and report; a guest that dies of memory is a cell not retained)
RESERVE_ENV = "MOETRACE_BALLOON_RESERVE"


def safe_reserve_bytes(mem_total: int) -> int:
    """The memory a balloon must leave to the machine: MemTotal / 16 clamped to [256 MiB,
    1 GiB], plus 5% of MemTotal. From 16 GiB up that is the 1 GiB + 5% it always was; a
    small machine (a 4 GiB lab guest: 256 MiB + 205 MiB) keeps what its kernel and the
    recorder need without a reserve larger than the machine's spare memory, so a balloon
    can lock about 80% of it and never all of it. ``MOETRACE_BALLOON_RESERVE`` (a size) replaces
    the rule on a disposable machine."""
    env = os.environ.get(RESERVE_ENV, "").strip()
    if env:
        from moetrace.inputs.geometry import parse_bytes

        return parse_bytes(env)
    fixed = min(RESERVE_FIXED_MAX, max(RESERVE_FIXED_MIN, mem_total // 16))
    return fixed + mem_total // 20


def balloon_size(capacity: int, headroom: int, root: str | os.PathLike = "/") -> tuple[int, dict[str, int]]:
    """(balloon bytes, facts) so that about ``capacity`` + ``headroom`` stays available:
    MemAvailable - capacity - headroom, page-rounded down. Raises UsageError when the
    balloon would be <= 0 or would leave less than :func:`safe_reserve_bytes`."""
    mi = read_meminfo(root)
    avail, total = mi["MemAvailable_bytes"], mi["MemTotal_bytes"]
    size = (avail - capacity - headroom) // PAGE * PAGE
    reserve = safe_reserve_bytes(total)
    facts = {"mem_available_bytes": avail, "mem_total_bytes": total, "reserve_bytes": reserve,
             "balloon_bytes": size}
    if size <= 0:
        raise UsageError(f"a balloon cannot make capacity {capacity} B: only {avail} B are available "
                         f"(capacity + headroom {headroom} B needs a negative balloon)",
                         hint="choose a smaller --capacity or use --mechanism cgroup")
    if avail - size < reserve:
        raise UsageError(f"a balloon of {size} B would leave {avail - size} B, below the safe reserve of "
                         f"{reserve} B (MemTotal/16 within [256 MiB, 1 GiB], + 5% of MemTotal)",
                         hint=f"use --capacity >= {max(0, reserve - headroom)} B with the balloon, or "
                              "--mechanism cgroup for smaller capacities")
    return size, facts


_BALLOON_CODE = r"""
import ctypes, mmap, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, signal.SIGKILL, 0, 0, 0)
if os.getppid() != int(sys.argv[2]):
    sys.exit(3)
n = int(sys.argv[1])
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if len(sys.argv) > 3 and sys.argv[3] in ("on", "off"):  # before mlock faults the pages in
    m.madvise(mmap.MADV_HUGEPAGE if sys.argv[3] == "on" else mmap.MADV_NOHUGEPAGE)
buf = (ctypes.c_char * n).from_buffer(m)
if libc.mlock(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(n)) != 0:
    e = ctypes.get_errno()
    sys.stdout.write("error mlock %s\n" % os.strerror(e)); sys.stdout.flush(); sys.exit(4)
sys.stdout.write("locked %d\n" % n); sys.stdout.flush()
sys.stdin.read()
"""


class Balloon:
    """An mlocked anonymous balloon in a child process (dies with its parent).

    ``Balloon(size).start()`` returns once the child reports the memory locked and its
    VmLck has been read back into :attr:`vmlck_bytes`; ``stop()`` ends it. ``thp``: "on"
    madvises the balloon MADV_HUGEPAGE, "off" MADV_NOHUGEPAGE (before it is locked); None leaves
    it to the system's transparent_hugepage/enabled."""

    def __init__(self, size_bytes: int, scope: Scope | None = None, python: str = sys.executable,
                 thp: str | None = None):
        self.size_bytes = int(size_bytes)
        self.scope = scope
        self.python = python
        self.thp = thp
        self.proc: subprocess.Popen | None = None
        self.vmlck_bytes: int | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 600.0) -> "Balloon":
        """Spawn, wait until locked (mlock faults every page in), verify VmLck."""
        pre = self.scope.preexec() if self.scope else (lambda: set_pdeathsig(signal.SIGKILL))
        self.proc = subprocess.Popen([self.python, "-c", _BALLOON_CODE, str(self.size_bytes), str(os.getpid()),
                                      *([self.thp] if self.thp else [])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=pre,
                                     close_fds=True)
        import select

        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise ScopeError(f"the balloon did not lock {self.size_bytes} B within {timeout:.0f} s")
            r, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if r:
                b = os.read(self.proc.stdout.fileno(), 256)
                if not b:
                    break
                line += b
        text = line.decode().strip()
        if not text.startswith("locked"):
            rc = self.proc.poll()
            self.stop()
            raise ScopeError(f"the balloon failed to lock {self.size_bytes} B ({text or f'exit {rc}'})",
                             hint="mlock needs root or a large enough RLIMIT_MEMLOCK (ulimit -l)")
        self.vmlck_bytes = read_vmlck(self.proc.pid)
        return self

    def verified(self) -> bool:
        """VmLck equals the balloon size (page-rounded)."""
        want = -(-self.size_bytes // PAGE) * PAGE
        return self.vmlck_bytes is not None and abs(self.vmlck_bytes - want) <= PAGE

    def stop(self, timeout: float = 30.0) -> None:
        """End the balloon (close stdin, then SIGKILL) and reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f:
                    f.close()
            except OSError:
                pass
