"""`moetrace lab guest-cell`: the wrapper a matrix cell runs in its guest (issue 34).

``moetrace lab guest-cell --dir /tmp/lab --settings JSON -- moetrace cell ...`` (the matrix
writes it: moetrace.lab.matrix.guest_command), as root in a disposable lab guest:

1. applies the cell's guest settings (:data:`REQUEST_KEYS`; None: the kernel's), in this order:
   transparent_hugepage/enabled (first: enabling THP raises min_free_kbytes by itself,
   khugepaged's set_recommended_min_free_kbytes), the swap disk (found by its serial,
   moetrace.lab.run.SWAP_SERIAL: mkswap, swapon), lru_gen/min_ttl_ms, the pool disk's
   queue/read_ahead_kb, then the watermarks (min_free_kbytes, or a bite_fraction reached through
   min_free_kbytes and watermark_scale_factor: moetrace.lab.watermarks, /proc/zoneinfo read
   again after each write, at most WATERMARK_TRIES times);
2. starts the sampler (moetrace.lab.sampler.Sampler, into DIR/sampler/, where
   moetrace.run.sampler finds it) and, with ``bites_bytes``, the bites controller
   (moetrace.lab.bites_controller, its log DIR/bites.csv);
3. runs the cell (the command after ``--``), SIGINT / SIGTERM passed on to it;
4. stops the controller and the sampler, puts every knob back, swapoff — also on an error or a
   signal — and writes DIR/guest_settings.json (what was asked, what each knob was before and
   became, Σhigh before and after, errors and notes).

Exit status: the cell's; EXIT_SETUP (4) when a setting could not be applied or the controller
cannot run (the cell is not started; guest_settings.json ``errors`` says why).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

from moetrace.errors import UsageError

GUEST_SETTINGS = "guest_settings.json"
EXIT_SETUP = 4
WATERMARK_TRIES = 3
#: the settings the wrapper takes (moetrace.lab.matrix.guest_settings writes them)
REQUEST_KEYS = {"capacity_bytes": int, "pool": str, "memcg": str, "min_free_kbytes": int, "bite_fraction": float,
                "read_ahead_kb": int, "min_ttl_ms": int, "swap": bool, "thp": str, "bites_bytes": int, "sampler": bool}
THP_MODES = {"on": "always", "off": "never"}


def parse_request(text: str) -> dict[str, Any]:
    """--settings JSON -> the request, every key checked (UsageError naming it otherwise)."""
    try:
        req = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--settings is not JSON: {e}") from None
    if not isinstance(req, dict):
        raise UsageError("--settings must be a JSON object")
    unknown = sorted(set(req) - set(REQUEST_KEYS))
    if unknown:
        raise UsageError(f"--settings: unknown key(s) {', '.join(unknown)}", hint=f"known: {', '.join(REQUEST_KEYS)}")
    for k, v in req.items():
        want = REQUEST_KEYS[k]
        ok = v is None or (isinstance(v, want) and not (want is not bool and isinstance(v, bool))) \
            or (want is float and isinstance(v, int) and not isinstance(v, bool))
        if not ok:
            raise UsageError(f"--settings: {k} must be {want.__name__} or null, not {v!r}")
    if req.get("thp") not in (None, *THP_MODES):
        raise UsageError(f"--settings: thp {req['thp']!r}", hint="on, off or null")
    if (req.get("bite_fraction") or req.get("bites_bytes")) and not req.get("capacity_bytes"):
        raise UsageError("--settings: bite_fraction and bites_bytes need capacity_bytes")
    return {k: req.get(k) for k in REQUEST_KEYS}


# -- the knobs -------------------------------------------------------------------------------------

def _read(path: Path) -> str:
    return path.read_text().strip()


def _set(path: Path, value: Any, stack: ExitStack, doc: dict[str, Any], key: str, show=None) -> None:
    """Write ``value`` to ``path`` (its old value put back when ``stack`` unwinds) and record
    before / wanted / after in doc['knobs'][key] (``show``: how a value reads back)."""
    show = show or (lambda text: int(text) if text.lstrip("-").isdigit() else text)
    before = _read(path)
    rec = {"path": str(path), "before": show(before), "wanted": value, "after": None}
    doc["knobs"][key] = rec
    path.write_text(f"{value}\n")
    stack.callback(_restore, path, show(before), doc, key)
    rec["after"] = show(_read(path))


def _restore(path: Path, value: str, doc: dict[str, Any], key: str) -> None:
    try:
        path.write_text(f"{value}\n")
        doc["restored"].append(key)
    except OSError as e:
        doc["notes"].append(f"{key} not put back to {value}: {e.strerror or e}")


def _bracketed(text: str) -> str:
    """'always [madvise] never' -> 'madvise'."""
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text


def _thp(req: dict[str, Any], doc: dict[str, Any], stack: ExitStack, root: Path) -> None:
    if req["thp"] is not None:
        _set(root / "sys/kernel/mm/transparent_hugepage/enabled", THP_MODES[req["thp"]], stack, doc, "thp",
             _bracketed)


def _min_ttl(req: dict[str, Any], doc: dict[str, Any], stack: ExitStack, root: Path) -> None:
    if req["min_ttl_ms"] is not None:
        _set(root / "sys/kernel/mm/lru_gen/min_ttl_ms", req["min_ttl_ms"], stack, doc, "min_ttl_ms")


def queue_dir(path: str | os.PathLike, root: Path) -> Path:
    """The request queue directory (sysfs) of the disk holding ``path`` (a partition's parent)."""
    st = os.stat(path)
    dev = (root / "sys/dev/block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
    return dev / "queue" if (dev / "queue").is_dir() else dev.parent / "queue"


def _read_ahead(req: dict[str, Any], doc: dict[str, Any], stack: ExitStack, root: Path) -> None:
    if req["read_ahead_kb"] is not None:
        if not req["pool"]:
            raise UsageError("read_ahead_kb needs the pool's path (settings: pool)")
        _set(queue_dir(req["pool"], root) / "read_ahead_kb", req["read_ahead_kb"], stack, doc, "read_ahead_kb")


def swap_device(root: Path) -> str | None:
    """/dev/<disk> of the lab's swap disk (its sysfs serial is moetrace.lab.run.SWAP_SERIAL)."""
    from moetrace.lab.run import SWAP_SERIAL

    for serial in sorted((root / "sys/block").glob("*/serial")):
        try:
            if _read(serial) == SWAP_SERIAL:
                return f"/dev/{serial.parent.name}"
        except OSError:
            continue
    return None


def _swap(req: dict[str, Any], doc: dict[str, Any], stack: ExitStack, root: Path,
          run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> None:
    if not req["swap"]:
        return
    dev = swap_device(root)
    if dev is None:
        raise UsageError("no swap disk in this guest (no /sys/block/*/serial says moetrace-swap)",
                         hint="the matrix boots a swap cell with moetrace.lab.run.run_in_guest(swap_bytes=...)")
    rec = doc["swap"] = {"device": dev, "on": False, "off_at_end": None}
    for argv in (["mkswap", "-f", dev], ["swapon", dev]):
        r = run(argv, capture_output=True, text=True)
        if r.returncode != 0:
            raise UsageError(f"{' '.join(argv)} failed: {(r.stderr or r.stdout).strip()}")
    rec["on"] = True
    rec["swaps"] = _read(root / "proc/swaps").splitlines()[1:]

    def off() -> None:
        r = run(["swapoff", dev], capture_output=True, text=True)
        rec["off_at_end"] = r.returncode == 0
        if r.returncode != 0:
            doc["notes"].append(f"swapoff {dev} failed: {(r.stderr or r.stdout).strip()}")
    stack.callback(off)


# -- the watermarks --------------------------------------------------------------------------------

def watermark_state(zones: list[dict[str, Any]], root: Path, capacity_bytes: int | None) -> dict[str, Any]:
    """The knobs, the zones' sums (pages; /proc/zoneinfo's watermarks count a boost in, which
    ``sum_boost_pages`` says) and Σhigh / C of /proc/zoneinfo's ``zones``."""
    from moetrace.kernel.procfs import watermark_sums

    page = os.sysconf("SC_PAGE_SIZE")
    s = watermark_sums(zones)
    vm = root / "proc/sys/vm"
    return {"min_free_kbytes": int(_read(vm / "min_free_kbytes")),
            "watermark_scale_factor": int(_read(vm / "watermark_scale_factor")), **s,
            "sum_boost_pages": sum(z.get("boost", 0) for z in zones if z.get("managed", 0) > 0),
            "bite_fraction": (s["sum_high_pages"] * page / capacity_bytes) if capacity_bytes else None}


def _watermarks(req: dict[str, Any], doc: dict[str, Any], stack: ExitStack, root: Path,
                read_zones: Callable[[], list[dict[str, Any]]] | None = None) -> None:
    """Σhigh before; min_free_kbytes, or the knobs reaching bite_fraction x C (re-read after
    each write, the model's target shifted by the miss); Σhigh after. Recorded always."""
    from moetrace.kernel.procfs import read_zoneinfo
    from moetrace.lab.watermarks import plan_watermarks

    read_zones = read_zones or (lambda: read_zoneinfo(root))
    page_kb = os.sysconf("SC_PAGE_SIZE") // 1024
    zones = read_zones()
    cap = req["capacity_bytes"]
    rec = doc["watermarks"] = {"before": watermark_state(zones, root, cap), "attempts": []}
    vm = root / "proc/sys/vm"
    if req["min_free_kbytes"] is not None:
        _set(vm / "min_free_kbytes", req["min_free_kbytes"], stack, doc, "min_free_kbytes")
    elif req["bite_fraction"] is not None:
        target = rec["target_sum_high_pages"] = int(round(req["bite_fraction"] * cap / (page_kb * 1024)))
        aim, wsf0 = target, rec["before"]["watermark_scale_factor"]
        for _ in range(WATERMARK_TRIES):
            p = plan_watermarks(zones, aim, wsf0, page_kb)
            for key, value in (("watermark_scale_factor", p.watermark_scale_factor),
                               ("min_free_kbytes", p.min_free_kbytes)):
                if key not in doc["knobs"]:
                    _set(vm / key, value, stack, doc, key)
                else:
                    (vm / key).write_text(f"{value}\n")
                    doc["knobs"][key].update(wanted=value, after=int(_read(vm / key)))
            st = watermark_state(read_zones(), root, cap)
            got = st["sum_high_pages"] - st["sum_boost_pages"]  # the knobs' own: a boost passes
            rec["attempts"].append({"min_free_kbytes": p.min_free_kbytes, "watermark_scale_factor":
                                    p.watermark_scale_factor, "predicted_sum_high_pages": p.predicted_sum_high_pages,
                                    "sum_high_pages": got})
            if abs(got - target) <= max(1, len(zones)):
                break
            aim = max(1, aim + target - got)
        rec["reached"] = abs(got - target) <= max(target // 100, len(zones))
        if not rec["reached"]:
            doc["notes"].append(f"bite_fraction {req['bite_fraction']}: Σhigh {got} pages, not the {target} asked")
    rec["after"] = watermark_state(read_zones(), root, cap)


# -- the run ---------------------------------------------------------------------------------------

def _sampler(req: dict[str, Any], lab_dir: Path, doc: dict[str, Any], stack: ExitStack) -> None:
    """The guest's sampler into DIR/sampler/ (a note, not an error, when this build has none)."""
    rec = doc["sampler"] = {"dir": "sampler", "running": False, "note": None}
    if not req["sampler"]:
        rec["note"] = "not asked"
        return
    try:
        from moetrace.lab.sampler import Sampler
        from moetrace.run.sampler import SAMPLER_DIR
    except ImportError as e:
        rec["note"] = f"no sampler in this build (moetrace.lab.sampler: {e})"
        doc["notes"].append(rec["note"])
        return
    rec["dir"] = SAMPLER_DIR
    try:
        stack.enter_context(Sampler(lab_dir / SAMPLER_DIR))
        rec["running"] = True
    except Exception as e:  # noqa: BLE001 - the cell's own measurements stand without it
        rec["note"] = f"the sampler did not start: {type(e).__name__}: {e}"
        doc["notes"].append(rec["note"])


def _controller(req: dict[str, Any], lab_dir: Path, doc: dict[str, Any], stack: ExitStack, root: Path) -> None:
    from moetrace.lab.bites_controller import CSV_NAME, BitesController, unavailable

    if not req["bites_bytes"]:
        return
    why = unavailable(root)
    if why:
        raise UsageError(f"lru_gen-bites: {why}")
    pages = max(1, req["bites_bytes"] // os.sysconf("SC_PAGE_SIZE"))
    c = BitesController(lab_dir, pages, memcg_path=req["memcg"], root=root)
    rec = doc["controller"] = {}
    stack.callback(lambda: rec.update(c.summary(), csv=CSV_NAME))  # after it stopped
    stack.enter_context(c)


#: the settings in the order they are applied (THP first: enabling it raises min_free_kbytes)
APPLY = (_thp, _swap, _min_ttl, _read_ahead, _watermarks)


def run_guest_cell(request: dict[str, Any], argv: list[str], lab_dir: str | os.PathLike,
                   root: str | os.PathLike = "/") -> int:
    """Settings, sampler, controller, the cell, then everything undone; guest_settings.json
    written last. Returns the cell's exit status (EXIT_SETUP when it was not started)."""
    from moetrace.run.documents import GUEST_SCHEMA
    from moetrace.run.metadata import write_guest_settings

    lab_dir, root = Path(lab_dir), Path(root)
    doc: dict[str, Any] = {"schema": GUEST_SCHEMA, "request": request, "cell_argv": argv, "pid": os.getpid(), "knobs": {},
                           "restored": [], "errors": [], "notes": [], "exit_status": None,
                           "started_monotonic_ns": time.monotonic_ns()}
    rc = EXIT_SETUP
    try:
        with ExitStack() as stack:
            try:
                for step in APPLY:
                    step(request, doc, stack, root)
                _sampler(request, lab_dir, doc, stack)
                _controller(request, lab_dir, doc, stack, root)
            except (UsageError, OSError) as e:
                doc["errors"].append(e.format_message() if isinstance(e, UsageError)
                                     else f"{e.filename or 'a setting'}: {e.strerror or e}")
            if not doc["errors"]:
                rc = doc["exit_status"] = run_cell(argv)
    finally:
        doc["ended_monotonic_ns"] = time.monotonic_ns()
        write_guest_settings(lab_dir / GUEST_SETTINGS, doc)
    return rc


def run_cell(argv: list[str]) -> int:
    """The cell as a child, SIGINT / SIGTERM passed on to it; its exit status (128 + signal
    when a signal ended it)."""
    proc = subprocess.Popen(argv)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 - rc if rc < 0 else rc


def read_guest_settings(path: str | os.PathLike) -> dict[str, Any]:
    """A cell's guest_settings.json (moetrace.run.metadata.read_guest_settings)."""
    from moetrace.run.metadata import read_guest_settings as read

    return dict(read(path))


__all__ = ["EXIT_SETUP", "GUEST_SETTINGS", "REQUEST_KEYS", "parse_request", "queue_dir",
           "read_guest_settings", "run_cell", "run_guest_cell", "swap_device", "watermark_state"]
