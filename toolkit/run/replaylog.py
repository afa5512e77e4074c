"""The replay's log in a run directory: what a recorder or an analysis reads of it.

The replay (:mod:`moetrace.replay.harness`) writes ``replay.json`` (summary, plan and pool
identity, the epochs it assigned) and ``iterations.parquet`` (one row per iteration and
pass) into its run directory; the recorder reads them through here, never through the
replay's code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from moetrace.run.documents import ReplaySummary

from moetrace.errors import MoetraceError

# imported by the replay: nothing heavy at module level (every MiB the replay process holds is
# taken from a cell's headroom; pandas alone is ~70 MiB of RSS)
ITERATIONS_FILE = "iterations.parquet"
SUMMARY_FILE = "replay.json"
PAGE = os.sysconf("SC_PAGE_SIZE")


#: the directory the recorded command writes its replay log (replay.json) to: `moetrace record` sets it
RUN_DIR_ENV = "MOETRACE_RUN_DIR"


def read_replay_summary(log_dir: str | os.PathLike) -> "ReplaySummary | None":
    """replay.json of a replay log directory (its one reader: :func:`moetrace.run.metadata.read_replay`),
    or None (absent or unreadable)."""
    from moetrace.errors import InputError
    from moetrace.run.metadata import read_replay

    try:
        return read_replay(Path(log_dir) / SUMMARY_FILE)
    except InputError:
        return None


def requested_from_replay(replay_dir: Path, pool) -> tuple["np.ndarray | None", "np.ndarray | None", str]:
    """(requested bytes, requested pages) per expert_id from the replay's log, and how.

    Requested bytes per expert cannot be taken from the read syscalls without
    fd -> inode (kernel structs, unsafe with mismatched headers), so they come
    from the replay's plan accounting: every logged iteration row (warm-up and
    measured) contributes the plan's reads of that iteration x expert bytes.
    None (with the reason) when there is no usable log."""
    import numpy as np
    import pandas as pd

    from moetrace.inputs.plan import load_flat_plan

    sp, ip = Path(replay_dir) / SUMMARY_FILE, Path(replay_dir) / ITERATIONS_FILE
    if not sp.exists() or not ip.exists():
        return None, None, "no replay log (the command wrote no replay.json / iterations.parquet)"
    from moetrace.errors import InputError
    from moetrace.run.metadata import read_replay

    try:
        summary = read_replay(sp)
    except InputError as e:
        return None, None, f"replay.json unreadable ({e.message})"
    mode = summary.get("mode")
    if mode not in ("pagecache", "mmap"):
        return None, None, (f"replay mode {mode}: its reads do not all go through the page cache "
                            "(O_DIRECT or an mlocked arena), requested pages are not derived")
    if summary.get("pool", {}).get("identity") != pool.manifest.get("checksum"):
        return None, None, "the replay used another pool than the recorded one"
    try:
        plan = load_flat_plan(summary["plan"]["path"])
    except (MoetraceError, KeyError, OSError) as e:
        return None, None, f"the replay's plan is unreadable ({e})"
    it = pd.read_parquet(ip, columns=["iteration"])
    n_it = plan.n_iterations
    occ = np.bincount(it["iteration"].to_numpy(np.int64), minlength=n_it)[:n_it]
    reads_per_it = plan.slot_bounds[plan.iter_bounds[1:]] - plan.slot_bounds[plan.iter_bounds[:-1]]
    weight = np.repeat(occ, reads_per_it)
    reads = np.bincount(plan.ids, weights=weight, minlength=pool.n_total).astype(np.int64)
    eb = pool.geometry.expert_bytes
    how = (f"replay plan accounting: {len(it)} logged iteration rows x the plan's reads per iteration x "
           f"{eb} expert bytes ({-(-eb // PAGE)} pages) per read; interrupted iterations are not logged")
    return reads * eb, reads * -(-eb // PAGE), how
