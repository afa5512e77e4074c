"""Live: the llama.cpp the set-up unpacked (scripts/engine-setup.sh) runs through sid's loader
on this machine: its --version is the build engine.json records, it reads the model `model
synth` writes as the MoE it is, and it generates from it. The oracles are the engine's own
words (llama-fit-params' hyperparameters, llama-simple's token count)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from moetrace.engines.llamacpp import find_engine
from moetrace.inputs.modelsynth import ModelSpec, synth_model


@pytest.fixture(scope="module")
def engine():
    e = find_engine()
    if e is None:
        reason = "no llama.cpp unpacked (run: bash scripts/engine-setup.sh)"
        if os.environ.get("MOETRACE_LIVE") == "1":
            pytest.fail(f"MOETRACE_LIVE=1: {reason}")
        pytest.skip(reason)
    return e


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
    assert re.search(r"eval time =\s+[\d.]+ ms /\s+15 runs", err), err[-1500:]  # 16 tokens: the first from the prompt pass
