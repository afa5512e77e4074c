"""`moetrace model synth`: a tiny random-weight Mixture-of-Experts GGUF that llama.cpp runs,
written deterministically with the ``gguf`` package (llama.cpp's own writer).

The architecture is ``qwen3moe``: per layer attention (q/k/v/o with q/k norms) and a routed FFN of
``experts`` experts, ``k`` per token, stacked in ``blk.L.ffn_{gate,up,down}_exps.weight`` with
the expert outermost, so each (layer, expert) is three contiguous slices of the file
(``n_embd x n_ff_exp`` elements each). The vocabulary is SentencePiece-style ("llama": three
specials, the 256 byte tokens, then pieces). ``general.alignment`` places every tensor: 4096 (the
default here) starts each on a page; 32 (GGUF's own default) lets two experts share a page.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from moetrace.errors import InputError

ARCH = "qwen3moe"
DTYPES = ("f16", "f32")


@dataclass(frozen=True)
class ModelSpec:
    """The tiny model's shape (the defaults: issue 35's 388 MiB model, a 384 MiB expert pool)."""

    layers: int = 8
    experts: int = 64
    k: int = 8
    n_embd: int = 256
    n_ff_exp: int = 512
    head_dim: int = 64
    vocab: int = 452
    dtype: str = "f16"
    alignment: int = 4096
    context: int = 4096
    seed: int = 0

    def check(self) -> None:
        """InputError naming the first option out of range."""
        rules = [("layers", self.layers >= 1), ("experts", self.experts >= 1), ("k", 1 <= self.k <= self.experts),
                 ("n_embd", self.n_embd >= self.head_dim and self.n_embd % self.head_dim == 0),
                 ("n_ff_exp", self.n_ff_exp >= 1), ("head_dim", self.head_dim >= 2 and self.head_dim % 2 == 0),
                 ("vocab", self.vocab >= 260), ("dtype", self.dtype in DTYPES),
                 ("alignment", self.alignment >= 8 and self.alignment % 8 == 0), ("context", self.context >= 16)]
        for name, ok in rules:
            if not ok:
                raise InputError(f"model synth: --{name.replace('_', '-')} {getattr(self, name)} is out of range",
                                 hint="k <= experts; n_embd a multiple of head_dim; vocab >= 260 (3 specials, "
                                      "256 bytes, a piece); alignment a multiple of 8; dtype f16 or f32")

    @property
    def expert_bytes(self) -> int:
        """Bytes of one (layer, expert): its slices of the three stacked tensors."""
        return 3 * self.n_embd * self.n_ff_exp * (2 if self.dtype == "f16" else 4)


def _vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types): <unk> <s> </s>, <0x00>..<0xFF>, then "▁" pieces up to ``n``."""
    from gguf import TokenType

    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ["\u2581"] + [f"\u2581{a}" for a in letters] + list(letters)
    pieces += [f"\u2581{a}{b}" for a in letters for b in letters]
    pieces = pieces[: n - 259]
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256 + \
        [TokenType.NORMAL] * len(pieces)
    return toks, [0.0] * 259 + [-float(i) for i in range(len(pieces))], [int(t) for t in types]


def _header(w, s: ModelSpec, heads: int, kv_heads: int) -> None:
    import gguf

    w.add_name("moetrace-tiny-moe")
    w.add_custom_alignment(s.alignment)
    w.add_context_length(s.context)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.n_ff_exp)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.k)
    w.add_expert_feed_forward_length(s.n_ff_exp)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if s.dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    toks, scores, types = _vocab(s.vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)


def _tensors(w, s: ModelSpec, heads: int, kv_heads: int) -> None:
    """Every tensor, numpy shapes (ggml's ``ne`` reversed); norms and the router in F32."""
    rng = np.random.default_rng(s.seed)
    wt = np.float16 if s.dtype == "f16" else np.float32
    D, F, E, hd = s.n_embd, s.n_ff_exp, s.experts, s.head_dim

    def mat(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(wt)

    def one(n):
        return np.ones(n, dtype=np.float32)

    w.add_tensor("token_embd.weight", mat(s.vocab, D))
    w.add_tensor("output_norm.weight", one(D))
    w.add_tensor("output.weight", mat(s.vocab, D))
    for layer in range(s.layers):
        p = f"blk.{layer}."
        w.add_tensor(p + "attn_norm.weight", one(D))
        w.add_tensor(p + "attn_q.weight", mat(heads * hd, D))
        w.add_tensor(p + "attn_k.weight", mat(kv_heads * hd, D))
        w.add_tensor(p + "attn_v.weight", mat(kv_heads * hd, D))
        w.add_tensor(p + "attn_output.weight", mat(D, heads * hd))
        w.add_tensor(p + "attn_q_norm.weight", one(hd))
        w.add_tensor(p + "attn_k_norm.weight", one(hd))
        w.add_tensor(p + "ffn_norm.weight", one(D))
        w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((E, D), dtype=np.float32))
        w.add_tensor(p + "ffn_gate_exps.weight", mat(E, F, D))  # ne {D, F, E}: the expert outermost
        w.add_tensor(p + "ffn_up_exps.weight", mat(E, F, D))
        w.add_tensor(p + "ffn_down_exps.weight", mat(E, D, F))  # ne {F, D, E}


def synth_model(path: str | os.PathLike, spec: ModelSpec = ModelSpec()) -> int:
    """Write the model to ``path`` (atomically: a failed write leaves nothing); its size."""
    import gguf

    from moetrace.atomic import atomic_write

    spec.check()
    heads = spec.n_embd // spec.head_dim
    kv_heads = max(1, heads // 2)
    with atomic_write(path, what="model file") as tmp:
        w = gguf.GGUFWriter(str(tmp), ARCH)
        _header(w, spec, heads, kv_heads)
        _tensors(w, spec, heads, kv_heads)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return os.path.getsize(path)
