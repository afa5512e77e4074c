"""moetrace: what does the kernel do with MoE expert weights served from the page cache?"""

from moetrace.version import __version__


def __getattr__(name: str):
    """The library behind the commands, imported on first use (``import moetrace`` stays light for
    `record`): ``moetrace.open_run`` / ``moetrace.open_sweep`` (read a run, cell or sweep directory),
    ``moetrace.sim`` (`moetrace sim`), ``moetrace.trace_stats`` / ``moetrace.counts_stats``
    (`moetrace trace stats`), ``moetrace.doctor`` (`moetrace doctor`)."""
    if name in ("open_run", "open_sweep"):
        from moetrace.run import handle

        return getattr(handle, name)
    if name == "sim":
        from moetrace.analyses.simrun import sim

        return sim
    if name in ("trace_stats", "counts_stats"):
        from moetrace.analyses import tracestats

        return getattr(tracestats, name)
    if name == "doctor":
        from moetrace.record.doctor import doctor

        return doctor
    raise AttributeError(f"module 'moetrace' has no attribute {name!r}")
