"""llama.cpp inside the kernel lab (live tier: the set-up's QEMU, lab kernels and engine): Debian
6.12 in a TCG guest, the tiny MoE on the guest's virtio-blk ext4 image, `moetrace record --pool
MODEL -- moetrace model route --cold --advise random` as on the host. The guest's QEMU CPU has
neither AVX-512 nor AVX2: the routing logger lets ggml score the CPU backend variants there
(the set-up's zen4 choice does not load in the guest).

Oracles: the engine's own routing, every token and (layer, expert): the pagecache probe's added
pages are the expert's 192 pages when the router chose it, none otherwise, each one a demand
page (6.12 has the filemap fault tracepoint; readahead off: one page per fault); and the guest's
/proc/vmstat pgpgin over the recording equals the model pages added (the image is the guest's
only block device)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

from common.engines import engine, routed_against_added  # noqa: F401  (engine: the fixture)
from common.lab import K612, _lab, _need

TOKENS, E, L, PPE = 4, 64, 8, 192


@pytest.mark.live
def test_the_engine_in_a_612_guest_adds_exactly_the_pages_of_the_experts_it_routed(engine, tmp_path):
    from moetrace.inputs.modelsynth import ModelSpec, synth_model

    _need()
    pool = tmp_path / "models"
    pool.mkdir()
    model = pool / "tiny.gguf"
    synth_model(model, ModelSpec())
    out = tmp_path / "lab"
    m = f"{Path(sys.executable).parent}/moetrace"
    r = _lab(out, "--kernel", "6.12", "--pool", str(pool), "--timeout", "600", "--json", "--",
             m, "record", "--out", "/tmp/lab/run", "--pool", str(model), "--probes", "pagecache", "--",
             m, "model", "route", str(model), "-o", "/tmp/lab/route.jsonl", "-n", str(TOKENS), "--cold",
             "--advise", "random", timeout=700)
    assert r.returncode == 0, r.stderr + ((out / "stderr").read_text() if (out / "stderr").exists() else "")
    assert json.loads(r.stdout)["release"] == K612
    run = out / "run"
    man = json.loads((run / "manifest.json").read_text())
    assert man["complete"] is True and man["exit_status"] == 0 and man["kernel"]["release"] == K612
    trace = [json.loads(x) for x in (out / "route.jsonl").read_text().splitlines()]
    routed = [x for x in trace if x.get("phase") != "prefill"]
    assert len(routed) == TOKENS * L
    ee = pd.read_parquet(run / "expert_epochs.parquet")
    ep = pd.read_parquet(run / "epochs.parquet")
    ee = ee.merge(ep[["epoch", "phase", "iteration"]], on="epoch")
    want, bad = routed_against_added(ee, routed, TOKENS, L, E, PPE)
    assert not bad, f"tokens whose added pages differ from their routing (token, experts): {bad}"
    # every expert page a token added is one a fault asked for (the epochs' causes: expert pages)
    meas = ep[ep["phase"] == "measured"].set_index("iteration")
    assert meas["added_demand_pages"].astype(int).tolist() == want.sum(axis=1).tolist()
    assert (meas["added_readahead_pages"] == 0).all() and (meas["added_other_pages"] == 0).all()
    xp = pd.read_parquet(run / "experts.parquet")
    groups = {g["group"]: g["status"] for g in man["attach_plan"]["pagecache"]["entries"]}
    assert groups["fault"] == "attached"  # 6.11+: the fault's own page told from its read-around
    model_pages = int(xp.loc[xp["kind"].isin(["expert", "shared", "non_expert"]), "added_pages"].sum())
    snaps = json.loads((run / "snapshots.json").read_text())
    pgpgin = snaps["post"]["vmstat"]["pgpgin"] - snaps["pre"]["vmstat"]["pgpgin"]
    lab = json.loads((out / "lab.json").read_text())
    print(f"\n6.12 guest: {TOKENS} tokens, model pages added {model_pages}, pgpgin {pgpgin} KiB, "
          f"host wall {lab['host_wall_s']:.0f} s")
    assert pgpgin == model_pages * 4
