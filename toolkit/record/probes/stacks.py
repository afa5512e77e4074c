"""The stacks probe: where the replay's CPU time goes, kernel and user frames, as flame-graph
input.

probes/stacks.bpf.c (CO-RE, compiled once)
samples every CPU with the software cpu-clock perf event (an hrtimer; no hardware PMU, so it
works in a VM; one event per online CPU, opened by :mod:`moetrace.kernel.perf` for the CO-RE
object, by bcc for its own) at ``MOE_SAMPLE_HZ`` and counts, in the kernel, the
samples of the followed command's processes (the command's pid, its forks through
task:task_newtask) and of the kswapd threads per (tgid, user stack id, kernel stack id,
comm). Nothing is streamed, so no sample is lost to a ring; a sample whose key does not
fit in the counters (``keys_full``) or whose stack lost its hash bucket (``*_eexist``) is
counted in the probe's stats.

User space symbolizes at :meth:`StacksRecorder.close`: kernel frames through
/proc/kallsyms, user frames through the executable mappings of /proc/<pid>/maps (taken in
:meth:`StacksRecorder.poll` while the command runs: it has exited by the time the probe
closes) and the ELF symbol tables of the mapped files (:mod:`moetrace.kernel.symbolize`). The run
directory gets:

- ``stacks.folded``: Brendan Gregg's folded format, one line per distinct stack,
  ``comm;user frames (root first);kernel frames_[k] samples``; user frames are
  ``module`symbol`` (``module+0x<file offset>`` when no symbol covers the address,
  ``[unknown]`` outside every known mapping); ``flamegraph.pl`` and speedscope read it;
- ``stacks.parquet``: the same per (stack, comm, tgid), with frame counts and the
  stack-id status of both sides.

No raw address is written (:func:`moetrace.kernel.symbolize.find_kernel_addresses` checks a run
directory for kernel addresses).

Why 99 Hz by default: a sample of a followed task costs one hrtimer interrupt plus two
stack walks; measured here (BPF_ENABLE_STATS run time of on_cpu_clock, 2 vCPUs, a replay of
hot preads) 5-15 us per followed sample and ~0.3 us per other tick, so 99 Hz on both CPUs
costs ~0.15 % of the machine (999 Hz: ~0.5 %), far inside the default probe set's 3 %
budget, while a replay of one CPU-second still yields ~100 samples (49 Hz would halve
that for no measurable saving). 99, not 100, keeps the samples out of lockstep with
100 Hz timer work. The maps snapshots cost ~0.7 ms of kernel time each for a Python
process with numpy loaded, hence the backing-off interval (MAPS_INTERVAL_S).

Knobs (probespec STACKS): ``MOE_SAMPLE_HZ``, ``MOE_STACK_ENTRIES``, ``MOE_MAX_KEYS``,
``MOE_MAX_TASKS``; ``MOE_FOLLOW_FORKS`` follows the attach plan. ``moetrace record`` has no
per-probe knob option yet, so overrides come from the environment:
``MOETRACE_STACKS_KNOBS="MOE_SAMPLE_HZ=499,MOE_STACK_ENTRIES=32768"``.
"""

from __future__ import annotations

import os
import re
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from moetrace.lazyimport import pandas as pd

from moetrace.record.spec import AttachCandidate, Knob, ProbeSpec, Struct, named_tp, group
from moetrace.run.tables import TABLES
from moetrace.atomic import atomic_write
from moetrace.run import directory as rd
from moetrace.errors import ProbeError, UsageError
from moetrace.record.probe import ProbeRecorder, RecordContext
from moetrace.kernel.symbolize import Kallsyms, ProcMaps, Symbolizer, find_kernel_addresses  # noqa: F401 (re-export)

# -- the declaration: attach candidates, knobs, tables (probes/stacks.bpf.c and probes/stacks.bpf.c agree:
# tests/probe_build/test_core_objects.py)

