"""The replay's side of per-iteration counters: it moves the recorder's epoch itself.

``moetrace record`` hands the replay an inherited fd of the pagecache probe's one-entry
``epoch_now`` map (:data:`moetrace.run.epochs.EPOCH_MAP_FD_ENV`); :class:`EpochWriter`
writes the next epoch into it with one ``bpf(BPF_MAP_UPDATE_ELEM)`` before each
iteration's timed interval and logs the assignment for the replay's replay.json.
"""

from __future__ import annotations

import ctypes
import os
import time

from moetrace.kernel.syscalls import close_fd, sys_bpf
from moetrace.run.epochs import EPOCH_MAP_FD_ENV, EPOCHS_ENV, epoch_mode

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
        self.open_ended = False
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
        # an open-ended window keeps the last slot for "after": its passes beyond the slots fold
        # into the last measured epoch (the row says so); otherwise epoch_mode() leaves room
        full = e >= self.n_epochs - (1 if self.open_ended and phase != "after" else 0)
        if full:
            self.assigned[-1][5] = True
            return
        if self._write(e):
            self.assigned.append([e, phase, repeat, iteration, time.monotonic_ns(), False])

    def start(self, warmup: int, passes: int, iterations: int, open_ended: bool = False) -> None:
        """Before the first iteration: choose the mode, log epoch 0 (setup). ``open_ended``: the
        measured passes run for a duration (at least ``passes`` of them)."""
        self.open_ended = open_ended
        self.mode = epoch_mode(self.n_epochs, warmup, passes, iterations, open_ended)
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

    def begin_steps(self) -> None:
        """An engine's passes instead of a plan's iterations: one epoch per :meth:`step`
        (those beyond the slots fold into the last)."""
        self.mode = "step"
        self.assigned.append([0, "setup", None, None, 0, False])

    def step(self, phase: str, index: int | None) -> None:
        """A new epoch from now: the engine's next pass (load, prefill, decode ``index``)."""
        if self.mode == "step":
            self._new(phase, None, index)

    def done(self) -> None:
        if self.mode is not None:
            self._new("after", None, None)

    def summary(self) -> dict:
        return {"mode": self.mode, "slots": self.n_epochs, "error": self.error, "assigned": self.assigned}

    def close(self) -> None:
        close_fd(self.fd)
