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


__all__ = ["engine"]
