"""What this kernel and this process can record, and why not: `moetrace doctor` as
``moetrace.doctor()``, one row per capability, probe, attach point and background reclaimer,
yes / no / degraded with the reason and the fix.

    >>> import moetrace
    >>> rep = moetrace.doctor(mount=False)            # what `moetrace doctor --json` prints
    >>> rep["plans"]["pagecache"]["status"]
"""

from __future__ import annotations

import os
from typing import Any

Row = dict[str, Any]


def _row(section: str, name: str, status: str, detail: str, fix: str | None = None,
         checked: bool = True) -> Row:
    return {"section": section, "name": name, "status": status, "detail": detail, "fix": fix,
            "checked": checked}


def capability_rows(feats) -> list[Row]:
    """One row per capability of ``feats`` (a moetrace.kernel.features.Features)."""
    from moetrace.kernel import features as F

    rows: list[Row] = []
    priv = feats.privileges
    rows.append(_row("capability", "root", "yes" if priv["root"] else "no",
                     "effective uid 0" if priv["root"] else "not root: record needs root "
                     "(or CAP_BPF + CAP_PERFMON + tracefs access)", None if priv["root"] else "sudo moetrace ..."))
    for key, label in (("cap_bpf", "CAP_BPF"), ("cap_perfmon", "CAP_PERFMON")):
        rows.append(_row("capability", key, "yes" if priv[key] else "no",
                         f"{label} {'in' if priv[key] else 'not in'} CapEff"
                         + (" (via CAP_SYS_ADMIN)" if priv[key] and priv["cap_sys_admin"] else "")))
    ok, detail = feats.bpf()
    rows.append(_row("capability", "bpf", "yes" if ok else "no", detail,
                     None if ok else "run as root (or grant CAP_BPF)",
                     checked=not detail.startswith("could not check")))

    if feats.tracefs is not None:
        try:
            readable = (feats.tracefs / "events").is_dir()
        except PermissionError:
            readable = False
        rows.append(_row("capability", "tracefs", "yes" if readable else "degraded",
                         f"mounted at {feats.tracefs}" + ("" if readable else ", not readable (needs root)"),
                         checked=readable))
    else:
        rows.append(_row("capability", "tracefs", "no", "not mounted (tracepoints cannot be checked)",
                         F.TRACEFS_MOUNT_CMD + "   (or: moetrace doctor --mount)"))
    if feats.debugfs is not None:
        rows.append(_row("capability", "debugfs", "yes", f"mounted at {feats.debugfs}"))
    else:
        rows.append(_row("capability", "debugfs", "no", "not mounted (lru_gen sampler needs it)",
                         F.DEBUGFS_MOUNT_CMD + "   (or: moetrace doctor --mount)"))

    kr = feats.kprobes_reason()
    rows.append(_row("capability", "kprobes", "yes" if kr is None else "no", kr or "kprobes can be created",
                     checked=kr is None or not kr.startswith("could not check")))
    rows.append(_row("capability", "btf", "yes" if feats.btf else "no",
                     "/sys/kernel/btf/vmlinux: the compiled probes relocate against it" if feats.btf else
                     "no /sys/kernel/btf/vmlinux (CONFIG_DEBUG_INFO_BTF off): the compiled probes cannot be "
                     "relocated, and moetrace has no loader that compiles at run time",
                     None if feats.btf else "boot a kernel built with CONFIG_DEBUG_INFO_BTF=y (every Debian "
                     "kernel since 5.x; `moetrace lab kernels` lists some)"))
    pe = F.perf_events_available(feats.root)
    rows.append(_row("capability", "perf_events", "yes" if pe else "no",
                     "software PMU (cpu-clock)" if pe else "no perf events"))

    mg = feats.mglru
    if mg is None:
        rows.append(_row("capability", "mglru", "no", "MGLRU not built (no /sys/kernel/mm/lru_gen)"))
    elif mg["on"]:
        rows.append(_row("capability", "mglru", "yes", f"on (enabled={mg['enabled_raw']}, "
                         f"lru_gen in debugfs: {'yes' if mg['debugfs_lru_gen'] else 'no'})"))
    else:
        rows.append(_row("capability", "mglru", "degraded", f"built but off (enabled={mg['enabled_raw']})",
                         "echo y > /sys/kernel/mm/lru_gen/enabled"))

    cg = F.cgroup_memory(feats.root)
    if cg["v2"]:
        rows.append(_row("capability", "cgroup_v2_memory", "yes", f"memory controller in {cg['v2']}"))
    else:
        where = (f"{cg['v2_mount']} offers only {', '.join(cg['v2_controllers']) or 'no controllers'}"
                 if cg["v2_mount"] else "no cgroup2 mount")
        rows.append(_row("capability", "cgroup_v2_memory", "no", where))
    rows.append(_row("capability", "cgroup_v1_memory", "yes" if cg["v1"] else "no",
                     f"memory controller at {cg['v1']}" if cg["v1"] else "no v1 memory hierarchy mounted"))
    psi = F.psi_available(feats.root)
    rows.append(_row("capability", "psi", "yes" if psi else "no",
                     "/proc/pressure/memory" if psi else "no readable /proc/pressure/memory (CONFIG_PSI off or psi=0)"))
    return rows


