"""Parse the MGLRU admin files ``<debugfs>/lru_gen`` and ``<debugfs>/lru_gen_full``.

The format is lru_gen_seq_show() in mm/vmscan.c (documented in the kernel's
Documentation/admin-guide/mm/multigen_lru.rst), the same from 6.1 to 6.12 for the
lines read here::

    memcg  memcg_id  memcg_path              "memcg %5hu %s" (6.1..6.13; later "%llu")
     node  node_id                           " node %5d"
        min_gen_nr  age_in_ms  nr_anon_pages  nr_file_pages      " %10lu %10u" + 2 x " %10lu%c"
        ...
        max_gen_nr  age_in_ms  nr_anon_pages  nr_file_pages

``lru_gen`` lists the generations from min_seq[anon] to max_seq; ``lru_gen_full``
lists the last MAX_NR_GENS (4) and marks a type's count with ``x`` when that
generation is already evicted for it (``seq < min_seq[type]``). After each
generation line, ``lru_gen_full`` (lru_gen_seq_show_full) adds:

* MAX_NR_TIERS (4) tier lines: ``tier`` then, per type (anon, file), three
  ``%10lu%c`` numbers: at max_seq ``R`` avg_refaulted, ``T`` avg_total (third
  unused); at other generations ``r`` refaulted, ``e`` evicted, ``p`` protected;
  no marker (6.1: a space, 6.12: ``x``) where the kernel has no value;
* one page-table walk line when the lruvec has an mm_state: 6.1 six numbers marked
  ``L O Y N F A`` (leaf total, old, young; non-leaf total, found, added in Bloom
  filters), 6.12 four marked ``T Y F A`` (MM_LEAF_OLD and MM_NONLEAF_TOTAL were
  removed: "mm: multi-gen LRU: remove MM_LEAF_OLD and MM_NONLEAF_TOTAL stats",
  6.12-rc), lower case for history generations, blank (6.1) / ``x`` (6.12) when
  not kept.

Lines are told apart by shape (token count, markers), never by kernel version. Any
other line is an :class:`moetrace.errors.InputError` naming the file and line.
Lines starting with ``#`` are comments (the kernel never prints one; fixtures
carry a header that way).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetrace.lazyimport import pandas as pd

from moetrace.errors import InputError

MAX_NR_GENS = 4  # include/linux/mmzone.h (the same since MGLRU was merged in 6.1)
_NUM = re.compile(r"^(\d+)([A-Za-z]?)$")
_MEMCG = re.compile(r"^memcg\s+(\d+)(?:\s(.*))?$")
_NODE = re.compile(r"^\s*node\s+(\d+)\s*$")
#: walk-stat columns of the full format, by marker (upper: max_seq, lower: history gens)
WALK_MARKERS = {"L": "leaf_total", "O": "leaf_old", "Y": "leaf_young", "N": "nonleaf_total",
                "F": "nonleaf_found", "A": "nonleaf_added", "T": "leaf_total"}
WALK_COLUMNS = ("leaf_total", "leaf_old", "leaf_young", "nonleaf_total", "nonleaf_found", "nonleaf_added")
TIER_COLUMNS = ("avg_refaulted_pages", "avg_total_pages", "refaulted_pages", "evicted_pages", "protected_pages")
GEN_COLUMNS = ("memcg_id", "memcg_path", "node", "seq", "gen", "age_ms", "nr_anon_pages", "nr_file_pages",
               "anon_evicted", "file_evicted")


@dataclass
class LruGenSample:
    """One read of lru_gen / lru_gen_full.

    generations: one dict per (memcg, node, generation) with GEN_COLUMNS
    (``gen`` = seq % MAX_NR_GENS; ``*_evicted``: the full format's ``x`` mark, False in
    the short format). tiers / walk: the full format's extra lines (empty otherwise).
    full: whether full-format lines were seen."""

    generations: list[dict[str, Any]] = field(default_factory=list)
    tiers: list[dict[str, Any]] = field(default_factory=list)
    walk: list[dict[str, Any]] = field(default_factory=list)
    full: bool = False


def _nums(tokens: list[str]) -> list[tuple[int, str]] | None:
    out = []
    for t in tokens:
        m = _NUM.match(t)
        if not m:
            return None
        out.append((int(m.group(1)), m.group(2)))
    return out


def parse(text: str, path: str | None = None) -> LruGenSample:
    """Parse the text of lru_gen or lru_gen_full (``path`` only names it in errors)."""
    out = LruGenSample()
    memcg: tuple[int, str] | None = None
    node: int | None = None
    gen: dict[str, Any] | None = None  # the last generation line of the current node
    tiers_seen = 0

    def bad(lineno: int, line: str, why: str) -> InputError:
        shown = line if len(line) <= 120 else line[:117] + "..."
        return InputError(f"{why}: {shown.strip()!r}", path=path or "<lru_gen>", line=lineno,
                          hint="expected the MGLRU debugfs format (lru_gen_seq_show in mm/vmscan.c)")

    for lineno, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.startswith("memcg"):
            m = _MEMCG.match(s)
            if not m:
                raise bad(lineno, line, "malformed memcg line")
            memcg = (int(m.group(1)), (m.group(2) or "").rstrip())
            node, gen = None, None
            continue
        if s.startswith("node"):
            m = _NODE.match(s)
            if not m:
                raise bad(lineno, line, "malformed node line")
            if memcg is None:
                raise bad(lineno, line, "node line before any memcg line")
            node, gen = int(m.group(1)), None
            continue
        toks = s.split()
        nums = _nums(toks)
        if nums is None:
            raise bad(lineno, line, "not a number in a generation / tier / walk line")
        if node is None:
            raise bad(lineno, line, "numbers before any memcg / node line")
        marks = [mk for _v, mk in nums]
        if len(nums) == 4 and not marks[0] and not marks[1] and set(marks[2:]) <= {"", "x"}:
            shape = "gen"  # seq, age_ms, anon, file (the full format marks evicted types with 'x')
        elif len(nums) == 7 and not marks[0]:
            shape = "tier"  # tier, then (anon, file) x 3 marked numbers
        elif len(nums) == 6 or (len(nums) == 4 and marks[0]):
            shape = "walk"  # 6.1: six numbers (L O Y N F A); 6.12: four, always marked (T Y F A / x)
        else:
            raise bad(lineno, line, f"unrecognised line ({len(nums)} numbers)")
        if shape == "gen":
            seq = nums[0][0]
            if gen is not None and seq <= gen["seq"]:
                raise bad(lineno, line, f"generation {seq} after generation {gen['seq']} (not increasing)")
            if gen is not None and out.tiers and tiers_seen == 0:
                raise bad(lineno, line, "full format: a generation line without its tier lines")
            gen = {"memcg_id": memcg[0], "memcg_path": memcg[1], "node": node, "seq": seq,
                   "gen": seq % MAX_NR_GENS, "age_ms": nums[1][0], "nr_anon_pages": nums[2][0],
                   "nr_file_pages": nums[3][0], "anon_evicted": marks[2] == "x", "file_evicted": marks[3] == "x"}
            if "x" in marks[2:]:
                out.full = True
            out.generations.append(gen)
            tiers_seen = 0
            continue
        if gen is None:
            raise bad(lineno, line, "a tier / walk line before any generation line of its node")
        mk = "".join(m_ or " " for m_ in marks)
        if shape == "tier":
            if tiers_seen >= 8:
                raise bad(lineno, line, "too many tier lines after one generation")
            out.full = True
            tiers_seen += 1
            for ti, typ in enumerate(("anon", "file")):
                trio = nums[1 + 3 * ti: 4 + 3 * ti]
                tmk = mk[1 + 3 * ti: 4 + 3 * ti]
                row = {"memcg_id": gen["memcg_id"], "node": gen["node"], "seq": gen["seq"], "tier": nums[0][0],
                       "type": typ, **{c: None for c in TIER_COLUMNS}}
                if tmk[:2] == "RT" and tmk[2] in " x":
                    row["avg_refaulted_pages"], row["avg_total_pages"] = trio[0][0], trio[1][0]
                elif tmk == "rep":
                    row["refaulted_pages"], row["evicted_pages"], row["protected_pages"] = (v for v, _m in trio)
                elif tmk.strip(" x"):
                    raise bad(lineno, line, f"unknown tier markers {tmk!r}")
                out.tiers.append(row)
            continue
        out.full = True  # the walk line
        if mk.upper() in ("LOYNFA", "TYFA") and (mk.isupper() or mk.islower()):
            row = {"memcg_id": gen["memcg_id"], "node": gen["node"], "seq": gen["seq"],
                   **{c: None for c in WALK_COLUMNS}}
            for v, m_ in nums:
                row[WALK_MARKERS[m_.upper()]] = v
            out.walk.append(row)
        elif mk.strip(" x"):
            raise bad(lineno, line, f"unknown walk-stat markers {mk!r}")
    if out.tiers and gen is not None and tiers_seen == 0:
        raise InputError("full format: the last generation line has no tier lines (a truncated read?)",
                         path=path or "<lru_gen>")
    return out


def read(path: str | Path) -> LruGenSample:
    """Read and parse one lru_gen / lru_gen_full file."""
    p = Path(path)
    return parse(p.read_text(), str(p))


def generations_frame(samples: list[tuple[int, int, LruGenSample]]) -> pd.DataFrame:
    """The ``lru_gen`` table from (sample index, CLOCK_MONOTONIC ns, sample) triples:
    time_ns, sample, memcg_id, memcg_path, node, seq, gen, age_ms, birth_ns (time_ns minus
    the age: when the generation was created, at the kernel's jiffy resolution),
    nr_anon_pages, nr_file_pages, anon_evicted, file_evicted."""
    rows = [{"time_ns": t, "sample": i, **g} for i, t, s in samples for g in s.generations]
    cols = ["time_ns", "sample", *GEN_COLUMNS]
    df = pd.DataFrame(rows, columns=cols)
    out = pd.DataFrame({
        "time_ns": df["time_ns"].astype("int64"),
        "sample": df["sample"].astype("int32"),
        "memcg_id": df["memcg_id"].astype("int64"),
        "memcg_path": df["memcg_path"].astype("string"),
        "node": df["node"].astype("int32"),
        "seq": df["seq"].astype("int64"),
        "gen": df["gen"].astype("int32"),
        "age_ms": df["age_ms"].astype("int64"),
        "birth_ns": (df["time_ns"].astype("int64") - df["age_ms"].astype("int64") * 1_000_000),
        "nr_anon_pages": df["nr_anon_pages"].astype("int64"),
        "nr_file_pages": df["nr_file_pages"].astype("int64"),
        "anon_evicted": df["anon_evicted"].astype("bool"),
        "file_evicted": df["file_evicted"].astype("bool"),
    })
    return out


def tiers_frame(samples: list[tuple[int, int, LruGenSample]]) -> pd.DataFrame:
    """The full format's tier lines: time_ns, sample, memcg_id, node, seq, tier, type and
    TIER_COLUMNS (NA where the kernel printed no value)."""
    rows = [{"time_ns": t, "sample": i, **r} for i, t, s in samples for r in s.tiers]
    df = pd.DataFrame(rows, columns=["time_ns", "sample", "memcg_id", "node", "seq", "tier", "type",
                                     *TIER_COLUMNS])
    out = pd.DataFrame({"time_ns": df["time_ns"].astype("int64"), "sample": df["sample"].astype("int32"),
                        "memcg_id": df["memcg_id"].astype("int64"), "node": df["node"].astype("int32"),
                        "seq": df["seq"].astype("int64"), "tier": df["tier"].astype("int32"),
                        "type": df["type"].astype("string")})
    for c in TIER_COLUMNS:
        out[c] = pd.array(df[c].tolist(), dtype="Int64")
    return out


def walk_frame(samples: list[tuple[int, int, LruGenSample]]) -> pd.DataFrame:
    """The full format's page-table walk lines: time_ns, sample, memcg_id, node, seq and
    WALK_COLUMNS (NA where this kernel has no such counter)."""
    rows = [{"time_ns": t, "sample": i, **r} for i, t, s in samples for r in s.walk]
    df = pd.DataFrame(rows, columns=["time_ns", "sample", "memcg_id", "node", "seq", *WALK_COLUMNS])
    out = pd.DataFrame({"time_ns": df["time_ns"].astype("int64"), "sample": df["sample"].astype("int32"),
                        "memcg_id": df["memcg_id"].astype("int64"), "node": df["node"].astype("int32"),
                        "seq": df["seq"].astype("int64")})
    for c in WALK_COLUMNS:
        out[c] = pd.array(df[c].tolist(), dtype="Int64")
    return out


__all__ = ["LruGenSample", "parse", "read", "generations_frame", "tiers_frame", "walk_frame", "MAX_NR_GENS"]
