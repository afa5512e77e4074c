"""The eviction controller for causal tests (issue 34, mechanism ``+lru_gen-bites:F``): 6.8's
one-pass kswapd emulated on any MGLRU kernel, in the guest.

It watches MemFree (``/proc/meminfo`` kept open and read with pread: the guest runs under TCG,
~20x slower than native) every ``interval_s``. When MemFree falls below the threshold it takes a
*bite*: it evicts ``pages`` (F x C) from the memcg that holds the pool's file pages through
MGLRU's debugfs file (mm/vmscan.c ``lru_gen_seq_write`` -> ``run_cmd``), in rounds::

    + memcg_id node max_seq 0 1          age (swappiness 0: file only; force_scan 1) when only
                                         two file generations remain (MIN_NR_GENS): eviction
                                         never takes the youngest two
    - memcg_id node (max_seq - 2) 0 N    evict up to N file pages, oldest generation first,
                                         through every generation but the youngest two

``run_eviction()`` evicts while ``seq >= min_seq[file]`` and fewer than N were reclaimed, so one
round drains min_seq toward max_seq - 2 as a 6.8 kswapd pass with ``nr_to_reclaim`` = Σhigh
would (``run_aging()`` wants ``seq == max_seq``; ``run_eviction()`` refuses ``seq + 2 > max_seq``
with EINVAL). A bite runs up to MAX_ROUNDS rounds until /proc/vmstat's ``pgsteal_direct`` (a
debugfs eviction counts there: reclaimer_offset() of a task that is neither kswapd nor
khugepaged) rose by N, a round frees nothing, or a write fails.

Threshold (the default, ``threshold_kb=None``, from /proc/zoneinfo at the start): one watermark
gap above the MemFree at which the zones stand at their high watermarks for an allocation of the
top zone T (the highest zone with managed pages below Movable)::

    threshold = high_T + (high_T - low_T) + Σ over the zones z below T of
                min(managed_z, high_z + protection_z[T])

kswapd wakes only when an allocation finds every eligible zone below its low watermark, and a
lower zone's free pages count for an allocation of T only above its watermark plus its
lowmem_reserve for T (``protection`` in /proc/zoneinfo): MemFree stays that high however hard the
page cache presses (a zone smaller than that keeps all its pages free; measured in a 1.25 GiB 6.12 guest: Σhigh + gap alone, 6 MiB, sat below the
MemFree at which kswapd woke, ~8 MiB, and the controller bit once while kswapd reclaimed 86k
pages). So the controller bites while the node still counts as balanced, and kswapd stays asleep
as long as the bites keep up.

Each bite is a row of ``bites.csv`` (in the cell's lab directory) (written and flushed as it happens: no memory grows with
the window): CSV_COLUMNS. :meth:`BitesController.summary` sums it up (the guest wrapper keeps it
in guest_settings.json). Only with MGLRU on: :func:`unavailable` says why not otherwise.
"""

from __future__ import annotations

import csv
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIN_NR_GENS = 2  # include/linux/mmzone.h: eviction keeps the youngest two generations
MAX_ROUNDS = 8
#: the least time between two bites (a bite that freed nothing is not retried at once)
MIN_GAP_S = 0.2
CSV_NAME = "bites.csv"
CSV_COLUMNS = ("t_s", "memcg_id", "memcg_path", "node", "memfree_before_kb", "threshold_kb", "pages_asked",
               "min_seq_before", "max_seq_before", "oldest_gen_file_pages", "memcg_file_pages_before", "agings",
               "evictions", "min_seq_after", "max_seq_after", "memcg_file_pages_after", "steal_pages",
               "memfree_after_kb", "duration_ms", "error")


@dataclass(frozen=True)
class Lruvec:
    """One (memcg, node) of lru_gen as the controller needs it (file generations)."""

    memcg_id: int
    memcg_path: str
    node: int
    min_seq: int  # min_seq[file]: the full format's first generation not marked 'x' (the short
    # format's first with file pages: it skips an emptied generation the kernel keeps)
    max_seq: int
    oldest_file_pages: int
    file_pages: int  # over every generation


def lruvecs(text: str) -> list[Lruvec]:
    """Every (memcg, node) of an lru_gen / lru_gen_full text. The full format marks the file
    type's evicted generations (seq < min_seq[file]) with 'x': min_seq[file] is the first
    unmarked one. The short format lists the generations from min_seq[anon] unmarked: the
    first with file pages stands in for it."""
    from moetrace.kernel.lru_gen import parse

    sample = parse(text)
    by: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for g in sample.generations:
        by.setdefault((g["memcg_id"], g["node"]), []).append(g)
    out = []
    for (mid, node), gens in by.items():
        live = [g for g in gens if not g["file_evicted"]] or gens[-1:]
        first = live[0] if sample.full else next((g for g in live if g["nr_file_pages"] > 0), live[-1])
        out.append(Lruvec(mid, gens[0]["memcg_path"], node, first["seq"], gens[-1]["seq"], first["nr_file_pages"],
                          sum(g["nr_file_pages"] for g in live)))
    return out


