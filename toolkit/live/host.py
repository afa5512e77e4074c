"""What the host (or one cgroup) says about memory, read cumulatively for ``moetrace watch``.

Reclaim scan and steal, file refaults, PSI memory stall time and locked bytes: the kernel's own
counters, no probe. With a cgroup v2 directory they come from its memory.stat, memory.pressure
and memory.max (the scope the serving engine runs in); without a cgroup from /proc/vmstat,
/proc/pressure/memory and /proc/meminfo (the whole host); a v1 cgroup has some of them.
Every reading is cumulative (PSI's ``total_us`` too): an interval is the difference of two.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from moetrace.kernel.procfs import parse_psi, read_meminfo, read_vmstat


def _kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in path.read_text().splitlines():
        f = line.split()
        if len(f) == 2 and f[1].lstrip("-").isdigit():
            out[f[0]] = int(f[1])
    return out


def _psi(path: Path) -> dict[str, float | None]:
    try:
        rows = parse_psi(path.read_text())
    except OSError:
        return {"some_us": None, "full_us": None, "some_avg10": None, "full_avg10": None}
    some, full = rows.get("some", {}), rows.get("full", {})
    return {"some_us": some.get("total_us"), "full_us": full.get("total_us"),
            "some_avg10": some.get("avg10"), "full_avg10": full.get("avg10")}


def _host_scan_steal(vm: dict[str, int]) -> tuple[int, int]:
    """File-LRU scan and steal since boot (pgscan_file / pgsteal_file, 5.x+); before those
    existed, kswapd + direct (every list)."""
    if "pgscan_file" in vm and "pgsteal_file" in vm:
        return vm["pgscan_file"], vm["pgsteal_file"]
    return (sum(v for k, v in vm.items() if k in ("pgscan_kswapd", "pgscan_direct")),
            sum(v for k, v in vm.items() if k in ("pgsteal_kswapd", "pgsteal_direct")))


def cgroup_version(path: str | os.PathLike | None) -> int | None:
    """2 or 1 for a memory cgroup directory (by its files), None for none."""
    if path is None:
        return None
    p = Path(path)
    if (p / "memory.max").is_file() and (p / "memory.stat").is_file():
        return 2
    if (p / "memory.limit_in_bytes").is_file() and (p / "memory.stat").is_file():
        return 1
    return None


def _host(root: str | os.PathLike, mem: dict[str, int]) -> dict[str, Any]:
    vm = read_vmstat(root)
    scanned, stolen = _host_scan_steal(vm)
    out = {"scope": "host", "reclaim_scope": "host", "psi_scope": "host", "scanned_pages": scanned,
           "stolen_pages": stolen, "refault_file_pages": vm.get("workingset_refault_file", vm.get("workingset_refault", 0)),
           "locked_bytes": mem.get("Mlocked_bytes", 0), "memory_bytes": mem.get("MemTotal_bytes", 0)}
    out.update(_psi(Path(root) / "proc" / "pressure" / "memory"))
    return out


def read_scope(cgroup: str | os.PathLike | None = None, root: str | os.PathLike = "/") -> dict[str, Any]:
    """One cumulative reading: scanned / stolen pages, file refaults, PSI memory some / full
    (total µs and avg10 %), locked bytes and the memory they are a fraction of. A v2 cgroup gives
    all of it; a v1 cgroup its refaults, unevictable bytes and limit (v1 has no scan / steal or
    pressure per cgroup: those stay the host's, ``reclaim_scope`` / ``psi_scope`` say so)."""
    mem = read_meminfo(root)
    total = mem.get("MemTotal_bytes", 0)
    out = _host(root, mem)
    ver = cgroup_version(cgroup)
    if ver is None:
        return out
    cg = Path(cgroup)
    st = _kv(cg / "memory.stat")
    if ver == 2:
        raw = (cg / "memory.max").read_text().strip()
        out.update({"reclaim_scope": str(cg), "psi_scope": str(cg), "scanned_pages": st.get("pgscan", 0),
                    "stolen_pages": st.get("pgsteal", 0), "refault_file_pages": st.get("workingset_refault_file", 0),
                    "locked_bytes": st.get("unevictable", 0)})
        out.update(_psi(cg / "memory.pressure"))
    else:
        raw = (cg / "memory.limit_in_bytes").read_text().strip()
        out.update({"refault_file_pages": st.get("total_workingset_refault_file", 0),
                    "locked_bytes": st.get("total_unevictable", 0)})
    limit = total if raw == "max" or not raw.isdigit() else int(raw)
    out["memory_bytes"] = min(limit, total) if total else limit
    out["scope"] = str(cg)
    return out


def cgroup_pids(cgroup: str | os.PathLike) -> list[int]:
    """The processes (tgids) in a cgroup now; [] when it is gone. (Read every poll of
    `moetrace watch`: plain os calls, no pathlib.)"""
    try:
        fd = os.open(os.path.join(cgroup, "cgroup.procs"), os.O_RDONLY)
    except OSError:
        return []
    try:
        return [int(x) for x in os.read(fd, 1 << 20).split()]
    except (OSError, ValueError):
        return []
    finally:
        os.close(fd)
