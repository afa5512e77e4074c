"""The offline half from Python: generate, type, compile, stream, simulate.

    .venv/bin/python examples/api.py
"""

import tempfile
from pathlib import Path

from moetrace.analyses.sim import compute_sim
from moetrace.inputs.geometry import preset
from moetrace.inputs.plan import compile_plan, iter_passes
from moetrace.inputs.synth import SynthConfig, write_synth
from moetrace.inputs.trace import parse_jsonl

with tempfile.TemporaryDirectory() as d:
    d = Path(d)
    geo = preset("olmoe")
    write_synth(SynthConfig(geo, steps=200, spec_accept_rate=0.1, seed=3), d / "t.jsonl")
    tt = parse_jsonl(d / "t.jsonl", n_layers=geo.n_layers, n_experts=geo.n_experts)
    print("accepted tokens:", tt.accounting["accepted_tokens"])

    compile_plan([d / "t.jsonl"], d / "plan.bin", geometry=geo, hints="oracle")
    first = next(iter_passes(d / "plan.bin"))  # streams block by block
    print("iteration 0, layer 0 reads experts", first.by_layer()[0].tolist())

    df = compute_sim(tt.accesses(), policies=["lru", "belady"], budgets=[8, 16],
                     expert_bytes=geo.expert_bytes)
    print(df[["policy", "budget", "hit_rate", "miss_bytes_per_iteration"]].to_string(index=False))
