"""Per-iteration counters: the replay announces each iteration, the recorder moves the
pagecache probe's epoch, so every count lands in the iteration that caused it.

The channel is a Unix socket pair: ``moetrace record`` keeps one end, the command
inherits the other as ``MOETRACE_PHASE_FD``. The replay (moetrace.replay) speaks a
line protocol, each line answered before it goes on, so an epoch switch is exact:

    hello <warmup passes> <measured passes> <iterations per pass>   -> "k iteration|pass|phase"
    i <phase> <repeat> <iteration>                                  -> "k"
    done                                                            -> "k"

The answer to ``hello`` says how finely the recorder can keep epochs (the probe's
``EPOCHS`` slots are fixed when it compiles): ``iteration`` (one epoch per replayed
iteration), ``pass`` (one per warm-up / measured pass) or ``phase`` (setup, warmup,
measured, after). In ``pass`` / ``phase`` mode the replay announces only the first
iteration of each pass. The announcement is made before the iteration's timed
interval begins, so it never counts in iteration durations.

Epoch 0 is ``setup`` (pool open, arena preload: everything before the first iteration);
the epoch after ``done`` is ``after``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

PHASE_FD_ENV = "MOETRACE_PHASE_FD"
#: per-epoch counter slots the recorder allows in total (x 24 bytes of kernel memory)
EPOCH_SLOTS = 1 << 20
MAX_EPOCHS = 4096
MIN_EPOCHS = 4  # setup, warmup, measured, after


def epochs_for(n_slots_per_epoch: int) -> int:
    """EPOCHS for a pool of ``n_slots_per_epoch`` counters (experts + unattributed)."""
    return int(max(MIN_EPOCHS, min(MAX_EPOCHS, EPOCH_SLOTS // max(1, n_slots_per_epoch))))


@dataclass
class Epoch:
    epoch: int
    phase: str
    repeat: int | None
    iteration: int | None
    start_ns: int
    end_ns: int | None = None
    folded: bool = False


@dataclass
class PhaseServer:
    """The recorder's end of the channel, served by a thread (the main thread polls rings).

    ``set_epoch(e)`` writes the probe's ``epoch_now[0]``; it is called before the answer
    is sent, so the replay starts the iteration only once its epoch is in place."""

    sock: socket.socket
    set_epoch: Callable[[int], None]
    n_epochs: int
    epochs: list[Epoch] = field(default_factory=list)
    mode: str | None = None
    errors: list[str] = field(default_factory=list)
    messages: int = 0

    def __post_init__(self) -> None:
        self.epochs.append(Epoch(0, "setup", None, None, time.monotonic_ns()))
        self._thread = threading.Thread(target=self._run, name="moetrace-phase", daemon=True)

    def start(self) -> "PhaseServer":
        self._thread.start()
        return self

    def _new(self, phase: str, repeat: int | None, iteration: int | None) -> None:
        now = time.monotonic_ns()
        last = self.epochs[-1]
        if last.end_ns is None:
            last.end_ns = now
        e = len(self.epochs)
        if e >= self.n_epochs:  # cannot happen with the hello negotiation; kept exact anyway
            last.folded = True
            last.end_ns = None
            return
        self.epochs.append(Epoch(e, phase, repeat, iteration, now))
        self.set_epoch(e)

    def _answer(self, hello: tuple[int, int, int]) -> str:
        w, p, n = hello
        if (w + p) * n + 2 <= self.n_epochs:
            return "iteration"
        if w + p + 2 <= self.n_epochs:
            return "pass"
        return "phase"

    def _handle(self, line: bytes) -> bytes:
        parts = line.decode("ascii", "replace").split()
        if not parts:
            return b"k\n"
        self.messages += 1
        if parts[0] == "hello" and len(parts) == 4:
            try:
                self.mode = self._answer((int(parts[1]), int(parts[2]), int(parts[3])))
            except ValueError:
                self.errors.append(f"bad hello {line[:60]!r}")
                self.mode = "phase"
            return f"k {self.mode}\n".encode()
        if parts[0] == "i" and len(parts) == 4:
            phase = parts[1]
            try:
                rep, it = int(parts[2]), int(parts[3])
            except ValueError:
                self.errors.append(f"bad iteration line {line[:60]!r}")
                return b"k\n"
            last = self.epochs[-1]
            if self.mode == "iteration":
                self._new(phase, rep, it)
            elif self.mode == "pass":
                if (last.phase, last.repeat) != (phase, rep):
                    self._new(phase, rep, None)
            elif last.phase != phase:
                self._new(phase, None, None)
            return b"k\n"
        if parts[0] == "done":
            self._new("after", None, None)
            return b"k\n"
        self.errors.append(f"unknown message {line[:60]!r}")
        return b"k\n"

    def _run(self) -> None:
        buf = b""
        try:
            while True:
                chunk = self.sock.recv(4096)
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    try:
                        reply = self._handle(line)
                    except Exception as e:  # noqa: BLE001 - never leave the replay waiting
                        self.errors.append(f"{type(e).__name__}: {e}")
                        reply = b"k\n"
                    self.sock.sendall(reply)
        except OSError as e:
            if e.errno not in (errno.EBADF, errno.ECONNRESET, errno.EPIPE):
                self.errors.append(f"phase channel: {e}")

    def stop(self) -> None:
        """Close our end (the replay is gone by now) and finish the last epoch."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(timeout=2)
        if self.epochs and self.epochs[-1].end_ns is None:
            self.epochs[-1].end_ns = time.monotonic_ns()


