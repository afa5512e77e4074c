"""Per-iteration counters: the replay moves the pagecache probe's epoch itself, so every
count lands in the iteration that caused it.

``moetrace record`` hands the command an inherited file descriptor of the probe's
one-entry ``epoch_now`` BPF map (``MOETRACE_EPOCH_MAP_FD``) and the number of epoch
slots the probe was loaded with (``MOETRACE_EPOCHS``). The replay
(:class:`EpochWriter`) writes the epoch number into the map with one
``bpf(BPF_MAP_UPDATE_ELEM)`` before each iteration's timed interval begins — a
synchronous syscall of a few microseconds, so the switch is exact and costs no round
trip — and logs which epoch was which in its replay.json (``epochs.assigned``).

How finely epochs are kept depends on the slots (fixed when the probe loads):
``iteration`` (one epoch per replayed iteration), else ``pass`` (one per warm-up /
measured pass), else ``phase`` (setup, warmup, measured, after). Epoch 0 is
``setup`` (pool open, arena preload: everything before the first iteration); the
epoch after the last iteration is ``after``.
"""

from __future__ import annotations

from dataclasses import dataclass



EPOCH_MAP_FD_ENV = "MOETRACE_EPOCH_MAP_FD"
EPOCHS_ENV = "MOETRACE_EPOCHS"
#: per-epoch counter slots the recorder allows in total (x 24 bytes of kernel memory)
EPOCH_SLOTS = 1 << 20
MAX_EPOCHS = 4096
MIN_EPOCHS = 4  # setup, warmup, measured, after


def epochs_for(n_slots_per_epoch: int) -> int:
    """EPOCHS for a pool of ``n_slots_per_epoch`` counters (experts + unattributed)."""
    return int(max(MIN_EPOCHS, min(MAX_EPOCHS, EPOCH_SLOTS // max(1, n_slots_per_epoch))))


def epoch_mode(n_epochs: int, warmup: int, passes: int, iterations: int, open_ended: bool = False) -> str:
    """How finely ``n_epochs`` slots can keep a replay of (warmup + passes) x iterations.
    ``open_ended`` (a measured window of a duration: its passes are not known before): per pass
    at most, the passes beyond the slots folded into the last measured one."""
    if open_ended:
        return "pass" if warmup + passes + 2 <= n_epochs else "phase"
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
