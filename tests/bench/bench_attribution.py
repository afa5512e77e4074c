"""Benchmark: streamed per-expert attribution of page_events.parquet against pandas.

    .venv/bin/python tests/bench/bench_attribution.py [--events 10000000] [--runs 5] [--json]

Generates --events synthetic page events (default 10 million) shaped like `moetrace
record --stream-events` output (the recorder's own columns, dtypes and DataFrame ->
to_parquet path, one row group per million rows) into a Parquet file under a temporary
directory (removed at the end, also on error):

* expert_id over 64 layers x 64 experts (4096), per layer a Zipf(0.9) popularity over
  a random expert order, layers uniform; 1 % unattributed (expert_id = 4096);
* ~60 % adds; pages 1-16 mostly (1, 2, 4, 8, 16; 3 % of 32), first_page_index within
  a 1024-page (4 MiB) expert; re_added_pages ~ Binomial(pages, 0.3) on adds;
* monotone ts_ns (exponential gaps, mean 1 us); a few tgids;
* delete evictors kswapd 70 %, direct 15 %, memcg 10 %, drop_caches 3 %, other 2 %.

Then --runs rounds, the order of the sides alternating each round. Every timed run is a
fresh child process (this script with --child) that imports its libraries, times the one
call from the inside (file open + decode + reduce, not the interpreter start-up) and
reports its peak RSS (/proc/self/status VmHWM) and its RSS before the call:

* ``stream``: moetrace.analyses.page_events.attribute_page_events (batches of 2**20
  rows): per-expert added / evicted / re-added / per-evictor pages and event counts;
* ``baseline``: pandas read_parquet(columns=[expert_id, kind, pages]) +
  groupby(["expert_id", "kind"])["pages"].sum(): the straightforward way. It holds the
  decoded columns in memory and computes less (no evictor classes, re-adds or event
  counts); its sums are checked equal to the streamed ones;
* ``stream-b18`` (info): the same with batches of 2**18 rows (the memory / speed trade-off);
* ``stream+epochs`` (info): the same call with a 256-epoch table (per (epoch, expert));
* ``rereads`` (info): count_epoch_rereads over the same epochs (numba, per-page state).

Prints events/s (min / median / max over the runs) per side, the stream / baseline ratio
of medians, peak RSS against the Parquet file size and the decoded size of the data in
memory (pandas memory_usage(deep=True) of all columns, and of the baseline's three).
Target: >= 10 million events/s for ``stream``. --json prints one JSON document instead.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TARGET_EVENTS_PER_S = 10e6
N_LAYERS, N_EXPERTS, PPE = 64, 64, 1024
N_TOTAL = N_LAYERS * N_EXPERTS
N_EPOCHS = 256
SIDES = ("stream", "baseline")
INFO_SIDES = ("stream-b18", "stream+epochs", "rereads")


def generate(path: Path, n: int, seed: int = 3, chunk: int = 1 << 20) -> None:
    """Write n synthetic page events to ``path`` the way the recorder does (its struct ->
    DataFrame -> to_parquet conversion, per chunk of ``chunk`` rows = one row group)."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moetrace.record.probes.pagecache import EVICTORS, PAGE_EVENT_DTYPE

    rng = np.random.default_rng(seed)
    # joint popularity over expert_id: layers uniform, each a Zipf(0.9) over a random order
    ranks = np.argsort(rng.random((N_LAYERS, N_EXPERTS)), axis=1)
    w = 1.0 / (ranks + 1.0) ** 0.9
    p = (w / w.sum(axis=1, keepdims=True) / N_LAYERS).reshape(-1)
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    sizes, size_p = np.array([1, 2, 4, 8, 16, 32]), np.array([.45, .15, .15, .12, .10, .03])
    ev_names = ["kswapd", "direct", "memcg", "drop_caches", "other"]
    ev_codes, ev_p = np.array([EVICTORS.index(e) for e in ev_names]), np.array([.70, .15, .10, .03, .02])
    tgids = np.array([4242, 4243, 4244, 977], np.uint32)
    t = 10**12
    writer = None
    try:
        for a in range(0, n, chunk):
            m = min(chunk, n - a)
            rec = np.zeros(m, PAGE_EVENT_DTYPE)
            gaps = rng.exponential(1000.0, m).astype(np.uint64) + 1
            rec["ts_ns"] = t + np.cumsum(gaps)
            t = int(rec["ts_ns"][-1])
            eid = np.searchsorted(cdf, rng.random(m), side="right").astype(np.uint32)
            eid[rng.random(m) < 0.01] = N_TOTAL
            rec["expert_id"] = np.minimum(eid, N_TOTAL)
            is_del = rng.random(m) >= 0.60
            rec["kind"] = is_del
            pages = sizes[np.searchsorted(np.cumsum(size_p), rng.random(m) * size_p.sum(), side="right")]
            rec["pages"] = pages
            rec["first_page"] = np.where(eid < N_TOTAL, rng.integers(0, PPE - pages + 1), 0)
            rec["re_added"] = np.where(is_del | (eid >= N_TOTAL), 0, rng.binomial(pages, 0.3))
            rec["tgid"] = tgids[rng.integers(0, len(tgids), m)]
            rec["evictor"] = np.where(is_del, ev_codes[np.searchsorted(np.cumsum(ev_p), rng.random(m),
                                                                        side="right").clip(0, 4)], 0)
            # toolkit/record/probes/pagecache.py PagecacheRecorder.write, verbatim
            ev = pd.DataFrame(rec)
            ev["kind"] = ev["kind"].map({0: "add", 1: "delete"}).astype("string")
            ev["evictor"] = pd.Categorical.from_codes(ev["evictor"].astype(np.int64), EVICTORS).astype("string")
            ev.loc[ev["kind"] == "add", "evictor"] = pd.NA
            ev = ev.drop(columns=["reserved"]).rename(columns={"first_page": "first_page_index",
                                                               "re_added": "re_added_pages"})
            tab = pa.Table.from_pandas(ev, preserve_index=False)
            if writer is None:
                writer = pq.ParquetWriter(path, tab.schema)
            writer.write_table(tab)
    finally:
        if writer is not None:
            writer.close()