def probe_rows(plans) -> list[Row]:
    """A summary row per probe, then one row per attach group."""
    rows: list[Row] = []
    for name, plan in plans.items():
        rows.append(_row("probe", name, plan.status,
                         (plan.reason or f"all {len(plan.entries)} attach points")
                         + "; loaded from its compiled CO-RE object (libbpf)",
                         checked=all(e.checked for e in plan.entries)))
        for e in plan.entries:
            if e.attached:
                st = "degraded" if e.tried else "yes"
                detail = e.candidate.describe()
                if e.tried:
                    detail += " (fallback; " + "; ".join(f"{c.describe()}: {r}" for c, r in e.tried) + ")"
            else:
                st, detail = "no", e.reason + ("" if e.required else " [optional]")
            rows.append(_row("attach", f"{name}.{e.group}", st, detail, checked=e.checked))
    return rows


def background_rows(damon: dict[str, Any]) -> list[Row]:
    """One row per active DAMON scheme (read only): a reclaimer that perturbs measurements."""
    rows: list[Row] = []
    if not damon["available"]:
        return [_row("background", "damon", "no", damon["note"])]
    if not damon["active_schemes"]:
        return [_row("background", "damon", "no", "no kdamond is on: nothing evicts behind the measurement's back")]
    for s in damon["active_schemes"]:
        regions = ", ".join(f"{r['start'] / 2**30:.2f}-{r['end'] / 2**30:.2f} GiB" for r in s["regions"]
                            if r["start"] is not None and r["end"] is not None)
        where = f" over {s['operations']} {regions}" if regions else f" ({s['operations']})"
        rows.append(_row("background", f"damon.{s['thread']}.scheme{s['index']}",
                         "active" if s["evicts_page_cache"] else "passive", s["effect"] + where,
                         "pool evictions by it are attributed to 'damon' (experts.parquet evicted_by_damon_pages);"
                         " cells flag them. moetrace never changes DAMON's settings" if s["evicts_page_cache"]
                         else None))
    return rows


def engine_rows() -> list[Row]:
    """The engines the set-up unpacked (scripts/engine-setup.sh): llama.cpp's version, its CPU
    backend, where it is; or why there is none and how to get it."""
    from moetrace.engines.llamacpp import SETUP, engine_root, find_engine
    from moetrace.errors import InputError

    try:
        e = find_engine()
    except InputError as err:
        return [_row("engine", "llama.cpp", "no", err.format_message())]
    if e is None:
        return [_row("engine", "llama.cpp", "no", f"not unpacked under {engine_root()}",
                     f"{SETUP} (as root: Debian sid's llama.cpp with its own loader, never installed, ~20 s)")]
    backend = os.path.basename(e.backend) if e.backend else "no CPU backend recorded"
    return [_row("engine", "llama.cpp", "yes", f"{e.version} ({e.build}), {backend}, in {e.path}")]


def doctor(root: str = "/", mount: bool | str = "temporary", probes_only: bool = False) -> dict[str, Any]:
    """Everything `doctor --json` prints: kernel, mount notes, rows, plans, not_checked, damon
    (``probes_only``: no capability rows).

    mount: "temporary" (default) answers for the way `record` runs: record mounts tracefs /
    debugfs itself when absent, so doctor mounts them for the check (root, live system) and
    unmounts them again; True mounts and leaves them; False checks what is mounted now."""
    from moetrace.kernel.damon import read_damon
    from moetrace.kernel.features import Features, unmount_ours
    from moetrace.record.probes import resolve_all

    feats = Features(root, mount=bool(mount))
    plans = resolve_all(feats)
    damon = read_damon(root)
    rows = capability_rows(feats) + probe_rows(plans) + background_rows(damon) + engine_rows()  # while mounted
    if mount == "temporary" and feats.notes:
        feats.notes = [f"{n} for this check, as record does (unmounted again)" for n in feats.notes]
        unmount_ours()
    not_checked = [r["name"] for r in rows if not r["checked"]]
    if probes_only:
        rows = [r for r in rows if r["section"] not in ("capability", "engine")]
    return {"kernel": feats.osrelease, "root": feats.root, "mounted": feats.notes, "rows": rows,
            "plans": {n: p.to_dict() for n, p in plans.items()}, "not_checked": not_checked, "damon": damon}
