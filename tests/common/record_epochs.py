"""Per-iteration counters: the replay writes each iteration's epoch into the pagecache probe's
epoch_now map (MOETRACE_EPOCH_MAP_FD) and the probe counts into it (moetrace.run.epochs).

No-kernel tier: the mode rule and the epoch bookkeeping (map writes recorded, or refused by
an fd that is no map). Live tier: a cold warm-up pass then two measured passes of a 23 x 1 MiB pool: every
added page lands in the first warm-up iteration, none in the measured ones, and the epochs
sum to the totals exactly.
"""


from __future__ import annotations


import json


import mmap


import os


import subprocess


import sys


import pytest


from moetrace.run import directory as rundir


from moetrace.replay.epochs import EpochWriter


from moetrace.run.epochs import epoch_mode, epochs_for, epochs_from_replay


N, MIB = 23, 1 << 20


PAGES = MIB // mmap.PAGESIZE


RECORD = [sys.executable, "-c", "from moetrace.cli.record import record; record.main(prog_name='moetrace record')"]


REPLAY = [sys.executable, "-m", "moetrace.cli.replay"]


from conftest import io_lock as _io_lock  # noqa: E402


class _Recorded(EpochWriter):
    """An EpochWriter whose map writes are recorded instead of made (no kernel)."""

    def __init__(self, n_epochs):
        super().__init__(-1, n_epochs)
        self.writes: list[int] = []

    def _write(self, e):
        self.writes.append(e)
        return True


def _replay_like(w, p, n, slots):
    wr = _Recorded(slots)
    wr.start(w, p, n)
    for ph, reps in (("warmup", w), ("measured", p)):
        for r in range(reps):
            for i in range(n):
                wr.iteration(ph, r, i)
    wr.done()
    return wr


def _moetrace(*args):
    r = subprocess.run([sys.executable, "-c", "from moetrace.cli import main; main()", *args],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


__all__ = ['EpochWriter', 'MIB', 'N', 'PAGES', 'RECORD', 'REPLAY', '_Recorded', '_io_lock', '_moetrace', '_replay_like', 'epoch_mode', 'epochs_for', 'epochs_from_replay', 'json', 'mmap', 'os', 'pytest', 'rundir', 'subprocess', 'sys']
