"""The reclaim probe (probes/reclaim.c + toolkit/record/probes/reclaim.py).

Tiers: the C file and its Python side agree (no kernel); it compiles, loads and detaches
(probe_build, needs root); live: a reader in a cgroup v1/v2 memory scope of 64 MiB reads
256 MiB of files three times while the probe is attached — the probe's scanned and
reclaimed totals equal /proc/vmstat's pgscan_{anon,file} / pgsteal_{anon,file} deltas
within 2 %, and memcg limit reclaim is what did it. Measurements run under fcntl.flock on
/tmp/moetrace-io.lock."""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from moetrace.kernel import bpf
from moetrace.record.probes import reclaim as reclaimrec
from moetrace.probes import PROBES_DIR
from moetrace.record.probes import PROBES
from moetrace.record.probes.reclaim import (FIELDS, GROUPS, HAVE_KNOBS, KINDS, STATS, TIMELINE_FIELDS, ReclaimRecorder,
                                 read_vmstat, reclaim_cflags, resolve_attach, vmstat_delta)

SRC = reclaimrec.SOURCE.read_text()
from conftest import io_lock as shared_io_lock  # noqa: E402
MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


# -- tier 1: the two sides agree --------------------------------------------------------------

def _defines(prefix: str) -> list[tuple[str, int]]:
    return [(n, int(i)) for n, i in re.findall(r"^#define %s(\w+) (\d+)" % prefix, SRC, re.M)]


def test_declaration_matches_c_source():
    for prefix, names, count in (("KIND_", KINDS, "N_KINDS"), ("F_", FIELDS, "N_FIELDS"),
                                 ("STAT_", STATS, "N_STATS"), ("T_", TIMELINE_FIELDS, "N_TL")):
        d = _defines(prefix)
        assert [i for _, i in d] == list(range(len(d))), prefix
        assert [n.lower() for n, _ in d] == list(names), prefix
        assert int(re.search(r"#define %s (\d+)" % count, SRC).group(1)) == len(names)
    assert int(re.search(r"#define HIST_SLOTS (\d+)", SRC).group(1)) == reclaimrec.HIST_SLOTS
    spec = PROBES["reclaim"]
    assert {g.name for g in spec.attach} == set(GROUPS)
    for g in spec.attach:
        fn, knob = GROUPS[g.name]
        assert knob is None or not g.required, g.name  # only optional groups are compiled out
        for c in g.candidates:
            assert c.fn_name == fn, (g.name, c.fn_name)
            assert re.search(r"^int %s\(struct tracepoint__%s \*args\)" % (fn, c.target.replace(":", "__")),
                             SRC, re.M), c
    # every function behind a knob sits inside that knob's #if
    for fn, knob in GROUPS.values():
        if knob is not None:
            block = re.search(r"#if %s\n(.*?)#endif" % knob, SRC, re.S).group(1)
            assert f"int {fn}(" in block, fn
    # every knob (declared or set by reclaimrec) has a default: compilable as is
    knobs = {k.name for k in spec.knobs} | {f[2:].split("=")[0] for f in reclaim_cflags()}
    for k in knobs:
        assert f"#ifndef {k}\n#define {k} " in SRC, k
    assert "{" + "{" not in SRC and "%s" not in SRC  # -D only, no templates


def test_cflags_are_checked():
    assert reclaim_cflags({"MOE_HAVE_KSWAPD": 0}, bucket_ns=10**8, t0_ns=5) == [
        "-DMOE_HAVE_DIRECT=1", "-DMOE_HAVE_KSWAPD=0", "-DMOE_HAVE_SHRINK_ACTIVE=1", "-DMOE_HAVE_ISOLATE=1",
        "-DMOE_CTX_WRITE=1", "-DMOE_MAX_TASKS=16384", "-DMOE_BUCKET_NS=100000000", "-DMOE_MAX_BUCKETS=4096", "-DMOE_T0_NS=5"]
    with pytest.raises(ValueError):
        reclaim_cflags({"MOE_HAVE_NOPE": 1})
    with pytest.raises(ValueError):
        reclaim_cflags(bucket_ns=-1)
    with pytest.raises(ValueError):
        ReclaimRecorder(max_buckets=0)


