"""The stacks probe (probes/stacks.c + toolkit/record/probes/stacks.py + toolkit/kernel/symbolize.py).

Tiers:
- no kernel: maps parsing and lookup over a fake /proc, kallsyms lookup (and the zeros
  fallback), ELF symbols of this very process checked against dlsym, the folded format,
  knob parsing, kswapd discovery, and the leak checker on planted files (each plant found
  with its file and offset; clean look-alikes not flagged).
- probe build: compiles, loads, opens the cpu-clock perf events, puts the kswapd threads in
  the task map, and detaches (program ids and perf-event fds gone), with the knob sets the
  recorder uses.
- live: ``moetrace record --probes stacks`` over a replay of a cold 64 MiB pool (plus hot
  passes). Oracle: the followed tree's CPU time from getrusage (a shim that runs the replay
  as its child and reports RUSAGE_SELF + RUSAGE_CHILDREN). Samples must equal
  cpu_s x sample_hz within 3 binomial sigmas + 2, sigma = sqrt(n p (1 - p)) for n =
  wall x hz x CPUs ticks of which a fraction p lands on the command (measured here: ratios
  0.95-1.005 at 99 Hz, 0.986-0.988 at 999 Hz). Kernel frames must show the page-cache read
  path of 6.18 (filemap_read, filemap_get_pages, copy_page_to_iter / _copy_to_iter; at 999 Hz
  on a cold pass also readahead: page_cache_ra_order / page_cache_ra_unbounded /
  filemap_add_folio), user frames the interpreter (python3.x / libpython), and
  find_kernel_addresses(run_dir) must be [].
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from moetrace.run import directory as rundir
from moetrace.record.probes import stacks as stacksrec
from moetrace.kernel import symbolize
from moetrace.record.probes import PROBES
from moetrace.kernel.symbolize import Kallsyms, Mapping, ProcMaps, Symbolizer, find_kernel_addresses, parse_maps

from conftest import io_lock  # noqa: E402

SPEC = PROBES["stacks"]
MIB = 1 << 20
RECORD = [sys.executable, "-c", "from moetrace.cli import main; main()", "record"]
REPLAY = [sys.executable, "-m", "moetrace.cli.replay"]


# ---------------------------------------------------------------------------
# no kernel

MAPS = """\
00400000-00420000 r--p 00000000 fe:00 1                                  /usr/bin/prog
00420000-00500000 r-xp 00020000 fe:00 1                                  /usr/bin/prog
7f0000000000-7f0000100000 r-xp 00001000 fe:00 2                          /lib/libx.so
7f0000200000-7f0000201000 rw-p 00000000 00:00 0 
7fff00000000-7fff00002000 r-xp 00000000 00:00 0                          [vdso]
"""


def _fake_proc(tmp_path: Path, pid: int, maps: str) -> Path:
    d = tmp_path / "proc" / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "maps").write_text(maps)
    return tmp_path


def test_parse_maps_keeps_executable_mappings():
    ms = parse_maps(MAPS)
    assert [(m.start, m.end, m.offset, m.path) for m in ms] == [
        (0x420000, 0x500000, 0x20000, "/usr/bin/prog"), (0x7F0000000000, 0x7F0000100000, 0x1000, "/lib/libx.so"),
        (0x7FFF00000000, 0x7FFF00002000, 0, "[vdso]")]
    assert ms[0].module == "prog" and ms[0].is_file and not ms[2].is_file


def test_proc_maps_snapshots_newest_first(tmp_path):
    root = _fake_proc(tmp_path, 7, MAPS)
    pm = ProcMaps(root)
    assert pm.snapshot(7) is True and pm.snapshot(7) is False  # unchanged: kept once
    assert pm.snapshot(8) is None  # no such process
    assert pm.find(7, 0x420010).path == "/usr/bin/prog"
    assert pm.find(7, 0x410000) is None  # a non-executable mapping
    # the library is replaced by another at the same address; a third one is unmapped
    _fake_proc(tmp_path, 7, "7f0000000000-7f0000100000 r-xp 00000000 fe:00 3 /lib/liby.so\n")
    assert pm.snapshot(7) is True
    assert pm.find(7, 0x7F0000000010).path == "/lib/liby.so"  # newest wins
    assert pm.find(7, 0x420010).path == "/usr/bin/prog"  # still found in the older snapshot
    assert len(pm.snaps[7]) == 2 and pm.reads == 3


KALLSYMS = """\
ffffffff81000000 T _stext
ffffffff81100000 T filemap_read
ffffffff81100800 t filemap_get_pages
ffffffff81200000 D some_data
ffffffffc0001000 t ext4_helper	[ext4]
"""


def test_kallsyms_lookup_and_return_address_adjustment(tmp_path):
    p = tmp_path / "kallsyms"
    p.write_text(KALLSYMS)
    ks = Kallsyms(path=p)
    assert ks.available
    assert ks.name(0xFFFFFFFF81100000) == "filemap_read"
    assert ks.name(0xFFFFFFFF811007FF) == "filemap_read"
    assert ks.name(0xFFFFFFFF81100800) == "filemap_get_pages"
    assert ks.name(0xFFFFFFFFC0001234) == "ext4_helper"
    assert ks.name(0x1000) == "[kernel]"
    assert 0xFFFFFFFF81200000 in ks.addresses  # data symbols count for the leak check
    sym = Symbolizer(ProcMaps(tmp_path), ks, tmp_path)
    # leaf first; a return address right after a call at the end of filemap_read is
    # looked up at addr - 1, inside filemap_read, not in the next function
    assert sym.kernel_frames([0xFFFFFFFF81100810, 0xFFFFFFFF81100800]) == ["filemap_read", "filemap_get_pages"]


def test_kallsyms_zeros_drop_frames_as_kernel(tmp_path):
    p = tmp_path / "kallsyms"
    p.write_text("".join(f"0000000000000000 {ln.split(' ', 1)[1]}\n" for ln in KALLSYMS.splitlines()))
    ks = Kallsyms(path=p)
    assert not ks.available and "no addresses" in ks.reason and not ks.addresses
    sym = Symbolizer(ProcMaps(tmp_path), ks, tmp_path)
    assert sym.kernel_frames([0xFFFFFFFF81100810, 0xFFFFFFFF81100800, 0xFFFFFFFF81000010]) == ["[kernel]"]
    assert not Kallsyms(path=tmp_path / "absent").available


def test_user_frames_of_this_process_match_dlsym():
    """The ELF path end to end on the live process: /proc/self/maps + libc's symbol
    tables name the address dlsym gives for a libc function (the independent oracle)."""
    libc = ctypes.CDLL("libc.so.6")
    addr = ctypes.cast(libc.getpid, ctypes.c_void_p).value
    pm = ProcMaps()
    assert pm.snapshot(os.getpid()) is True
    sym = Symbolizer(pm, Kallsyms(path="/nonexistent"))
    name = sym.user_frame(os.getpid(), addr)
    module, _, fn = name.partition("`")
    assert module.startswith("libc.so") and fn in ("getpid", "__getpid"), name
    # an address in no mapping ends the walk with one [unknown] frame (root side)
    assert sym.user_frames(os.getpid(), [addr, 0x10, addr]) == ["[unknown]", name]
    # a mapped file without a covering symbol: module+file offset, never a raw address
    pm2 = ProcMaps()
    pm2.add(1, [Mapping(0x1000, 0x3000, 0x10, "/nonexistent/libz.so")])
    assert Symbolizer(pm2, Kallsyms(path="/nonexistent")).user_frame(1, 0x1100) == "libz.so+0x110"


def test_fold_and_tables():
    assert stacksrec.fold("python", ["python3.11`main", "libc.so.6`pread"], ["do_syscall_64", "filemap_read"]) \
        == "python;python3.11`main;libc.so.6`pread;do_syscall_64_[k];filemap_read_[k]"
    assert stacksrec.fold("kswapd0", [], ["kswapd", "shrink_node"], "none") == "kswapd0;kswapd_[k];shrink_node_[k]"
    assert stacksrec.fold("a b;c", ["x y"], [], "ok", "none") == "a_b:c;x_y"
    assert stacksrec.fold("p", [], [], "lost", "lost") == "p;[lost];[lost]_[k]"
    assert [stacksrec._status(i) for i in (3, -14, -17, -12)] == ["ok", "none", "lost", "error"]
    rows = [dict(stack="p;f", samples=3, comm="p", tgid=1, who="command", user_frames=1, kernel_frames=0,
                 user_stack="ok", kernel_stack="none"),
            dict(stack="p;f", samples=2, comm="p", tgid=1, who="command", user_frames=1, kernel_frames=0,
                 user_stack="ok", kernel_stack="none"),
            dict(stack="p;f", samples=4, comm="p", tgid=2, who="command", user_frames=1, kernel_frames=0,
                 user_stack="ok", kernel_stack="none")]
    df = stacksrec.stacks_table(rows)
    assert list(df.columns) == [c.name for c in SPEC.schema]
    assert df["samples"].tolist() == [5, 4] and df["tgid"].tolist() == [1, 2]
    assert stacksrec.folded_text(df) == "p;f 9\n"
    assert stacksrec.stacks_table([]).empty and stacksrec.folded_text(stacksrec.stacks_table([])) == ""


def test_knobs_from_the_environment_are_checked(tmp_path):
    assert stacksrec.parse_knobs("MOE_SAMPLE_HZ=499, MOE_STACK_ENTRIES=0x8000") == \
        {"MOE_SAMPLE_HZ": 499, "MOE_STACK_ENTRIES": 32768}
    assert stacksrec.parse_knobs(None) == {}
    with pytest.raises(Exception, match="knobs: .*MOE_SAMPLE_HZ"):
        stacksrec.parse_knobs("NOPE=1")
    with pytest.raises(Exception, match="must be an integer"):
        stacksrec.parse_knobs("MOE_SAMPLE_HZ=fast")
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/perf_event_max_sample_rate").write_text("1000\n")
    ok = SPEC.knob_values()
    stacksrec.check_knobs(ok, tmp_path)
    with pytest.raises(Exception, match="perf_event_max_sample_rate=1000"):
        stacksrec.check_knobs(dict(ok, MOE_SAMPLE_HZ=4000), tmp_path)
    with pytest.raises(Exception, match="positive"):
        stacksrec.check_knobs(dict(ok, MOE_SAMPLE_HZ=0), tmp_path)


def test_poll_waits_out_its_timeout_and_wakes_on_exit(tmp_path):
    """The recorder's loop relies on poll() to sleep (no busy loop) and to return as soon
    as the command exits; maps are snapshotted while the process lives."""
    import time

    from moetrace.record.probe import RecordContext

    rec = stacksrec.StacksRecorder(RecordContext(features=None, plan=None))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.6)"])
    try:
        rec.followed.add(child.pid)
        rec._pidfd = os.pidfd_open(child.pid)
        t = time.monotonic()
        rec.poll(150)
        assert 0.14 <= time.monotonic() - t < 0.5
        assert child.pid in rec.maps.snaps  # snapshotted while alive
        t = time.monotonic()
        rec.poll(5000)  # returns when the child exits (~0.45 s later), not after 5 s
        assert time.monotonic() - t < 2.0
        assert child.poll() == 0 or child.wait(5) == 0  # not reaped by poll: the caller's wait works
    finally:
        rec.abort()
        if child.poll() is None:
            child.kill()
            child.wait()


def test_find_kswapd_reads_comm(tmp_path):
    for pid, comm in ((2, "kthreadd"), (45, "kswapd0"), (46, "kswapd1"), (47, "kswapd0:0"), (50, "kswapdx"),
                      (51, "python")):
        (tmp_path / "proc" / str(pid)).mkdir(parents=True)
        (tmp_path / "proc" / str(pid) / "comm").write_text(comm + "\n")
    assert stacksrec.find_kswapd(tmp_path) == [45, 46, 47]


def test_find_kernel_addresses_finds_plants_with_file_and_offset(tmp_path):
    ks_path = tmp_path / "kallsyms"
    ks_path.write_text(KALLSYMS)
    ks = Kallsyms(path=ks_path)
    run = tmp_path / "run"
    (run / "replay").mkdir(parents=True)
    clean = {"identity": "ab" * 32, "build": "ffff8000000000001234", "neg": -1, "all_ones": "0xffffffffffffffff",
             "ns": 1234567890123, "u64max": 18446744073709551615, "user": "0x00007f0000001000",
             "float": 1.8446744071578845e19}
    (run / "manifest.json").write_text(json.dumps(clean))
    assert find_kernel_addresses(run, ks) == []
    text = "python;main;filemap_read_[k] 3\n"
    plant = "ffffffff81100abc_[k]"
    (run / "stacks.folded").write_text(text + f"python;{plant} 1\n")
    (run / "replay" / "log.json").write_text('{"ip": %d}' % 0xFFFFFFFF81100000)  # a symbol's address in decimal
    pd.DataFrame({"stack": ["a", "b", "c", "x;0xFFFF888100000000;y"], "n": [1, 2, 3, 4],
                  "ip": [0, 0, -2128609280, 0],  # -2128609280: 0xffffffff81200000 as int64
                  "u": pd.array([0, 0xFFFF888012345678, 2**64 - 1, 7], dtype="UInt64"),
                  "frames": [[], ["filemap_read"], None, ["ok", "ffffffff81000010"]]}).to_parquet(run / "t.parquet")
    big = pd.DataFrame({"time_ns": range(1_000_000), "who": ["kswapd0"] * 1_000_000})
    big.loc[765_432, "time_ns"] = -2128609280
    big.to_parquet(run / "big.parquet")
    hits = find_kernel_addresses(run, ks)
    assert ("stacks.folded", len(text) + len("python;"), "ffffffff81100abc") in hits
    assert ("replay/log.json", 7, str(0xFFFFFFFF81100000)) in hits
    assert ("t.parquet", 3, "stack: 0xFFFF888100000000") in hits  # kernel half, not a symbol
    assert ("t.parquet", 2, "ip: -2128609280") in hits  # an int64 column holding a kallsyms address
    assert ("t.parquet", 1, f"u: {0xFFFF888012345678}") in hits  # u64: kernel half (all-ones is not)
    assert ("t.parquet", 3, "frames: ffffffff81000010") in hits  # nested columns too
    assert ("big.parquet", 765_432, "time_ns: -2128609280") in hits
    assert len(hits) == 7, hits
    # without kallsyms only the kernel-half rule holds: the int64 plant is not findable
    no_ks = Kallsyms(path=tmp_path / "absent")
    assert {h[0] for h in find_kernel_addresses(run, no_ks)} == {"stacks.folded", "replay/log.json", "t.parquet"}
    assert ("t.parquet", 2, "ip: -2128609280") not in find_kernel_addresses(run, no_ks)
    assert symbolize.scan_text(b"0xffff800000000000 0xffff7fffffffffff") and \
        len(list(symbolize.scan_text(b"0xffff800000000000 0xffff7fffffffffff"))) == 1


# ---------------------------------------------------------------------------
# probe build


def _perf_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[perf_event]":
                n += 1
        except OSError:
            pass
    return n


def _ctx():
    from moetrace.kernel.features import Features
    from moetrace.record.probe import RecordContext
    from moetrace.record.spec import resolve

    feats = Features("/", mount=True)
    return RecordContext(features=feats, plan=resolve(SPEC, feats))


@pytest.mark.probe_build
@pytest.mark.parametrize("knobs", [{}, {"MOE_FOLLOW_FORKS": 0, "MOE_SAMPLE_HZ": 49, "MOE_STACK_ENTRIES": 1024}],
                         ids=["recorder-defaults", "no-forks-small"])
def test_stacks_compiles_loads_and_detaches(live, knobs):
    from moetrace.kernel.bpf import prog_id_exists

    before = _perf_fds()
    rec = stacksrec.StacksRecorder(_ctx(), knobs=knobs)
    rec.open()
    try:
        assert rec.knobs == SPEC.knob_values(**knobs)
        assert ("task:task_newtask" in rec.probe.tracepoints) == bool(rec.knobs["MOE_FOLLOW_FORKS"])
        tps = len(rec.probe.tracepoints)  # bcc attaches a tracepoint through a perf event too
        assert _perf_fds() - before == os.cpu_count() + tps  # one cpu-clock event per CPU
        tg = rec.probe.table("tgids")
        k = stacksrec.find_kswapd()
        assert k and sorted(int(x.value) for x in tg.keys()) == k  # kswapd threads, read only
        assert all(v.value == stacksrec.TASK_KSWAPD for v in tg.values())
        assert len(rec.probe.table("stats")) == len(SPEC.stats)
        ids = rec.prog_ids()
        assert ids and all(prog_id_exists(i) for i in ids)
    finally:
        rec.close()
        rec.abort()
    assert rec.collected and rec.df is not None
    assert not any(prog_id_exists(i) for i in ids), "programs still loaded after close()"
    assert _perf_fds() == before, "perf events still open after close()"


# ---------------------------------------------------------------------------
# live

SHIM = '''\
import json, os, resource, subprocess, sys
out, cmd = sys.argv[1], sys.argv[2:]
rc = subprocess.run(cmd).returncode
s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
with open(out, "w") as fh:
    json.dump({"self_cpu_s": s.ru_utime + s.ru_stime, "children_cpu_s": c.ru_utime + c.ru_stime}, fh)
os._exit(rc)
'''


def _moetrace(*args):
    r = subprocess.run([sys.executable, "-c", "from moetrace.cli import main; main()", *args],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A 64 MiB pool of 32 x 2 MiB expert files and a one-pass plan over all of them."""
    base = tmp_path_factory.mktemp("stacks")
    n = 32
    _moetrace("pool", "create", str(base / "pool"), "--layers", "1", "--experts", str(n), "--k", str(n),
              "--expert-bytes", "2MiB", "--layout", "files")
    from moetrace.inputs.trace import write_jsonl

    write_jsonl([(0, 0, list(range(n)))], base / "t.jsonl")
    _moetrace("plan", "compile", str(base / "t.jsonl"), "--layers", "1", "--experts", str(n), "--k", str(n),
              "--expert-bytes", "2MiB", "-o", str(base / "plan.bin"))
    (base / "shim.py").write_text(SHIM)
    return base


