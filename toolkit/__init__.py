"""moetrace: what does the kernel do with MoE expert weights served from the page cache?"""

from moetrace.version import __version__


def __getattr__(name: str):
    """``moetrace.open_run`` / ``moetrace.open_sweep`` (imported on first use: ``import
    moetrace`` stays light for `record`)."""
    if name in ("open_run", "open_sweep"):
        from moetrace.run import handle

        return getattr(handle, name)
    raise AttributeError(f"module 'moetrace' has no attribute {name!r}")
