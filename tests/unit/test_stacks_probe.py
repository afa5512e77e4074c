"""The stacks probe (probes/stacks.bpf.c + toolkit/record/probes/stacks.py + toolkit/kernel/symbolize.py) (unit tier)."""

from __future__ import annotations

from common.stacks_probe import *  # noqa: F401,F403


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
        pidfd = os.pidfd_open(child.pid)
        rec.wake_on(pidfd)  # what the recorder hands every probe
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
        os.close(pidfd)
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


def test_core_source_and_perf_attr():
    """probes/stacks.bpf.c: TASK_* as the recorder's (STAT_*: test_probe_build.py); struct
    stack_key is 28 bytes (the recorder's dtype); map sizes from the knobs; perf_event_attr is the
    112-byte VER5 layout and the kernel's id lists parse (moetrace.kernel.perf)."""
    import re

    from moetrace.kernel import bpf
    from moetrace.kernel.perf import PerfEventAttr, id_list, online_cpus

    src = bpf.core_source("stacks").read_text()
    tasks = dict(re.findall(r"^#define TASK_(\w+) (\d+)", src, re.M))
    assert tasks == {"FOLLOWED": str(stacksrec.TASK_FOLLOWED), "KSWAPD": str(stacksrec.TASK_KSWAPD)}
    assert stacksrec.STACK_KEY_DTYPE.itemsize == 28
    k = {x.name: int(x.default) for x in SPEC.knobs}
    assert SPEC.map_sizes(k) == {"tgids": 4096, "counts": 16384, "stack_traces": 16384, "stats": len(SPEC.stats)}
    assert ctypes.sizeof(PerfEventAttr) == 112 and PerfEventAttr.flags.offset == 40
    assert id_list("0-3,5\n") == [0, 1, 2, 3, 5] and id_list("0") == [0] and id_list("") == []
    assert online_cpus("/nonexistent") == list(range(os.cpu_count()))
