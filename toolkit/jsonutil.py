"""JSON helpers shared by the writers (plan meta, run directories, --json output)."""

from __future__ import annotations

import sys
from typing import Any


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
