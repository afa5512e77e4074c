"""Writers for the importer fixtures (tests/data/imp_*), deterministic. Regenerate from the repo root:

    .venv/bin/python tests/data/imp_make.py

One reference routing (ROUTES: decode steps x layers x k, plus PROMPT rows) is
written in every format; tests/unit/test_importers.py checks that each imports to
the same typed trace as imp_expected.jsonl.
"""

from __future__ import annotations

import base64
import collections
import io
import json
import pickle
import random
import sys
import types
import zipfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
N_LAYERS, N_EXPERTS, K = 3, 16, 4
N_STEPS, N_PROMPT = 6, 3


def reference(seed: int = 7, n_steps: int = N_STEPS, n_prompt: int = N_PROMPT) -> np.ndarray:
    """(prompt + steps, layers, k) int32 routes, distinct experts per row."""
    rng = random.Random(seed)
    arr = np.array([[rng.sample(range(N_EXPERTS), K) for _ in range(N_LAYERS)] for _ in range(n_prompt + n_steps)],
                   dtype=np.int32)
    return arr


def write_expected(path: Path, arr: np.ndarray, n_prompt: int = N_PROMPT) -> None:
    with open(path, "w") as fh:
        for t in range(n_prompt, arr.shape[0]):
            for lay in range(arr.shape[1]):
                fh.write(json.dumps({"step": t - n_prompt, "layer": lay, "experts": arr[t, lay].tolist()}) + "\n")


def write_llamacpp_csv(path: Path, arr: np.ndarray, n_prompt: int = N_PROMPT) -> None:
    """Layer-major within the trace, as a per-tensor dump converts: IL,Token,Expert_ID,rank,weight."""
    lines = ["IL,Token,Expert_ID,rank,weight"]
    for lay in range(arr.shape[1]):
        for t in range(n_prompt, arr.shape[0]):
            for j, e in enumerate(arr[t, lay]):
                lines.append(f"{lay},{t - n_prompt},{float(e):.4f},{j},{1 / (j + 2):.4f}")
    path.write_text("\n".join(lines) + "\n")


def write_eval_callback_log(path: Path, arr: np.ndarray, n_prompt: int = N_PROMPT) -> None:
    """What llama-eval-callback prints for ffn_moe_topk-<il> (k <= 6 so nothing is elided), with other
    tensors around it: one prompt micro-batch of n_prompt tokens, then one decode token per call."""
    out = ["llama_new_context_with_model: n_ctx      = 512"]

    def tensor(name, typ, op, ne, rows):
        out.append(f"ggml_debug: {name:>24} = ({typ}) {op:>10}(src{{{ne[0]}, {ne[1]}, 1, 1}}, }}) = "
                   f"{{{ne[0]}, {ne[1]}, 1, 1}}")
        out.append(" " * 37 + "[")
        out.append(" " * 38 + "[")
        for r in rows:
            out.append(" " * 39 + "[" + ", ".join(f"{v:12.4f}" for v in r) + "],")
        out.append(" " * 38 + "],")
        out.append(" " * 37 + "]")
        out.append(" " * 37 + f"sum = {float(np.sum(rows)):f}")

    batches = [range(0, n_prompt)] + [range(t, t + 1) for t in range(n_prompt, arr.shape[0])]
    for b in batches:
        for lay in range(arr.shape[1]):
            tensor(f"ffn_moe_logits-{lay}", "f32", "MUL_MAT", (N_EXPERTS, len(b)), [[0.5, 0.25, 0.125]] * len(b))
            tensor(f"ffn_moe_topk-{lay}", "i32", "VIEW", (K, len(b)), [arr[t, lay].tolist() for t in b])
    path.write_text("\n".join(out) + "\n")


def write_vllm_npy(path: Path, arr: np.ndarray, dense_layers: int = 1) -> None:
    """vLLM's (seq_len, num_hidden_layers, topk) int32, with leading dense layers left zero."""
    full = np.zeros((arr.shape[0], arr.shape[1] + dense_layers, arr.shape[2]), np.int32)
    full[:, dense_layers:, :] = arr
    np.save(path, full)


def write_vllm_json(path: Path, arr: np.ndarray, n_prompt: int = N_PROMPT) -> None:
    """An OpenAI-style completion response with routed_experts as a base64 .npy (prompt + completion - 1 rows)."""
    buf = io.BytesIO()
    np.save(buf, arr.astype(np.int32))
    obj = {"id": "cmpl-1", "object": "text_completion",
           "choices": [{"index": 0, "text": "...", "finish_reason": "length",
                        "routed_experts": base64.b64encode(buf.getvalue()).decode()}],
           "usage": {"prompt_tokens": n_prompt, "completion_tokens": arr.shape[0] - n_prompt + 1,
                     "total_tokens": arr.shape[0] + 1}}
    path.write_text(json.dumps(obj))


# ---- a torch.save-compatible zip written without torch


class _FakeStorage:
    def __init__(self, data: np.ndarray, key: str):
        self.data, self.key = data, key


