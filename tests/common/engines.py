"""What the engine tests share: the set-up's llama.cpp (scripts/engine-setup.sh), or a skip that
says why (a failure under MOETRACE_LIVE=1)."""

from __future__ import annotations

import os

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


__all__ = ["engine", "free_port", "serving"]
