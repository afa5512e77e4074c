"""Live, issue 35 acceptance 2: `moetrace record --pool MODEL` on an unmodified llama.cpp decoding
the tiny MoE, one token at a time, cold (the model dropped from the page cache before every pass
by process_madvise(MADV_PAGEOUT) from outside) and with readahead off on the fault path
(MADV_RANDOM on the engine's mapping: one page per fault).

Oracles: the engine's own routing (the routing logger's trace) — every token, every (layer,
expert): the pagecache probe's added pages are the expert's 192 pages when the router chose it,
none when it did not; the block probe's device bytes per expert equal its added pages; and the
test's own /proc/diskstats of the model's device and the recording's /proc/vmstat pgpgin
bound the whole."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

from common.engines import engine, routed_against_added  # noqa: F401  (engine: the fixture)
from conftest import io_lock
from moetrace.inputs.modelmap import expert_table, map_model, page_owners
from moetrace.inputs.modelsynth import ModelSpec, synth_model
from moetrace.kernel.procfs import device_of, read_diskstats

TOKENS = 64
MOETRACE = str(Path(sys.executable).parent / "moetrace")


def _record(tmp_path: Path, model: Path, tokens: int) -> tuple[Path, list[dict], int]:
    import subprocess

    run, trace = tmp_path / "run", tmp_path / "route.jsonl"
    dev = device_of(model).name
    with io_lock():
        before = read_diskstats(device=dev)["sectors_read"]
        r = subprocess.run([MOETRACE, "record", "--out", str(run), "--pool", str(model), "--probes", "pagecache,block",
                            "--", MOETRACE, "model", "route", str(model), "-o", str(trace), "-n", str(tokens),
                            "--cold", "--advise", "random"], capture_output=True, text=True, timeout=600)
        after = read_diskstats(device=dev)["sectors_read"]
    assert r.returncode == 0, r.stderr[-3000:]
    return run, [json.loads(x) for x in trace.read_text().splitlines()], (after - before) * 512


def _per_token(run: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    ee = pd.read_parquet(run / "expert_epochs.parquet")
    ep = pd.read_parquet(run / "epochs.parquet")
    return ee.merge(ep[["epoch", "phase", "iteration"]], on="epoch"), ep


@pytest.mark.live
def test_each_token_adds_exactly_the_pages_of_the_experts_it_routed(live, engine, tmp_path):
    model = tmp_path / "tiny.gguf"
    synth_model(model, ModelSpec())
    run, trace, disk_bytes = _record(tmp_path, model, TOKENS)
    routed = [r for r in trace if r.get("phase") != "prefill"]
    E, L, ppe = 64, 8, 192
    assert len(routed) == TOKENS * L
    ee, ep = _per_token(run)
    dec = ep[ep["phase"] == "measured"]
    assert dec["iteration"].tolist() == list(range(TOKENS))  # one epoch per token, none folded
    assert not ep["folded"].any()
    want, bad = routed_against_added(ee, routed, TOKENS, L, E, ppe)
    assert not bad, f"tokens whose added pages differ from their routing (token, experts): {bad[:8]}"
    assert (want.sum(axis=1) == 8 * L * ppe).all()  # top-8 of 64 in each of 8 layers, 768 KiB each
    other = ee[(ee["phase"] == "measured") & (ee["kind"] == "non_expert")].groupby("iteration")["added_pages"].sum()
    assert len(other) == TOKENS and (other > 0).all()  # the non-expert weights each token reads
    assert not (ee["kind"] == "shared").any()  # alignment 4096: no page has two owners
    # the whole recording: per expert, device bytes (block, by the model's extents) = added pages
    xp = pd.read_parquet(run / "experts.parquet")
    e = xp[xp["kind"] == "expert"]
    assert (e["device_read_bytes"] == e["added_pages"] * 4096).all()
    model_pages = int(xp.loc[xp["kind"].isin(["expert", "shared", "non_expert"]), "added_pages"].sum())
    snaps = json.loads((run / "snapshots.json").read_text())
    pgpgin = (snaps["post"]["vmstat"]["pgpgin"] - snaps["pre"]["vmstat"]["pgpgin"]) * 1024
    print(f"\n{TOKENS} tokens: expert pages {int(e['added_pages'].sum())}, model pages {model_pages}, "
          f"diskstats {disk_bytes} B, pgpgin {pgpgin} B")
    assert model_pages * 4096 <= disk_bytes and model_pages * 4096 == pytest.approx(disk_bytes, rel=0.05)
    assert pgpgin == pytest.approx(model_pages * 4096, rel=0.05)


@pytest.mark.live
def test_pages_two_experts_share_count_as_shared_never_as_either(live, engine, tmp_path):
    """Alignment 32: each expert's slice shares its edge pages with its neighbours. A token adds
    an expert's own pages exactly when it routes it; a shared page holding bytes of a routed
    slice is added, as shared; a shared page of no routed slice only if non-expert bytes share it."""
    model = tmp_path / "tiny32.gguf"
    synth_model(model, ModelSpec(alignment=32))
    tokens = 8
    run, trace, _disk = _record(tmp_path, model, tokens)
    m = map_model(model)
    own = {int(r.layer) * 64 + int(r.expert): int(r.pages) for r in expert_table(m).itertuples()}
    owners = page_owners(m)
    owner_sets = [set(o.split(",")) for o in owners["owners"]]
    assert len(owner_sets) == 1350
    ee, _ep = _per_token(run)
    for t in range(tokens):
        rows = [r for r in trace if r.get("phase") != "prefill" and r["step"] == t]
        routed = {r["layer"] * 64 + x for r in rows for x in r["experts"]}
        names = {f"L{s // 64}E{s % 64}" for s in routed}
        x = ee[(ee["iteration"] == t) & (ee["phase"] == "measured")]
        got = {int(r.expert_id): int(r.added_pages) for r in x[x["kind"] == "expert"].itertuples() if r.added_pages}
        assert got == {s: own[s] for s in routed if own[s]}, t
        shared = int(x.loc[x["kind"] == "shared", "added_pages"].sum())
        lo = sum(bool(o & names) for o in owner_sets)
        hi = lo + sum(not (o & names) and "non_expert" in o for o in owner_sets)
        assert lo <= shared <= hi, (t, lo, shared, hi)
