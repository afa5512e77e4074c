"""The mlock probe (probes/mlock.c + moetrace.record.probes.mlock).

No-kernel tier: the locked-range model (an interval set per process, page-rounded like
do_mlock) against a brute-force page set, and against hand-computed call sequences; the
ring record layout. Probe-build tier: mlock.c compiles, loads and detaches with the
recorder's knobs and with every optional group off; its kprobe programs (compiled out on
this kernel) pass the verifier when compiled in. Live tier: a ctypes child's VmLck after
each of its calls is the probe's locked bytes after that call (a forked grandchild
included); `moetrace record --probes mlock -- replay --mode pinned` puts the replay's own
VmLck at loop entry in the manifest and the probe matches it exactly.
"""

from __future__ import annotations

import json
import mmap
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moetrace.record.probes import mlock as ml
from moetrace.record.probes import PROBES

SPEC = PROBES["mlock"]
PAGE = mmap.PAGESIZE
SRC = (Path(__file__).resolve().parents[1] / "probes" / "mlock.c").read_text()
RECORD = [sys.executable, "-c", "from moetrace.cli.record import record; record.main(prog_name='moetrace record')"]
REPLAY = [sys.executable, "-m", "moetrace.cli.replay"]


# ---------------------------------------------------------------------------
# no kernel


def test_call_codes_and_record_layout_match_the_c_file():
    codes = re.findall(r"#define CALL_(\w+) (\d+)", SRC)
    assert [n.lower() for n, _ in codes] == list(ml.CALLS)
    assert [int(i) for _, i in codes] == list(range(len(ml.CALLS)))
    assert ml.EVENT_DTYPE.itemsize == 64
    assert ml.EVENT_DTYPE == SPEC.struct("mlock_event").dtype()
    assert [c.name for c in SPEC.schema][:10] == ["time_ns", "tgid", "tid", "call", "start", "len_bytes",
                                                 "new_len_bytes", "flags", "ret", "latency_ns"]


def test_rangeset_matches_a_page_set():
    rng = random.Random(7)
    rs = ml.RangeSet()
    pages: set[int] = set()
    for _ in range(3000):
        a = rng.randrange(0, 200)
        b = a + rng.randrange(0, 30)
        op = rng.random()
        if op < 0.45:
            d = rs.add(a, b)
            want = len(set(range(a, b)) - pages)
            pages |= set(range(a, b))
            assert d == want
        elif op < 0.9:
            d = rs.remove(a, b)
            want = -len(set(range(a, b)) & pages)
            pages -= set(range(a, b))
            assert d == want
        else:
            assert rs.overlap(a, b) == len(set(range(a, b)) & pages)
        assert rs.total == len(pages)
        rr = rs.ranges()
        assert all(s < e for s, e in rr) and all(rr[i][1] < rr[i + 1][0] for i in range(len(rr) - 1)), rr
    assert rs.clear() == -len(pages) and rs.total == 0


def _calls(rows: list[tuple]) -> pd.DataFrame:
    """(time, tgid, call, start, len, ret[, flags[, new_len]]) -> a calls frame."""
    full = [r + (0,) * (8 - len(r)) for r in rows]
    return pd.DataFrame({
        "time_ns": np.array([r[0] for r in full], np.int64), "tgid": np.array([r[1] for r in full], np.int32),
        "tid": np.array([r[1] for r in full], np.int32), "call": pd.array([r[2] for r in full], dtype="string"),
        "start": np.array([r[3] for r in full], np.uint64), "len_bytes": np.array([r[4] for r in full], np.int64),
        "new_len_bytes": pd.array([r[7] if r[2] == "mremap" else pd.NA for r in full], dtype="Int64"),
        "flags": np.array([r[6] for r in full], np.int64), "ret": np.array([r[5] for r in full], np.int64),
        "latency_ns": np.zeros(len(full), np.int64)})


