"""Benchmark: one-pass LRU curve, Belady, against naive baselines in the same run.

    .venv/bin/python tests/bench/bench_sim.py [--accesses 10000000] [--naive-seconds 20] [--repeats 5]

Builds ~10 million accesses of the kimi-k3 geometry (92 layers x 896 experts)
with numpy: per iteration and layer a set of 16 distinct experts drawn from a
per-layer Zipf(1.0) popularity (Gumbel top-k), with the previous iteration's
experts boosted so about a third are reused. Times, after a numba warm-up on a
tiny input (compile or cache-load time reported separately):

* the one-pass LRU curve (every budget), per-layer and global;
* baseline 1: a naive numpy stack-distance pass (per access, the number of
  distinct items since its previous access with np.unique) on a capped prefix,
  extrapolated to the whole stream — said so in the output;
* baseline 2: direct per-budget LRU simulation (linked list) at 8 budgets;
* Belady's MIN at one budget, in accesses per second;
* baseline 3: libCacheSim 0.3.5 (GPL: never a moetrace dependency nor bundled,
  only run beside it; imported from ``--libcachesim-path DIR`` /
  ``MOETRACE_LIBCACHESIM_PATH`` / a cache directory, where it is
  ``pip install --no-deps --target``-ed when absent; ``--no-libcachesim``
  skips it): its LRU once per budget at the 8 budgets x n_layers of the global
  stream and its Belady at one budget, over a temporary oracleGeneral trace of
  the same stream (object id = expert_id, size 1, so the cache size in objects
  is the budget), against moetrace's global curve and Belady (its next-use pass
  included) over the whole stream (warm_fraction 0), in ``--repeats`` paired,
  interleaved runs.

Targets (issue 21, acceptance 4): the LRU curve >= 8x faster than libCacheSim's
LRU at the 8 budgets, Belady >= 3x, every hit count equal; the script ends with
a VERDICT line and exits 1 when a median ratio misses its target or a hit count
differs (the ratios print as median [min - max] over the paired repeats).
Earlier targets: LRU curve < 18 s (ambition < 5 s); Belady >= 1M accesses/s.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def build_accesses(n_target: int = 10_000_000, seed: int = 1):
    """~n_target accesses (kimi-k3 geometry, k=16 distinct experts per layer set)."""
    from moetrace.inputs.trace import Accesses

    L, E, K = 92, 896, 16
    n_it = -(-n_target // (L * K))
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((L, E)), axis=1)  # per-layer popularity order
    logp = (-1.0 * np.log1p(ranks)).astype(np.float32)  # Zipf alpha = 1
    bonus = np.float32(2.0)  # previous-iteration boost (~1/3 reuse)
    out = np.empty((n_it, L, K), np.int32)
    prev = np.zeros((L, E), np.float32)
    rows = np.arange(L)[:, None]
    chunk = 64
    for c0 in range(0, n_it, chunk):
        c1 = min(n_it, c0 + chunk)
        u = rng.random((c1 - c0, L, E), dtype=np.float32)
        np.clip(u, np.float32(1e-12), np.float32(1 - 1e-7), out=u)
        gum = -np.log(-np.log(u))
        for t in range(c1 - c0):
            keys = logp + gum[t] + prev
            top = np.argpartition(-keys, K, axis=1)[:, :K]
            out[c0 + t] = top
            prev[:] = 0
            prev[rows, top] = bonus
    out.sort(axis=2)
    it = np.repeat(np.arange(n_it, dtype=np.int32), L * K)
    lay = np.tile(np.repeat(np.arange(L, dtype=np.int16), K), n_it)
    ex = out.reshape(-1)
    n = n_target
    return Accesses(it[:n], np.zeros(n, np.int8), lay[:n], ex[:n].copy(), L, E,
                    int(it[n - 1]) + 1)


def tiny_accesses():
    from moetrace.inputs.trace import Accesses

    it = np.array([0, 0, 1, 1, 2, 2], np.int32)
    lay = np.array([0, 1, 0, 1, 0, 1], np.int16)
    ex = np.array([0, 1, 1, 1, 0, 0], np.int32)
    return Accesses(it, np.zeros(6, np.int8), lay, ex, 2, 2, 3)


def naive_stack_distances(item: np.ndarray, limit_s: float) -> tuple[int, float]:
    """Per access: distinct items since its previous access (numpy), until limit_s.

    Returns (accesses done, seconds)."""
    n = item.size
    # previous occurrence of each access, with numpy
    order = np.argsort(item, kind="stable")
    srt = item[order]
    prev = np.full(n, -1, np.int64)
    same = srt[1:] == srt[:-1]
    prev[order[1:][same]] = order[:-1][same]
    t0 = time.perf_counter()
    done = 0
    acc = 0
    for i in range(n):
        p = prev[i]
        if p >= 0:
            acc += np.unique(item[p + 1:i]).size + 1
        done += 1
        if (done & 1023) == 0 and time.perf_counter() - t0 > limit_s:
            break
    return done, time.perf_counter() - t0


LIBCACHESIM_ENV = "MOETRACE_LIBCACHESIM_PATH"
LIBCACHESIM_VERSION = "0.3.5"
# acceptance 4 of issue 21: the LRU curve (every budget, one pass) against libCacheSim's LRU
# at 8 budgets, and Belady (next-use pass included) against libCacheSim's Belady (next uses
# read from its trace file), both over the same 10 M accesses, hit counts equal
TARGETS = {"lru_curve": 8.0, "belady": 3.0}
# oracleGeneral binary record (libCacheSim): packed, little-endian, 24 bytes
ORACLE_GENERAL = np.dtype([("clock_time", "<u4"), ("obj_id", "<u8"), ("obj_size", "<u4"),
                           ("next_access_vtime", "<i8")])


def default_libcachesim_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moetrace", f"libcachesim-{LIBCACHESIM_VERSION}")


def load_libcachesim(path: str | None, fetch: bool):
    """``import libcachesim`` from ``path`` (prepended to sys.path) or the environment. When it is
    absent and ``fetch``, pip installs libcachesim==LIBCACHESIM_VERSION into ``path`` (default: a
    cache directory outside the venv): libCacheSim is GPL, so moetrace never bundles or depends on
    it, it is only run beside moetrace here. Returns the module, or None when absent and not fetched."""
    path = os.path.abspath(path or default_libcachesim_dir())
    sys.path.insert(0, path)
    try:
        import libcachesim
        return libcachesim
    except ImportError:
        if not fetch:
            return None
    print(f"libCacheSim not importable: pip install --no-deps --target {path} "
          f"libcachesim=={LIBCACHESIM_VERSION} (GPL; outside moetrace's venv, only run beside it)", flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", path,
                        f"libcachesim=={LIBCACHESIM_VERSION}"])
    if r.returncode != 0:
        raise SystemExit(f"FAIL: could not install libcachesim=={LIBCACHESIM_VERSION} into {path} (pip exit "
                         f"{r.returncode}); install it by hand and pass --libcachesim-path DIR, or run with "
                         f"--no-libcachesim to skip the comparison")
    importlib.invalidate_caches()
    import libcachesim
    return libcachesim


def write_oracle_general(item: np.ndarray, nxt: np.ndarray, clock: np.ndarray, path: str) -> None:
    """Write a libCacheSim oracleGeneral trace: one request per access, size 1.

    ``nxt`` is :func:`moetrace.analyses.sim.next_use` (len when none -> -1)."""
    n = item.size
    rec = np.empty(n, ORACLE_GENERAL)
    rec["clock_time"] = clock
    rec["obj_id"] = item
    rec["obj_size"] = 1
    rec["next_access_vtime"] = np.where(nxt >= n, -1, nxt)
    rec.tofile(path)


def spread(xs: list[float]) -> str:
    """median [min - max] of paired repeats, as the verdict reads them."""
    return f"{np.median(xs):.1f}x [{min(xs):.1f} - {max(xs):.1f}]"


def libcachesim_baseline(lcs, acc, budgets: list[int], belady_budget: int, repeats: int,
                         hashpower: int = 18) -> dict:
    """Baseline 3: libCacheSim LRU at each global budget and Belady at one, against moetrace's
    curve and Belady over the same stream (moetrace warm_fraction=0: every access scored on
    both sides), timed in ``repeats`` interleaved pairs. Returns the ratios and hit counts."""
    from moetrace.analyses import sim, stackdist

    n = len(acc)
    _, item, _, _ = stackdist.stream(acc, "global")
    gb = [b * acc.n_layers for b in budgets]
    bb = belady_budget * acc.n_layers
    res: dict = {"lru_curve": [], "belady": [],
                 "t": {k: [] for k in ("lcs_lru", "curve", "lcs_belady", "belady", "next_use")}}
    with tempfile.TemporaryDirectory(prefix="bench_lcs_") as tmp:
        path = os.path.join(tmp, "stream.oracleGeneral.bin")
        write_oracle_general(item, sim.next_use(acc), acc.iteration, path)
        print(f"libCacheSim {lcs.__version__}: an oracleGeneral trace of {n:,} requests "
              f"({os.path.getsize(path) / 2**20:.0f} MiB, written untimed); hashpower={hashpower}; "
              f"{repeats} paired repeats", flush=True)
        reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
        assert reader.get_num_of_req() == n, (reader.get_num_of_req(), n)

        def run(cache) -> tuple[int, float]:
            reader.reset()
            t = time.perf_counter()
            miss_ratio, _ = cache.process_trace(reader)
            return n - int(round(miss_ratio * n)), time.perf_counter() - t

        def theirs_lru() -> tuple[list[int], float]:
            hits, secs = [], 0.0
            for b in gb:
                h, t = run(lcs.LRU(b, hashpower=hashpower))
                hits.append(h)
                secs += t
            return hits, secs

        def ours_curve() -> tuple[list[int], float]:
            t0 = time.perf_counter()
            curve = stackdist.lru_stack_curve(acc, "global", 0.0)
            return [int(h) for h in curve.hits_at(np.asarray(gb))], time.perf_counter() - t0

        def ours_belady() -> tuple[int, float, float]:
            t0 = time.perf_counter()
            nxt = sim.next_use(acc)
            t_nu = time.perf_counter() - t0
            h = sim.belady_hits(acc, bb, "global", 0.0, nxt=nxt)
            return h, time.perf_counter() - t0, t_nu

        for r in range(repeats):
            # each pair in both orders by turns: what runs second inherits the first's cache and memory state
            if r % 2 == 0:
                theirs, t_lcs = theirs_lru()
                ours, t_curve = ours_curve()
                h_lcs, t_bl = run(lcs.Belady(bb, hashpower=hashpower))
                h_ours, t_bo, t_nu = ours_belady()
            else:
                ours, t_curve = ours_curve()
                theirs, t_lcs = theirs_lru()
                h_ours, t_bo, t_nu = ours_belady()
                h_lcs, t_bl = run(lcs.Belady(bb, hashpower=hashpower))
            for k, v in (("lcs_lru", t_lcs), ("curve", t_curve), ("lcs_belady", t_bl), ("belady", t_bo),
                         ("next_use", t_nu)):
                res["t"][k].append(v)
            res["lru_curve"].append(t_lcs / t_curve)
            res["belady"].append(t_bl / t_bo)
        del reader
    res.update(gb=gb, bb=bb, n=n, lru_ours=ours, lru_theirs=theirs, belady_ours=h_ours, belady_theirs=h_lcs)
    t = {k: float(np.median(v)) for k, v in res["t"].items()}
    print(f"baseline 3: libCacheSim LRU at {len(gb)} budgets (global, {gb[0]}..{gb[-1]}): {t['lcs_lru']:.2f} s "
          f"({n * len(gb) / t['lcs_lru'] / 1e6:.1f} M acc/s per budget) vs moetrace curve (global, warm 0, "
          f"every budget) {t['curve']:.2f} s -> curve is {spread(res['lru_curve'])} faster")
    print(f"           hit counts: {sum(o == h for o, h in zip(ours, theirs))}/{len(gb)} budgets equal "
          f"(libCacheSim hit rates {', '.join(f'{h / n:.4f}' for h in theirs)})")
    print(f"baseline 3: Belady global B={bb} over the whole stream: libCacheSim {t['lcs_belady']:.2f} s "
          f"({n / t['lcs_belady'] / 1e6:.1f} M acc/s, next uses read from its trace file) vs moetrace "
          f"{t['belady']:.2f} s with its next-use pass ({t['next_use']:.2f} s; {n / t['belady'] / 1e6:.1f} M acc/s) -> moetrace is "
          f"{spread(res['belady'])} faster; hits {h_ours:,} vs {h_lcs:,} "
          f"({'equal' if h_ours == h_lcs else f'differ by {abs(h_ours - h_lcs)}'})")
    return res


def verdict(res: dict | None) -> int:
    """Acceptance 4: median ratios over the paired repeats >= TARGETS and every hit count equal.
    Prints PASS or FAIL with each reason; returns the exit status (0 pass, 1 fail)."""
    if res is None:
        print("VERDICT: libCacheSim comparison not run (--no-libcachesim): acceptance 4 not checked")
        return 0
    fails = []
    for key, what in (("lru_curve", "LRU curve vs libCacheSim LRU at 8 budgets"), ("belady", "Belady")):
        med = float(np.median(res[key]))
        ok = med >= TARGETS[key]
        print(f"  {what}: {spread(res[key])} (target >= {TARGETS[key]:g}x): {'ok' if ok else 'MISSED'}")
        if not ok:
            fails.append(f"{what} {med:.1f}x < {TARGETS[key]:g}x")
    bad = [b for b, o, h in zip(res["gb"], res["lru_ours"], res["lru_theirs"]) if o != h]
    if bad:
        fails.append(f"LRU hit counts differ from libCacheSim at budgets {bad}")
    if res["belady_ours"] != res["belady_theirs"]:
        fails.append(f"Belady hits differ: {res['belady_ours']} vs {res['belady_theirs']}")
    print("VERDICT: " + ("PASS" if not fails else "FAIL: " + "; ".join(fails)))
    return 1 if fails else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--accesses", type=int, default=10_000_000)
    ap.add_argument("--naive-seconds", type=float, default=20.0,
                    help="cap on the naive baseline per scope before extrapolating")
    ap.add_argument("--budget", type=int, default=32, help="Belady budget (experts per layer)")
    ap.add_argument("--libcachesim-path", metavar="DIR", default=os.environ.get(LIBCACHESIM_ENV),
                    help=f"directory prepended to sys.path to find libcachesim, and where it is pip-installed "
                         f"when absent (GPL: never a moetrace dependency, only run beside it); default "
                         f"${LIBCACHESIM_ENV}, else {default_libcachesim_dir()}")
    ap.add_argument("--no-libcachesim", action="store_true",
                    help="skip the libCacheSim comparison (acceptance 4 is then not checked)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="paired repeats (libCacheSim, moetrace) whose ratios the verdict takes the median of")
    args = ap.parse_args()
    lcs = None if args.no_libcachesim else load_libcachesim(args.libcachesim_path, fetch=True)

    t0 = time.perf_counter()
    from moetrace.analyses import sim, stackdist

    t_imp = time.perf_counter() - t0
    t0 = time.perf_counter()
    tiny = tiny_accesses()
    for scope in ("per_layer", "global"):
        stackdist.lru_stack_curve(tiny, scope)
        sim.lru_hits(tiny, 1, scope)
        sim.lfu_hits(tiny, 1, scope)
        sim.belady_hits(tiny, 1, scope)
    t_jit = time.perf_counter() - t0
    print(f"import {t_imp:.2f} s; numba warm-up (compile or cache load) {t_jit:.2f} s")

    t0 = time.perf_counter()
    acc = build_accesses(args.accesses)
    print(f"built {len(acc):,} accesses ({acc.n_iterations} iterations, {acc.n_layers}x{acc.n_experts}) "
          f"in {time.perf_counter() - t0:.1f} s (not timed below)")

    res = {}
    for scope in ("per_layer", "global"):
        t0 = time.perf_counter()
        curve = stackdist.lru_stack_curve(acc, scope, 0.6)
        res[scope] = time.perf_counter() - t0
        b = 32 if scope == "per_layer" else 32 * acc.n_layers
        print(f"LRU curve {scope:9s}: {res[scope]:6.2f} s  ({len(acc) / res[scope] / 1e6:.1f} M acc/s; "
              f"hit rate at {b}: {curve.hit_rate_at(b):.3f})")
    curve_total = res["per_layer"] + res["global"]

    budgets = [4, 8, 16, 32, 64, 128, 256, 512]
    t0 = time.perf_counter()
    pl = stackdist.lru_stack_curve(acc, "per_layer", 0.6)
    for b in budgets:
        h = sim.lru_hits(acc, b, "per_layer", 0.6)
        assert h == pl.hits_at(b), (b, h, pl.hits_at(b))
    t_direct = time.perf_counter() - t0 - res["per_layer"]
    print(f"baseline 2: direct LRU at {len(budgets)} budgets (per_layer): {t_direct:6.2f} s "
          f"(equal to the curve at each) -> curve is {t_direct / res['per_layer']:.1f}x faster")

    for scope in ("per_layer", "global"):
        _, item, _, _ = stackdist.stream(acc, scope)
        if scope == "per_layer":  # each layer's own stream: distances within layer 0
            item = acc.expert[acc.layer == 0].astype(np.int64)
            scale = len(acc) / item.size
        else:
            item = item.astype(np.int64)
            scale = 1.0
        done, secs = naive_stack_distances(item, args.naive_seconds)
        est = secs / done * item.size * scale
        what = "layer 0's stream" if scope == "per_layer" else "the stream"
        if done < item.size:
            what = f"the first {done:,} of {what} (capped at {args.naive_seconds:g} s)"
        print(f"baseline 1: naive numpy stack distances {scope:9s}: {done:,} accesses ({what}) in "
              f"{secs:.1f} s -> extrapolated {est:,.0f} s for {len(acc):,} -> curve is "
              f"{est / res[scope]:,.0f}x faster")

    nxt_t0 = time.perf_counter()
    nxt = sim.next_use(acc)
    t_nxt = time.perf_counter() - nxt_t0
    for scope, b in (("per_layer", args.budget), ("global", args.budget * acc.n_layers)):
        t0 = time.perf_counter()
        h = sim.belady_hits(acc, b, scope, 0.6, nxt=nxt)
        tb = time.perf_counter() - t0
        print(f"Belady {scope:9s} B={b}: {tb:.2f} s + next-use {t_nxt:.2f} s -> "
              f"{len(acc) / (tb + t_nxt) / 1e6:.1f} M acc/s (hit rate {h / (len(acc) - sim.window(acc).cut):.3f})")
    print(f"LRU curve per_layer+global {curve_total:.2f} s (target < 18 s, ambition < 5 s)")
    res = None if lcs is None else libcachesim_baseline(lcs, acc, budgets, args.budget, max(1, args.repeats))
    return verdict(res)


if __name__ == "__main__":
    raise SystemExit(main())
