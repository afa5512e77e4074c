"""The facts of the host a cell runs on, written into every cell.json as ``host``: what tells
two cells' machines apart when cells run as jobs on several hosts (issue 22), so ``check``
can refuse to pool repeats from different hosts and the report can group by host.

Every fact is read independently; one that cannot be read is None, never an exception (a
virtual disk has no model, an overlay no block device, a kernel without MGLRU no knob).
``root=`` is where ``proc/`` and ``sys/`` are looked up (a fake tree in the no-kernel tier);
the host name, the kernel release and the CPU count always come from the running system.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Callable

from moetrace.errors import MoetraceError
from moetrace.kernel.features import mglru_state
from moetrace.kernel.procfs import BlockDevice, device_of, read_meminfo

#: the keys of ``host_facts`` (and of cell.json ``host``), in order
HOST_KEYS = ("name", "kernel", "mglru", "device", "model", "cpus", "memory_bytes")


def _or_none(read: Callable[[], Any]) -> Any:
    """read(), or None when the fact is unreadable (absent file, no block device, bad text)."""
    try:
        return read()
    except (OSError, ValueError, KeyError, MoetraceError):
        return None


def disk_model(disk: str, root: str | os.PathLike = "/") -> str | None:
    """The whole disk's model string: /sys/block/<disk>/device/model, or (NVMe namespaces)
    /sys/class/block/<disk>/device/model; None when neither is readable (a virtual disk, a loop
    device) or it is empty."""
    for rel in (f"sys/block/{disk}/device/model", f"sys/class/block/{disk}/device/model"):
        try:
            text = (Path(root) / rel).read_text(errors="replace").strip()
        except OSError:
            continue
        if text:
            return text
    return None


def host_facts(pool_dir: str | os.PathLike | None = None, root: str | os.PathLike = "/") -> dict[str, Any]:
    """{"name", "kernel", "mglru", "device", "model", "cpus", "memory_bytes"} of this host.

    ``mglru`` is the raw /sys/kernel/mm/lru_gen/enabled value (e.g. "0x0007"; None without MGLRU);
    ``device`` the block device holding ``pool_dir`` as "MAJ:MIN name" (e.g. "259:1 nvme0n1p1")
    and ``model`` its whole disk's model (both None without ``pool_dir`` or a block device);
    ``memory_bytes`` is MemTotal."""
    dev: BlockDevice | None = _or_none(lambda: device_of(pool_dir, root)) if pool_dir is not None else None
    facts = {
        "name": _or_none(socket.gethostname),
        "kernel": _or_none(lambda: os.uname().release),
        "mglru": _or_none(lambda: (mglru_state(root) or {}).get("enabled_raw")),
        "device": f"{dev.major}:{dev.minor} {dev.name}" if dev is not None else None,
        "model": disk_model(dev.disk, root) if dev is not None else None,
        "cpus": os.cpu_count(),
        "memory_bytes": _or_none(lambda: read_meminfo(root)["MemTotal_bytes"]),
    }
    return {k: facts[k] for k in HOST_KEYS}
