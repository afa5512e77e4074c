"""The sweep's tables and figure: results (one row per cell), capacity (per C: median and
spread over retained repeats, the paper's Table 2) and fig2.png (Fig. 2)."""

from __future__ import annotations

from pathlib import Path

from moetrace.capacity.sweep import CELL_COLUMNS


def numeric_cells(cells):
    """The results with nullable numbers as plain float64 (NA as NaN), as the capacity table and
    Fig. 2 take them."""
    num = cells.copy()
    for c in num.columns:
        if str(num[c].dtype) in ("Float64", "Int64"):
            num[c] = num[c].astype("float64")
    return num


def write_results(rows: list[dict], out: Path, plot: bool = True) -> dict:
    """results.csv/.parquet (one row per cell), capacity.csv/.parquet (one per C), fig2.png."""
    import pandas as pd

    from moetrace.analyses.capacity_response import compute_capacity_table, plot_capacity

    cells = pd.DataFrame(rows, columns=CELL_COLUMNS)
    for c in CELL_COLUMNS:
        if c not in ("capacity", "cell_dir", "mechanism", "mode", "reasons", "retained", "host"):
            cells[c] = pd.to_numeric(cells[c], errors="coerce").astype("Float64" if c not in (
                "capacity_bytes", "repeat", "order", "host_order") else "Int64")
    cells["retained"] = cells["retained"].astype(bool)
    cells.to_csv(out / "results.csv", index=False)
    cells.to_parquet(out / "results.parquet", index=False)
    num = numeric_cells(cells)
    table = compute_capacity_table(num)
    table.to_csv(out / "capacity.csv", index=False)
    table.to_parquet(out / "capacity.parquet", index=False)
    files = {"results": str(out / "results.csv"), "capacity": str(out / "capacity.csv")}
    if plot and not num.empty:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        plot_capacity(num, axes)
        fig.tight_layout()
        fig.savefig(out / "fig2.png", dpi=120)
        plt.close(fig)
        files["figure"] = str(out / "fig2.png")
    return {"files": files, "table": table}
