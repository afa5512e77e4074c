"""Synthetic router traces with controlled locality (`moetrace trace synth`).

The generative model, per layer and per accepted token t, picks k distinct
experts in four *recency classes*, by the age a = t - (last token that
selected the expert):

* class 1, a == 1 (the previous token's experts): each of the k slots falls in
  it with probability ``w1``;
* class 2, 2 <= a <= 8: probability ``w8 - w1``;
* class 3, 9 <= a <= 64: probability ``w64 - w8``;
* class 4, a > 64 or never selected: probability ``1 - w64``.

Slot counts per class are multinomial; within a class, experts are drawn
without replacement in proportion to the layer's current popularity
(Efraimidis-Spirakis / Gumbel-top-m keys). Because a class is by construction
the set of experts whose age lies in that window, the reuse that
`trace stats` measures (W_n: fraction of selections whose expert was selected
in any of the previous n tokens) is, in expectation, exactly the knob:
W1 = w1, W8 = w8, W64 = w64 (after the first n tokens; a class too small to
hold its slots, which only happens in the first tokens or in tiny pools,
passes its excess to the next older class).

Popularity per layer is Zipf-Mandelbrot, p(r) ~ (r + q)^-s over a ranking of
the experts, with a per-layer exponent s (a preset profile: the first routed
layer far flatter than the most concentrated one), times a slowly drifting
log-normal factor (an Ornstein-Uhlenbeck process in log space, stationary std
``drift_sigma``, correlation time ``drift_tokens``) so that a static ranking
learned early goes stale while recency adapts. Popularity can instead come
from real per-expert counts (`popularity_from_counts`).

Domains: a base ranking comes from ``seed``; a fraction ``domain_overlap`` of
the rank positions (the same positions for every domain) keeps the base
expert, the other positions are shuffled independently per domain. So the
same seed gives every domain the same shared part of the hot set and
the measured top-N Jaccard between domains grows with the overlap.

Engine iterations: each step is, independently, a speculative accept (with
probability ``spec_accept_rate``: two tokens, one record per layer of width
2k), a speculative fallback (``spec_fallback_rate``: every layer routed twice,
first width 2k = [this token's experts, a rejected draft token's experts],
then width k = the accepted token), or normal (one token, width k).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import numpy as np

from moetrace.errors import InputError, UsageError
from moetrace.inputs.geometry import Geometry

#: Reuse windows of the recency classes (tokens).
WINDOWS = (1, 8, 64)


@dataclass(frozen=True)
class LocalityProfile:
    """Default locality knobs of a geometry preset (tuned against paper Table 1)."""

    #: Zipf-Mandelbrot exponent knots, piecewise linear over relative depth
    #: (list of (depth in [0, 1], exponent)).
    zipf_knots: tuple[tuple[float, float], ...]
    #: Mandelbrot offset q as a fraction of the pool size (flat head).
    q_frac: float
    w1: float
    w8: float
    w64: float
    drift_sigma: float
    drift_tokens: float
    domain_overlap: float
    #: within a recency class, weight ~ popularity x age^-recency (favours the younger)
    recency: float = 1.0
    #: in the oldest class, weight x revisit for experts this trace already selected
    revisit: float = 1.0


# Kimi-K3 (paper §3): first routed layer top-8 share ~3.9%, most concentrated
# ~18% (deepest quarter), last ~10.7%; W1 32-36%, W8 57-59%, W64 80-82%.
PROFILES: dict[str, LocalityProfile] = {
    "kimi-k3": LocalityProfile(
        zipf_knots=((0.0, 0.0), (0.06, 0.8), (0.5, 1.0), (0.8, 1.25), (0.96, 1.2), (1.0, 0.5)),
        q_frac=0.035, w1=0.34, w8=0.58, w64=0.81, drift_sigma=0.9, drift_tokens=80.0,
        domain_overlap=0.6, recency=1.0, revisit=2.5),
    # DeepSeek-V3 (E=256): slope 0.86-0.93, W1 26-31%, W64 83-85%
    "deepseek-v3": LocalityProfile(
        zipf_knots=((0.0, 0.0), (0.06, 0.52), (0.5, 0.72), (0.8, 0.97), (0.96, 0.92), (1.0, 0.22)),
        q_frac=0.035, w1=0.285, w8=0.60, w64=0.84, drift_sigma=0.9, drift_tokens=80.0,
        domain_overlap=0.3, recency=1.0, revisit=2.5),
    # Qwen3-30B-A3B (E=128): slope 1.10-1.26, top-8 34-42%, W1 38-45%, W64 95-96%
    "qwen3-30b-a3b": LocalityProfile(
        zipf_knots=((0.0, 0.0), (0.06, 0.52), (0.5, 0.72), (0.8, 0.97), (0.96, 0.92), (1.0, 0.22)),
        q_frac=0.035, w1=0.415, w8=0.80, w64=0.955, drift_sigma=0.9, drift_tokens=80.0,
        domain_overlap=0.1, recency=1.0, revisit=2.5),
    "olmoe": LocalityProfile(
        zipf_knots=((0.0, 0.6), (0.5, 1.0), (1.0, 1.0)),
        q_frac=0.02, w1=0.40, w8=0.80, w64=0.95, drift_sigma=0.6, drift_tokens=200.0,
        domain_overlap=0.3),
}
DEFAULT_PROFILE = PROFILES["kimi-k3"]


def layer_zipf_profile(n_layers: int, profile: LocalityProfile = DEFAULT_PROFILE) -> np.ndarray:
    """Per-layer Zipf-Mandelbrot exponents of a profile (piecewise linear over depth)."""
    xs, ys = zip(*profile.zipf_knots)
    depth = np.linspace(0.0, 1.0, n_layers) if n_layers > 1 else np.zeros(1)
    return np.interp(depth, xs, ys)


@dataclass
class SynthConfig:
    """Everything that determines a synthetic trace (same config + seed -> same trace).

    zipf: per-layer exponents (None: the preset profile, scaled by zipf_spread
    around its mean; a float: that mean with the profile's spread scaled by
    zipf_spread). popularity: optional (n_layers, n_experts) array of real
    selection probabilities replacing the Zipf-Mandelbrot ranking.
    """

    geometry: Geometry
    steps: int = 300
    zipf: float | None = None
    zipf_spread: float = 1.0
    q: float | None = None
    w1: float | None = None
    w8: float | None = None
    w64: float | None = None
    drift_sigma: float | None = None
    drift_tokens: float | None = None
    domains: int = 1
    domain: int = 0
    domain_overlap: float | None = None
    spec_accept_rate: float = 0.0
    spec_fallback_rate: float = 0.0
    seed: int = 0
    popularity: np.ndarray | None = field(default=None, repr=False)
    profile: LocalityProfile | None = None

    def resolved(self) -> "SynthConfig":
        """Fill unset knobs from the geometry's preset profile and check ranges."""
        prof = self.profile or PROFILES.get(self.geometry.name, DEFAULT_PROFILE)
        c = replace(self, profile=prof)
        E = self.geometry.n_experts
        c.q = prof.q_frac * E if self.q is None else self.q
        c.w1 = prof.w1 if self.w1 is None else self.w1
        c.w8 = max(prof.w8, c.w1) if self.w8 is None else self.w8
        c.w64 = max(prof.w64, c.w8) if self.w64 is None else self.w64
        c.drift_sigma = prof.drift_sigma if self.drift_sigma is None else self.drift_sigma
        c.drift_tokens = prof.drift_tokens if self.drift_tokens is None else self.drift_tokens
        c.domain_overlap = prof.domain_overlap if self.domain_overlap is None else self.domain_overlap
        if c.steps < 1:
            raise UsageError(f"--steps must be >= 1, got {c.steps}")
        if not 0.0 <= c.w1 <= c.w8 <= c.w64 <= 1.0:
            raise UsageError(f"reuse targets must satisfy 0 <= W1 <= W8 <= W64 <= 1, got "
                             f"W1={c.w1}, W8={c.w8}, W64={c.w64}")
        for name in ("spec_accept_rate", "spec_fallback_rate"):
            v = getattr(c, name)
            if not 0.0 <= v <= 1.0:
                raise UsageError(f"--{name.replace('_', '-')} must lie in [0, 1], got {v}")
        if c.spec_accept_rate + c.spec_fallback_rate > 1.0:
            raise UsageError("--spec-accept-rate + --spec-fallback-rate exceed 1")
        if not 0.0 <= c.domain_overlap <= 1.0:
            raise UsageError(f"--domain-overlap must lie in [0, 1], got {c.domain_overlap}")
        if c.domains < 1 or not 0 <= c.domain < c.domains:
            raise UsageError(f"--domain {c.domain} is not in [0, --domains={c.domains})")
        if c.q < 0 or c.drift_sigma < 0 or c.drift_tokens <= 0 or c.zipf_spread < 0:
            raise UsageError("q, drift sigma and zipf spread must be >= 0, drift tokens > 0")
        if c.popularity is not None:
            p = np.asarray(c.popularity, dtype=np.float64)
            if p.shape != (self.geometry.n_layers, E):
                raise UsageError(f"popularity has shape {p.shape}, the geometry needs "
                                 f"({self.geometry.n_layers}, {E})")
            c.popularity = p
        return c

    def layer_exponents(self) -> np.ndarray:
        """The per-layer Zipf-Mandelbrot exponents this config uses."""
        prof = self.profile or PROFILES.get(self.geometry.name, DEFAULT_PROFILE)
        base = layer_zipf_profile(self.geometry.n_layers, prof)
        mean = float(base.mean()) if self.zipf is None else float(self.zipf)
        return np.maximum(mean + self.zipf_spread * (base - base.mean()), 0.0)