def test_apply_calls_rounds_like_the_kernel_and_never_counts_twice():
    B = 1 << 30  # a page-aligned base address
    P = PAGE
    seq = [
        (1, 10, "mlock", B + 100, 5000, 0),               # crosses a page boundary: 2 pages
        (2, 10, "mlock", B, 3 * P, 0),                    # overlaps: 3 pages in all
        (3, 10, "mlock2", B + 10 * P, 2 * P, 0, 1),       # MLOCK_ONFAULT counts like mlock: 5
        (4, 10, "munlock", B + P, 1, 0),                  # one byte still unlocks its page: 4
        (5, 10, "munlock", B + 30 * P, 4 * P, 0),         # never locked: 4
        (6, 10, "mlock", B + 20 * P, 4 * P, -12),         # failed (ENOMEM): 4
        (7, 10, "mlock", B + 20 * P, 4 * P, 0),           # 8
        (8, 10, "munmap", B + 21 * P, 2 * P - 5, 0),      # PAGE_ALIGN(len): 2 pages gone: 6
        (9, 10, "mmap", 0, 8 * P - 1, B + 100 * P, ml.MAP_LOCKED),  # +8: 14
        (10, 10, "mremap", B + 100 * P, 8 * P, B + 200 * P, 1, 16 * P),  # locked mapping moves, grows: 22
        (11, 10, "mmap", 0, 2 * P, B + 200 * P, ml.MAP_FIXED),      # replaces 2 locked pages: 20
        (12, 20, "mlock", B, P, 0),                       # another process: 1
        (13, 10, "mlockall", 0, 0, 0, ml.MCL_CURRENT),    # unknowable
        (14, 10, "mlock", B, P, 0),                       # still unknowable
        (15, 10, "munlockall", 0, 0, 0),                  # known again: 0
        (16, 10, "mlock", B + 5 * P, P, 0),               # 1
    ]
    df, tl, summ = ml.apply_calls(_calls(seq))
    want = [2, 3, 5, 4, 4, 4, 8, 6, 14, 22, 20, 1, None, None, 0, 1]
    got = [None if v is pd.NA else int(v) // P for v in df["locked_bytes"]]
    assert got == want
    assert [None if v is pd.NA else int(v) // P for v in df["delta_bytes"]] == \
        [2, 1, 2, -1, 0, 0, 4, -2, 8, 8, -2, 1, None, None, None, 1]
    # the timeline: one row per change, with the total over processes (NA while one is unknowable)
    assert list(tl["time_ns"]) == [1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 13, 15, 16]
    tot = [None if v is pd.NA else int(v) // P for v in tl["total_locked_bytes"]]
    assert tot == [2, 3, 5, 4, 8, 6, 14, 22, 20, 21, None, 1, 2]
    assert ml.locked_bytes_at(tl, 10, 12) == 20 * P and ml.locked_bytes_at(tl, 10, 14) is None
    assert ml.locked_bytes_at(tl, 20, 11) == 0 and ml.locked_bytes_at(tl, 10, 0) == 0
    assert summ["10"]["locked_bytes_end"] == P and summ["10"]["failed_calls"] == 1
    assert summ["10"]["max_locked_bytes"] == 22 * P and summ["20"]["locked_bytes_end"] == P
    assert str(tl["locked_bytes"].dtype) == "Int64" and str(df["locked_bytes"].dtype) == "Int64"


def test_mremap_partly_overlapping_a_locked_range_is_marked_unknowable():
    B, P = 1 << 30, PAGE
    df, _tl, summ = ml.apply_calls(_calls([(1, 5, "mlock", B, 2 * P, 0),
                                           (2, 5, "mremap", B + P, 4 * P, B + 50 * P, 1, 4 * P)]))
    assert df["locked_bytes"].iloc[1] is pd.NA and summ["5"]["inexact_calls"] == 1


def test_exit_and_exec_release_everything_and_the_table_drops_idle_mapping_calls():
    B, P = 1 << 30, PAGE
    df, tl, summ = ml.apply_calls(_calls([
        (1, 5, "mlock", B, 4 * P, 0),
        (2, 5, "munmap", B + 64 * P, P, 0),            # a locked process's unrelated munmap: no change
        (3, 5, "mmap", 0, P, B + 70 * P, ml.MAP_FIXED),  # ld.so-style MAP_FIXED elsewhere: no change
        (4, 5, "exec", 0, 0, 0),                       # a new mm: nothing locked
        (5, 5, "mlock", B, P, 0),
        (6, 5, "exit", 0, 0, 0),
    ]))
    assert [int(v) // P for v in df["locked_bytes"]] == [4, 4, 4, 0, 1, 0]
    assert summ["5"]["exited"] is True and summ["5"]["locked_bytes_at_exit"] == P
    assert summ["5"]["locked_bytes_end"] == 0 and list(tl["time_ns"]) == [1, 4, 5, 6]
    table = ml.table_rows(df)
    assert list(table["call"]) == ["mlock", "exec", "mlock", "exit"] and "changed" not in table.columns


def test_records_round_trip():
    ev = np.zeros(3, ml.EVENT_DTYPE)
    ev["ts_ns"] = [30, 10, 20]
    ev["tgid"] = 7
    ev["call"] = [ml.CALLS.index("munlock"), ml.CALLS.index("mlock"), ml.CALLS.index("mremap")]
    ev["start"] = [1 << 30, 1 << 30, 1 << 31]
    ev["len"] = [PAGE, 2 * PAGE, PAGE]
    ev["len2"] = [0, 0, 3 * PAGE]
    ev["ret"] = [0, 0, -14]
    df = ml.records_to_calls(ev.tobytes())
    assert list(df["call"]) == ["munlock", "mlock", "mremap"]
    assert df["new_len_bytes"].tolist()[:2] == [pd.NA, pd.NA] and df["new_len_bytes"].iloc[2] == 3 * PAGE
    out, tl, _ = ml.apply_calls(df)
    assert list(out["time_ns"]) == [10, 20, 30] and list(out["locked_bytes"]) == [2 * PAGE, 2 * PAGE, PAGE]
    ev["call"][0] = 99
    with pytest.raises(ml.ProbeError, match="unknown call code"):
        ml.records_to_calls(ev.tobytes())


def test_mlock_is_a_default_enrichment_probe_with_units_in_names():
    assert SPEC.default is True and SPEC.enrichment is True  # in the default set; missing only warns
    assert set(SPEC.tables()) == {"mlock", "mlock_timeline"}
    req = {g.name for g in SPEC.attach if g.required}
    assert req == {"mlock_enter", "mlock_exit", "munlock_enter", "munlock_exit"}
    for g in SPEC.attach:
        if g.name.startswith("kp_"):
            assert g.knob and all(c.needs == "exact-headers" for c in g.candidates)


# ---------------------------------------------------------------------------
# probe build


def _features():
    from moetrace.kernel.features import Features

    return Features(mount=True)


@pytest.mark.probe_build
def test_mlock_compiles_loads_and_detaches(live):
    from bcc import BPF

    from moetrace.kernel import bpf
    from moetrace.record.spec import resolve
    from moetrace.kernel.bpf import prog_id_exists, prog_info

    plan = resolve(SPEC, _features())
    assert plan.status != "no", plan.reason
    ids: list[int] = []
    # 1. what the recorder loads: the plan's knobs (kprobes compiled out here)
    knobs = SPEC.knob_values(**plan.knobs)
    p = bpf.load_probe("mlock", knobs)
    try:
        assert sorted(p.tracepoints) == sorted(e.candidate.target for e in plan.attached
                                               if e.candidate.kind == "tracepoint")
        assert len(p.table("stats")) == len(SPEC.stats)
        ids += [prog_info(f.fd)["id"] for f in p.bpf.funcs.values()]
    finally:
        p.close()
    # 2. every optional group off: only mlock / munlock enter and exit
    off = {k.name: 0 for k in SPEC.knobs if k.name.startswith(("MOE_HAVE_", "MOE_TRACK_", "MOE_FOLLOW_"))}
    p = bpf.load_probe("mlock", SPEC.knob_values(**off))
    try:
        assert sorted(p.tracepoints) == ["syscalls:sys_enter_mlock", "syscalls:sys_enter_munlock",
                                         "syscalls:sys_exit_mlock", "syscalls:sys_exit_munlock"]
        ids += [prog_info(f.fd)["id"] for f in p.bpf.funcs.values()]
    finally:
        p.close()
    # 3. the kprobe groups compiled in (the installed headers are the 6.1 lab kernel's own): each
    #    program passes this kernel's verifier; none can be attached here (no kprobes)
    kp = {k.name: 1 for k in SPEC.knobs if k.name.startswith("MOE_KP_")}
    p = bpf.load_probe("mlock", SPEC.knob_values(**kp))
    try:
        fns = [c.fn_name for g in SPEC.attach for c in g.candidates if c.kind == "kprobe"]
        assert len(fns) == 5
        for fn in fns:
            f = p.bpf.load_func(fn.encode(), BPF.KPROBE)
            ids.append(prog_info(f.fd)["id"])
    finally:
        p.close()
    assert ids and not any(prog_id_exists(i) for i in ids), "programs still loaded after close()"


# ---------------------------------------------------------------------------
# live

_CHILD = r"""
import ctypes, ctypes.util, json, mmap, os, sys
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
V, S, I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
sig = {"mlock": [V, S], "munlock": [V, S], "mlock2": [V, S, ctypes.c_uint], "mlockall": [I], "munlockall": [],
       "munmap": [V, S], "mmap": [V, S, I, I, I, ctypes.c_long], "mremap": [V, S, S, I]}
for n, a in sig.items():
    getattr(libc, n).argtypes = a
libc.mmap.restype = V
libc.mremap.restype = V
P = mmap.PAGESIZE
RW, PRIV_ANON, LOCKED = 3, 0x22, 0x2000

def vmlck():
    for line in open("/proc/self/status"):
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024

def do(op, *args, key=None):
    r = getattr(libc, op)(*args)
    err = ctypes.get_errno()
    if op in ("mmap", "mremap"):
        r = r if r not in (None, ctypes.c_void_p(-1).value) else -err
    elif r != 0:
        r = -err
    print(json.dumps({"pid": os.getpid(), "op": op, "key": key, "ret": r, "vmlck": vmlck()}), flush=True)
    return r

sys.stdin.read(1)  # the gate: the recorder follows this pid first
base = libc.mmap(None, 64 * P, RW, PRIV_ANON, -1, 0)
do("mlock", base + 100, 5000, key=[base + 100, 5000])
do("mlock", base, 3 * P, key=[base, 3 * P])
do("mlock2", base + 10 * P, 2 * P, 1, key=[base + 10 * P, 2 * P])
do("munlock", base + P, P, key=[base + P, P])
do("munlock", base + 30 * P, 4 * P, key=[base + 30 * P, 4 * P])
do("mlock", base + 20 * P, 4 * P, key=[base + 20 * P, 4 * P])
do("munmap", base + 21 * P, 2 * P, key=[base + 21 * P, 2 * P])
do("mlock", base + 21 * P, P, key=[base + 21 * P, P])  # the hole just unmapped: ENOMEM, nothing locked
m2 = do("mmap", None, 8 * P, RW, PRIV_ANON | LOCKED, -1, 0, key=[0, 8 * P])
m3 = do("mremap", m2, 8 * P, 16 * P, 1, key=[m2, 8 * P])
do("munmap", m3, 16 * P, key=[m3, 16 * P])
pid = os.fork()
if pid == 0:  # a grandchild: followed through task_newtask, starts with nothing locked
    do("mlock", base + 40 * P, 3 * P, key=[base + 40 * P, 3 * P])
    os._exit(0)
os.waitpid(pid, 0)
do("mlockall", 1, key=[0, 0])
do("munlockall", key=[0, 0])
do("mlock", base, P, key=[base, P])
"""


def test_probe_locked_bytes_equal_vmlck_after_each_call(live):
    from moetrace.kernel.features import Features
    from moetrace.record.probe import RecordContext
    from moetrace.record.spec import resolve

    feats = Features(mount=True)
    rec = ml.MlockRecorder(RecordContext(features=feats, plan=resolve(SPEC, feats)))
    rec.open()
    try:
        child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        rec.follow(child.pid)
        child.stdin.write("g")
        child.stdin.close()
        child.stdin = None  # communicate() below must not flush it again
        deadline = time.monotonic() + 60
        while child.poll() is None and time.monotonic() < deadline:
            rec.poll(50)
        out, err = child.communicate(timeout=30)
        assert child.returncode == 0, err
    finally:
        rec.close()
    assert rec.collected
    logged = [json.loads(x) for x in out.splitlines()]
    assert len(logged) == 15
    calls = rec.calls
    assert rec.stats["ring_lost"] == 0 and rec.stats["pending_full"] == 0
    assert rec.stream.lost_kernel == 0 and rec.stream.lost_user == 0
    pos: dict[int, int] = {}
    for lg in logged:
        rows = calls[calls["tgid"] == lg["pid"]].reset_index(drop=True)
        start, ln = lg["key"]
        i = pos.get(lg["pid"], 0)
        while i < len(rows):
            r = rows.iloc[i]
            if r["call"] == lg["op"]:
                if lg["op"] in ("mlockall", "munlockall"):
                    break
                if lg["op"] == "mmap" and int(r["ret"]) == lg["ret"] and int(r["len_bytes"]) == ln:
                    break
                if lg["op"] != "mmap" and int(r["start"]) == start and int(r["len_bytes"]) == ln:
                    break
            i += 1
        assert i < len(rows), f"no probe row for {lg}"
        pos[lg["pid"]] = i + 1
        assert int(r["ret"]) == lg["ret"], (lg, r.to_dict())
        if lg["op"] == "mlockall":
            assert r["locked_bytes"] is pd.NA  # unknowable from arguments, and said so
            assert lg["vmlck"] > 0
        else:
            assert r["locked_bytes"] is not pd.NA and int(r["locked_bytes"]) == lg["vmlck"], (lg, r.to_dict())
    by_op = [(lg["op"], lg["vmlck"] // PAGE) for lg in logged if lg["op"] != "mlockall"]
    assert by_op[:11] == [("mlock", 2), ("mlock", 3), ("mlock2", 5), ("munlock", 4), ("munlock", 4),
                          ("mlock", 8), ("munmap", 6), ("mlock", 6), ("mmap", 14), ("mremap", 22),
                          ("munmap", 6)], by_op
    gchild = [lg for lg in logged if lg["pid"] != child.pid]
    assert len(gchild) == 1 and gchild[0]["vmlck"] == 3 * PAGE
    # both processes ended: an exit row each (sched_process_exit), their locks released
    s = rec.summary()
    for pid, last in ((child.pid, logged[-1]["vmlck"]), (gchild[0]["pid"], 3 * PAGE)):
        t = s["per_tgid"][str(pid)]
        assert t["exited"] is True and t["locked_bytes_at_exit"] == last and t["locked_bytes_end"] == 0, t
        assert calls[calls["tgid"] == pid]["call"].iloc[-1] == "exit"
    assert logged[-1]["vmlck"] == PAGE and s["per_tgid"][str(child.pid)]["failed_calls"] >= 1
    assert s["total_locked_bytes_end"] == 0
    real = calls[~calls["call"].isin(["exit", "exec"])]
    assert (real["latency_ns"] > 0).all()


@pytest.fixture(scope="module")
def pinned_pool():
    d = Path(tempfile.mkdtemp(prefix="moetrace-test-mlock-", dir="/var/tmp"))
    try:
        def mt(*a):
            r = subprocess.run([sys.executable, "-c", "from moetrace.cli import main; main()", *a],
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stderr

        n = 12
        mt("pool", "create", str(d / "pool"), "--layers", "1", "--experts", str(n), "--k", "4",
           "--expert-bytes", "1MiB", "--layout", "files")
        from moetrace.inputs.trace import write_jsonl

        write_jsonl([(i, 0, [(i + j) % n for j in range(4)]) for i in range(6)], d / "t.jsonl")
        mt("plan", "compile", str(d / "t.jsonl"), "--layers", "1", "--experts", str(n), "--k", "4",
           "--expert-bytes", "1MiB", "-o", str(d / "plan.bin"))
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_record_pinned_replay_locked_bytes_at_loop_entry_equal_vmlck(live, pinned_pool, tmp_path):
    from moetrace.run import directory as rundir

    d = pinned_pool
    arena = 5 * (1 << 20) + 12345  # whole experts are locked: 5 MiB
    cmd = [*REPLAY, str(d / "plan.bin"), "--pool", str(d / "pool"), "--mode", "pinned", "--arena-bytes",
           str(arena), "--warmup", "0", "--passes", "2", "--threads", "2"]
    r = subprocess.run([*RECORD, "--probes", "mlock", "--out", str(tmp_path / "run"), "--", *cmd],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc, tables = rundir.load_run(tmp_path / "run")
    assert doc["complete"] is True
    assert doc["attach_plan"]["mlock"]["recorded"] is True
    rs = json.loads((tmp_path / "run" / "replay" / "replay.json").read_text())
    assert rs["arena_bytes"] == 5 << 20 and rs["vmlck_bytes"] == 5 << 20
    chk = doc["summaries"]["mlock"]["replay_check"]
    assert chk["match"] is True, chk
    assert chk["probe_locked_bytes_at_loop_entry"] == rs["vmlck_bytes"] == 5 << 20
    calls = tables["mlock"]
    mine = calls[calls["tgid"] == rs["pid"]]
    locks = mine[mine["call"] == "mlock"]
    assert len(locks) == 1 and int(locks["len_bytes"].iloc[0]) == 5 << 20 and int(locks["ret"].iloc[0]) == 0
    assert int(locks["time_ns"].iloc[0]) < rs["loop_entry_ns"]
    assert (mine["call"] == "munlock").sum() == 1  # Replayer.close() unlocks the arena
    tl = tables["mlock_timeline"]
    assert ml.locked_bytes_at(tl, rs["pid"], rs["loop_entry_ns"]) == 5 << 20
    assert ml.locked_bytes_at(tl, rs["pid"], rs["measured_end_ns"]) == 5 << 20
    assert int(tl[tl["tgid"] == rs["pid"]]["locked_bytes"].iloc[-1]) == 0
    assert doc["lost"]["mlock"]["ring_lost_calls"] == 0 and doc["lost"]["mlock"]["user_lost_calls"] == 0
    assert doc["stats"]["mlock"]["unmatched_exits"] == 0 and doc["stats"]["mlock"]["pending_full"] == 0
    # munmap / mmap calls that touched no locked range are counted, not listed
    assert set(mine["call"]) <= {"mlock", "munlock", "exit"}, set(mine["call"])
    assert doc["summaries"]["mlock"]["calls"] > len(calls)
    assert set(doc["tables"]) >= {"mlock", "mlock_timeline"}
    assert doc["summaries"]["mlock"]["max_total_locked_bytes"] == 5 << 20
    for c in SPEC.schema:
        assert c.name in calls.columns
    assert list(calls.columns) == [c.name for c in SPEC.schema]