def channel() -> tuple[socket.socket, int]:
    """(the recorder's socket, the fd the command inherits)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = b.detach()
    os.set_inheritable(fd, True)
    return a, fd


class PhaseClient:
    """The replay's end: announce iterations and wait for the answer (at most 10 s;
    a recorder that stops answering turns the channel off, never the replay)."""

    TIMEOUT_S = 10.0

    def __init__(self, fd: int):
        self.sock = socket.socket(fileno=fd)
        self.sock.settimeout(self.TIMEOUT_S)
        self.mode: str | None = None
        self.error: str | None = None

    @classmethod
    def from_env(cls) -> "PhaseClient | None":
        v = os.environ.get(PHASE_FD_ENV)
        if not v:
            return None
        try:
            fd = int(v)
            os.fstat(fd)
        except (ValueError, OSError):
            return None
        os.environ.pop(PHASE_FD_ENV, None)  # not for the replay's own children
        try:
            return cls(fd)
        except OSError:
            return None

    def _ask(self, msg: str) -> str | None:
        if self.error is not None:
            return None
        try:
            self.sock.sendall(msg.encode())
            buf = b""
            while b"\n" not in buf:
                chunk = self.sock.recv(256)
                if not chunk:
                    raise OSError("the recorder closed the phase channel")
                buf += chunk
            return buf.split(b"\n", 1)[0].decode("ascii", "replace")
        except (OSError, socket.timeout) as e:
            self.error = str(e)
            return None

    def hello(self, warmup: int, passes: int, iterations: int) -> None:
        r = self._ask(f"hello {warmup} {passes} {iterations}\n")
        self.mode = r.split()[1] if r and len(r.split()) == 2 else None

    def iteration(self, phase: str, repeat: int, it: int) -> None:
        if self.mode == "iteration" or (self.mode in ("pass", "phase") and it == 0):
            self._ask(f"i {phase} {repeat} {it}\n")

    def done(self) -> None:
        if self.mode is not None:
            self._ask("done\n")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# ---------------------------------------------------------------------------
# reading a BPF array fast


def read_array(table, dtype: np.dtype) -> np.ndarray:
    """Every value of a BPF_ARRAY as a numpy structured array, by BPF_MAP_LOOKUP_BATCH
    (one syscall per 64 Ki entries instead of one per entry); falls back to per-entry
    lookups where the kernel lacks batch ops."""
    from bcc.libbcc import lib

    n = len(table)
    dtype = np.dtype(dtype)
    if dtype.itemsize != ctypes.sizeof(table.Leaf):
        raise ValueError(f"dtype {dtype} ({dtype.itemsize} B) != the map's value size {ctypes.sizeof(table.Leaf)} B")
    out = np.zeros(n, dtype)
    keys = np.zeros(min(n, 65536), np.uint32)
    chunk = len(keys)
    vals = np.zeros(chunk, dtype)
    in_b, out_b = ctypes.c_uint32(0), ctypes.c_uint32(0)
    got = 0
    first = True
    while got < n:
        cnt = ctypes.c_uint32(min(chunk, n - got))
        res = lib.bpf_lookup_batch(table.map_fd, None if first else ctypes.byref(in_b), ctypes.byref(out_b),
                                   ctypes.c_void_p(keys.ctypes.data), ctypes.c_void_p(vals.ctypes.data),
                                   ctypes.byref(cnt))
        err = ctypes.get_errno()
        k = cnt.value
        if k:
            out[keys[:k]] = vals[:k]
            got += k
        if res != 0:
            if err == errno.ENOENT:
                break
            if first and err in (errno.EINVAL, 524):  # 524: ENOTSUPP, no batch ops
                return _read_array_slow(table, dtype)
            raise OSError(err, f"BPF_MAP_LOOKUP_BATCH: {os.strerror(err)}")
        first = False
        in_b.value = out_b.value
        if k == 0:
            break
    return out


def _read_array_slow(table, dtype: np.dtype) -> np.ndarray:
    out = np.zeros(len(table), dtype)
    for i in range(len(table)):
        out[i] = np.frombuffer(bytes(table[ctypes.c_int(i)]), dtype)[0]
    return out