def choose(vecs: list[Lruvec], memcg_path: str | None) -> Lruvec | None:
    """The lruvec to bite: the memcg at ``memcg_path`` (the cell's scope, where the pool's pages
    are charged; None while it does not exist or holds no file pages), or without a path the one
    holding the most file pages."""
    pool = [v for v in vecs if v.file_pages > 0 and memcg_path in (None, v.memcg_path)]
    return max(pool, key=lambda v: v.file_pages, default=None)


def round_commands(v: Lruvec, pages: int) -> list[str]:
    """One round of a bite on ``v``: age first when only two file generations remain, then
    evict up to ``pages`` from every generation but the youngest two."""
    cmds, max_seq = [], v.max_seq
    if max_seq - v.min_seq + 1 <= MIN_NR_GENS:
        cmds.append(f"+ {v.memcg_id} {v.node} {max_seq} 0 1")
        max_seq += 1
    cmds.append(f"- {v.memcg_id} {v.node} {max_seq - MIN_NR_GENS} 0 {pages}")
    return cmds


def bite_commands(lru_text: str, memfree_kb: int, threshold_kb: int, pages: int,
                  memcg_path: str | None = None) -> list[str]:
    """The command lines the controller writes first for this MemFree: none at or above the
    threshold, else the first round of a bite of ``pages`` (:func:`round_commands`)."""
    if memfree_kb >= threshold_kb or pages <= 0:
        return []
    v = choose(lruvecs(lru_text), memcg_path)
    return [] if v is None else round_commands(v, pages)


def default_threshold_kb(zones: list[dict[str, Any]], page_kb: int = 4) -> int:
    """The default threshold in kB from /proc/zoneinfo's zones of one node (the module's
    docstring): the top zone's high watermark and gap, each lower zone's high watermark and
    protection for the top zone."""
    idx = {id(z): i for i, z in enumerate(zones)}
    live = [z for z in zones if z.get("managed", 0) > 0 and z.get("zone") != "Movable"]
    if not live:
        return 0
    top = live[-1]
    pages = 2 * top.get("high", 0) - top.get("low", 0)
    for z in live[:-1]:
        prot = z.get("protection") or []
        reserve = z.get("high", 0) + (prot[idx[id(top)]] if idx[id(top)] < len(prot) else 0)
        pages += min(z["managed"], reserve)
    return pages * page_kb


def unavailable(root: str | os.PathLike = "/") -> str | None:
    """Why the controller cannot run here (None: it can): MGLRU off or absent, no writable
    lru_gen in debugfs."""
    from moetrace.kernel.features import debugfs_path, mglru_state

    st = mglru_state(root)
    if st is None:
        return "this kernel has no MGLRU (/sys/kernel/mm/lru_gen): the bites controller evicts through it"
    if not st["on"]:
        return f"MGLRU is off (lru_gen/enabled {st['enabled_raw']}): the bites controller needs it on"
    dbg = debugfs_path(root)
    if dbg is None or not os.access(dbg / "lru_gen", os.W_OK):
        return "no writable <debugfs>/lru_gen (mount -t debugfs none /sys/kernel/debug, as root)"
    return None


def _memfree_kb(fd: int) -> int:
    """MemFree (kB) from the open /proc/meminfo: one pread of its first lines."""
    head = os.pread(fd, 256, 0)
    i = head.index(b"MemFree:")
    return int(head[i + 8:head.index(b"kB", i)])