#: probes/stacks.bpf.c. Reads only the sample's registers
#: (stack ids) and task_newtask's arguments; counted in the kernel per (tgid, user stack, kernel stack, comm), symbolized in user space
#: (moetrace.record.probes.stacks, moetrace.kernel.symbolize).
STACKS = ProbeSpec(
    name="stacks",
    recorder="StacksRecorder",
    order=70,
    description="perf cpu-clock samples of the command's processes and kswapd, kernel + user stacks counted in "
                "the kernel, symbolized in user space (stacks.folded, stacks.parquet)",
    attach=(
        group("cpu_clock", AttachCandidate("perf_event", "software:cpu-clock", "on_cpu_clock",
                                        "PERF_COUNT_SW_CPU_CLOCK, an hrtimer per CPU: no hardware PMU needed "
                                        "in a VM; sample_freq becomes a fixed period of 1e9 / MOE_SAMPLE_HZ ns")),
        group("newtask", named_tp("task:task_newtask", fields=("pid", "clone_flags"),
                              note="follow the command's child processes (threads share the tgid)"),
           required=False, knob="MOE_FOLLOW_FORKS"),
    ),
    knobs=(
        Knob("MOE_SAMPLE_HZ", 99, "samples per second per CPU (perf sample_freq); 99 Hz costs well under "
                                  "1 % of a CPU and stays out of lockstep with 100 Hz timers"),
        Knob("MOE_STACK_ENTRIES", 16384, "stack-trace map entries (distinct user + kernel stacks; ~1 KiB each)"),
        Knob("MOE_MAX_KEYS", 16384, "(tgid, user stack, kernel stack, comm) counters"),
        Knob("MOE_MAX_TASKS", 4096, "followed tgids + kswapd threads"),
        Knob("MOE_FOLLOW_FORKS", 1, "1: a followed tgid's new processes are followed too (newtask group)"),
    ),
    table="stacks",
    schema=TABLES["stacks"],
    stats=("ticks", "idle_ticks", "samples", "kswapd_samples", "user_stack_eexist", "user_stack_efault",
           "user_stack_other_err", "kernel_stack_eexist", "kernel_stack_efault", "kernel_stack_other_err",
           "keys_full", "tasks_full"),
    map_sizes=lambda k: {"tgids": int(k["MOE_MAX_TASKS"]), "counts": int(k["MOE_MAX_KEYS"]),
                         "stack_traces": int(k["MOE_STACK_ENTRIES"]), "stats": len(SPEC.stats)},
    enrichment=True,
)

SPEC = STACKS
#: environment variable with knob overrides: "NAME=int,NAME=int"
KNOBS_ENV = "MOETRACE_STACKS_KNOBS"
#: values of the probe's tgids map (TASK_* in probes/stacks.bpf.c)
TASK_FOLLOWED, TASK_KSWAPD = 1, 2
#: struct stack_key of probes/stacks.bpf.c (its comm is a char array, which a Struct cannot
#: declare: tests/probe_build/test_stacks_probe.py holds this dtype to the object's BTF)
STACK_KEY_DTYPE = np.dtype([("tgid", "<u4"), ("user_stack_id", "<i4"), ("kernel_stack_id", "<i4"), ("comm", "S16")],
                           align=True)
U32, U64 = np.dtype("<u4"), np.dtype("<u8")
#: bpf_get_stackid errors (negated errno)
EFAULT, EEXIST = 14, 17
FOLDED = "stacks.folded"
#: /proc/<pid>/maps of the followed processes is read every MAPS_INTERVAL_S while it
#: changes, the interval doubling up to MAPS_MAX_INTERVAL_S while it does not (reading the
#: maps of a Python process with numpy loaded costs ~0.7 ms of kernel time)
MAPS_INTERVAL_S = 0.25
MAPS_MAX_INTERVAL_S = 2.0
_KSWAPD = re.compile(r"^kswapd\d+(:\d+)?$")


