"""One simulation of a trace or plan file: what `moetrace sim` computes, as ``moetrace.sim(...)``.

The file decides the driver: a plan is simulated as it is, in bounded memory
(:func:`moetrace.analyses.simstream.compute_sim_stream`); an engine JSONL trace larger than
``MOETRACE_STREAM_BYTES`` (default 8 MiB) is compiled to a temporary plan first and streamed
the same way; anything else (a typed Parquet, a small trace, a plan to re-order or to split
by request) is loaded whole (:func:`moetrace.analyses.sim.compute_sim`).

    >>> import moetrace
    >>> res = moetrace.sim("trace.jsonl", policies="lru,belady", budgets=[8, 16], geometry="kimi-k3")
    >>> res.table                   # one row per policy x scope x budget
    >>> res.to_dict()               # what `moetrace sim --json` prints
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from moetrace.errors import UsageError


@dataclass
class SimResult:
    """A simulation of one file: ``table`` (policy, scope, budget, ..., hit_rate,
    miss_bytes_per_iteration; ``table.attrs`` the window), the stream simulated (``info``:
    stream, order, requests) and the static table's name."""

    source: str
    table: pd.DataFrame
    policies: list[str]
    static_table: str
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document `moetrace sim --json` prints: the window, the stream, the rows."""
        df = self.table
        rows = df.astype(object).where(df.notna(), None).to_dict(orient="records")
        return {"input": self.source, **df.attrs, **self.info, "static_table": self.static_table, "rows": rows}


def sim_scopes(scope: str | None, global_budgets: list[int] | None) -> list[str]:
    """The scopes to simulate: per-layer, global or both (None: per-layer, or both with
    global budgets)."""
    if scope is None:
        scopes = ["per_layer", "global"] if global_budgets else ["per_layer"]
    elif scope == "both":
        scopes = ["per_layer", "global"]
    else:
        scopes = [scope.replace("-", "_")]
    if global_budgets and "global" not in scopes:
        raise UsageError("--global-budgets needs --scope global or both")
    return scopes


def sim(trace_or_plan: str | os.PathLike, policies: str | Sequence[str] = "lru,lfu,static,belady",
        budgets: str | Iterable[int] = "8,16,32,64", scope: str | None = None,
        global_budgets: str | Iterable[int] | None = None, static_table: str = "oracle",
        warm_fraction: float = 0.6, expert_bytes: int | None = None, geometry: str | None = None,
        request: str | None = None, order: str | None = None) -> SimResult:
    """Simulate expert caches (lru, lfu, static, belady) on a router trace or a compiled plan
    under fair windows: every policy warms on the first ``warm_fraction`` of iterations, the
    rest is scored.

    ``budgets``: experts per layer (comma-separated text or integers); ``scope``: "per-layer",
    "global" or "both" (default per-layer, or both with ``global_budgets``, pool sizes in all);
    ``static_table``: "oracle", "warm", or another trace or plan (domain shift);
    ``expert_bytes``: bytes per expert for miss demand (default: the geometry preset's, else the
    plan's, else NA); ``geometry``: a preset name (layers, experts and k of a JSONL trace);
    ``request``: simulate one request's own stream; ``order``: "rank" or "sorted" within a step.
    Bad input raises :class:`moetrace.errors.MoetraceError` naming the cause and the fix."""
    from moetrace.analyses.sim import parse_budgets, parse_policies
    from moetrace.inputs.accesses import load_accesses

    source = str(trace_or_plan)
    pols = parse_policies(policies)
    budget_list = parse_budgets(budgets)
    gbudgets = parse_budgets(global_budgets, "--global-budgets") if global_budgets else None
    scopes = sim_scopes(scope, gbudgets)
    geo = None
    if geometry:
        from moetrace.inputs.geometry import preset

        geo = preset(geometry)
    if expert_bytes is None and geo is not None:
        expert_bytes = geo.expert_bytes or None
    kw = dict(k=geo.k, n_layers=geo.n_layers, n_experts=geo.n_experts) if geo else {}
    info: dict[str, Any] = {}
    table: Any = static_table
    if "static" in pols and static_table not in ("oracle", "warm"):
        table = load_accesses(static_table, **kw)
    static = table if "static" in pols else "oracle"
    args = (pols, budget_list, scopes, gbudgets, warm_fraction)
    with streamable(source, order, request, kw, info) as plan_path:
        if plan_path is not None:
            from moetrace.analyses.simstream import compute_sim_stream
            from moetrace.inputs.plan import read_header

            h = read_header(plan_path)
            _check_shape(source, geo, h.n_layers, h.n_experts, h.n_reads)
            expert_bytes = expert_bytes if expert_bytes is not None else (h.expert_bytes or None)
            df = compute_sim_stream(plan_path, *args, expert_bytes, static, static_table)
            info.setdefault("order", h.order)
        else:
            from moetrace.analyses.sim import compute_sim
            from moetrace.inputs.accesses import plan_expert_bytes

            acc = load_accesses(source, order=order, request=request, info=info, **kw)
            _check_shape(source, geo, acc.n_layers, acc.n_experts, len(acc))
            expert_bytes = expert_bytes if expert_bytes is not None else plan_expert_bytes(source)
            df = compute_sim(acc, *args, expert_bytes, static, static_table)
            info.setdefault("order", acc.order)
    return SimResult(source, df, pols, static_table, info)


def _check_shape(source: str, geo, n_layers: int, n_experts: int, n_accesses: int) -> None:
    """The file agrees with --geometry and holds accesses (UsageError naming both otherwise)."""
    if geo is not None and (n_layers, n_experts) != (geo.n_layers, geo.n_experts):
        raise UsageError(f"{source} is {n_layers}x{n_experts} but --geometry {geo.name} "
                         f"is {geo.n_layers}x{geo.n_experts}")
    if n_accesses == 0:
        raise UsageError(f"{source} holds no accesses to simulate")


@contextlib.contextmanager
def streamable(path: str, order: str | None, request: str | None, kw: dict, info: dict):
    """The plan to simulate in bounded memory, or None for the in-memory path.

    A plan is streamed as it is (unless it must be re-ordered or split by
    request, which a plan cannot); an engine JSONL trace larger than
    MOETRACE_STREAM_BYTES (default 8 MiB) is compiled to a temporary plan first."""
    from moetrace.inputs.accesses import is_plan

    if not os.path.isfile(path):
        yield None
        return
    if is_plan(path):
        from moetrace.inputs.plan import read_header
        from moetrace.inputs.trace import check_dense_pool

        h = read_header(path)
        # the simulators keep state per (layer, expert): a plan compiled from a trace with a stray id
        # can name a pool of billions (its header says so; nothing is allocated before this)
        check_dense_pool(h.n_layers, h.n_experts, path, "simulate")
        if request is None and (order is None or order == h.order):
            req = h.meta.get("request")
            info.update(stream=f"the plan's stream ({'request ' + str(req) if req else 'as compiled'})",
                        order=h.order)
            yield path
            return
        yield None
        return
    from moetrace.inputs.stream import is_streamable

    if not is_streamable(path):
        yield None
        return
    from moetrace.inputs.accesses import stream_sentence
    from moetrace.inputs.plan import compile_plan

    tmp = tempfile.mkdtemp(prefix="moetrace-sim-")
    try:
        out = os.path.join(tmp, "plan.bin")
        h = compile_plan([path], out, k=kw.get("k"), n_layers=kw.get("n_layers"), n_experts=kw.get("n_experts"),
                         request=request, order=order or "rank")
        n_req = (h.meta.get("requests") or [1])[0]
        stream = stream_sentence(request, h.n_iterations, n_req)
        info.update(stream=stream + " (compiled to a temporary plan, simulated in bounded memory)",
                    order=h.order, requests=n_req)
        yield out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