def _drop(pool_dir: Path) -> None:
    for p in sorted(pool_dir.rglob("*.bin")):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _record_replay(base: Path, run: Path, passes: int, env_knobs: str | None = None) -> tuple[dict, dict]:
    env = dict(os.environ)
    env.pop(stacksrec.KNOBS_ENV, None)
    if env_knobs:
        env[stacksrec.KNOBS_ENV] = env_knobs
    oracle = base / f"{run.name}.cpu.json"
    cmd = [sys.executable, str(base / "shim.py"), str(oracle), *REPLAY, str(base / "plan.bin"), "--pool",
           str(base / "pool"), "--warmup", "0", "--passes", str(passes), "--threads", "2"]
    with io_lock():
        _drop(base / "pool")
        r = subprocess.run([*RECORD, "--out", str(run), "--probes", "stacks", "--", *cmd], capture_output=True,
                           text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    return rundir.read_manifest(run), json.loads(oracle.read_text())


def _frames(df: pd.DataFrame) -> dict[str, int]:
    out: dict[str, int] = {}
    for s, n in zip(df["stack"], df["samples"]):
        for f in set(s.split(";")[1:]):
            out[f] = out.get(f, 0) + int(n)
    return out


def _check_rate(doc: dict, cpu: dict, hz: int) -> None:
    summ = doc["summaries"]["stacks"]
    expected = (cpu["self_cpu_s"] + cpu["children_cpu_s"]) * hz
    n = doc["timings"]["command_wall_s"] * hz * os.cpu_count()
    p = min(expected / n, 1.0)
    tol = 3 * math.sqrt(n * p * (1 - p)) + 2
    got = summ["command_samples"]
    print(f"stacks {hz} Hz: {got} samples, oracle {expected:.1f} (cpu x hz), tolerance {tol:.1f}, "
          f"ratio {got / expected:.3f}")
    assert abs(got - expected) <= tol, (got, expected, tol)


def test_live_record_replay_default_rate(live, pool, tmp_path):
    """Default knobs (99 Hz): cold pass then 59 hot passes."""
    run = tmp_path / "run"
    doc, cpu = _record_replay(pool, run, passes=60)
    summ, st = doc["summaries"]["stacks"], doc["stats"]["stacks"]
    assert doc["attach_plan"]["stacks"]["recorded"] is True and doc["knobs"]["stacks"]["MOE_SAMPLE_HZ"] == 99
    assert summ["sample_hz"] == 99 and summ["kallsyms"]["available"] is True
    _check_rate(doc, cpu, 99)
    df = pd.read_parquet(run / "stacks.parquet")
    folded = (run / "stacks.folded").read_text().splitlines()
    # three views of one count: the kernel's stat, the table, the folded file
    assert st["samples"] == int(df["samples"].sum()) == sum(int(ln.rsplit(" ", 1)[1]) for ln in folded) > 0
    assert summ["command_samples"] + summ["kswapd_samples"] == st["samples"]
    assert set(df["who"]) <= {"command", "kswapd"} and summ["kswapd_pids"] == stacksrec.find_kswapd()
    assert all(ln.rsplit(" ", 1)[1].isdigit() and ";" in ln for ln in folded)
    # the replay's hot passes are pread copies out of the page cache
    fr = _frames(df[df["who"] == "command"])
    assert fr.get("filemap_read_[k]", 0) > 0, sorted(fr, key=fr.get)[-30:]
    assert fr.get("copy_page_to_iter_[k]", 0) + fr.get("_copy_to_iter_[k]", 0) > 0
    assert any(f.split("`")[0].startswith(("python3", "libpython")) for f in fr if not f.endswith("_[k]")), fr
    # kernel-mode samples carry both sides; user-mode ones no kernel frames
    assert (df.loc[df["kernel_stack"] == "ok", "kernel_frames"] > 0).all()
    assert (df.loc[df["kernel_stack"] != "ok", "kernel_frames"] == 0).all()
    assert (df["kernel_stack"] == "ok").any() and (df["kernel_stack"] == "none").any()
    assert doc["lost"]["stacks"]["lost_events"] == 0 and st["keys_full"] == 0
    assert doc["tables"]["stacks"]["samples"]["dtype"] == "int64"
    assert find_kernel_addresses(run) == []
    for p in [run, *run.rglob("*")]:
        assert rundir.is_private(p), p


def test_live_cold_pass_shows_readahead_at_999hz(live, pool, tmp_path):
    """MOE_SAMPLE_HZ=999 through the environment; one cold pass: readahead shows up."""
    run = tmp_path / "run"
    doc, cpu = _record_replay(pool, run, passes=1, env_knobs="MOE_SAMPLE_HZ=999")
    assert doc["knobs"]["stacks"]["MOE_SAMPLE_HZ"] == 999
    _check_rate(doc, cpu, 999)
    df = pd.read_parquet(run / "stacks.parquet")
    fr = _frames(df[df["who"] == "command"])
    ra = {f: fr.get(f + "_[k]", 0) for f in ("page_cache_ra_order", "page_cache_ra_unbounded", "filemap_add_folio",
                                              "filemap_get_pages")}
    assert fr.get("filemap_read_[k]", 0) > 0 and sum(ra.values()) > 0, ra
    assert find_kernel_addresses(run) == []