def domain_rankings(geometry: Geometry, seed: int, domain: int, overlap: float) -> np.ndarray:
    """Per layer, the expert at each popularity rank (n_layers, n_experts) for one domain.

    The base ranking and the shared rank positions come from ``seed`` alone;
    the non-shared positions are shuffled with a domain-specific stream.
    """
    L, E = geometry.n_layers, geometry.n_experts
    base_rng = np.random.default_rng([seed, 0x5EED])
    ranking = np.argsort(base_rng.random((L, E)), axis=1)  # random base permutation per layer
    shared = base_rng.random((L, E)) < overlap
    drng = np.random.default_rng([seed, 0xD0, domain])
    for lay in range(L):
        pos = np.flatnonzero(~shared[lay])
        ranking[lay, pos] = ranking[lay, drng.permutation(pos)]
    return ranking


def zipf_log_weights(cfg: SynthConfig) -> np.ndarray:
    """Log popularity (n_layers, n_experts) of a resolved config, before drift."""
    g = cfg.geometry
    if cfg.popularity is not None:
        p = cfg.popularity / cfg.popularity.sum(axis=1, keepdims=True)
        return np.log(np.maximum(p, 1e-12))
    s = cfg.layer_exponents()
    ranks = np.arange(1, g.n_experts + 1, dtype=np.float64)
    lw_rank = -s[:, None] * np.log(ranks[None, :] + cfg.q)
    ranking = domain_rankings(g, cfg.seed, cfg.domain, cfg.domain_overlap)
    lw = np.empty_like(lw_rank)
    np.put_along_axis(lw, ranking, lw_rank, axis=1)
    return lw