def test_unavailable_optional_groups_are_compiled_out(monkeypatch):
    """kswapd_sleep missing: both kswapd groups go (a wake without sleep only leaves
    windows open); a missing required group is an error naming it."""
    from moetrace.record import spec as probespec

    spec = PROBES["reclaim"]

    def fake_resolve(missing):
        def _r(s, feats=None):
            entries = []
            for g in s.attach:
                if g.name in missing:
                    entries.append(probespec.PlanEntry(g.name, g.required, "unavailable", None, "no format file"))
                else:
                    entries.append(probespec.PlanEntry(g.name, g.required, "attached", g.candidates[0]))
            return probespec.AttachPlan(s.name, entries, s.needs, "mismatched")
        return _r

    monkeypatch.setattr(probespec, "resolve", fake_resolve({"kswapd_sleep", "isolate"}))
    attached, missing, have = resolve_attach()
    assert have == {"MOE_HAVE_DIRECT": 1, "MOE_HAVE_KSWAPD": 0, "MOE_HAVE_SHRINK_ACTIVE": 1, "MOE_HAVE_ISOLATE": 0,
                    "MOE_CTX_WRITE": 1}
    assert "kswapd_wake" not in attached and missing["kswapd_wake"].startswith("compiled out")
    assert missing["kswapd_sleep"] == "no format file"
    assert attached["shrink_inactive"] == spec.group("shrink_inactive").candidates[0].target
    monkeypatch.setattr(probespec, "resolve", fake_resolve({"memcg_end"}))
    with pytest.raises(reclaimrec.ProbeError, match="memcg_end"):
        resolve_attach()


def test_vmstat_reader(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/vmstat").write_text("nr_free_pages 5\npgscan_file 10\npgsteal_file 7\npgscan_anon 1\n")
    a = read_vmstat(tmp_path)
    assert a == {"pgscan_file": 10, "pgsteal_file": 7, "pgscan_anon": 1}
    assert vmstat_delta(a, {"pgscan_file": 15, "pgsteal_file": 9, "pgscan_anon": 1}) == {
        "pgscan_file": 5, "pgsteal_file": 2, "pgscan_anon": 0}


# -- tier 2: probe build ----------------------------------------------------------------------

def _prog_exists(prog_id: int) -> bool:
    """bpf(BPF_PROG_GET_FD_BY_ID): does a program with this id still exist?"""
    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint32 * 4)(prog_id, 0, 0, 0)
    fd = libc.syscall(321, 13, ctypes.byref(attr), ctypes.sizeof(attr))  # x86_64 SYS_bpf
    if fd >= 0:
        os.close(fd)
        return True
    return False


def _prog_ids(rec: ReclaimRecorder) -> list[int]:
    return [bpf.prog_fdinfo(f.fd)["prog_id"] for f in rec.bpf.funcs.values()]


@pytest.mark.probe_build
@pytest.mark.parametrize("bucket_ns", [0, 10**8], ids=["totals", "timeline"])
def test_reclaim_probe_compiles_loads_and_detaches(live, bucket_ns):
    t0 = time.perf_counter()
    rec = ReclaimRecorder(bucket_ns=bucket_ns).open()
    took = time.perf_counter() - t0
    try:
        ids = _prog_ids(rec)
        assert len(ids) == len(rec.attach) and all(_prog_exists(i) for i in ids)
        assert len(rec.bpf[b"totals"]) == len(KINDS) * len(FIELDS)
        assert len(rec.bpf[b"stats"]) == len(STATS)
        snap = rec.snapshot()
        assert list(snap.per_kind["kind"]) == list(KINDS)
    finally:
        res = rec.close()
    print(f"\nreclaim probe (bucket_ns={bucket_ns}): compile+load {rec.compile_s:.2f} s, "
          f"attach {rec.attach_s * 1e3:.1f} ms, open() {took:.2f} s; attached {sorted(rec.attach)}; "
          f"unavailable {rec.unavailable}")
    assert not any(_prog_exists(i) for i in ids), "programs still loaded after close()"
    assert res is not None and rec.close() is res
    assert set(res.summary()["kinds"]) == set(KINDS)


