"""The access stream of any input file: a trace (typed .parquet or engine .jsonl) or a
plan (a file starting with a plan magic).

:func:`load_accesses` is the one loader every consumer calls (the simulator, the
replay harness's frequency tables, the ``sim`` command); :func:`is_plan` tells the
two kinds apart from the file's head.
"""

from __future__ import annotations

import os

import numpy as np

from moetrace.errors import InputError, UsageError
from moetrace.inputs.trace import Accesses

# toolkit/inputs/plan.py writes b"MOETPLAN"; b"MOEPLAN" is the spelling in the issue.
PLAN_MAGICS = (b"MOETPLAN", b"MOEPLAN")


def is_plan(path: str | os.PathLike) -> bool:
    """True when the file starts with a plan magic (checked on the head, nothing imported).
    InputError when it cannot be read."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(max(len(m) for m in PLAN_MAGICS))
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror}", path=str(path)) from None
    return any(head.startswith(m) for m in PLAN_MAGICS)


def plan_expert_bytes(path: str | os.PathLike) -> int | None:
    """The expert size a plan's header records (None when unknown or not a plan)."""
    if not is_plan(path):
        return None
    try:
        from moetrace.inputs.plan import read_header
    except ImportError:
        return None
    eb = int(getattr(read_header(path), "expert_bytes", 0) or 0)
    return eb or None


def load_accesses(path: str | os.PathLike, k: int | None = None, n_layers: int | None = None,
                  n_experts: int | None = None, order: str | None = None, request: str | None = None,
                  info: dict | None = None) -> Accesses:
    """The access stream of a trace (typed .parquet or engine .jsonl) or of a plan
    (a file starting with a plan magic, read by moetrace.inputs.plan.read_accesses,
    imported only then).

    A trace gives the batch stream (per forward pass and layer, the union of its
    requests' experts), or with request one request's own stream; order "rank"
    (default) or "sorted" orders each slot's experts. info, when a dict, gets
    stream (a sentence saying which), order and requests."""
    spath = str(path)
    if not os.path.exists(spath):
        raise InputError("no such file", path=spath)
    if os.path.isdir(spath):
        raise InputError("is a directory, not a trace or plan", path=spath)
    if is_plan(spath):
        try:
            from moetrace.inputs.plan import read_accesses
        except ImportError as e:
            raise InputError(f"this is a plan but the plan reader is unavailable ({e})", path=spath) from None
        if request is not None:
            raise UsageError("--request needs a trace: a plan holds no requests")
        acc = read_accesses(spath)
        if order is not None and order != acc.order:
            if order == "rank":
                raise UsageError("this plan was compiled in sorted order; compile it again with --order rank")
            acc = _sorted_accesses(acc)
        if info is not None:
            meta_req = None
            try:
                from moetrace.inputs.plan import read_header

                meta_req = read_header(spath).meta.get("request")
            except Exception:  # noqa: BLE001 - the stream sentence is informational
                pass
            info.update(stream=f"the plan's stream ({'request ' + str(meta_req) if meta_req else 'as compiled'})",
                        order=acc.order)
        return acc
    from moetrace.inputs.trace import load_trace

    tt = load_trace(spath, k=k, n_layers=n_layers, n_experts=n_experts)
    n_req = tt.n_requests
    if request is not None:
        tt = tt.select_request(request)
    acc = tt.accesses(order=order or "rank")
    if info is not None:
        info.update(stream=stream_sentence(request, tt.n_steps, n_req), order=acc.order, requests=n_req)
    return acc


def stream_sentence(request: str | None, n_passes: int, n_requests: int) -> str:
    """Which access stream a simulation ran on, in words."""
    if request is not None:
        return f"request {request} alone ({n_passes} forward passes)"
    if n_requests > 1:
        return f"the batch stream: per forward pass the union of {n_requests} requests' experts"
    return "one request"


def _sorted_accesses(acc: Accesses) -> Accesses:
    """The same stream with each slot's experts ascending."""
    key = ((acc.iteration.astype(np.int64) * 2 + acc.pass_) * acc.n_layers + acc.layer) * acc.n_experts + acc.expert
    o = np.argsort(key, kind="stable")
    return Accesses(acc.iteration[o], acc.pass_[o], acc.layer[o], acc.expert[o], acc.n_layers, acc.n_experts,
                    acc.n_iterations, "sorted")


__all__ = ["PLAN_MAGICS", "is_plan", "plan_expert_bytes", "load_accesses", "stream_sentence"]
