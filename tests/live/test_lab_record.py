"""`moetrace record` inside the kernel lab: a real MGLRU kernel (Debian 6.12, MGLRU on), the pool
on a virtio-blk ext4 image, the replay in a cgroup v2 memcg smaller than the pool (live tier:
needs the set-up's QEMU and kernels; skips without them, fails under MOETRACE_LIVE=1).

Oracles, all from the guest: its /proc/vmstat deltas over the recording (snapshots.json, taken
inside the probes' armed interval) — pgpgin (the pool image is the guest's only block device, so
every KiB read in is a pool KiB), pgsteal_file, workingset_refault_file — and its own lru_gen
file (max_seq must grow when an mmap replay re-touches pages under a limit)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from common.lab import K61, K612, LAB_EXPERTS as EXPERTS, LAB_STEPS as STEPS, _lab, _need, lab_pool  # noqa: F401
from common.lab import make_lab_pool
from moetrace.reports.matrix import added_pages_oracle
from moetrace.record.recorder import DEFAULT_RECORD


def test_full_default_set_records_on_612_with_mglru_under_a_v2_memcg(lab_pool, tmp_path):
    """Every default probe, in the guest, under memory pressure: no crash, every table written
    (under QEMU's -cpu max, numpy's AVX2 sort crashed the recorder while it wrote them)."""
    out = tmp_path / "lab"
    bindir = str(Path(sys.executable).parent)
    r = _lab(out, "--kernel", "6.12", "--mglru", "on", "--pool", str(lab_pool / "pool"), "--memcg", "80M",
             "--timeout", "600", "--json", "--",
             f"{bindir}/moetrace", "record", "--out", "/tmp/lab/run", "--cgroup", "/sys/fs/cgroup/lab",
             "--",
             "replay", str(lab_pool / "plan.bin"), "--pool", str(lab_pool / "pool"), "--mode", "mmap",
             "--warmup", "1", "--passes", "2", timeout=700)
    assert r.returncode == 0, r.stderr + (out / "stderr").read_text() if (out / "stderr").exists() else r.stderr
    lab = json.loads(r.stdout)
    assert lab["release"] == K612 and lab["mglru"] == "0x0007" and lab["status"] == "ok"
    assert lab["cmd_start_uptime_s"] < 20  # boot to COMMAND (measured 4.4 s)
    assert lab["memcg"] == {"path": "/sys/fs/cgroup/lab", "memory.max": "80M"}
    run = out / "run"
    m = json.loads((run / "manifest.json").read_text())
    assert m["complete"] is True and m["exit_status"] == 0 and m["kernel"]["release"] == K612
    assert m["mglru"]["on"] is True and m["cgroup"] == "/sys/fs/cgroup/lab"
    assert {p: a["recorded"] for p, a in m["attach_plan"].items()} == {p: True for p in DEFAULT_RECORD}
    assert "failed_probes" not in m and m["knobs"]["mlock"]["MOE_PG_HEAD"] == -1  # the kernel's own (CO-RE enum)
    # compiled once on the host, loaded here: no compiler, no headers; function hooks as BPF trampolines
    assert {a["loader"]["backend"] for a in m["attach_plan"].values() if a["recorded"]} == {"core"}
    assert set(m["summaries"]["mlock"]["function_hooks"].values()) == {
        "fentry mlock_folio", "fentry mlock_new_folio", "fentry munlock_folio"}
    for table in ("experts", "epochs", "lru", "reclaim", "mlock", "block_latency", "reads", "stacks", "lru_gen",
                  "mglru_aging"):
        assert (run / f"{table}.parquet").is_file(), table
    assert (run / "stacks.folded").stat().st_size > 0
    # the pool came from the virtio-blk image: an ext4 device of the guest, not 9p
    assert m["pool"]["root"] == str((lab_pool / "pool").resolve())
    snaps = json.loads((run / "snapshots.json").read_text())
    d = {k: snaps["post"]["vmstat"].get(k, 0) - snaps["pre"]["vmstat"].get(k, 0)
         for k in ("pgpgin", "pgsteal_file", "workingset_refault_file")}
    t = m["totals"]
    # every page read from the pool image is an expert page added: pgpgin counts KiB; the block
    # probe maps every bio to an expert through the image's extents
    assert t["experts_added_pages"] * 4 == d["pgpgin"], (t, d)
    assert t["experts_device_read_bytes"] == t["experts_added_pages"] * 4096 and \
        t["unattributed_device_read_bytes"] == 0
    assert t["experts_added_pages"] >= EXPERTS * 256 * STEPS * 3 * 0.5  # the limit forces re-reads
    # the kernel's own evictions: the reclaim probe and the workingset_eviction kprobe = pgsteal_file
    mg, rc = m["summaries"]["mglru"], m["summaries"]["reclaim"]
    assert rc["reclaimed_pages"] == d["pgsteal_file"] == mg["kprobe_counts"]["workingset_eviction"]
    # pool evictions are a part of them; refaults of other pages (the replay's Python over 9p, in
    # the same memcg) can only come from the other evictions
    assert t["experts_evicted_pages"] <= d["pgsteal_file"]
    assert 0 <= d["workingset_refault_file"] - t["experts_re_added_pages"] \
        <= d["pgsteal_file"] - t["experts_evicted_pages"], (t, d)
    # every call of workingset_refault is a refault, but MGLRU's lru_gen_refault counts it in
    # workingset_refault_file only when the shadow entry's lruvec is the new folio's (mm/workingset.c:
    # `if (lruvec != folio_lruvec(folio)) goto unlock;`): a page evicted from one memcg and read back
    # charged to another is a call the counter skips (measured: 29 of 181,381 in one 6.12 run, 0 in
    # others); the type is file (the guest has no swap, so no anon refault)
    assert mg["kprobe_counts"]["workingset_refault"] >= d["workingset_refault_file"], (mg["kprobe_counts"], d)
    # MGLRU aged /lab: generations born (max_seq's delta) with aging events from this kernel's
    # own try_to_inc_max_seq, and lru_gen samples of the memcg
    lab_vec = [v for v in mg["lruvecs"].values() if v["memcg_path"] == "/lab"]
    assert len(lab_vec) == 1 and lab_vec[0]["generations_born"] > 0
    assert lab_vec[0]["generations_born"] >= lab_vec[0]["generations_seen"]
    assert mg["kprobes"]["inc_max_seq"] == "try_to_inc_max_seq" and mg["kprobe_counts"]["inc_max_seq"] > 0
    aging = pd.read_parquet(run / "mglru_aging.parquet")
    assert len(aging) == mg["kprobe_counts"]["inc_max_seq"] and aging["seq"].notna().all()
    g = pd.read_parquet(run / "lru_gen.parquet")
    assert (g["memcg_path"] == "/lab").any() and g["sample"].nunique() == mg["samples"]
    # one eviction record per evicted pool folio (workingset_eviction, fields read at BTF offsets):
    # per expert exactly the pages the pagecache probe saw deleted (ext4 here caches order-0 folios,
    # and every pool eviction was the memcg's reclaim), each from /lab at a generation it had
    assert mg["eviction_records"]["recorded"] is True
    evs = pd.read_parquet(run / "mglru_evictions.parquet")
    assert len(evs) == mg["kprobe_counts"]["evict_pool"] == mg["eviction_records"]["records"]
    assert m["lost"]["mglru"]["ring_lost_eviction_records"] == 0
    experts = pd.read_parquet(run / "experts.parquet")
    experts = experts[experts["kind"] == "expert"]
    per = evs.groupby("expert_id").size().reindex(experts["expert_id"], fill_value=0)
    assert per.tolist() == experts["evicted_pages"].tolist()
    lab_id = int(g.loc[g["memcg_path"] == "/lab", "memcg_id"].iloc[0])
    assert (evs["memcg_id"] == lab_id).all() and evs["seq"].notna().all()
    assert evs["seq"].min() >= lab_vec[0]["max_seq_first"] - 3 and evs["seq"].max() <= lab_vec[0]["max_seq_last"]
    # the age report renders the MGLRU side from this kernel's tables
    rep = subprocess.run([sys.executable, "-m", "moetrace.cli", "report", str(run), "--only", "age", "--out",
                          str(tmp_path / "rep"), "--json"], capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    cad = {c["memcg_path"]: c for c in json.loads(rep.stdout)["summary"]["mglru"]["cadence"]}
    assert cad["/lab"]["seq_increments"] == lab_vec[0]["generations_born"]
    assert cad["/lab"]["aging_events_all_memcgs"] == mg["kprobe_counts"]["inc_max_seq"]
    assert "MGLRU on this kernel: on (enabled 0x0007)" in (tmp_path / "rep" / "REPORT.md").read_text()
    ages = json.loads(rep.stdout)["summary"]["mglru"]["evictions"]
    assert ages["folios"] == len(evs) and ages["birth_known"] > 0 and ages["age_ms_median"] >= 0
    print(f"\n6.12 lab record: command at {lab['cmd_start_uptime_s']} s guest uptime; probes attached in "
          f"{m['timings']['probes_attach_s']:.1f} s; host wall {lab['host_wall_s']:.1f} s; added "
          f"{t['experts_added_pages']} = pgpgin/4; reclaimed {rc['reclaimed_pages']}; generations born "
          f"{lab_vec[0]['generations_born']} (seen {lab_vec[0]['generations_seen']})")


def test_the_newest_debian_kernel_records_the_default_set_with_the_objects_built_here(lab_pool, tmp_path):
    """Compile once, shown: the newest Debian kernel (unpacked by the set-up, never installed; no
    headers for it anywhere) boots and records every default probe from the very objects built on
    this host, nothing compiled in the guest, every function hook an fentry program, the MGLRU
    generation field found where the kernel's config says (no folio of slot 0)."""
    from common.lab import newest_release

    rel = newest_release()
    out = tmp_path / "lab"
    bindir = str(Path(sys.executable).parent)
    r = _lab(out, "--kernel", "newest", "--mglru", "on", "--pool", str(lab_pool / "pool"), "--memcg", "80M",
             "--timeout", "600", "--json", "--",
             f"{bindir}/moetrace", "record", "--out", "/tmp/lab/run", "--cgroup", "/sys/fs/cgroup/lab", "--",
             "replay", str(lab_pool / "plan.bin"), "--pool", str(lab_pool / "pool"), "--mode", "mmap",
             "--warmup", "1", "--passes", "2", timeout=700)
    assert r.returncode == 0, r.stderr + ((out / "stderr").read_text() if (out / "stderr").exists() else "")
    lab = json.loads(r.stdout)
    assert lab["release"] == rel and lab["status"] == "ok" and lab["mglru"] == "0x0007"
    run = out / "run"
    m = json.loads((run / "manifest.json").read_text())
    assert m["complete"] is True and m["kernel"]["release"] == rel
    assert {p: a["recorded"] for p, a in m["attach_plan"].items()} == {p: True for p in DEFAULT_RECORD}
    for p, a in m["attach_plan"].items():  # the objects built on this host, loaded as they are
        assert a["loader"]["backend"] == "core" and a["loader"]["object"].endswith(f"/probes/build/{p}.bpf.o"), a
    assert not Path(f"/lib/modules/{rel}/build").exists()  # no headers for it, here or in the guest
    hooks = m["summaries"]["mlock"]["function_hooks"]
    assert hooks and all(v.startswith("fentry ") for v in hooks.values())
    mg = m["summaries"]["mglru"]
    assert m["attach_plan"]["mglru"]["status"] in ("yes", "degraded")
    snaps = json.loads((run / "snapshots.json").read_text())
    d = {k: snaps["post"]["vmstat"].get(k, 0) - snaps["pre"]["vmstat"].get(k, 0) for k in ("pgpgin", "pgsteal_file")}
    t = m["totals"]
    # What is exact on 6.1 and 6.12 (pages added x 4 KiB = pgpgin = the block probe's bytes) is exact
    # on 7.2 too, up to the program runs the kernel skipped and counted (recursion_misses, in the
    # manifest's `lost`: 7.2 skipped 136 runs of mm_filemap_add_to_page_cache in one run, and the
    # added pages were exactly 136 short of the device bytes; 6.12 skips none). A skipped add is at
    # most one folio (order 9: 2 MiB), a skipped bio_queue at most one bio (bounded by 4 MiB here).
    o = added_pages_oracle(run)  # the bounds once, with the matrix report's column
    assert o["added_pages_within_skipped_runs"], o
    add_miss, bio_miss, dev = o["skipped_add_runs"], o["skipped_bio_runs"], o["recording_device_bytes"]
    assert t["experts_added_pages"] > 0 and t["experts_device_read_bytes"] > 0 and d["pgpgin"] > 0, (t, d)
    assert 0 < m["summaries"]["reclaim"]["reclaimed_pages"] <= d["pgsteal_file"]
    assert mg["kprobe_counts"]["inc_max_seq"] > 0 and mg["eviction_records"]["recorded"] is True
    inc = pd.read_parquet(run / "mglru_inc_gen.parquet")  # the generation field found where the config says
    assert inc["folios"].sum() > 0 and int(inc.loc[inc["from_gen"].isna(), "folios"].sum()) == 0
    # each eviction record names the folio's memcg (7.x: through the obj_cgroup its memcg_data now
    # points to) and the generation eviction took it from, as on 6.12
    g = pd.read_parquet(run / "lru_gen.parquet")
    lab_id = int(g.loc[g["memcg_path"] == "/lab", "memcg_id"].iloc[0])
    evs = pd.read_parquet(run / "mglru_evictions.parquet")
    assert len(evs) > 0 and (evs["memcg_id"] == lab_id).all() and evs["seq"].notna().all(), (
        lab_id, evs["memcg_id"].value_counts().head(), evs["seq"].isna().sum())
    print(f"\n{rel} lab record: command at {lab['cmd_start_uptime_s']} s guest uptime, replay started "
          f"{m['timings']['command_start_ns'] / 1e9:.1f} s after boot; probes attached in "
          f"{m['timings']['probes_attach_s']:.1f} s; added {t['experts_added_pages']} pages, pgpgin {d['pgpgin']} KiB, "
          f"device {dev} B; skipped by the kernel: {add_miss} page adds, {bio_miss} bios")


