"""JSON helpers shared by the writers (plan meta, run directories, --json output)."""

from __future__ import annotations

import sys
from typing import Any


def write_json(path, doc: Any, indent: int = 1) -> None:
    """``doc`` as JSON into ``path``, atomically (moetrace.atomic), its directory made first."""
    import json
    from pathlib import Path

    from moetrace.atomic import atomic_write

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        tmp.write_text(json.dumps(doc, indent=indent, default=json_default) + "\n")


def json_default(o: Any) -> Any:
    """json.dumps(default=...) for numpy scalars and arrays; NaN becomes null. (numpy is not
    imported here: an object of numpy's exists only once numpy has been; 1.7 s of a guest's
    start-up under TCG.)"""
    np = sys.modules.get("numpy")
    if np is None:
        raise TypeError(f"not JSON serializable: {type(o).__name__}")
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return None if np.isnan(o) else float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