def epochs_for(path: Path):
    """N_EPOCHS equal epochs over the file's ts range (the ends inclusive of the last event)."""
    import pandas as pd
    import pyarrow.parquet as pq

    md = pq.ParquetFile(path).metadata
    col = md.schema.to_arrow_schema().get_field_index("ts_ns")
    lo = min(md.row_group(i).column(col).statistics.min for i in range(md.num_row_groups))
    hi = max(md.row_group(i).column(col).statistics.max for i in range(md.num_row_groups)) + 1
    edges = np.linspace(lo, hi, N_EPOCHS + 1).astype(np.int64)
    edges[-1] = hi
    return pd.DataFrame({"epoch": np.arange(N_EPOCHS, dtype=np.int32), "phase": "measured",
                         "start_ns": edges[:-1], "end_ns": edges[1:]})


# -- the child: one timed call -------------------------------------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def child(side: str, path: Path, out: Path, batch_rows: int) -> None:
    """One timed call in this fresh process; the baseline imports pandas only."""
    import pandas as pd

    if side != "baseline":
        from moetrace.analyses import page_events as pe
    ep = epochs_for(path) if side in ("stream+epochs", "rereads") else None
    if side == "rereads":  # numba: compile / cache-load before the clock starts
        pe.count_epoch_rereads(pe_tiny(), 1, 1, ep.iloc[:1])
    rss0 = _status_kib("VmRSS")
    c0 = _cpu_s()
    t0 = time.perf_counter()
    if side in ("stream", "stream-b18"):
        r = pe.attribute_page_events(path, N_TOTAL, batch_rows=batch_rows if side == "stream" else 1 << 18)
        n = r.events
    elif side == "stream+epochs":
        r = pe.attribute_page_events(path, N_TOTAL, ep, batch_rows=batch_rows)
        n = r.events
    elif side == "rereads":
        rr = pe.count_epoch_rereads(path, N_TOTAL, PPE, ep, batch_rows=batch_rows)
        n = None
    else:
        df = pd.read_parquet(path, columns=["expert_id", "kind", "pages"])
        g = df.groupby(["expert_id", "kind"])["pages"].sum()
        n = len(df)
    dt = time.perf_counter() - t0
    doc = {"side": side, "seconds": dt, "cpu_seconds": _cpu_s() - c0, "events": n, "rss_before_kib": rss0,
           "peak_rss_kib": _status_kib("VmHWM")}
    if side == "stream":
        doc["added"] = r.experts["added_pages"].to_numpy(np.int64).tolist()
        doc["evicted"] = r.experts["evicted_pages"].to_numpy(np.int64).tolist()
    elif side == "baseline":
        doc["decoded_bytes"] = int(df.memory_usage(deep=True, index=False).sum())
        for k, name in (("added", "add"), ("evicted", "delete")):
            s = g.xs(name, level="kind").reindex(range(N_TOTAL + 1), fill_value=0)
            doc[k] = s.to_numpy(np.int64).tolist()
    elif side == "rereads":
        doc["events"] = pq_rows(path)
        doc["reread_pages"] = int(rr["reread_pages"].sum())
    out.write_text(json.dumps(doc))


