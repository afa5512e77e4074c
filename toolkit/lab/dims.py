"""The matrix's guest dimensions (issue 34): SPEC.toml keys beside kernels x MGLRU x mechanisms x
capacities, each a scalar (every cell) or a list (a dimension crossed like those), each absent by
default, and then every cell is what it was before these keys existed (same cells, digest and
directories).

=================  ==========================================================================
key                what a value does (default when the key is absent)
=================  ==========================================================================
cpus               the guest's vCPUs (the lab's: 1 under TCG, 2 under KVM)
readers            the replay's reader threads (2; ``threads`` is the same key, its older name)
min_free_kbytes    /proc/sys/vm/min_free_kbytes in the guest (the kernel's)
bite_fraction      a target Σhigh / C (the zones' high watermarks over the capacity): the guest sets
                   min_free_kbytes (and watermark_scale_factor when that alone cannot) to reach it
                   and records what it got (moetrace.lab.watermarks); not with min_free_kbytes
window             the measured window: a number of passes (``passes``: 2), or a time ("8min":
                   passes repeat until it is up; `moetrace cell --duration`)
pool_layout        "expert" (a file per expert: the pool as given) or "layer" (a file per layer,
                   experts at offsets: made once from the given pool, in OUT/pools/layer)
read_ahead_kb      the pool disk's queue/read_ahead_kb in the guest (the kernel's, 128)
min_ttl_ms         /sys/kernel/mm/lru_gen/min_ttl_ms (the kernel's, 0)
swap               a swap disk of this size in the guest ("512MiB"; "off": none, the default)
thp                "on": transparent_hugepage/enabled = always and the balloon madvised
                   MADV_HUGEPAGE; "off": never and MADV_NOHUGEPAGE (the kernel's, no madvise)
=================  ==========================================================================

A cell's directory name carries the values of the keys that vary (a list of several values),
between its capacity and its repeat: ``balloon0.81-320MiB-cpus2-bite0.26-r0``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

from moetrace.errors import InputError, UsageError

#: the keys in the order they are crossed and named
DIMENSIONS = ("cpus", "readers", "min_free_kbytes", "bite_fraction", "window", "pool_layout", "read_ahead_kb",
              "min_ttl_ms", "swap", "thp")
#: pool_layout -> the pool layout (moetrace.inputs.pool.LAYOUTS) it is
POOL_LAYOUTS = {"expert": "files", "layer": "layers"}
TCG_THREADS = ("single", "multi")


def _count(least: int, most: int | None = None) -> Callable[[Any], int]:
    def parse(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < least or (most is not None and v > most):
            raise UsageError(f"{v!r} is not an integer in [{least}, {most if most is not None else '...'}]")
        return v
    return parse


def _fraction(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
        raise UsageError(f"{v!r} is not a fraction between 0 and 1")
    return float(v)


def _window(v: Any) -> int | str:
    """Passes (an integer >= 1) or a time ("8min" -> "480s")."""
    from moetrace.inputs.geometry import parse_duration

    if isinstance(v, int) and not isinstance(v, bool):
        return _count(1)(v)
    if not isinstance(v, str):
        raise UsageError(f"{v!r} is neither a number of passes nor a time such as \"8min\"")
    return f"{parse_duration(v):g}s"


def _choice(values: tuple[str, ...], booleans: tuple[str, str] | None = None) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        if booleans is not None and isinstance(v, bool):
            return booleans[0] if v else booleans[1]
        if v not in values:
            raise UsageError(f"{v!r} is not one of {', '.join(values)}")
        return v
    return parse


def _swap(v: Any) -> int:
    """Bytes of swap (0: none) from "512MiB", "off" or false."""
    from moetrace.inputs.geometry import parse_bytes

    if v is False or v == "off" or v == 0:
        return 0
    b = parse_bytes(v) if isinstance(v, (str, int)) and not isinstance(v, bool) else None
    if b is None or b < 1 << 20:
        raise UsageError(f"{v!r} is neither \"off\" nor a swap size of 1MiB or more")
    return b


def _size_label(b: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return f"{b}B"


def _window_label(v: int | str) -> str:
    from moetrace.inputs.geometry import format_duration

    return f"{v}passes" if isinstance(v, int) else format_duration(float(v[:-1]))


@dataclass(frozen=True)
class Dimension:
    key: str
    parse: Callable[[Any], Any]  # a spec value -> its canonical (JSON) value; UsageError saying why not
    label: Callable[[Any], str]  # a canonical value -> its part of a cell's name
    meaning: str


DIMS: dict[str, Dimension] = {d.key: d for d in (
    Dimension("cpus", _count(1, 64), lambda v: f"cpus{v}", "guest vCPUs"),
    Dimension("readers", _count(1, 1024), lambda v: f"readers{v}", "replay reader threads"),
    Dimension("min_free_kbytes", _count(128), lambda v: f"minfree{v}k", "vm.min_free_kbytes"),
    Dimension("bite_fraction", _fraction, lambda v: f"bite{v:g}", "target sum of high watermarks / C"),
    Dimension("window", _window, _window_label, "measured passes, or a time"),
    Dimension("pool_layout", _choice(tuple(POOL_LAYOUTS)), lambda v: f"{v}files", "expert or layer files"),
    Dimension("read_ahead_kb", _count(0), lambda v: f"ra{v}k", "the pool disk's read_ahead_kb"),
    Dimension("min_ttl_ms", _count(0), lambda v: f"ttl{v}ms", "lru_gen min_ttl_ms"),
    Dimension("swap", _swap, lambda v: f"swap{_size_label(v)}" if v else "noswap", "a swap disk's size"),
    Dimension("thp", _choice(("on", "off"), ("on", "off")), lambda v: f"thp{v}", "transparent huge pages"),
)}


def _values(doc: dict, key: str, where: str) -> tuple[Any, ...]:
    """The canonical values of ``key`` (a scalar: one); InputError naming the key and the file."""
    raw = doc[key]
    vals = raw if isinstance(raw, list) else [raw]
    if not vals:
        raise InputError(f"{key} must be a value or a non-empty list", path=where)
    try:
        out = tuple(DIMS[key].parse(v) for v in vals)
    except UsageError as e:
        raise InputError(f"{key}: {e.message}", path=where, hint=f"{key}: {DIMS[key].meaning}") from None
    if len(set(out)) != len(out):
        raise InputError(f"{key} names one value twice", path=where)
    return out


def load_dims(doc: dict, where: str) -> tuple[dict[str, Any], tuple[tuple[str, tuple[Any, ...]], ...]]:
    """(MatrixSpec fields, dimensions) from a spec's keys: ``threads``/``readers`` and
    ``passes``/``window`` with one value stay the fields they were (so a spec written before these
    keys resolves as it did); every other given key is a dimension, one value or several."""
    if "threads" in doc and "readers" in doc:
        raise InputError("threads and readers are the same key: give one", path=where)
    if "passes" in doc and "window" in doc:
        raise InputError("passes and window both set the measured window: give one", path=where,
                         hint='window = 2 (passes) or window = "8min" (a time), or a list of them')
    if "bite_fraction" in doc and "min_free_kbytes" in doc:
        raise InputError("bite_fraction and min_free_kbytes both set the watermarks: give one", path=where)
    fields: dict[str, Any] = {}
    dims = []
    for key in DIMENSIONS:
        src = "threads" if key == "readers" and "threads" in doc else key
        if src not in doc:
            continue
        vals = _values({key: doc[src]}, key, where)
        if key == "readers" and len(vals) == 1:
            fields["threads"] = vals[0]
        elif key == "window" and len(vals) == 1 and isinstance(vals[0], int):
            fields["passes"] = vals[0]
        else:
            dims.append((key, vals))
    if "tcg_thread" in doc:
        if doc["tcg_thread"] not in TCG_THREADS:
            raise InputError(f"tcg_thread {doc['tcg_thread']!r} is not one of {', '.join(TCG_THREADS)}", path=where)
        fields["tcg_thread"] = doc["tcg_thread"]
    if "stream_events" in doc:
        if not isinstance(doc["stream_events"], bool):
            raise InputError(f"stream_events must be true or false, not {doc['stream_events']!r}", path=where)
        fields["stream_events"] = doc["stream_events"]
    return fields, tuple(dims)


def combinations(dims: tuple[tuple[str, tuple[Any, ...]], ...]) -> list[tuple[tuple[tuple[str, Any], ...], str]]:
    """Every combination of the dimensions' values, each as ((key, value), ...) with its name
    part (the labels of the keys that vary, '-'-joined; '' when none varies). No dimension: one
    empty combination, so the cells are those of a spec without them."""
    keys = [k for k, _ in dims]
    varying = {k for k, vals in dims if len(vals) > 1}
    out = []
    for combo in itertools.product(*[vals for _, vals in dims]):
        values = tuple(zip(keys, combo))
        out.append((values, "-".join(DIMS[k].label(v) for k, v in values if k in varying)))
    return out


def window_of(values: dict[str, Any], passes: int) -> tuple[int, float | None]:
    """(measured passes, duration_s) of a cell: a time window runs at least one whole pass."""
    w = values.get("window")
    if w is None:
        return passes, None
    return (w, None) if isinstance(w, int) else (1, float(w[:-1]))


__all__ = ["DIMENSIONS", "DIMS", "POOL_LAYOUTS", "TCG_THREADS", "combinations", "load_dims", "window_of"]