def parse_knobs(text: str | None) -> dict[str, int]:
    """``"NAME=int,NAME=int"`` -> {NAME: int}; names must be declared knobs of the probe."""
    out: dict[str, int] = {}
    if not text:
        return out
    names = {k.name for k in SPEC.knobs}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        k, sep, v = item.partition("=")
        k = k.strip()
        if not sep or k not in names:
            raise UsageError(f"{KNOBS_ENV}: bad item {item!r}",
                             hint=f"NAME=integer, comma-separated; knobs: {', '.join(sorted(names))}")
        try:
            out[k] = int(v.strip(), 0)
        except ValueError:
            raise UsageError(f"{KNOBS_ENV}: {k} must be an integer, not {v.strip()!r}") from None
    return out


def check_knobs(knobs: dict[str, int], root: str | os.PathLike = "/") -> None:
    """Refuse knob values perf_event_open or the maps would reject, with the reason."""
    hz = int(knobs["MOE_SAMPLE_HZ"])
    if hz <= 0:
        raise UsageError(f"MOE_SAMPLE_HZ={hz}: the sampling frequency must be positive")
    try:
        cap = int(Path(root, "proc/sys/kernel/perf_event_max_sample_rate").read_text())
    except (OSError, ValueError):
        cap = None
    if cap is not None and hz > cap:
        raise UsageError(f"MOE_SAMPLE_HZ={hz} exceeds kernel.perf_event_max_sample_rate={cap}",
                         hint="choose a lower frequency (99 Hz is the default)")
    for k in ("MOE_STACK_ENTRIES", "MOE_MAX_KEYS", "MOE_MAX_TASKS"):
        if int(knobs[k]) <= 0:
            raise UsageError(f"{k}={knobs[k]}: must be positive")


def find_kswapd(root: str | os.PathLike = "/") -> list[int]:
    """Pids of the kswapd kernel threads (comm ``kswapdN``), read from <root>/proc/*/comm.
    They are only looked up and sampled, never signalled."""
    out = []
    try:
        entries = os.listdir(Path(root, "proc"))
    except OSError:
        return out
    for e in entries:
        if not e.isdigit():
            continue
        try:
            comm = Path(root, "proc", e, "comm").read_text().strip()
        except OSError:
            continue
        if _KSWAPD.match(comm):
            out.append(int(e))
    return sorted(out)


def _clean(frame: str) -> str:
    """A frame name safe for the folded format (no ';', no whitespace)."""
    return re.sub(r"\s+", "_", frame.replace(";", ":"))


def _status(stack_id: int) -> str:
    if stack_id >= 0:
        return "ok"
    if stack_id == -EFAULT:
        return "none"
    if stack_id == -EEXIST:
        return "lost"
    return "error"


def fold(comm: str, user: list[str], kernel: list[str], ustatus: str = "ok", kstatus: str = "ok") -> str:
    """One folded stack (without its count): comm, user frames, kernel frames suffixed _[k].
    A lost side (stack-map collision) is one ``[lost]`` frame, an error ``[error]``."""
    frames = [_clean(comm) or "[unknown]"]
    if ustatus == "ok":
        frames += [_clean(f) for f in user]
    elif ustatus in ("lost", "error"):
        frames.append(f"[{ustatus}]")
    if kstatus == "ok":
        frames += [_clean(f) + "_[k]" for f in kernel]
    elif kstatus in ("lost", "error"):
        frames.append(f"[{kstatus}]_[k]")
    return ";".join(frames)