def pe_tiny():
    import pandas as pd

    return pd.DataFrame({"expert_id": np.zeros(1, np.uint32), "kind": ["add"],
                         "first_page_index": np.zeros(1, np.uint32), "pages": np.ones(1, np.uint32),
                         "ts_ns": np.zeros(1, np.uint64)})


def pq_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def run_child(side: str, path: Path, d: Path, batch_rows: int) -> dict:
    out = d / f"child-{side.replace('+', '_')}.json"
    subprocess.run([sys.executable, __file__, "--child", side, "--file", str(path), "--out", str(out),
                    "--batch-rows", str(batch_rows)], check=True)
    doc = json.loads(out.read_text())
    out.unlink()
    return doc


def decoded_size(path: Path) -> int:
    """Bytes of every column decoded into pandas (the recorder's dtypes), in a child."""
    code = ("import sys, pandas as pd; print(int(pd.read_parquet(sys.argv[1]).memory_usage(deep=True, "
            "index=False).sum()))")
    return int(subprocess.run([sys.executable, "-c", code, str(path)], check=True, capture_output=True,
                              text=True).stdout)


def _mib(b: float) -> str:
    return f"{b / 2**20:,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--runs", type=int, default=5, help="rounds (each side once per round, fresh process)")
    ap.add_argument("--batch-rows", type=int, default=1 << 20)
    ap.add_argument("--no-info", action="store_true", help="time only stream and baseline")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--child", choices=SIDES + INFO_SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a.file, a.out, a.batch_rows)
        return 0
    say = (lambda *x, **k: None) if a.json else print
    d = Path(tempfile.mkdtemp(prefix="moetrace-bench-attribution-"))
    try:
        path = d / "page_events.parquet"
        t0 = time.perf_counter()
        generate(path, a.events)
        file_bytes = path.stat().st_size
        say(f"{a.events:,} synthetic page events ({N_LAYERS} x {N_EXPERTS} experts, Zipf, 1 % unattributed) -> "
            f"{_mib(file_bytes)} Parquet in {time.perf_counter() - t0:.1f} s", flush=True)
        decoded = decoded_size(path)
        load0 = os.getloadavg()[0]
        sides = SIDES + (() if a.no_info else INFO_SIDES)
        runs: dict[str, list[dict]] = {s: [] for s in sides}
        for r in range(a.runs):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                doc = run_child(side, path, d, a.batch_rows)
                runs[side].append(doc)
                say(f"  round {r} {side:<14} {doc['seconds']:.3f} s  {doc['events'] / doc['seconds'] / 1e6:6.2f} M "
                    f"events/s (CPU {doc['cpu_seconds']:.3f} s)  peak RSS {_mib(doc['peak_rss_kib'] * 1024)} "
                    f"(before the call {_mib(doc['rss_before_kib'] * 1024)})", flush=True)
        s0, b0 = runs["stream"][0], runs["baseline"][0]
        agree = s0["added"] == b0["added"] and s0["evicted"] == b0["evicted"]
        summary: dict[str, dict] = {}
        for side, docs in runs.items():
            eps = [doc["events"] / doc["seconds"] for doc in docs]
            cpu = [doc["events"] / doc["cpu_seconds"] for doc in docs]
            summary[side] = {
                "seconds": [doc["seconds"] for doc in docs],
                "cpu_seconds": [doc["cpu_seconds"] for doc in docs],
                "events_per_s": {"min": min(eps), "median": statistics.median(eps), "max": max(eps)},
                "events_per_cpu_s_median": statistics.median(cpu),
                "peak_rss_bytes": max(doc["peak_rss_kib"] for doc in docs) * 1024,
                "rss_before_call_bytes": statistics.median(doc["rss_before_kib"] for doc in docs) * 1024,
                "peak_rss_over_before_call_bytes": statistics.median(
                    doc["peak_rss_kib"] - doc["rss_before_kib"] for doc in docs) * 1024,
            }
        ratio = summary["stream"]["events_per_s"]["median"] / summary["baseline"]["events_per_s"]["median"]
        ok = summary["stream"]["events_per_s"]["median"] >= TARGET_EVENTS_PER_S
        res = {"load_average_1min_start_end": [load0, os.getloadavg()[0]], "cpus": os.cpu_count(),
               "events": a.events, "runs": a.runs, "batch_rows": a.batch_rows, "file_bytes": file_bytes,
               "decoded_bytes_all_columns": decoded, "decoded_bytes_baseline_columns": b0["decoded_bytes"],
               "sides": summary, "ratio_stream_over_baseline": ratio, "results_agree": agree,
               "target_events_per_s": TARGET_EVENTS_PER_S, "target_met": ok}
        if "rereads" in runs:
            res["reread_pages"] = runs["rereads"][0]["reread_pages"]
        if a.json:
            print(json.dumps(res, indent=2))
        else:
            print()
            print(f"Parquet file {_mib(file_bytes)}; decoded in memory {_mib(decoded)} (all columns), "
                  f"{_mib(b0['decoded_bytes'])} (the baseline's expert_id, kind, pages)")
            for side, s in summary.items():
                e = s["events_per_s"]
                label = {"baseline": "baseline (pandas read_parquet + groupby, all in memory)",
                         "stream": "stream (attribute_page_events)"}.get(side, f"{side} (info)")
                print(f"{label:<58} M events/s min {e['min'] / 1e6:6.2f}  median {e['median'] / 1e6:6.2f}  "
                      f"max {e['max'] / 1e6:6.2f} (per CPU s {s['events_per_cpu_s_median'] / 1e6:6.2f})")
                print(f"{'':<58} peak RSS {_mib(s['peak_rss_bytes'])} = interpreter + imports "
                      f"{_mib(s['rss_before_call_bytes'])} + the call {_mib(s['peak_rss_over_before_call_bytes'])}")
            print(f"machine load average (1 min) at the start / end: {res['load_average_1min_start_end'][0]:.2f} / "
                  f"{res['load_average_1min_start_end'][1]:.2f} on {os.cpu_count()} CPUs")
            print(f"ratio stream / baseline (medians): {ratio:.2f}x; results agree: {agree}; target >= "
                  f"{TARGET_EVENTS_PER_S / 1e6:.0f} M events/s: {'ok' if ok else 'BELOW TARGET'}")
        return 0 if (ok and agree) else 1
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
