"""The sampler directory: what the lab guest's sampler (:class:`moetrace.lab.sampler.Sampler`)
writes while a cell runs, and its one reader.

A lab cell's sampler directory is ``<lab dir>/sampler`` (``/tmp/lab/sampler`` in the guest)::

    vmstat.csv     t, then VMSTAT_COUNTERS and this kernel's allocstall_<zone> (1 Hz)
    memfree.csv    t, memfree_kb, cached_kb (/proc/meminfo), free_<zone>_pages (/proc/buddyinfo;
                   one per populated zone, summed over nodes) (10 Hz)
    lru_gen.csv    t, memcg_id, memcg_path, node, seq, age_ms, nr_anon, nr_file (1 Hz; a row
                   per generation; absent without MGLRU or debugfs: sampler.json says why)
    zoneinfo.json  the zones' watermarks and the knobs that size them, at the start and the end
    sampler.json   what ran, the rates achieved, what failed (moetrace.run.documents.SamplerMeta)

``t`` is seconds since ``sampler.json`` ``t0_monotonic_ns`` (CLOCK_MONOTONIC, the clock of the
probes and the cell's snapshots). A counter this kernel does not have is an empty field (NA),
never 0. kB is KiB, as /proc/meminfo states it; nr_anon / nr_file are pages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moetrace.errors import InputError
from moetrace.run import documents as D

if TYPE_CHECKING:
    import pandas as pd

#: the sampler directory inside a lab directory (the guest's /tmp/lab/sampler)
SAMPLER_DIR = "sampler"
VMSTAT_CSV, MEMFREE_CSV, LRU_GEN_CSV = "vmstat.csv", "memfree.csv", "lru_gen.csv"
ZONEINFO_JSON, SAMPLER_JSON = "zoneinfo.json", "sampler.json"

#: /proc/vmstat counters sampled, in vmstat.csv's order (then each allocstall_<zone> the kernel has):
#: reclaim split by who ran it (kswapd, direct; khugepaged / proactive where the kernel splits
#: them), what MGLRU counts beside it (under MGLRU pgscan counts isolated folios only, the
#: protected ones go to pgrefill), refaults, kswapd's passes (pageoutrun: one per balance_pgdat)
#: and watermark checks, the page counts behind Σhigh, THP and swap
VMSTAT_COUNTERS = (
    "pgscan_kswapd", "pgscan_direct", "pgsteal_kswapd", "pgsteal_direct", "pgscan_file", "pgsteal_file",
    "pgscan_anon", "pgsteal_anon", "pgscan_khugepaged", "pgsteal_khugepaged", "pgscan_proactive",
    "pgsteal_proactive", "pgscan_direct_throttle", "pgrefill", "pgactivate", "pgdeactivate",
    "workingset_refault_file", "workingset_activate_file", "workingset_restore_file", "workingset_refault_anon",
    "workingset_nodereclaim", "unevictable_pgs_culled", "pageoutrun", "kswapd_low_wmark_hit_quickly",
    "kswapd_high_wmark_hit_quickly", "pgpgin", "pgpgout", "pgmajfault", "nr_free_pages", "nr_file_pages",
    "nr_inactive_file", "nr_active_file", "nr_inactive_anon", "nr_active_anon", "nr_unevictable", "nr_mlock",
    "drop_pagecache", "compact_stall", "compact_success", "nr_anon_transparent_hugepages", "nr_file_hugepages",
    "thp_fault_alloc", "thp_fault_fallback", "thp_collapse_alloc", "thp_file_alloc", "thp_split_page",
    "thp_swpout", "pswpin", "pswpout", "nr_swapcached", "swap_ra", "swap_ra_hit",
)
#: counters taken as a family: every /proc/vmstat name with this prefix (one per zone)
VMSTAT_PREFIXES = ("allocstall_",)
MEMFREE_COLUMNS = ("t", "memfree_kb", "cached_kb")  # then free_<zone>_pages per populated zone
LRU_GEN_COLUMNS = ("t", "memcg_id", "memcg_path", "node", "seq", "age_ms", "nr_anon", "nr_file")


@dataclass
class Samples:
    """A sampler directory read back: each CSV as a DataFrame (None: the file is absent: not
    sampled, sampler.json says why), zoneinfo.json and sampler.json."""

    path: Path
    meta: D.SamplerMeta
    vmstat: pd.DataFrame | None
    memfree: pd.DataFrame | None
    lru_gen: pd.DataFrame | None
    zoneinfo: D.ZoneinfoDoc | None

    @property
    def t0_ns(self) -> int:
        """CLOCK_MONOTONIC of t = 0."""
        return int(self.meta["t0_monotonic_ns"])


def find_sampler(directory: str | os.PathLike) -> Path | None:
    """The sampler directory of a lab (or matrix cell) directory — ``DIR/sampler`` — or ``DIR``
    itself when it is one; None when neither holds a sampler.json."""
    d = Path(directory)
    for cand in (d, d / SAMPLER_DIR, d / "cell" / SAMPLER_DIR):
        if (cand / SAMPLER_JSON).is_file():
            return cand
    return None


def _csv(path: Path, columns: tuple[str, ...] | None, strings: tuple[str, ...] = ()) -> pd.DataFrame | None:
    """One sampler CSV: ``t`` float64, ``strings`` as string, every other column Int64 (an empty
    field is NA); None when absent. InputError naming the file when a column is missing or a
    value is not a number."""
    import pandas as pd

    if not path.is_file():
        return None
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as e:
        raise InputError(f"not a sampler CSV: {e}", path=str(path)) from None
    want = columns or ("t",)
    missing = [c for c in want if c not in df.columns]
    if missing:
        raise InputError(f"the column(s) {', '.join(missing)} are missing", path=str(path),
                         hint="a sampler directory as moetrace.lab.sampler writes it")
    out = pd.DataFrame(index=df.index)
    for c in df.columns:
        try:
            if c == "t":
                out[c] = pd.to_numeric(df[c], errors="raise").astype("float64")
            elif c in strings:
                out[c] = df[c].astype("string")
            else:
                out[c] = pd.array(pd.to_numeric(df[c], errors="raise"), dtype="Int64")
        except (ValueError, TypeError):
            raise InputError(f"column {c!r} holds a value that is not a number", path=str(path)) from None
    if out["t"].isna().any():
        raise InputError("a row without its time t", path=str(path))
    return out.reset_index(drop=True)


def read_samples(directory: str | os.PathLike) -> Samples:
    """A sampler directory (or the lab directory holding one: :func:`find_sampler`) read back.
    InputError when there is none, or a file in it is damaged."""
    from moetrace.run.metadata import read_sampler_meta, read_zoneinfo_doc

    d = find_sampler(directory)
    if d is None:
        raise InputError(f"no {SAMPLER_JSON} in {directory} or its {SAMPLER_DIR}/",
                         hint="the cell ran without the sampler (moetrace.lab.sampler), or before it existed")
    meta = read_sampler_meta(d / SAMPLER_JSON)
    zi = read_zoneinfo_doc(d / ZONEINFO_JSON) if (d / ZONEINFO_JSON).is_file() else None
    return Samples(d, meta, _csv(d / VMSTAT_CSV, None), _csv(d / MEMFREE_CSV, MEMFREE_COLUMNS),
                   _csv(d / LRU_GEN_CSV, LRU_GEN_COLUMNS, strings=("memcg_path",)), zi)


__all__ = ["SAMPLER_DIR", "VMSTAT_CSV", "MEMFREE_CSV", "LRU_GEN_CSV", "ZONEINFO_JSON", "SAMPLER_JSON",
           "VMSTAT_COUNTERS", "VMSTAT_PREFIXES", "MEMFREE_COLUMNS", "LRU_GEN_COLUMNS", "Samples", "find_sampler",
           "read_samples"]