def stacks_table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The stacks table (declared columns, in order) from per-key rows, merging keys that
    symbolized to the same (stack, comm, tgid)."""
    cols = [c.name for c in SPEC.schema]
    if not rows:
        df = pd.DataFrame({c: [] for c in cols})
    else:
        df = pd.DataFrame(rows)
        keys = [c for c in cols if c != "samples"]
        df = df.groupby(keys, sort=False, dropna=False, as_index=False)["samples"].sum()
        df = df.sort_values(["samples", "stack"], ascending=[False, True], kind="stable")
    dtypes = {c.name: c.dtype for c in SPEC.schema}
    return df[cols].astype(dtypes).reset_index(drop=True)


def folded_text(df: pd.DataFrame) -> str:
    """``stack samples`` lines, stacks merged across tgids, sorted by stack."""
    if df.empty:
        return ""
    agg = df.groupby("stack", sort=True)["samples"].sum()
    return "".join(f"{s} {int(n)}\n" for s, n in agg.items())


class StacksRecorder(ProbeRecorder):
    """Attach the stacks probe; snapshot the followed processes' maps while
    they run; symbolize and fold at close. ``knobs`` override the declared defaults (after
    ``MOETRACE_STACKS_KNOBS``); ``kswapd=False`` samples only the command."""

    name = "stacks"
    spec = SPEC
    error = ProbeError
    needs_poll = True

    def __init__(self, ctx: RecordContext, knobs: dict[str, int] | None = None, kswapd: bool = True,
                 root: str | os.PathLike = "/"):
        super().__init__(ctx)
        self.root = root
        self._knob_overrides = dict(knobs or {})
        self.sample_kswapd = kswapd
        self.kswapd_pids: list[int] = []
        self.maps = ProcMaps(root)
        self.followed: set[int] = set()
        self.command_pid: int | None = None
        self._next_maps = 0.0
        self._maps_interval = MAPS_INTERVAL_S
        self._t_open = self._t_close = None
        self.df: pd.DataFrame | None = None
        self.stats: dict[str, int] = {}
        self.summary: dict[str, Any] = {}
        self.lost: dict[str, Any] = {}
        self._misses: dict[str, int | None] = {}

    # -- lifecycle --------------------------------------------------------------------------
    def open(self) -> "StacksRecorder":
        plan = self.ctx.plan
        entry = plan.entry("cpu_clock")
        if not entry.attached:
            raise ProbeError(f"stacks: cpu-clock perf events unavailable: {entry.reason}",
                                 hint="`moetrace doctor` shows the attach plan")
        over = parse_knobs(os.environ.get(KNOBS_ENV)) | self._knob_overrides | dict(self.ctx.knobs)
        knobs = SPEC.knob_values(**over)
        for k, v in plan.knobs.items():  # the kernel decides: a knob it turned off stays off
            if k in knobs:
                knobs[k] = min(int(knobs[k]), int(v))
        check_knobs(knobs, self.root)
        self.knobs = {k: int(v) for k, v in knobs.items()}
        t0 = time.perf_counter()
        self.load_planned(self.knobs)
        from moetrace.kernel.perf import attach_cpu_clock

        try:  # one cpu-clock event per online CPU, linked to the program (closed with the probe)
            attach_cpu_clock(self.probe.obj, entry.candidate.fn_name, self.knobs["MOE_SAMPLE_HZ"])
        except (OSError, ProbeError) as e:
            self.probe.close()
            raise ProbeError(f"stacks: cannot open the cpu-clock perf events: {e}",
                             hint="check kernel.perf_event_paranoid and perf_event_max_sample_rate") from None
        if self.sample_kswapd:
            self.kswapd_pids = find_kswapd(self.root)
            try:
                for pid in self.kswapd_pids:
                    self.probe.put("tgids", struct.pack("<I", pid), bytes([TASK_KSWAPD]))
            except OSError as e:  # a full map (MOE_MAX_TASKS)
                self.probe.close()
                raise ProbeError(f"stacks: cannot add the kswapd threads to the task map: {e}",
                                     hint="raise MOE_MAX_TASKS") from None
        self.compile_attach_s = time.perf_counter() - t0
        self._t_open = time.monotonic()
        return self

    def follow(self, pid: int) -> None:
        """Sample ``pid`` (the command, before it execs) and, in the kernel, its forks."""
        if self.probe is None or self.probe.closed:
            return
        self.probe.put("tgids", struct.pack("<I", pid), bytes([TASK_FOLLOWED]))
        self.followed.add(pid)
        if self.command_pid is None:
            self.command_pid = pid

    def _followed_now(self) -> set[int]:
        """The followed tgids: those given to follow() and those the kernel added on fork."""
        out = set(self.followed)
        if self.probe is not None and not self.probe.closed:
            try:
                pids, who = self.probe.items("tgids", U32, np.uint8)
                out.update(int(p) for p in pids[who == TASK_FOLLOWED])
            except Exception:  # noqa: BLE001 - a map read racing close: keep what we know
                pass
        return out

    def snapshot_maps(self) -> bool:
        """Snapshot every followed process's maps; True when any changed (or is new)."""
        changed = False
        for pid in sorted(self._followed_now()):
            changed |= bool(self.maps.snapshot(pid))
        return changed

    def poll(self, timeout_ms: int = 0) -> None:
        """Snapshot the followed processes' executable mappings when due (see
        MAPS_INTERVAL_S), then wait out ``timeout_ms``, returning early when the
        command exits (:meth:`wait_command`)."""
        deadline = time.monotonic() + max(timeout_ms, 0) / 1000
        now = time.monotonic()
        if now >= self._next_maps:
            if self.snapshot_maps():
                self._maps_interval = MAPS_INTERVAL_S
            else:
                self._maps_interval = min(2 * self._maps_interval, MAPS_MAX_INTERVAL_S)
            self._next_maps = now + self._maps_interval
        left = deadline - time.monotonic()
        if left > 0:
            self.wait_command(left)

    def settle(self) -> None:
        """The command has ended: read /proc/kallsyms in a thread meanwhile (~0.1 s, half of it
        the kernel's own formatting) while the other probes are read; :meth:`close` joins it."""
        import threading

        def load() -> None:
            self._kallsyms = Kallsyms(self.root)

        self._ks_thread = threading.Thread(target=load, name="moetrace-kallsyms", daemon=True)
        self._ks_thread.start()

    def _take_kallsyms(self) -> Kallsyms:
        t = getattr(self, "_ks_thread", None)
        if t is not None:
            t.join()
        ks = getattr(self, "_kallsyms", None)
        return ks if ks is not None else Kallsyms(self.root)

    def close(self) -> None:
        """Read the counters and stacks, detach, then symbolize (idempotent)."""
        got: dict[str, Any] = {}

        def read() -> None:
            self.snapshot_maps()  # processes still alive (the command's leftovers)
            self.stats = self.read_stats()
            keys, vals = self.probe.items("counts", STACK_KEY_DTYPE, U64)
            raw = [(int(k["tgid"]), int(k["user_stack_id"]), int(k["kernel_stack_id"]),
                    bytes(k["comm"]).split(b"\0", 1)[0].decode("utf-8", "replace"), int(v))
                   for k, v in zip(keys, vals)]
            ids = {sid for _t, u, k, _c, _n in raw for sid in (u, k) if sid >= 0}
            got.update(raw=raw, traces={sid: self._stack(sid) for sid in ids})
            self._misses = self.recursion_misses()

        if not self.collect(read):
            return
        self._t_close = time.monotonic()
        self._symbolize(got["raw"], got["traces"])
        self.collected = True

    def _stack(self, stack_id: int) -> list[int]:
        """The addresses of one stack-trace map entry, innermost first (the kernel fills the
        value's MOE_STACK_DEPTH slots from the start and zeroes the rest); [] when absent."""
        raw = self.probe.get("stack_traces", struct.pack("<I", stack_id))
        if raw is None:
            return []
        ips = np.frombuffer(raw, U64)
        end = np.flatnonzero(ips == 0)
        return [int(x) for x in ips[: end[0] if len(end) else len(ips)]]

    # -- symbolization ----------------------------------------------------------------------
    def _symbolize(self, raw: list[tuple[int, int, int, str, int]], traces: dict[int, list[int]]) -> None:
        ks = self._take_kallsyms()
        sym = Symbolizer(self.maps, ks, self.root)
        kswapd = set(self.kswapd_pids)
        rows = []
        for tgid, uid, kid, comm, n in raw:
            us, kst = _status(uid), _status(kid)
            user = sym.user_frames(tgid, traces[uid]) if us == "ok" else []
            kern = sym.kernel_frames(traces[kid]) if kst == "ok" else []
            rows.append({"stack": fold(comm, user, kern, us, kst), "samples": n, "comm": comm, "tgid": tgid,
                         "who": "kswapd" if tgid in kswapd else "command", "user_frames": len(user),
                         "kernel_frames": len(kern), "user_stack": us, "kernel_stack": kst})
        self.df = stacks_table(rows)
        df = self.df
        hz = self.knobs["MOE_SAMPLE_HZ"]
        cmd = df[df["who"] == "command"]
        n_cmd = int(cmd["samples"].sum())
        n_k = int(df.loc[df["who"] == "kswapd", "samples"].sum())

        def leaves(part: pd.DataFrame, suffix: bool) -> list[list[Any]]:
            c: Counter[str] = Counter()
            for s, n in zip(part["stack"], part["samples"]):
                leaf = s.rsplit(";", 1)[-1]
                if leaf.endswith("_[k]") == suffix:
                    c[leaf] += int(n)
            return [[f, n] for f, n in c.most_common(5)]

        in_kernel = cmd[cmd["kernel_frames"] > 0]
        wall = (self._t_close - self._t_open) if self._t_open and self._t_close else None
        self.summary = {
            "sample_hz": hz, "period_ns": 1_000_000_000 // hz, "samples": int(df["samples"].sum()),
            "command_samples": n_cmd, "kswapd_samples": n_k, "kswapd_pids": list(self.kswapd_pids),
            "command_cpu_s_estimate": n_cmd / hz,
            "command_kernel_fraction": (int(in_kernel["samples"].sum()) / n_cmd) if n_cmd else None,
            "distinct_stacks": int(df["stack"].nunique()), "tgids": sorted(int(t) for t in df["tgid"].unique()),
            "ticks": self.stats.get("ticks"), "idle_ticks": self.stats.get("idle_ticks"),
            "top_kernel_leaves": leaves(cmd, True), "top_user_leaves": leaves(cmd, False),
            "kallsyms": {"available": ks.available, "reason": ks.reason},
            "maps": {"processes": len(self.maps.snaps), "snapshots": sum(len(v) for v in self.maps.snaps.values()),
                     "reads": self.maps.reads},
            "user_addresses_symbolized": sym.resolved_user, "user_addresses_unsymbolized": sym.unresolved_user,
            "elf_unreadable": sorted(sym.elf.errors), "wall_s": wall, "folded": FOLDED,
        }
        st = self.stats
        self.lost = {
            "lost_events": st.get("keys_full", 0),
            "stacks_lost_collisions": st.get("user_stack_eexist", 0) + st.get("kernel_stack_eexist", 0),
            "stack_errors": st.get("user_stack_other_err", 0) + st.get("kernel_stack_other_err", 0),
            "tasks_full": st.get("tasks_full", 0),
            "recursion_misses": dict(self._misses),
            "note": "samples are counted in the kernel (no stream); lost_events: samples whose key did not "
                    "fit in the counters (MOE_MAX_KEYS); stacks_lost_collisions: samples counted with a [lost] "
                    "side (stack-map bucket taken, raise MOE_STACK_ENTRIES); a tick while another BPF "
                    "program runs on that CPU is skipped by the kernel without a count",
        }

    # -- output -----------------------------------------------------------------------------
    def write(self, run_dir: Path, manifest: dict[str, Any]) -> None:
        run_dir = Path(run_dir)
        self.write_tables(run_dir, manifest, {SPEC.table: self.df})
        text = folded_text(self.df)
        with atomic_write(run_dir / FOLDED, mode=rd.FILE_MODE) as tmp:
            tmp.write_text(text)
        self.write_sections(manifest, self.stats, dict(self.lost), dict(self.summary))
