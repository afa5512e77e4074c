"""Heavy libraries imported on first use, and loaded in a thread while the probes load.

`moetrace record` needs pandas and pyarrow only once the command has ended (to write the
tables), but importing them costs ~0.35 s of one CPU. The probes' loads (libbpf and the
verifier, called through ctypes, which releases the GIL) keep a CPU busy first: :func:`warm`
imports the libraries in a thread meanwhile, on another CPU, so start-up does not pay for
them. Modules that use pandas name it ``pd`` through :data:`pandas`, which imports the real
module when an attribute is first read.

Where every CPU is one in truth (the lab's single-threaded TCG) the warm-up costs its whole
time before the command (pandas ~5 s there, pyarrow ~3 s), so there it imports only what a
replay shares with the recorder, and only when the command runs in a cgroup of its own
(``record --cgroup``, as `moetrace cell` runs it): a replay that imports pyarrow itself then
finds its files in the page cache, charged to the recorder's cgroup, not to the memory cgroup
under test (measured in the lab without it: 26.6 -> 38-40 s of command wall at 80 MiB).
``MOETRACE_WARM_IMPORTS``, set by the lab's guest under TCG, names those libraries."""

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
#: set (a comma-separated list) where CPUs are serial (the lab's guest under TCG): the libraries
#: to import before the command, and only when it joins a cgroup ("": never any)
WARM_ENV = "MOETRACE_WARM_IMPORTS"


def warm_names(joins_cgroup: bool) -> tuple[str, ...]:
    """The libraries to import while the probes load: :data:`TABLE_LIBRARIES`; where
    ``MOETRACE_WARM_IMPORTS`` is set, the libraries it names when the command joins a cgroup
    (``joins_cgroup``), else none."""
    import os

    env = os.environ.get(WARM_ENV)
    if env is None:
        return TABLE_LIBRARIES
    if not joins_cgroup:
        return ()
    return tuple(n.strip() for n in env.split(",") if n.strip())


def warm(names: tuple[str, ...] = TABLE_LIBRARIES, first: tuple = ()) -> threading.Thread:
    """Import ``names`` in a daemon thread; join it before forking (an import lock held
    across fork would stay held in the child). ``first``: callables run in the thread
    before the imports (the kernel's BTF, parsed while the first probes load: 7 s of
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
