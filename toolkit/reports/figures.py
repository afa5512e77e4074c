"""The report's pictures: ``plot_<name>(df, ax)`` functions kept apart from the analyses
(docs/analyses.md), and a helper that renders a figure to PNG bytes for embedding.

matplotlib runs headless (Agg); every figure is closed after rendering.
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def new_figure(w: float = 7.5, h: float = 3.6, ncols: int = 1, nrows: int = 1, sharex: bool = False):
    plt = _plt()
    fig, ax = plt.subplots(nrows, ncols, figsize=(w, h), dpi=100, constrained_layout=True, sharex=sharex)
    return fig, ax


def png_bytes(fig) -> bytes:
    """Render and close ``fig``."""
    plt = _plt()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def layer_expert_matrix(df: pd.DataFrame, value: str, n_layers: int, n_experts: int) -> np.ndarray:
    """A (n_layers, n_experts) float matrix of ``value`` (NaN where absent or NA)."""
    m = np.full((n_layers, n_experts), np.nan)
    v = pd.to_numeric(df[value].astype("Float64"), errors="coerce").to_numpy(dtype=float, na_value=np.nan)
    m[df["layer"].to_numpy(int), df["expert"].to_numpy(int)] = v
    return m


def plot_heatmap(df: pd.DataFrame, value: str, n_layers: int, n_experts: int, ax, *, title: str,
                 unit: str = "", cmap: str = "viridis", log: bool = False) -> None:
    """Layers (rows) x experts (columns) of ``value``; NaN cells left blank."""
    from matplotlib.colors import LogNorm

    m = layer_expert_matrix(df, value, n_layers, n_experts)
    finite = m[np.isfinite(m)]
    norm = None
    if log and finite.size and (finite > 0).any():
        norm = LogNorm(vmin=max(finite[finite > 0].min(), 1e-9), vmax=finite.max())
    im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm, origin="lower")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=10)
    cb = ax.figure.colorbar(im, ax=ax, shrink=0.85)
    if unit:
        cb.set_label(unit)


def plot_iterations(it: pd.DataFrame, ax) -> None:
    """Pages added, re-added and the simulated LRU misses per replay iteration."""
    x = np.arange(len(it))
    ax.plot(x, it["added_pages"].astype(float), label="added (missed)", color="#1f77b4")
    ax.plot(x, it["re_added_pages"].astype(float), label="re-added (re-read)", color="#d62728")
    if "sim_miss_pages" in it and it["sim_miss_pages"].notna().any():
        ax.plot(x, it["sim_miss_pages"].astype("Float64").astype(float), label="simulated LRU misses",
                color="black", linestyle="--", linewidth=1)
    meas = np.flatnonzero((it["phase"] == "measured").to_numpy())
    if meas.size:
        ax.axvspan(meas[0] - 0.5, meas[-1] + 0.5, color="#eeeeee", zorder=0, label="measured")
    ax.set_xlabel("replay iteration (warm-up, then measured)")
    ax.set_ylabel("pages (4 KiB)")
    ax.legend(fontsize=8, loc="best")
    ax.set_title("Page-cache adds per iteration", fontsize=10)


def plot_observed_vs_sim(experts: pd.DataFrame, ax) -> None:
    """Per expert: observed hit rate against the simulated LRU hit rate at the same capacity."""
    e = experts.dropna(subset=["observed_hit_rate", "sim_hit_rate"])
    ax.scatter(e["sim_hit_rate"].astype(float), e["observed_hit_rate"].astype(float), s=6, alpha=0.5)
    ax.plot([0, 1], [0, 1], color="grey", linewidth=1, linestyle="--")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    from matplotlib.ticker import PercentFormatter

    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("simulated LRU hit rate")
    ax.set_ylabel("observed page hit rate")
    ax.set_title("Observed vs simulated, per expert", fontsize=10)


def plot_log2_hist(hist: pd.DataFrame, group: str, count: str, ax, *, title: str, xlabel: str) -> None:
    """Log2-bucketed histograms (lo_ns, hi_ns, count), one line per ``group`` value."""
    for name, g in hist.groupby(group, sort=True):
        g = g.sort_values("lo_ns")
        mid = np.sqrt(np.maximum(g["lo_ns"].to_numpy(float), 1.0) * g["hi_ns"].to_numpy(float))
        ax.plot(mid, g[count].to_numpy(float), marker="o", markersize=3, label=str(name))
    ax.set_xscale("log")
    if xlabel == "ns":  # durations ticked as a person reads them: 1 µs, 100 µs, 10 ms
        from matplotlib.ticker import FuncFormatter, LogLocator

        from moetrace.reports.document import fmt_ms

        ax.xaxis.set_major_locator(LogLocator(base=10))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_ms(v)))
        xlabel = "duration"
    ax.set_xlabel(xlabel)
    ax.set_ylabel(count)
    ax.set_title(title, fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def plot_breakdown(df: pd.DataFrame, ax, *, title: str) -> None:
    """Horizontal bars of ``share`` by ``category``."""
    d = df.sort_values("share")
    ax.barh(d["category"].astype(str), d["share"].astype(float) * 100, color="#ff7f0e")
    ax.set_xlabel("% of samples")
    ax.set_title(title, fontsize=10)


def plot_generations(gens: pd.DataFrame, ax) -> None:
    """MGLRU: the oldest generation's age over time, per memcg/node."""
    for (path, node), g in gens.groupby(["memcg_path", "node"], sort=True):
        t = (g["time_ns"] - gens["time_ns"].min()) / 1e9
        ax.plot(t, g["oldest_age_ms"].astype(float), marker=".", label=f"{path or '/'} node {node}")
    ax.set_xlabel("s")
    ax.set_ylabel("oldest generation age (ms)")
    ax.set_title("MGLRU: age of the generation eviction takes from", fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def plot_refaults(win: pd.DataFrame, ax) -> None:
    """Refault share per iteration with thrash states shaded."""
    x = np.arange(len(win))
    ax.plot(x, win["refault_share"].astype("Float64").astype(float), color="#d62728")
    colors = {"elevated": "#fff2cc", "thrashing": "#f4cccc"}
    for i, s in enumerate(win["state"]):
        if s in colors:
            ax.axvspan(i - 0.5, i + 0.5, color=colors[s], zorder=0)
    from matplotlib.ticker import PercentFormatter

    ax.set_ylim(0, 1.05)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("replay iteration")
    ax.set_ylabel("re-added / requested pages")
    ax.set_title("Refault windows (shaded: elevated / thrashing)", fontsize=10)


def plot_reclaim_timeline(tl: pd.DataFrame, ax) -> None:
    """Pages reclaimed per bucket (bars, by reclaimer) and scan-to-steal (line, right axis)."""
    t0 = tl["time_ns"].min()
    for who, g in tl.groupby("who", sort=True):
        ax.bar((g["time_ns"] - t0) / 1e9, g["reclaimed_pages"], width=0.09, label=f"reclaimed: {who}", alpha=0.7)
    ax.set_xlabel("s since the first reclaim")
    ax.set_ylabel("pages reclaimed per 100 ms")
    ax2 = ax.twinx()
    tot = tl.groupby("time_ns")[["scanned_pages", "reclaimed_pages"]].sum()
    s2s = tot["scanned_pages"] / tot["reclaimed_pages"].where(tot["reclaimed_pages"] > 0)
    ax2.plot((tot.index - t0) / 1e9, s2s, color="black", marker=".", linewidth=1, label="scan-to-steal")
    ax2.axhline(2.0, color="#d62728", linestyle=":", linewidth=1)
    ax2.set_ylabel("scan-to-steal (dotted: 2)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    if h1 or h2:
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    ax.set_title("Reclaim over time", fontsize=10)


def mechanism_order(mech: str) -> tuple:
    """cgroup, then balloons by their locked fraction, then vm-memory, then anything else."""
    if mech == "cgroup":
        return (0, 0.0, mech)
    if mech.startswith("balloon"):
        try:  # "balloon0.81", "balloon:0.81", "balloon0.81+bites0.26" (the bites controller's)
            return (1, float(mech[len("balloon"):].lstrip(":").partition("+")[0]), mech)
        except ValueError:
            return (1, 1.0, mech)
    return (2 if mech == "vm-memory" else 3, 0.0, mech)


def plot_mechanism_matrix(summary: list[dict], ax, kernel: str) -> None:
    """The paper's Fig. 3 (middle) for one kernel: per mechanism a pair of bars, MGLRU on (left)
    and off (right), the median device MB per iteration over the retained repeats with their
    range, the simulated miss demand at nominal C as a dotted tick over the pair, a dash on each
    bar at the miss demand of a global LRU as large as the pool's resident size there, and the
    median kswapd scan-to-steal over each bar."""
    rows = [s for s in summary if s["kernel"] == kernel]
    mechs = sorted(dict.fromkeys(s["mechanism"] for s in rows), key=mechanism_order)
    colors = {"on": "tab:blue", "off": "tab:orange"}
    dash = False
    for i, mech in enumerate(mechs):
        for j, state in enumerate(("on", "off")):
            s = next((r for r in rows if r["mechanism"] == mech and r["mglru"] == state), None)
            if s is None or s["device_bytes_per_iteration_median"] is None:
                continue
            x, y = i + (j - 0.5) * 0.38, s["device_bytes_per_iteration_median"] / 1e6
            lo, hi = s["device_bytes_per_iteration_min"] / 1e6, s["device_bytes_per_iteration_max"] / 1e6
            ax.bar(x, y, width=0.36, color=colors[state], label=f"MGLRU {state}" if i == 0 else None)
            ax.errorbar(x, y, yerr=[[y - lo], [hi - y]], color="black", capsize=2, lw=0.8)
            at_res = s.get("miss_bytes_per_iteration_at_resident_median")
            if at_res is not None:
                ax.hlines(at_res / 1e6, x - 0.17, x + 0.17, colors="black", lw=1.6,
                          label=None if dash else "LRU miss at the resident pool")
                dash = True
            if s["scan_to_steal_median"] is not None:
                ax.annotate(f"{s['scan_to_steal_median']:.1f}", (x, hi), ha="center", va="bottom", fontsize=7)
        miss = next((r["miss_bytes_per_iteration"] for r in rows if r["mechanism"] == mech
                     and r["miss_bytes_per_iteration"] is not None), None)
        if miss is not None:
            ax.hlines(miss / 1e6, i - 0.45, i + 0.45, colors="black", linestyles="dotted",
                      label="miss demand at C" if i == 0 else None)
    ax.set_xticks(range(len(mechs)), mechs, rotation=20, fontsize=8)
    ax.set_ylabel("device MB per iteration")
    release = next((r.get("release") for r in rows if r.get("release")), None)
    name = kernel if not release or release.startswith(kernel) else f"{kernel}: {release.split('+')[0]}"
    ax.set_title(f"{name} (numbers: kswapd scan/steal)", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def sim_png(table: pd.DataFrame) -> bytes:
    """`moetrace sim --plot`: hit rate vs budget per policy (and scope) of a simulation's table
    (moetrace.analyses.sim.plot_sim), as PNG bytes."""
    from moetrace.analyses.sim import plot_sim

    fig, ax = new_figure(7, 4.5)
    plot_sim(table, ax)
    return png_bytes(fig)


def engine_sweep_png(cap: pd.DataFrame) -> bytes:
    """Decode time and device bytes per token against C, per loader (the range of the repeats as
    error bars), with the routed miss demand (LRU at C) beside the device bytes."""
    fig, (a, b) = new_figure(10, 3.8, ncols=2)
    for lo, g in cap.groupby("loader"):
        x = g["capacity_bytes"] / 2**20
        for ax, f, scale in ((a, "decode_ms_per_token", 1), (b, "device_bytes_per_token", 2**20)):
            y = g[f] / scale
            err = [(g[f] - g[f"{f}_min"]) / scale, (g[f"{f}_max"] - g[f]) / scale]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=lo)
    g = cap.groupby("capacity_bytes")["miss_bytes_per_token"].median()
    b.plot(g.index / 2**20, g.to_numpy() / 2**20, "k--", label="routed miss demand (LRU at C)")
    a.set(xlabel="C (MiB)", ylabel="decode time per token (ms)", title="decode time")
    b.set(xlabel="C (MiB)", ylabel="device MiB per token", title="device reads", yscale="log")
    for ax in (a, b):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return png_bytes(fig)
