"""What the engine tests share: the set-up's llama.cpp (scripts/engine-setup.sh), or a skip that
says why (a failure under MOETRACE_LIVE=1); and the per-token comparison of a recording's added
pages with the engine's own routing."""

from __future__ import annotations

import os

import numpy as np
import pytest

from moetrace.engines.llamacpp import find_engine


@pytest.fixture(scope="module")
def engine():
    e = find_engine()
    if e is None:
        reason = "no llama.cpp unpacked (run: bash scripts/engine-setup.sh)"
        if os.environ.get("MOETRACE_LIVE") == "1":
            pytest.fail(f"MOETRACE_LIVE=1: {reason}")
        pytest.skip(reason)
    return e


def free_port() -> int:
    """A TCP port nobody listens on now (for a llama-server of the test's)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(port: int) -> bool:
    """llama-server on ``port`` answers /health (the model loaded, the server up)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def routed_against_added(ee, routed: list[dict], tokens: int, layers: int = 8, experts: int = 64,
                         ppe: int = 192) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(want, bad): ``want[token, layer * experts + expert]`` = ``ppe`` pages where the routing
    log's decode records ``routed`` chose the expert, else 0; ``bad``: (token, experts whose added
    pages differ) of the measured expert rows of ``ee`` (expert_epochs merged with the epochs'
    phase and iteration)."""
    want = np.zeros((tokens, layers * experts), np.int64)
    for r in routed:
        want[r["step"], r["layer"] * experts + np.array(r["experts"])] = ppe
    got = np.zeros_like(want)
    x = ee[(ee["phase"] == "measured") & (ee["kind"] == "expert")]
    got[x["iteration"].astype(int), x["expert_id"].astype(int)] = x["added_pages"].astype(np.int64)
    return want, [(t, int((got[t] != want[t]).sum())) for t in range(tokens) if (got[t] != want[t]).any()]


__all__ = ["engine", "free_port", "routed_against_added", "serving"]