@pytest.fixture(scope="module")
def pool_160(tmp_path_factory):
    _need()
    return make_lab_pool(tmp_path_factory.mktemp("labpool160"), experts=160, steps=2)


@pytest.mark.parametrize("mglru", ["off", "on"])
def test_61_classic_lru_and_mglru_from_the_same_replay(pool_160, tmp_path, mglru):
    """Debian 6.1 (MGLRU built, off by default, the old signatures), the full default probe set:
    MGLRU off, the lru probe's
    classic insertions / activations / dwell; on, the mglru probe's generations from 6.1's own
    symbols. The age report renders whichever the kernel has. A 128 MiB memcg over a 160 MiB pool:
    at 80 MiB over 64 MiB (what 6.12 records in ~25 s) 6.1 OOM-killed the replay with MGLRU off
    and had not finished after 600 s with it on (measured)."""
    lab_pool = pool_160
    out = tmp_path / "lab"
    bindir = str(Path(sys.executable).parent)
    r = _lab(out, "--kernel", "6.1", "--mglru", mglru, "--pool", str(lab_pool / "pool"), "--memcg", "128M",
             "--timeout", "900", "--json", "--",
             f"{bindir}/moetrace", "record", "--out", "/tmp/lab/run", "--cgroup", "/sys/fs/cgroup/lab",
             "--missing-probes", "warn", "--",
             "replay", str(lab_pool / "plan.bin"), "--pool", str(lab_pool / "pool"), "--mode", "mmap",
             "--warmup", "1", "--passes", "2", timeout=1000)
    assert r.returncode == 0, r.stderr + ((out / "stderr").read_text() if (out / "stderr").exists() else "")
    lab = json.loads(r.stdout)
    assert lab["release"] == K61 and lab["mglru"] == ("0x0007" if mglru == "on" else "0x0000")
    run = out / "run"
    m = json.loads((run / "manifest.json").read_text())
    assert m["complete"] is True and m["kernel"]["release"] == K61 and m["mglru"]["on"] is (mglru == "on")
    # the full default set under pressure on 6.1 too: every probe recorded, every table written
    recorded = {p: a["recorded"] for p, a in m["attach_plan"].items()}
    if mglru == "off":  # the mglru probe may skip itself (no lru_gen to sample): it says why below
        recorded["mglru"] = True
    assert recorded == {p: True for p in DEFAULT_RECORD}
    assert "failed_probes" not in m
    for table in ("experts", "epochs", "lru", "reclaim", "mlock", "block_latency", "reads", "stacks") + \
            (("lru_gen", "mglru_aging", "mglru_evictions") if mglru == "on" else ()):
        assert (run / f"{table}.parquet").is_file(), table
    # PG_head is the kernel's own (CO-RE: bpf_core_enum_value; 16 on 6.1, 6 on 6.12): no knob set
    assert m["knobs"]["mlock"]["MOE_PG_HEAD"] == -1
    assert m["attach_plan"]["mlock"]["loader"]["backend"] == "core"
    snaps = json.loads((run / "snapshots.json").read_text())
    pgpgin = snaps["post"]["vmstat"]["pgpgin"] - snaps["pre"]["vmstat"]["pgpgin"]
    assert m["totals"]["experts_added_pages"] * 4 == pgpgin
    lru = pd.read_parquet(run / "lru.parquet")
    e = lru[lru["kind"] == "expert"] if "kind" in lru else lru
    if mglru == "off":
        # classic LRU: every pool page inserted, evicted with its dwell (a cyclic 160 MiB stream
        # through 128 MiB: pages leave before their next touch, so activations may be none)
        # (first insertions: every added page exactly once; putbacks count in reinserted_pages)
        assert int(e["inserted_pages"].sum()) == int(e["added_pages"].sum()) == m["totals"]["experts_added_pages"]
        assert int(e["dwell_count"].sum()) > 0 and int(e["evicted_pages"].sum()) > 0
    mg = m["summaries"].get("mglru")
    if mglru == "off" and mg is None:  # the mglru probe skipped itself, saying why
        assert m["attach_plan"]["mglru"]["skip_reason"]
        mg = {"lruvecs": {}, "samples": 0}
    g = pd.read_parquet(run / "lru_gen.parquet") if (run / "lru_gen.parquet").exists() else pd.DataFrame(
        {"memcg_path": pd.Series([], dtype="string")})
    vec = [v for v in mg["lruvecs"].values() if v["memcg_path"] == "/lab"]
    if mglru == "on":
        assert len(vec) == 1 and vec[0]["generations_born"] > 0 and (g["memcg_path"] == "/lab").any()
        assert mg["kprobes"]["inc_max_seq"] == "try_to_inc_max_seq" and mg["kprobe_counts"]["inc_max_seq"] > 0
        rc = m["summaries"]["reclaim"]
        steal = snaps["post"]["vmstat"]["pgsteal_file"] - snaps["pre"]["vmstat"]["pgsteal_file"]
        assert mg["kprobe_counts"]["workingset_eviction"] == steal
        # 6.1 with MGLRU on reclaims without mm_vmscan_lru_shrink_inactive (measured in the lab): the
        # reclaim probe says so and keeps the windows' own nr_reclaimed
        assert rc["shrink_inactive_fired"] is False and rc["reclaimed_pages"] == 0
        assert rc["end_reclaimed_pages"] >= steal and rc["shrink_inactive_note"]
    else:
        assert g.empty or not (g["memcg_path"] == "/lab").any() or vec[0]["generations_born"] == 0
    rep = subprocess.run([sys.executable, "-m", "moetrace.cli", "report", str(run), "--only", "age", "--out",
                          str(tmp_path / "rep"), "--json"], capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    summ = json.loads(rep.stdout)["summary"]
    md = (tmp_path / "rep" / "REPORT.md").read_text()
    if mglru == "on":
        assert "MGLRU generations" in md and summ["mglru"]["samples"] == mg["samples"]
    else:
        assert "Classic LRU: dwell before eviction" in md and summ["dwell_quantiles"]
    print(f"\n6.1 MGLRU {mglru}: probes attached in {m['timings']['probes_attach_s']:.1f} s, host wall "
          f"{lab['host_wall_s']:.1f} s")
