"""JSON helpers shared by the writers (plan meta, run directories, --json output)."""

from __future__ import annotations

from typing import Any

import numpy as np


def json_default(o: Any) -> Any:
    """json.dumps(default=...) for numpy scalars and arrays; NaN becomes null."""
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return None if np.isnan(o) else float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
