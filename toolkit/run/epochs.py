"""Per-iteration counters: the replay moves the pagecache probe's epoch itself, so every
count lands in the iteration that caused it.

``moetrace record`` hands the command an inherited file descriptor of the probe's
one-entry ``epoch_now`` BPF map (``MOETRACE_EPOCH_MAP_FD``) and the number of epoch
slots the probe was compiled with (``MOETRACE_EPOCHS``). The replay
(:class:`EpochWriter`) writes the epoch number into the map with one
``bpf(BPF_MAP_UPDATE_ELEM)`` before each iteration's timed interval begins — a
synchronous syscall of a few microseconds, so the switch is exact and costs no round
trip — and logs which epoch was which in its replay.json (``epochs.assigned``).

How finely epochs are kept depends on the slots (fixed when the probe compiles):
``iteration`` (one epoch per replayed iteration), else ``pass`` (one per warm-up /
measured pass), else ``phase`` (setup, warmup, measured, after). Epoch 0 is
``setup`` (pool open, arena preload: everything before the first iteration); the
epoch after the last iteration is ``after``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from dataclasses import dataclass

import numpy as np

from moetrace.kernel.syscalls import sys_bpf

EPOCH_MAP_FD_ENV = "MOETRACE_EPOCH_MAP_FD"
EPOCHS_ENV = "MOETRACE_EPOCHS"
#: per-epoch counter slots the recorder allows in total (x 24 bytes of kernel memory)
EPOCH_SLOTS = 1 << 20
MAX_EPOCHS = 4096
MIN_EPOCHS = 4  # setup, warmup, measured, after


def epochs_for(n_slots_per_epoch: int) -> int:
    """EPOCHS for a pool of ``n_slots_per_epoch`` counters (experts + unattributed)."""
    return int(max(MIN_EPOCHS, min(MAX_EPOCHS, EPOCH_SLOTS // max(1, n_slots_per_epoch))))


def epoch_mode(n_epochs: int, warmup: int, passes: int, iterations: int) -> str:
    """How finely ``n_epochs`` slots can keep a replay of (warmup + passes) x iterations."""
    if (warmup + passes) * iterations + 2 <= n_epochs:
        return "iteration"
    if warmup + passes + 2 <= n_epochs:
        return "pass"
    return "phase"


@dataclass
class Epoch:
    epoch: int
    phase: str
    repeat: int | None
    iteration: int | None
    start_ns: int
    end_ns: int | None = None
    folded: bool = False


_BPF_MAP_UPDATE_ELEM = 2


class _UpdateAttr(ctypes.Structure):  # union bpf_attr, BPF_MAP_*_ELEM commands (UAPI, stable)
    _fields_ = [("map_fd", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("key", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


class EpochWriter:
    """The replay's side: set the recorder's epoch before each iteration.

    A write that fails turns the writer off (``error`` says why), never the replay."""

    def __init__(self, fd: int, n_epochs: int):
        self.fd, self.n_epochs = fd, n_epochs
        self.mode: str | None = None
        self.error: str | None = None
        self.assigned: list[list] = []  # [epoch, phase, repeat, iteration, start_ns]
        self._last: tuple | None = None
        self._key = ctypes.c_uint32(0)
        self._val = ctypes.c_uint32(0)
        self._attr = _UpdateAttr(fd, 0, ctypes.addressof(self._key), ctypes.addressof(self._val), 0)

    @classmethod
    def from_env(cls) -> "EpochWriter | None":
        fd, n = os.environ.pop(EPOCH_MAP_FD_ENV, None), os.environ.pop(EPOCHS_ENV, None)
        if not fd or not n:
            return None
        try:
            w = cls(int(fd), int(n))
            os.fstat(w.fd)
        except (ValueError, OSError):
            return None
        return w

    def _write(self, e: int) -> bool:
        if self.error is not None:
            return False
        self._val.value = e
        r = sys_bpf(_BPF_MAP_UPDATE_ELEM, self._attr)
        if r != 0:
            self.error = f"BPF_MAP_UPDATE_ELEM on fd {self.fd}: {os.strerror(-r)}"
            return False
        return True

    def _new(self, phase: str, repeat: int | None, iteration: int | None) -> None:
        e = len(self.assigned)
        if e >= self.n_epochs:  # cannot happen with epoch_mode(); kept exact anyway
            self.assigned[-1][5] = True
            return
        if self._write(e):
            self.assigned.append([e, phase, repeat, iteration, time.monotonic_ns(), False])

    def start(self, warmup: int, passes: int, iterations: int) -> None:
        """Before the first iteration: choose the mode, log epoch 0 (setup)."""
        self.mode = epoch_mode(self.n_epochs, warmup, passes, iterations)
        self.assigned.append([0, "setup", None, None, 0, False])  # the recorder starts at 0 before the exec

    def iteration(self, phase: str, repeat: int, it: int) -> None:
        if self.mode is None:
            return
        key = (phase, repeat, it) if self.mode == "iteration" else (phase, repeat) if self.mode == "pass" else phase
        if key == self._last:
            return
        self._last = key
        if self.mode == "iteration":
            self._new(phase, repeat, it)
        elif self.mode == "pass":
            self._new(phase, repeat, None)
        else:
            self._new(phase, None, None)

    def done(self) -> None:
        if self.mode is not None:
            self._new("after", None, None)

    def summary(self) -> dict:
        return {"mode": self.mode, "slots": self.n_epochs, "error": self.error, "assigned": self.assigned}

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def epochs_from_replay(doc: dict | None, start_ns: int, end_ns: int) -> list[Epoch] | None:
    """The epochs a replay assigned (its replay.json ``epochs``), ends filled in; epoch 0
    (setup) starts at ``start_ns`` (the command's start) and the last ends at ``end_ns``."""
    ep = (doc or {}).get("epochs") or {}
    rows = ep.get("assigned")
    if not rows:
        return None
    out = [Epoch(int(r[0]), str(r[1]), r[2], r[3], int(r[4]), None, bool(r[5]) if len(r) > 5 else False)
           for r in rows]
    out[0].start_ns = start_ns
    for a, b in zip(out, out[1:]):
        a.end_ns = b.start_ns
    out[-1].end_ns = end_ns
    return out


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
