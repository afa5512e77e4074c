"""perf_event_open(2) for the sampling probes: one software cpu-clock event per online CPU.

A probe's perf-event program is attached by libbpf to events opened here (:func:`attach_cpu_clock`). PERF_COUNT_SW_CPU_CLOCK is
an hrtimer per CPU, so it needs no hardware PMU (a VM has none); with ``freq`` set, the kernel
turns sample_freq into a fixed period of 1e9 / freq ns (perf_swevent_init_hrtimer: hrtimers have
a fixed rate, so there is no period feedback).

Ownership: libbpf's perf link owns the event it was attached to (bpf_link_perf_detach disables
and closes it when the link is destroyed, i.e. at :meth:`moetrace.kernel.libbpf.BpfObject.close`);
an event that was not attached is closed here.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from moetrace.kernel.syscalls import SYS_PERF_EVENT_OPEN, libc

#: perf_event_open(2)'s constants (its syscall numbers: moetrace.kernel.syscalls)
PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_CPU_CLOCK = 0
PERF_FLAG_FD_CLOEXEC = 1 << 3
_ATTR_DISABLED = 1 << 0  # perf_event_attr bit 0: start disabled (libbpf enables it once attached)
_ATTR_FREQ = 1 << 10     # bit 10: sample_period holds a frequency


class PerfEventAttr(ctypes.Structure):
    """``struct perf_event_attr`` up to PERF_ATTR_SIZE_VER5 (112 bytes, 4.1+; the UAPI only
    appends, and the kernel zero-fills what a shorter struct leaves out)."""

    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                ("sample_period", ctypes.c_uint64),  # union with sample_freq (flag bit 10)
                ("sample_type", ctypes.c_uint64), ("read_format", ctypes.c_uint64),
                ("flags", ctypes.c_uint64),  # the bitfield word: disabled, inherit, ..., freq, ...
                ("wakeup_events", ctypes.c_uint32), ("bp_type", ctypes.c_uint32),
                ("config1", ctypes.c_uint64), ("config2", ctypes.c_uint64),
                ("branch_sample_type", ctypes.c_uint64), ("sample_regs_user", ctypes.c_uint64),
                ("sample_stack_user", ctypes.c_uint32), ("clockid", ctypes.c_int32),
                ("sample_regs_intr", ctypes.c_uint64), ("aux_watermark", ctypes.c_uint32),
                ("sample_max_stack", ctypes.c_uint16), ("reserved_2", ctypes.c_uint16)]


def id_list(text: str) -> list[int]:
    """The kernel's list format of CPU and node ids ("0", "0-3,5", ""), as ids."""
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def online_cpus(root: str | os.PathLike = "/") -> list[int]:
    """Ids of the online CPUs (/sys/devices/system/cpu/online; every CPU os.cpu_count() names when
    that file is unreadable): where a per-CPU event can be opened."""
    try:
        return id_list((Path(root) / "sys/devices/system/cpu/online").read_text())
    except OSError:
        return list(range(os.cpu_count() or 1))


def open_cpu_clock(cpu: int, freq: int) -> int:
    """A disabled cpu-clock sampling event on ``cpu`` for every task (pid -1) at ``freq`` Hz: its
    fd. Raises OSError with the kernel's errno (EACCES: perf_event_paranoid; EINVAL: freq above
    kernel.perf_event_max_sample_rate)."""
    nr = SYS_PERF_EVENT_OPEN.get(os.uname().machine)
    if nr is None:
        raise OSError(38, f"perf_event_open: no syscall number for {os.uname().machine}")
    attr = PerfEventAttr(type=PERF_TYPE_SOFTWARE, size=ctypes.sizeof(PerfEventAttr), config=PERF_COUNT_SW_CPU_CLOCK,
                         sample_period=int(freq), flags=_ATTR_DISABLED | _ATTR_FREQ)
    fd = libc.syscall(ctypes.c_long(nr), ctypes.byref(attr), ctypes.c_int(-1), ctypes.c_int(cpu),
                       ctypes.c_int(-1), ctypes.c_ulong(PERF_FLAG_FD_CLOEXEC))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"perf_event_open(cpu-clock, cpu {cpu}, {freq} Hz): {os.strerror(e)}")
    return int(fd)


def attach_cpu_clock(obj, prog: str, freq: int, cpus: list[int] | None = None) -> int:
    """Open a cpu-clock event on every online CPU (``cpus``) and attach program ``prog`` of the
    loaded :class:`moetrace.kernel.libbpf.BpfObject` ``obj`` to each (one libbpf link per event:
    the link owns the event and closes it when ``obj`` closes). Returns the number of events;
    on failure every event opened here is closed (or owned by its link) and the error raised."""
    n = 0
    for cpu in online_cpus() if cpus is None else cpus:
        fd = open_cpu_clock(cpu, freq)
        try:
            obj.attach_perf_event(prog, fd)
        except BaseException:
            os.close(fd)  # not attached: no link owns it
            raise
        n += 1
    return n