class _FakeTensor:
    def __init__(self, arr: np.ndarray, key: str):
        self.arr = np.ascontiguousarray(arr)
        self.storage = _FakeStorage(self.arr.reshape(-1), key)

    def __reduce__(self):
        stride = tuple(s // self.arr.itemsize for s in self.arr.strides)
        return (_fake_torch.rebuild, (self.storage, 0, tuple(self.arr.shape), stride, False,
                                      collections.OrderedDict()))


class _FakeTorch:
    """Fake torch / torch._utils modules so pickle writes the same globals torch.save does."""

    def __init__(self):
        self.torch = types.ModuleType("torch")
        self.utils = types.ModuleType("torch._utils")

        def _rebuild_tensor_v2(*a):  # never called: only its name is pickled
            raise AssertionError

        _rebuild_tensor_v2.__module__ = "torch._utils"
        _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
        self.utils._rebuild_tensor_v2 = _rebuild_tensor_v2
        self.rebuild = _rebuild_tensor_v2
        self.storage_types = {}
        for name in ("IntStorage", "LongStorage", "FloatStorage"):
            cls = type(name, (), {"__module__": "torch"})
            setattr(self.torch, name, cls)
            self.storage_types[name] = cls
        self.torch._utils = self.utils


_fake_torch = _FakeTorch()
_DT = {np.dtype(np.int32): "IntStorage", np.dtype(np.int64): "LongStorage", np.dtype(np.float32): "FloatStorage"}


def torch_save_like(obj, path: Path) -> None:
    """Write obj (dicts, lists, numbers, _FakeTensor) in torch.save's zip layout."""
    storages: dict[str, np.ndarray] = {}

    class P(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, _FakeStorage):
                storages[o.key] = o.data
                return ("storage", _fake_torch.storage_types[_DT[o.data.dtype]], o.key, "cpu", o.data.size)
            return None

    saved = {m: sys.modules.get(m) for m in ("torch", "torch._utils")}
    sys.modules["torch"], sys.modules["torch._utils"] = _fake_torch.torch, _fake_torch.utils
    try:
        buf = io.BytesIO()
        P(buf, protocol=2).dump(obj)
    finally:
        for m, v in saved.items():
            if v is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = v
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", buf.getvalue())
        zf.writestr("archive/byteorder", "little")
        for key, data in storages.items():
            zf.writestr(f"archive/data/{key}", data.astype(data.dtype.newbyteorder("<")).tobytes())
        zf.writestr("archive/version", "3\n")


def write_sglang_per_token(path: Path, arr: np.ndarray, n_prompt: int = N_PROMPT, dense_layers: int = 1,
                           batch_decode: bool = False) -> None:
    """An expert_distribution_recorder per_token dump: one prefill pass, one pass per decode token.

    topk_ids_of_layer is (layers, tokens, 8) with -1 padding (k=4 < 8) and -1 dense layers; physical
    ids are logical id + 100 * (id % 2) remapped through last_physical_to_logical_map.
    """
    n_lay = arr.shape[1] + dense_layers
    n_phys = 2 * N_EXPERTS
    p2l = np.zeros((n_lay, n_phys), np.int64)
    phys_of = np.zeros((n_lay, N_EXPERTS), np.int64)
    for lay in range(n_lay):
        perm = np.random.default_rng(lay).permutation(n_phys)
        p2l[lay, perm] = np.arange(n_phys) % N_EXPERTS
        for e in range(N_EXPERTS):
            phys_of[lay, e] = perm[e]  # perm[e] maps back to e

    def pass_ids(rows):
        ids = np.full((n_lay, len(rows), 8), -1, np.int32)
        for j, t in enumerate(rows):
            for lay in range(arr.shape[1]):
                L = lay + dense_layers
                ids[L, j, :K] = phys_of[L, arr[t, lay]]
        return ids

    recs = []
    passes = [(list(range(n_prompt)), 1)] + [([t], 2) for t in range(n_prompt, arr.shape[0])]
    if batch_decode:
        passes.append(([n_prompt, n_prompt + 1], 2))
    for pid, (rows, mode) in enumerate(passes):
        recs.append({"forward_pass_id": pid, "rank": 0, "gatherer_key": "primary",
                     "input_ids": [1000 + t for t in rows], "positions": rows,
                     "extend_seq_lens": [len(rows)] if mode == 1 else None, "forward_mode": mode,
                     "topk_ids_of_layer": _FakeTensor(pass_ids(rows), f"{pid}"), "misc_objects": [],
                     "global_physical_count": _FakeTensor(np.zeros((n_lay, n_phys), np.int32), f"c{pid}")})
    torch_save_like({"records": recs, "last_physical_to_logical_map": _FakeTensor(p2l, "map")}, path)


def write_sglang_stat(path: Path) -> None:
    torch_save_like({"rank": 0, "logical_count": _FakeTensor(np.ones((5, N_LAYERS, N_EXPERTS), np.int32), "0"),
                     "average_utilization_rate_over_window": None}, path)


def main() -> None:
    arr = reference()
    write_expected(HERE / "imp_expected.jsonl", arr)
    write_llamacpp_csv(HERE / "imp_llamacpp.csv", arr)
    write_eval_callback_log(HERE / "imp_eval_callback.log", arr)
    write_vllm_npy(HERE / "imp_vllm.npy", arr)
    write_sglang_per_token(HERE / "imp_sglang_per_token.pt", arr)


if __name__ == "__main__":
    main()
