"""Engine cells: Algorithm 1 with a real engine in place of the replay.

One cell runs llama.cpp (the set-up's, through the routing logger: moetrace.engines.llamacpp)
decoding ``tokens`` tokens from a model file under a memory wall of C (a cgroup of C + headroom
that the engine alone joins, before it loads the model), recorded by ``moetrace record --pool
MODEL`` (pagecache and block: per token and per (layer, expert), and why each page was added),
with the model's pages dropped from the page cache first and the model disk's read_ahead_kb set
for the cell and restored. Its figures (:func:`engine_figures`), over the measured tokens (after
``warmup_tokens``):

- decode time per token (the logger's own timing of each decode);
- device bytes per token: the model file's pages added while decoding x the page size (each add
  is one read from the disk; block's device bytes per expert say the same over the whole run);
- the routed miss demand at C: an LRU cache of floor(C / expert bytes) experts over the engine's
  own routing, warmed by the warm-up tokens (moetrace.analyses.sim.lru_hits), x expert bytes;
- amplification = device bytes / miss demand per token;
- the share of expert pages added that no routed expert needed (pages of experts the token did
  not route), per expert and in total, and the added pages by cause (demand, readahead,
  populate, other: the pagecache probe's), with the load's populate apart; per expert, the whole
  run's pages by cause (engine_experts.parquet run_added_<cause>_pages).

The directory: engine_cell.json (inputs, figures, the scope's counters, notes), route.jsonl (the
routing), run/ (the recording), engine_experts.parquet and engine_tokens.parquet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moetrace.errors import UsageError

from moetrace.run.handle import ENGINE_CELL_JSON  # noqa: E402  (the directory contract)
ENGINE_CELL_SCHEMA = "moetrace.engine_cell/1"
MIB = 1 << 20
#: the loaders a cell names: llama.cpp's stock mmap, and the same with readahead off on the fault path
LOADERS = {"stock": None, "random": "random"}
MODEL_KINDS = ("expert", "shared", "non_expert")


@dataclass(frozen=True)
class EngineCellSpec:
    """The inputs of one engine cell."""

    model: str
    capacity_bytes: int
    tokens: int = 64
    warmup_tokens: int = 16
    loader: str = "stock"  # LOADERS
    load_mode: str = "mmap"
    read_ahead_kb: int | None = None  # the model disk's, for the cell (restored after)
    headroom_bytes: int = 32 * MIB  # the engine's own memory above C (llama.cpp on the tiny model: ~5 MiB)
    prompt: str = "the a b"
    threads: int = 1
    name: str = "engine-cell"
    timeout_s: float = 1800.0
    python: str = sys.executable

    def validate(self) -> None:
        if self.loader not in LOADERS:
            raise UsageError(f"--loader {self.loader!r}: one of {', '.join(LOADERS)}")
        if self.capacity_bytes <= 0 or self.headroom_bytes < 0:
            raise UsageError("the capacity must be > 0 and the headroom >= 0")
        if not 0 <= self.warmup_tokens < self.tokens:
            raise UsageError(f"--warmup-tokens {self.warmup_tokens}: between 0 and --tokens - 1 ({self.tokens - 1})")
        if self.read_ahead_kb is not None and self.read_ahead_kb < 0:
            raise UsageError(f"--read-ahead-kb {self.read_ahead_kb}: must be >= 0")
        if not Path(self.model).is_file():
            raise UsageError(f"--model {self.model}: no such file", hint="moetrace model synth writes one")

    @property
    def label(self) -> str:
        """How the cell loads and reads: the loader and the disk's readahead."""
        ra = "" if self.read_ahead_kb is None else f", ra {self.read_ahead_kb} KiB"
        return f"{self.loader} {self.load_mode}{ra}"


def _set_read_ahead(model: str, kb: int, stack: ExitStack, notes: list[str]) -> dict[str, Any]:
    """The model disk's read_ahead_kb set to ``kb``; its old value put back when ``stack`` unwinds."""
    from moetrace.lab.guest import queue_dir

    f = queue_dir(model, Path("/")) / "read_ahead_kb"
    before = int(f.read_text())
    f.write_text(f"{kb}\n")

    def restore() -> None:
        try:
            f.write_text(f"{before}\n")
        except OSError as e:
            notes.append(f"read_ahead_kb of {f} not restored to {before}: {e.strerror or e}")
    stack.callback(restore)
    return {"path": str(f), "before": before, "set": int(f.read_text())}


def _argv(spec: EngineCellSpec, run: Path, trace: Path, cgroup: Path) -> list[str]:
    """`moetrace record` (outside the wall) around the routing logger (joining it)."""
    py = [spec.python, "-m", "moetrace.cli"]
    route = [*py, "model", "route", spec.model, "-o", str(trace), "-n", str(spec.tokens), "--prompt", spec.prompt,
             "--load-mode", spec.load_mode, "--threads", str(spec.threads), "--cgroup", str(cgroup),
             "--warmup-tokens", str(spec.warmup_tokens)]
    if LOADERS[spec.loader]:
        route += ["--advise", LOADERS[spec.loader]]
    return [*py, "record", "--out", str(run), "--pool", spec.model, "--probes", "pagecache,block", "--", *route]


