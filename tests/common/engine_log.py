"""A faithful generator of JSON Lines engine routing logs, with the ground truth.

It writes what a vLLM routing hook writes (the shape of a public Qwen1.5-MoE
log): per logged layer one file (or all layers in one), a first ``"type":
"meta"`` line, then one ``"type": "route"`` line per token row of each forward
pass: ``req_id`` (one constant for every row, as that hook writes it, unless
``real_ids``), ``token_idx`` (the row's index within its pass, from 0 on every
pass), ``layer``, ``topk_ids`` (rank order), ``topk_weights`` (descending).

Forward passes, in order:

1. start-up profiling: one pass of ``profile_rows`` dummy rows, one route;
2. CUDA graph capture: passes of ``capture_sizes`` dummy rows, the same route;
3. prefill: one pass with every prompt token of every request (one row each);
4. decode: one row per running sequence, in slot order; a finished sequence
   leaves the batch (the rest keep their order).

With ``arrivals``, a request joins later: a prefill pass of its prompt, then it
decodes at the end of the batch.

The ground truth (:class:`EngineLog`) holds each request's decode routes, the
forward pass index and row of every decode token, and the batch union per
decode pass, so tests compute the expected figures without moetrace.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class EngineLog:
    files: list[Path]
    layers: list[int]
    k: int
    n_experts: int
    # request name -> list of decode tokens, each {layer: [experts in rank order]}
    routes: dict[str, list[dict[int, list[int]]]] = field(default_factory=dict)
    # decode passes: (log pass index, [request name per row])
    decode_passes: list[tuple[int, list[str]]] = field(default_factory=list)
    warmup_passes: int = 0
    warmup_rows: int = 0
    prefill_rows: int = 0
    n_passes: int = 0

    def batch_union(self, i: int) -> dict[int, set[int]]:
        """Per layer, the experts read by decode pass i (the union over its rows)."""
        pidx, names = self.decode_passes[i]
        out: dict[int, set[int]] = {lay: set() for lay in self.layers}
        pos = {nm: self._token_of(pidx, nm) for nm in names}
        for nm in names:
            for lay in self.layers:
                out[lay] |= set(self.routes[nm][pos[nm]][lay])
        return out

    def _token_of(self, pidx: int, name: str) -> int:
        n = 0
        for p, names in self.decode_passes:
            if p == pidx:
                return n
            if name in names:
                n += 1
        raise KeyError(name)


def reuse(routes: dict[str, list[dict[int, list[int]]]], n: int) -> tuple[int, int]:
    """Independent W_n: (hits, selections) over every request's tokens t >= n, a
    selection of expert e at layer l a hit when one of the tokens t-n..t-1 of the
    same request selected e at l."""
    hits = sel = 0
    for toks in routes.values():
        for t in range(n, len(toks)):
            for lay, ex in toks[t].items():
                for e in ex:
                    sel += 1
                    if any(e in toks[u][lay] for u in range(t - n, t)):
                        hits += 1
    return hits, sel


def _route(rng: random.Random, prev: list[int] | None, n_experts: int, k: int, stick: float) -> list[int]:
    out: list[int] = []
    if prev:
        for e in prev:
            if rng.random() < stick and len(out) < k:
                out.append(e)
    while len(out) < k:
        e = rng.randrange(n_experts) if rng.random() < 0.5 else min(int(rng.expovariate(0.12)), n_experts - 1)
        if e not in out:
            out.append(e)
    rng.shuffle(out)
    return out


def write_engine_log(out_dir: Path, *, layers=(3, 8), n_experts: int = 60, k: int = 4, requests: int = 5,
                     prompt_lens=None, decode_lens=None, profile_rows: int = 96,
                     capture_sizes=(32, 16, 8, 4, 2, 1), per_layer_files: bool = True, real_ids: bool = False,
                     arrivals: dict[int, int] | None = None, stick: float = 0.45, seed: int = 3,
                     req_id: str = "0") -> EngineLog:
    """Write the log under out_dir and return its ground truth (module docstring).

    decode_lens: decode tokens per request (default: all 40, so the batch holds);
    arrivals: {request index: decode pass after which it arrives}.
    """
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    layers = list(layers)
    prompt_lens = list(prompt_lens or [rng.randint(5, 30) for _ in range(requests)])
    decode_lens = list(decode_lens or [40] * requests)
    arrivals = dict(arrivals or {})
    names = [f"req-{i}" for i in range(requests)]
    lines: dict[int, list[str]] = {lay: [] for lay in layers}
    log = EngineLog([], layers, k, n_experts)
    pidx = 0

    def weights() -> list[float]:
        w = sorted((rng.random() for _ in range(k)), reverse=True)
        s = sum(w)
        return [round(x / s, 4) for x in w]

    def emit(rows: list[tuple[str, dict[int, list[int]]]]) -> None:
        nonlocal pidx
        for lay in layers:
            for j, (rid, route) in enumerate(rows):
                lines[lay].append(json.dumps({"type": "route", "req_id": rid, "token_idx": j, "layer": lay,
                                              "topk_ids": route[lay], "topk_weights": weights()}))
        pidx += 1

    dummy = {lay: rng.sample(range(n_experts), k) for lay in layers}
    for size in (profile_rows, *capture_sizes):
        emit([("dummy" if real_ids else req_id, dummy)] * size)
        log.warmup_passes += 1
        log.warmup_rows += size

    def prefill(idx: list[int]) -> None:
        rows = []
        for i in idx:
            prev = None
            for _ in range(prompt_lens[i]):
                r = {lay: _route(rng, prev and prev[lay], n_experts, k, 0.2) for lay in layers}
                prev = r
                rows.append((names[i] if real_ids else req_id, r))
        log.prefill_rows += len(rows)
        emit(rows)

    first = [i for i in range(requests) if i not in arrivals]
    prefill(first)
    running = list(first)
    done = {i: 0 for i in range(requests)}
    last: dict[int, dict[int, list[int]] | None] = {i: None for i in range(requests)}
    step = 0
    while running or any(v >= step for v in arrivals.values()):
        joining = [i for i, at in arrivals.items() if at == step]
        if joining:
            prefill(joining)
            running += joining
        rows = []
        for i in running:
            r = {lay: _route(rng, last[i] and last[i][lay], n_experts, k, stick) for lay in layers}
            last[i] = r
            log.routes.setdefault(names[i], []).append(r)
            rows.append((names[i] if real_ids else req_id, r))
        if rows:
            log.decode_passes.append((pidx, [names[i] for i in running]))
            emit(rows)
        for i in running:
            done[i] += 1
        running = [i for i in running if done[i] < decode_lens[i]]
        step += 1
        if not running and not any(at >= step for at in arrivals.values()):
            break
    log.n_passes = pidx
    meta = {"type": "meta", "model": "Qwen/Qwen1.5-MoE-A2.7B", "engine": "vllm", "engine_version": "0.6.3",
            "top_k": k, "seed": seed, "time": "2026-11-30T10:00:00Z"}
    if per_layer_files:
        for lay in layers:
            p = out_dir / f"routes_layer{lay}.jsonl"
            p.write_text("\n".join([json.dumps({**meta, "layers": [lay]})] + lines[lay]) + "\n")
            log.files.append(p)
    else:
        p = out_dir / "routes.jsonl"
        body = []
        # one file: layer-major rows within each forward pass
        per_pass: list[list[str]] = []
        for lay in layers:
            idx = 0
            for ln in lines[lay]:
                j = json.loads(ln)["token_idx"]
                if j == 0:
                    idx += 1
                while len(per_pass) < idx:
                    per_pass.append([])
                per_pass[idx - 1].append(ln)
        for chunk in per_pass:
            body += sorted(chunk, key=lambda s: json.loads(s)["layer"])
        p.write_text("\n".join([json.dumps({**meta, "layers": layers})] + body) + "\n")
        log.files.append(p)
    return log