@pytest.mark.probe_build
def test_reclaim_probe_compiles_as_is(live):
    """No -D flags at all: every knob has a default (all events compiled in)."""
    bcc = __import__("bcc")
    b = bcc.BPF(src_file=str(reclaimrec.SOURCE).encode(), cflags=[f"-I{PROBES_DIR}", *reclaimrec.QUIET_CFLAGS])
    try:
        for fn, _knob in GROUPS.values():
            b.load_func(fn.encode(), bcc.BPF.TRACEPOINT)
    finally:
        b.cleanup()


@pytest.mark.probe_build
def test_reclaim_probe_minimal_build(live):
    """Every optional group compiled out: only memcg begin/end and shrink_inactive remain."""
    bcc = __import__("bcc")
    flags = reclaim_cflags({k: 0 for k in HAVE_KNOBS}) + [f"-I{PROBES_DIR}", *reclaimrec.QUIET_CFLAGS]
    b = bcc.BPF(src_file=str(reclaimrec.SOURCE).encode(), cflags=flags)
    try:
        for g, (fn, knob) in GROUPS.items():
            if knob is None:
                b.load_func(fn.encode(), bcc.BPF.TRACEPOINT)
            else:
                with pytest.raises(Exception):
                    b.load_func(fn.encode(), bcc.BPF.TRACEPOINT)
    finally:
        b.cleanup()


@pytest.mark.probe_build
def test_attach_resolved_from_declaration(live):
    attached, missing, have = resolve_attach()
    for g in PROBES["reclaim"].attach:
        if g.required:
            assert attached[g.name] == g.candidates[0].target
    assert set(attached) | set(missing) == set(GROUPS)


@pytest.mark.probe_build
def test_detaches_on_exception(live):
    with pytest.raises(RuntimeError, match="boom"):
        with ReclaimRecorder() as rec:
            ids = _prog_ids(rec)
            raise RuntimeError("boom")
    assert rec.bpf is None and rec.result is not None
    assert not any(_prog_exists(i) for i in ids)


# -- tier 3: live, reclaim under a memory limit -----------------------------------------------

@pytest.fixture
def io_lock():
    with shared_io_lock():
        yield


