"""Live: the llama.cpp the set-up unpacked (scripts/engine-setup.sh) runs through sid's loader
on this machine: its --version is the build engine.json records, it reads the model `model
synth` writes as the MoE it is, and it generates from it. The oracles are the engine's own
words (llama-fit-params' hyperparameters, llama-simple's token count)."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from common.engines import engine  # noqa: F401  (the fixture)
from moetrace.inputs.modelsynth import ModelSpec, synth_model


def _run(e, tool, *args, timeout=120):
    return subprocess.run(e.command(tool, *args), env=e.env(), capture_output=True, timeout=timeout)


def test_the_engine_is_the_build_it_records(engine):
    r = _run(engine, "llama-cli", "--version")
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert f"version: {engine.build}" in (r.stdout + r.stderr).decode()
    assert engine.backend and os.path.isfile(engine.backend)
    assert engine.packages["libc6"] and engine.version.endswith(engine.path.name)


def test_it_reads_and_runs_the_synthesized_moe(engine, tmp_path):
    spec = ModelSpec(layers=2, experts=8, k=2, n_embd=64, n_ff_exp=128, head_dim=16)
    m = tmp_path / "tiny.gguf"
    synth_model(m, spec)
    r = _run(engine, "llama-fit-params", "-m", str(m), "-v")
    text = (r.stdout + r.stderr).decode(errors="replace")
    assert r.returncode == 0, text[-2000:]
    got = {k: int(v) for k, v in re.findall(r"print_info: (n_expert|n_expert_used|n_layer|n_embd)\s+= (\d+)", text)}
    assert got == {"n_expert": 8, "n_expert_used": 2, "n_layer": 2, "n_embd": 64}, got
    assert "arch             = qwen3moe" in text or re.search(r"arch\s+= qwen3moe", text)
    r = _run(engine, "llama-simple", "-m", str(m), "-n", "16", "the a b")
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 0, err[-2000:]
    # up to 15 decodes (the first token comes from the prompt pass): llama-simple stops at an
    # end-of-generation token, which a random model samples or not depending on the CPU backend's
    # rounding (the routing logger below does not stop: it is the exact one)
    runs = re.search(r"eval time =\s+[\d.]+ ms /\s+(\d+) runs", err)
    assert runs and int(runs.group(1)) <= 15, err[-1500:]
    assert r.stdout.startswith(b"<s> the a b")


def _eval_callback_topk(e, model, prompt) -> dict[int, list[int]]:
    """What llama.cpp's own llama-eval-callback prints for each ffn_moe_topk-L of the prompt
    pass (the last of its blocks per layer: the first is the warm-up's): the last row."""
    r = _run(e, "llama-eval-callback", "-m", str(model), "-p", prompt, "-n", "1", "-t", "1")
    text = (r.stdout + r.stderr).decode(errors="replace")
    assert r.returncode == 0, text[-2000:]
    out = {}
    for m in re.finditer(r"ffn_moe_topk-(\d+) = \(i32\)[^\n]*\n(.*?)\n\s*sum =", text, re.S):
        rows = re.findall(r"\[([^\[\]]+)\]", m.group(2))
        out[int(m.group(1))] = [int(float(x)) for x in rows[-1].split(",")]
    return out


def test_the_routing_logger_writes_each_decodes_experts_as_the_engine_routed_them(engine, tmp_path):
    from moetrace.engines.llamacpp import log_routing
    from moetrace.inputs.trace import read_jsonl

    m = tmp_path / "tiny.gguf"
    synth_model(m, ModelSpec(layers=2, experts=8, k=2, n_embd=64, n_ff_exp=128, head_dim=16))
    runs = []
    for name in ("a", "b"):
        s = log_routing(m, tmp_path / f"{name}.jsonl", tokens=24)
        assert (s["tokens"], s["layers"], s["load_mode"]) == (24, 2, "mmap")
        runs.append([json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()])
    recs = runs[0]
    pre = [r for r in recs if r.get("phase") == "prefill"]
    dec = [r for r in recs if "phase" not in r]
    assert [(r["step"], r["layer"]) for r in dec] == [(s, la) for s in range(24) for la in range(2)]
    assert all(len(set(r["experts"])) == 2 and all(0 <= x < 8 for x in r["experts"]) for r in recs)
    assert all(r["decode_ns"] > 0 for r in dec) and [r["t_ns"] for r in dec] == sorted(r["t_ns"] for r in dec)
    # greedy and no warm-up: the same routing every run
    assert [r["experts"] for r in runs[1]] == [r["experts"] for r in recs]
    # the prompt pass's routing as llama.cpp's own debug tool prints it
    assert {r["layer"]: r["experts"] for r in pre} == _eval_callback_topk(engine, m, "the a b")
    assert len(list(read_jsonl(tmp_path / "a.jsonl"))) == len(dec)  # the trace parser skips the prefill