def run_engine_cell(spec: EngineCellSpec, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Run one engine cell into ``out_dir``; what engine_cell.json holds. Bad inputs raise before
    anything is made; the scope is removed and read_ahead_kb restored whatever happens."""
    from moetrace.atomic import atomic_write
    from moetrace.capacity.cell import check_privileges
    from moetrace.capacity.scope import Scope, remove_stale_scopes
    from moetrace.engines.llamacpp import require_engine
    from moetrace.engines.pageout import drop_unmapped
    from moetrace.jsonutil import json_default
    from moetrace.kernel.hostfacts import host_facts
    from moetrace.record.poolmap import model_pool_map

    spec.validate()
    check_privileges()
    engine = require_engine()
    pm = model_pool_map(spec.model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run, trace = out / "run", out / "route.jsonl"
    res: dict[str, Any] = {"schema": ENGINE_CELL_SCHEMA, "complete": False, "inputs": asdict(spec),
                           "label": spec.label, "engine": engine.describe(), "kernel": os.uname().release,
                           "host": host_facts(str(Path(spec.model).parent)), "notes": [], "retained": False,
                           "reasons": []}
    remove_stale_scopes(spec.name)
    scope = Scope(spec.name)
    with ExitStack() as stack:
        scope.create(spec.capacity_bytes + spec.headroom_bytes)
        stack.callback(lambda: res.__setitem__("scope_removed", scope.remove(kill=True)))
        res["scope"] = {"path": str(scope.path), "limit_bytes": scope.limit_bytes, "cgroup_version": scope.version}
        if spec.read_ahead_kb is not None:
            res["read_ahead"] = _set_read_ahead(spec.model, spec.read_ahead_kb, stack, res["notes"])
        res["resident_at_start_pages"] = drop_unmapped(spec.model)  # nothing maps it yet
        r = subprocess.run(_argv(spec, run, trace, scope.path), capture_output=True, text=True,
                           timeout=spec.timeout_s)
        res["scope"].update(scope.counters())
        res["oom_killed"] = scope.oom_killed()
        if r.returncode != 0:
            res["reasons"].append(f"the recorded engine failed (exit {r.returncode}): {r.stderr.strip()[-800:]}")
    if not res["reasons"]:
        res.update(engine_figures(run, trace, pm, spec))
        res["retained"] = not res["oom_killed"]
        if not res["retained"]:
            res["reasons"].append("the engine was OOM-killed under the wall")
    res["complete"] = True
    with atomic_write(out / ENGINE_CELL_JSON, what="engine cell") as tmp:
        Path(tmp).write_text(json.dumps(res, indent=1, default=json_default) + "\n")
    return res


def _routing(trace: Path) -> tuple[dict[int, set[tuple[int, int]]], dict[int, float]]:
    """({decode step: the routed (layer, expert)s}, {decode step: its decode ms}) from the logger's
    trace (prefill records skipped), read once."""
    out: dict[int, set[tuple[int, int]]] = {}
    ms: dict[int, float] = {}
    for line in trace.read_text().splitlines():
        r = json.loads(line)
        if r.get("phase") != "prefill":
            out.setdefault(int(r["step"]), set()).update((int(r["layer"]), int(e)) for e in r["experts"])
            ms[int(r["step"])] = r["decode_ns"] / 1e6
    return out, ms


def engine_figures(run: Path, trace: Path, pm, spec: EngineCellSpec) -> dict[str, Any]:
    """The cell's figures (module docstring) from its recording and routing; writes
    engine_tokens.parquet and engine_experts.parquet beside ``run``."""
    import pandas as pd

    from moetrace.record.poolmap import PAGE

    ee = pd.read_parquet(run / "expert_epochs.parquet")
    ep = pd.read_parquet(run / "epochs.parquet")
    dec = ep[ep["phase"].isin(["warmup", "measured"])].copy()
    dec["token"] = dec["iteration"].astype(int)
    by_step, ms = _routing(trace)
    routed = {t: {la * pm.n_experts + e for la, e in s} for t, s in by_step.items()}
    model = ee[ee["kind"].isin(MODEL_KINDS)].merge(dec[["epoch", "token"]], on="epoch")
    ex = model[model["kind"] == "expert"].copy()
    ex["needed"] = np.array([int(s) in routed.get(int(t), ()) for s, t in zip(ex["expert_id"], ex["token"])],
                            dtype=bool)
    tokens = _token_table(dec, model, ex, ms, PAGE)
    measured = tokens[tokens["token"] >= spec.warmup_tokens]
    tokens.to_parquet(run.parent / "engine_tokens.parquet", index=False)
    mex = ex[ex["token"] >= spec.warmup_tokens]
    per_exp = _expert_table(mex, pm, routed, spec.warmup_tokens)
    x = pd.read_parquet(run / "experts.parquet")
    x = x[x["kind"] == "expert"].set_index("expert_id")
    for c in ("demand", "readahead", "populate", "other"):  # the whole run's, load included: per cause
        per_exp[f"run_added_{c}_pages"] = x[f"added_{c}_pages"].reindex(per_exp["expert_id"]).to_numpy()
    per_exp.to_parquet(run.parent / "engine_experts.parquet", index=False)
    miss = miss_demand(trace, pm, spec.capacity_bytes, spec.warmup_tokens)
    dev = float(measured["device_bytes"].mean())
    causes = {c: int(dec.loc[dec["token"] >= spec.warmup_tokens, f"added_{c}_pages"].fillna(0).sum())
              for c in ("demand", "readahead", "populate", "other")}
    added = int(mex["added_pages"].sum())
    unneeded = int(mex.loc[~mex["needed"], "added_pages"].sum())
    load = ep[ep["phase"] == "load"]
    return {"measured_tokens": len(measured), "decode_ms_per_token": float(measured["decode_ms"].mean()),
            "decode_ms_p50": float(measured["decode_ms"].median()),
            "device_bytes_per_token": dev, "miss_bytes_per_token": miss["miss_bytes_per_token"],
            "miss_demand": miss, "amplification": dev / miss["miss_bytes_per_token"] if miss["miss_bytes_per_token"]
            else None, "expert_pages_added": added, "unneeded_pages": unneeded,
            "unneeded_share": unneeded / added if added else None, "added_by_cause": causes,
            "load_populate_pages": int(load["added_populate_pages"].fillna(0).sum()) if len(load) else 0,
            "whole_run_device_bytes": _whole_run_device_bytes(run)}


def _token_table(dec, model, ex, ms: dict[int, float], page: int):
    """Per decode token: model pages added (device bytes), expert pages needed / not, decode time."""
    import pandas as pd

    by = model.groupby("token")["added_pages"].sum()
    need = ex[ex["needed"]].groupby("token")["added_pages"].sum()
    allx = ex.groupby("token")["added_pages"].sum()
    t = dec["token"].to_numpy()
    return pd.DataFrame({"token": t, "epoch": dec["epoch"].to_numpy(),
                         "decode_ms": [ms.get(int(x), np.nan) for x in t],
                         "model_pages_added": by.reindex(t, fill_value=0).to_numpy(),
                         "device_bytes": by.reindex(t, fill_value=0).to_numpy() * page,
                         "expert_pages_added": allx.reindex(t, fill_value=0).to_numpy(),
                         "needed_pages": need.reindex(t, fill_value=0).to_numpy(),
                         **{f"added_{c}_pages": dec[f"added_{c}_pages"].to_numpy()
                            for c in ("demand", "readahead", "populate", "other")}})


def _expert_table(mex, pm, routed: dict[int, set[int]], warmup: int):
    """Per (layer, expert) over the measured tokens: pages added, those its routed tokens needed,
    the rest (no routed expert needed them), and the tokens that routed it."""
    import pandas as pd

    n = pm.n_total
    added = mex.groupby("expert_id")["added_pages"].sum().reindex(range(n), fill_value=0).to_numpy()
    need = mex[mex["needed"]].groupby("expert_id")["added_pages"].sum().reindex(range(n), fill_value=0).to_numpy()
    count = np.zeros(n, np.int64)
    for t, s in routed.items():
        if t >= warmup:
            count[list(s)] += 1
    eid = np.arange(n)
    return pd.DataFrame({"layer": eid // pm.n_experts, "expert": eid % pm.n_experts, "expert_id": eid,
                         "routed_tokens": count, "added_pages": added, "needed_pages": need,
                         "unneeded_pages": added - need,
                         "unneeded_share": np.where(added > 0, (added - need) / np.maximum(added, 1), np.nan)})


def miss_demand(trace: Path, pm, capacity_bytes: int, warmup_tokens: int) -> dict[str, Any]:
    """The routed miss demand at C: a global LRU of floor(C / expert bytes) experts over the
    engine's routing, warmed by the first ``warmup_tokens`` tokens, scored over the rest."""
    from moetrace.analyses.sim import lru_hits
    from moetrace.inputs.accesses import load_accesses

    acc = load_accesses(trace)
    budget = max(1, int(capacity_bytes) // int(pm.extent_bytes))
    n_it = int(acc.n_iterations)
    frac = (warmup_tokens + 0.5) / n_it
    scored = int((acc.iteration >= warmup_tokens).sum())
    hits = lru_hits(acc, budget, scope="global", warm_fraction=frac)
    misses = scored - hits
    tokens = n_it - warmup_tokens
    return {"budget_experts": budget, "scored_accesses": scored, "misses": misses, "policy": "lru, global",
            "miss_bytes_per_token": misses * int(pm.extent_bytes) / tokens if tokens else None}


def _whole_run_device_bytes(run: Path) -> int | None:
    """The block probe's device bytes of the model (experts + unattributed on its disk) over the run."""
    import pandas as pd

    x = pd.read_parquet(run / "experts.parquet")
    v = x["device_read_bytes"].dropna()
    return int(v.sum()) if len(v) else None


__all__ = ["ENGINE_CELL_JSON", "EngineCellSpec", "LOADERS", "engine_figures", "miss_demand", "run_engine_cell"]