class BitesController:
    """The controller as a context manager: a daemon thread from ``__enter__`` to ``__exit__``
    (which stops it and joins it; :meth:`summary` after)."""

    def __init__(self, out_dir: str | os.PathLike, pages: int, *, memcg_path: str | None = None,
                 threshold_kb: int | None = None, interval_s: float = 0.02, root: str | os.PathLike = "/"):
        from moetrace.kernel.features import debugfs_path

        self.out = Path(out_dir)
        self.pages, self.memcg_path, self.interval_s, self.root = int(pages), memcg_path, interval_s, Path(root)
        self.threshold_kb = threshold_kb
        dbg = debugfs_path(root) or Path(root, "sys/kernel/debug")
        self.lru_gen = dbg / "lru_gen"
        # read the state from the full format when there: its 'x' marks say min_seq[file] exactly
        self.lru_state = dbg / "lru_gen_full" if (dbg / "lru_gen_full").exists() else self.lru_gen
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0_ns = 0
        self.stats: dict[str, Any] = {"bites": 0, "rounds": 0, "agings": 0, "steal_pages": 0, "errors": 0,
                                      "polls": 0, "skipped": 0, "error": None}

    def __enter__(self) -> "BitesController":
        from moetrace.kernel.procfs import read_zoneinfo

        if self.threshold_kb is None:
            self.threshold_kb = default_threshold_kb(read_zoneinfo(self.root), os.sysconf("SC_PAGE_SIZE") // 1024)
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0_ns = time.monotonic_ns()
        self._thread = threading.Thread(target=self._run, name="bites-controller", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def summary(self) -> dict[str, Any]:
        wall = (time.monotonic_ns() - self.t0_ns) / 1e9 if self.t0_ns else None
        return {"pages": self.pages, "memcg_path": self.memcg_path, "threshold_kb": self.threshold_kb,
                "interval_s": self.interval_s, "t0_monotonic_ns": self.t0_ns, "wall_s": wall,
                "poll_hz": (self.stats["polls"] / wall) if wall else None, "csv": CSV_NAME, **self.stats}

    def _run(self) -> None:
        try:
            with open(self.root / "proc/meminfo", "rb", buffering=0) as mi, \
                    open(self.out / CSV_NAME, "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
                w.writeheader()
                last = 0.0
                while not self._stop.wait(self.interval_s):
                    self.stats["polls"] += 1
                    free = _memfree_kb(mi.fileno())
                    if free >= self.threshold_kb or time.monotonic() - last < MIN_GAP_S:
                        continue
                    row = self._bite(free, mi.fileno())
                    last = time.monotonic()
                    if row is None:  # the memcg is not there (yet, or no more), or holds no file pages
                        self.stats["skipped"] += 1
                        continue
                    w.writerow(row)
                    fh.flush()
        except Exception as e:  # noqa: BLE001 - the cell goes on; controller.json says why it stopped
            self.stats["error"] = f"{type(e).__name__}: {e}"

    def _bite(self, free_kb: int, mi_fd: int) -> dict[str, Any] | None:
        """One bite: rounds until ``pages`` were stolen, a round stole nothing, or a write failed
        (None, no bite: no memcg to bite when it began)."""
        t0 = time.monotonic_ns()
        row: dict[str, Any] = {"t_s": round((t0 - self.t0_ns) / 1e9, 4), "memfree_before_kb": free_kb,
                               "threshold_kb": self.threshold_kb, "pages_asked": self.pages, "agings": 0,
                               "evictions": 0, "steal_pages": 0, "error": ""}
        first = None
        for _ in range(MAX_ROUNDS):
            v = choose(lruvecs(self.lru_state.read_text()), self.memcg_path)
            if v is None and first is None:
                return None
            if v is None:  # emptied (or removed) by the bite's own rounds
                break
            first = first or v
            stolen = self._round(v, self.pages - row["steal_pages"], row)
            if row["error"] or stolen <= 0 or row["steal_pages"] >= self.pages:
                break
        after = next((x for x in lruvecs(self.lru_state.read_text()) if first is not None
                      and (x.memcg_id, x.node) == (first.memcg_id, first.node)), None)
        self._fill(row, first, after, _memfree_kb(mi_fd), t0)
        return row

    def _round(self, v: Lruvec, pages: int, row: dict[str, Any]) -> int:
        """Write one round's commands (each alone: a failure names its command); the pages
        pgsteal_direct counted meanwhile."""
        before = self._steal()
        for cmd in round_commands(v, pages):
            try:
                with open(self.lru_gen, "w") as fh:
                    fh.write(cmd + "\n")
            except OSError as e:
                row["error"] = f"{cmd!r}: {e.strerror or e}"
                self.stats["errors"] += 1
                break
            key = "agings" if cmd.startswith("+") else "evictions"
            row[key] += 1
        stolen = self._steal() - before
        row["steal_pages"] += stolen
        self.stats["rounds"] += 1
        return stolen

    def _steal(self) -> int:
        for line in (self.root / "proc/vmstat").read_text().splitlines():
            if line.startswith("pgsteal_direct "):
                return int(line.split()[1])
        return 0

    def _fill(self, row: dict[str, Any], first: Lruvec | None, after: Lruvec | None, free_kb: int, t0: int) -> None:
        if first is not None:
            row.update(memcg_id=first.memcg_id, memcg_path=first.memcg_path, node=first.node,
                       min_seq_before=first.min_seq, max_seq_before=first.max_seq,
                       oldest_gen_file_pages=first.oldest_file_pages, memcg_file_pages_before=first.file_pages)
        if after is not None:
            row.update(min_seq_after=after.min_seq, max_seq_after=after.max_seq, memcg_file_pages_after=after.file_pages)
        row.update(memfree_after_kb=free_kb, duration_ms=round((time.monotonic_ns() - t0) / 1e6, 2))
        self.stats["bites"] += 1
        self.stats["agings"] += row["agings"]
        self.stats["steal_pages"] += row["steal_pages"]


__all__ = ["CSV_COLUMNS", "CSV_NAME", "BitesController", "Lruvec", "bite_commands", "choose",
           "default_threshold_kb", "lruvecs", "round_commands", "unavailable"]