@pytest.fixture
def file_set():
    """256 MiB in 8 files under /var/tmp/moetrace-test-*, written, synced and dropped from
    the page cache (so the scoped reader's pages are charged to its memcg). Deleted after."""
    d = Path(tempfile.mkdtemp(prefix="moetrace-test-", dir="/var/tmp"))
    paths = []
    try:
        chunk = os.urandom(4 * MiB)
        for i in range(8):
            p = d / f"f{i}.bin"
            with open(p, "wb") as fh:
                for _ in range(32 * MiB // len(chunk)):
                    fh.write(chunk)
                fh.flush()
                os.fsync(fh.fileno())
            paths.append(p)
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        yield paths
    finally:
        for p in d.glob("*"):
            p.unlink()
        d.rmdir()


READER = r"""
import os, sys
passes = int(sys.argv[1])
n = 0
for _ in range(passes):
    for p in sys.argv[2:]:
        fd = os.open(p, os.O_RDONLY)
        try:
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    break
                n += len(b)
        finally:
            os.close(fd)
print(n)
"""


@pytest.mark.live
def test_memcg_reclaim_matches_vmstat(live, io_lock, file_set):
    """64 MiB scope, 256 MiB read 3 times: memcg limit reclaim scans and steals; the probe's
    totals equal /proc/vmstat's pgscan/pgsteal (anon + file) deltas within 2 %."""
    from moetrace.capacity.scope import Scope

    limit, passes = 64 * MiB, 3
    scope = Scope(f"reclaim-test-{os.getpid()}")
    scope.create(limit)
    try:
        rec = ReclaimRecorder(bucket_ns=100_000_000).open()
        try:
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", READER, str(passes), *map(str, file_set)],
                                 preexec_fn=scope.preexec(), capture_output=True, text=True, timeout=300)
            took = time.perf_counter() - t0
        finally:
            res = rec.close()
        stat = scope.memory_stat()
        peak = scope.peak_bytes()
    finally:
        scope.remove(kill=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == passes * 256 * MiB
    assert not scope.exists()

    pk = res.per_kind.set_index("kind")
    chk = res.vmstat_check()
    m = res.kind("memcg")
    print(f"\nreader {passes} x 256 MiB in a {limit >> 20} MiB scope: {took:.1f} s, peak {peak} | "
          f"compile+load {res.compile_s:.2f} s attach {res.attach_s * 1e3:.1f} ms")
    print(pk[["invocations", "completed", "scanned_pages", "reclaimed_pages", "scan_to_steal",
              "duration_ns_sum", "end_reclaimed_pages", "scanned_file_pages", "inactive_calls",
              "active_calls", "active_taken_pages", "isolate_calls", "isolate_taken_pages"]].to_string())
    print(f"vmstat delta: {res.vmstat}")
    print(f"check: {chk}")
    print(f"stats {res.stats} open_windows {res.open_windows} recursion_misses {res.recursion_misses}")
    print(f"memcg durations: {m['histogram']}; memory.stat: { {k: stat.get(k) for k in ('pgpgin', 'pgpgout')} }")

    # the oracle: every reclaimer's shrink_inactive scan/steal is in pgscan/pgsteal_{anon,file}
    scan_v, steal_v = chk["vmstat_pgscan"], chk["vmstat_pgsteal"]
    assert steal_v > 0 and scan_v > 0
    assert abs(res.scanned_pages - scan_v) <= 0.02 * scan_v
    assert abs(res.reclaimed_pages - steal_v) <= 0.02 * steal_v
    # memcg limit reclaim did it: at least the pages read beyond the limit, less slack
    read_pages = passes * 256 * MiB // PAGE
    assert m["reclaimed_pages"] >= 0.9 * (read_pages - limit // PAGE)
    assert m["reclaimed_pages"] >= 0.9 * res.reclaimed_pages
    assert m["invocations"] > 0 and m["completed"] >= m["invocations"] - res.open_windows - res.stats["nested_begins"]
    # within a memcg window, end's nr_reclaimed is the sum of its shrink_inactive steals
    assert abs(m["end_reclaimed_pages"] - m["reclaimed_pages"]) <= 0.02 * m["reclaimed_pages"]
    # memcg reclaim is not counted in the global per-reclaimer counters (cgroup_reclaim(sc))
    if res.vmstat.get("pgscan_direct", 0) == 0:
        assert pk.loc["direct", "scanned_pages"] == 0
    # the histogram: one entry per completed invocation, bounds bracket the duration sum
    h = res.histogram[res.histogram["kind"] == "memcg"]
    assert int(h["invocations"].sum()) == m["completed"]
    lo = int((h["lo_ns"].astype("int64") * h["invocations"]).sum())
    hi = int((h["hi_ns"].astype("int64") * h["invocations"]).sum())
    assert lo <= m["duration_ns_sum"] <= hi
    # the timeline adds up to the totals
    tl = res.timeline
    assert res.stats["timeline_overflow"] == 0
    by = tl.groupby("who")[["nr_scanned_pages", "nr_reclaimed_pages", "invocations"]].sum()
    assert int(by.loc["memcg", "nr_scanned_pages"]) == m["scanned_pages"]
    assert int(by.loc["memcg", "nr_reclaimed_pages"]) == m["reclaimed_pages"]
    assert int(by.loc["memcg", "invocations"]) == m["completed"]
    assert res.stats["task_map_full"] == 0
    s = res.summary()
    assert s["lost_events"] == 0 and s["kinds"]["memcg"]["scan_to_steal"] >= 1.0
