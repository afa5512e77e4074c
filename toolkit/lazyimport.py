"""Heavy libraries imported on first use, and loaded in a thread while the probes load.

`moetrace record` needs pandas and pyarrow only once the command has ended (to write the
tables), but importing them costs ~0.35 s of one CPU. The probes' loads (libbpf and the
verifier, called through ctypes, which releases the GIL) keep a CPU busy first: :func:`warm`
imports the libraries in a thread meanwhile, on another CPU, so start-up does not pay for
them. Modules that use pandas name it ``pd`` through :data:`pandas`, which imports the real
module when an attribute is first read.

Where every CPU is one in truth (the lab's single-threaded TCG) the warm-up still runs before
the command, on purpose: a replay that imports pandas / pyarrow itself then finds their files
in the page cache, charged to the recorder's cgroup, not to the memory cgroup under test
(measured in the lab without it: 26.6 -> 38-40 s of command wall at 80 MiB)."""

from __future__ import annotations

import importlib
import threading
import types


class LazyModule(types.ModuleType):
    """A stand-in for a module, imported at the first attribute access."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__dict__["_lazy_target"] = name

    def __getattr__(self, attr: str):
        mod = importlib.import_module(self.__dict__["_lazy_target"])
        return getattr(mod, attr)

    def __dir__(self):
        return dir(importlib.import_module(self.__dict__["_lazy_target"]))


pandas = LazyModule("pandas")

#: what writing a run directory imports
TABLE_LIBRARIES = ("pandas", "pyarrow", "pyarrow.parquet")


def warm(names: tuple[str, ...] = TABLE_LIBRARIES, first: tuple = ()) -> threading.Thread:
    """Import ``names`` in a daemon thread; join it before forking (an import lock held
    across fork would stay held in the child). ``first``: callables run in the thread
    before the imports (the kernel's BTF, parsed while the first probes compile: 7 s of
    Python under the lab's TCG); each must be safe to call again from another thread."""

    def run() -> None:
        for f in first:
            try:
                f()
            except Exception:  # noqa: BLE001 - the caller's own call reports it
                pass
        for n in names:
            try:
                importlib.import_module(n)
            except ImportError:  # the first real use reports it
                pass

    t = threading.Thread(target=run, name="moetrace-warm-imports", daemon=True)
    t.start()
    return t