class TokenSampler:
    """Draws the per-layer expert sets of successive tokens (the recency-class model).

    ``sample(t)`` returns an (n_layers, k) int array for token t without
    changing the history; ``commit(t, sel)`` records it as accepted.
    """

    def __init__(self, cfg: SynthConfig, rng: np.random.Generator):
        self.cfg = cfg
        g = cfg.geometry
        self.L, self.E, self.k = g.n_layers, g.n_experts, g.k
        self.rng = rng
        self.base_lw = zipf_log_weights(cfg)
        # drift amplitude per layer follows the layer's concentration (flat layers stay flat)
        s = cfg.layer_exponents() if cfg.popularity is None else np.ones(self.L)
        self.sigma = (cfg.drift_sigma * s / max(float(s.mean()), 1e-9))[:, None].astype(np.float32)
        self.x = rng.standard_normal((self.L, self.E), dtype=np.float32) * self.sigma
        self.recency = cfg.profile.recency
        self.revisit = cfg.profile.revisit
        tbl = np.zeros(66, np.float32)
        tbl[2:65] = self.recency * np.log(np.arange(2, 65, dtype=np.float32))
        self._age_penalty = tbl  # applied in classes 2 and 3 (ages 2..64) only
        self.decay = float(np.exp(-1.0 / cfg.drift_tokens))
        self.last = np.full((self.L, self.E), -(10**9), dtype=np.int32)
        self._slots = np.arange(self.k)
        self.drift_every = max(1, int(cfg.drift_tokens // 20))
        self._since = 0
        self._rows4 = (np.arange(self.L) * 4)[:, None]
        self.pclass = np.array([cfg.w1, cfg.w8 - cfg.w1, cfg.w64 - cfg.w8, 1.0 - cfg.w64])
        self.pclass = np.clip(self.pclass, 0.0, None)
        self.pclass /= self.pclass.sum()
        self.bounds = np.array(WINDOWS)
        self._cols = np.arange(self.E)
        self._rows = np.arange(self.L)[:, None]

    def advance(self) -> None:
        """Move the popularity drift one token forward (applied every ``drift_every`` tokens)."""
        if self.cfg.drift_sigma > 0:
            self._since += 1
            if self._since >= self.drift_every:
                a = self.decay ** self._since
                self._since = 0
                self.x *= a
                self.x += np.sqrt(1 - a * a) * self.sigma * self.rng.standard_normal((self.L, self.E),
                                                                                    dtype=np.float32)

    def sample(self, t: int) -> np.ndarray:
        """Per-layer expert sets (n_layers, k) of token t (the history is not changed)."""
        L, E, k = self.L, self.E, self.k
        age = t - self.last
        cls = (age > 1).astype(np.int16)
        cls += age > 8
        cls += age > 64
        sizes = np.bincount((self._rows4 + cls).ravel(), minlength=4 * L).reshape(L, 4)
        m = self.rng.multinomial(k, self.pclass, size=L)
        # a class too small passes its excess to the next older class, then back
        for c in range(3):
            over = np.maximum(m[:, c] - sizes[:, c], 0)
            m[:, c] -= over
            m[:, c + 1] += over
        for c in range(3, 0, -1):
            over = np.maximum(m[:, c] - sizes[:, c], 0)
            m[:, c] -= over
            m[:, c - 1] += over
        # Gumbel keys: the top m by key within a class is a weighted sample without replacement
        key = self.base_lw + self.x
        key -= np.log(np.maximum(self.rng.standard_exponential((L, E), dtype=np.float32), np.float32(1e-30)))
        if self.recency:
            key -= self._age_penalty[np.minimum(age, 65)]
        # sort by (class, -key) with a 16-bit radix sort: 13 bits of key (steps of ~0.012)
        q = np.clip((np.float32(40.0) - key) * np.float32(8191 / 100.0), 0, 8191).astype(np.int16)
        q += cls << 13
        order = np.argsort(q, axis=1, kind="stable")
        # slot j of a row takes class c (cum_m[c-1] <= j < cum_m[c]), at sorted position
        # start[c] + (j - cum_m[c-1])
        cm = np.cumsum(m, axis=1)
        cj = (self._slots[None, :, None] >= cm[:, None, :]).sum(axis=2)
        start = np.cumsum(sizes, axis=1) - sizes
        pos = start[self._rows, cj] + self._slots[None, :] - (cm - m)[self._rows, cj]
        return np.take_along_axis(order, pos, axis=1)

    def commit(self, t: int, sel: np.ndarray) -> None:
        """Record token t's selections as accepted (they enter the recency classes)."""
        if self.revisit != 1.0:
            # the revisit bonus matters only in the oldest class, where it separates
            # experts selected before from never-selected ones: fold it into the base
            new = self.last[self._rows, sel] < -(10**8)
            self.base_lw[self._rows, sel] += np.where(new, np.float32(np.log(self.revisit)), np.float32(0))
        self.last[self._rows, sel] = t


def step_kinds(cfg: SynthConfig) -> np.ndarray:
    """Kind of each engine step (0 normal, 1 spec_accept, 2 spec_fallback) for a resolved config."""
    rng = np.random.default_rng([cfg.seed, 0x5BEC, cfg.domain])
    u = rng.random(cfg.steps)
    kinds = np.zeros(cfg.steps, np.int8)
    kinds[u < cfg.spec_accept_rate + cfg.spec_fallback_rate] = 2
    kinds[u < cfg.spec_accept_rate] = 1
    return kinds


def generate(cfg: SynthConfig, on_step: Callable[[int], None] | None = None
             ) -> Iterator[tuple[int, int, np.ndarray]]:
    """Yield engine records (step, layer, experts) of a synthetic trace, in engine order.

    on_step(n) is called after each engine step (for a progress bar).
    """
    cfg = cfg.resolved()
    rng = np.random.default_rng([cfg.seed, 0x70C, cfg.domain])
    sampler = TokenSampler(cfg, rng)
    kinds = step_kinds(cfg)
    L = cfg.geometry.n_layers
    t = 0

    def token() -> np.ndarray:
        nonlocal t
        sel = sampler.sample(t)
        sampler.commit(t, sel)
        sampler.advance()
        t += 1
        # the model draws sets, not a router's ranking: a record lists them ascending
        return np.sort(sel, axis=1)

    for step in range(cfg.steps):
        kind = kinds[step]
        if kind == 0:
            sel = token()
            for lay in range(L):
                yield step, lay, sel[lay]
        elif kind == 1:
            a = token()
            b = token()
            both = np.concatenate([a, b], axis=1)
            for lay in range(L):
                yield step, lay, both[lay]
        else:
            sel = token()
            draft = np.sort(sampler.sample(t), axis=1)  # the rejected draft position: not committed
            rejected = np.concatenate([sel, draft], axis=1)
            for lay in range(L):
                yield step, lay, rejected[lay]
            for lay in range(L):
                yield step, lay, sel[lay]
        if on_step is not None:
            on_step(1)


def prefill_lines(cfg: SynthConfig, n_records: int) -> list[str]:
    """n_records engine prefill records ("phase": "prefill"), layer-cyclic, random experts."""
    g = cfg.geometry
    rng = np.random.default_rng([cfg.seed, 0x9F, cfg.domain])
    out = []
    for i in range(n_records):
        ex = np.sort(rng.choice(g.n_experts, size=g.k, replace=False))
        out.append('{"step": %d, "layer": %d, "experts": [%s], "phase": "prefill"}\n'
                   % (i // g.n_layers, i % g.n_layers, ", ".join(map(str, ex))))
    return out


def write_synth(cfg: SynthConfig, path: str | os.PathLike, prefill_records: int = 0,
                on_step: Callable[[int], None] | None = None) -> dict:
    """Generate a trace and write it in engine JSONL format (moetrace.inputs.trace.write_jsonl).

    With prefill_records > 0, that many prefill records come first. Returns a
    summary dict (records, steps, steps_by_kind, accepted_tokens, path).
    """
    from moetrace.inputs.trace import write_jsonl

    cfg = cfg.resolved()
    n = write_jsonl(generate(cfg, on_step=on_step), path)
    if prefill_records > 0:
        from moetrace.atomic import atomic_write

        with atomic_write(path) as tmp, open(tmp, "w") as out, open(path) as body:
            out.writelines(prefill_lines(cfg, prefill_records))
            while chunk := body.read(1 << 20):
                out.write(chunk)
    kinds = step_kinds(cfg)
    by = np.bincount(kinds, minlength=3)
    return {
        "path": str(path),
        "geometry": cfg.geometry.to_dict(),
        "steps": cfg.steps,
        "steps_by_kind": {"normal": int(by[0]), "spec_accept": int(by[1]), "spec_fallback": int(by[2])},
        "accepted_tokens": int(by[0] + 2 * by[1] + by[2]),
        "records": n,
        "prefill_records": int(prefill_records),
        "domain": cfg.domain,
        "seed": cfg.seed,
        "reuse_targets": {"W1": cfg.w1, "W8": cfg.w8, "W64": cfg.w64},
    }


def popularity_from_counts(path: str | os.PathLike, key: str, geometry: Geometry) -> np.ndarray:
    """Per-layer selection probabilities (n_layers, n_experts) from a counts JSON file.

    The file maps key -> {layer: {expert: count}} (e.g. the OLMoE/Mixtral
    expert counts). Layers absent from the file take the counts of the nearest
    available layer, after scaling the geometry's depth onto the file's
    (so a 16-layer geometry maps layer 3 to file layer 0, layer 5 to 7).
    Zero counts get a pseudo-count of 0.5. Raises InputError if the key is
    missing or the expert count differs from the geometry.
    """
    counts = load_counts(path)
    if key not in counts:
        raise InputError(f"no key {key!r} in the counts file", path=str(path),
                         hint=f"choose one of {', '.join(sorted(counts))}")
    layers = counts[key]
    src = sorted(layers)
    n_src_exp = {layers[s].size for s in src}
    if n_src_exp != {geometry.n_experts}:
        raise InputError(f"{key} has {sorted(n_src_exp)} experts per layer, the geometry has "
                         f"{geometry.n_experts}", path=str(path),
                         hint="pick the matching --preset or --experts (OLMoE: 64, top-8; Mixtral: 8, top-2)")
    span = max(src)
    L = geometry.n_layers
    out = np.empty((L, geometry.n_experts))
    for lay in range(L):
        pos = lay * span / (L - 1) if L > 1 else 0.0
        near = min(src, key=lambda s: (abs(s - pos), s))
        c = np.maximum(layers[near].astype(np.float64), 0.5)
        out[lay] = c / c.sum()
    return out


def load_counts(path: str | os.PathLike) -> dict[str, dict[int, np.ndarray]]:
    """Read a counts JSON ({key: {layer: {expert: count}}}) into {key: {layer: counts array}}.

    Experts absent from a layer count 0. Raises InputError with the path on bad input.
    """
    spath = str(path)
    try:
        with open(spath) as fh:
            raw = json.load(fh)
    except OSError as e:
        raise InputError(f"cannot open counts file: {e.strerror}", path=spath) from None
    except json.JSONDecodeError as e:
        raise InputError(f"not valid JSON ({e.msg})", path=spath, line=e.lineno) from None
    if not isinstance(raw, dict):
        raise InputError("a counts file maps keys to {layer: {expert: count}}", path=spath)
    out: dict[str, dict[int, np.ndarray]] = {}
    for key, layers in raw.items():
        if not isinstance(layers, dict) or not layers:
            raise InputError(f"{key!r}: expected {{layer: {{expert: count}}}}", path=spath)
        per: dict[int, np.ndarray] = {}
        n_exp = 0
        try:
            parsed = {int(lay): {int(e): float(c) for e, c in ex.items()} for lay, ex in layers.items()}
        except (ValueError, TypeError, AttributeError):
            raise InputError(f"{key!r}: layers and experts must be integer keys with numeric counts",
                             path=spath) from None
        n_exp = max(max(d) + 1 for d in parsed.values() if d)
        for lay, d in parsed.items():
            arr = np.zeros(n_exp)
            for e, c in d.items():
                if e < 0 or c < 0:
                    raise InputError(f"{key!r} layer {lay}: negative expert index or count", path=spath)
                arr[e] = c
            per[lay] = arr
        out[key] = per
    return out
