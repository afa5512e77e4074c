"""No-kernel tests of feature detection and attach-plan resolution (fake /proc, /sys, /lib trees)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetrace.kernel import features as F
from moetrace.kernel.features import FieldSpec, Features
from moetrace.record.spec import AttachCandidate, AttachGroup, Column, Knob, ProbeSpec, resolve
from moetrace.record.probes import PROBES, resolve_all

# Real format files, read from this project's 6.18 kernel (tracefs mounted).
ADD_TO_PAGE_CACHE_FORMAT = """\
name: mm_filemap_add_to_page_cache
ID: 600
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:unsigned long pfn;\toffset:8;\tsize:8;\tsigned:0;
\tfield:unsigned long i_ino;\toffset:16;\tsize:8;\tsigned:0;
\tfield:unsigned long index;\toffset:24;\tsize:8;\tsigned:0;
\tfield:dev_t s_dev;\toffset:32;\tsize:4;\tsigned:0;
\tfield:unsigned char order;\toffset:36;\tsize:1;\tsigned:0;

print fmt: "dev %d:%d ino %lx pfn=0x%lx ofs=%lu order=%u", ((unsigned int) ((REC->s_dev) >> 20)), \
((unsigned int) ((REC->s_dev) & ((1U << 20) - 1))), REC->i_ino, REC->pfn, REC->index << 12, REC->order
"""

BLOCK_RQ_ISSUE_FORMAT = """\
name: block_rq_issue
ID: 2104
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:dev_t dev;\toffset:8;\tsize:4;\tsigned:0;
\tfield:sector_t sector;\toffset:16;\tsize:8;\tsigned:0;
\tfield:unsigned int nr_sector;\toffset:24;\tsize:4;\tsigned:0;
\tfield:unsigned int bytes;\toffset:28;\tsize:4;\tsigned:0;
\tfield:unsigned short ioprio;\toffset:32;\tsize:2;\tsigned:0;
\tfield:char rwbs[10];\toffset:34;\tsize:10;\tsigned:0;
\tfield:char comm[16];\toffset:44;\tsize:16;\tsigned:0;
\tfield:__data_loc char[] cmd;\toffset:60;\tsize:4;\tsigned:0;

print fmt: "%d,%d %s %u (%s) %llu + %u", ((unsigned int) ((REC->dev) >> 20)), REC->rwbs
"""

SYS_ENTER_PREAD64_FORMAT = """\
name: sys_enter_pread64
ID: 838
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:int __syscall_nr;\toffset:8;\tsize:4;\tsigned:1;
\tfield:unsigned int fd;\toffset:16;\tsize:8;\tsigned:0;
\tfield:char * buf;\toffset:24;\tsize:8;\tsigned:0;
\tfield:size_t count;\toffset:32;\tsize:8;\tsigned:0;
\tfield:loff_t pos;\toffset:40;\tsize:8;\tsigned:0;

print fmt: "fd: 0x%08lx, buf: 0x%08lx, count: 0x%08lx, pos: 0x%08lx", ((unsigned long)(REC->fd))
"""

SYS_EXIT_FORMAT = """\
name: {ev}
ID: 700
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:int __syscall_nr;\toffset:8;\tsize:4;\tsigned:1;
\tfield:long ret;\toffset:16;\tsize:8;\tsigned:1;

print fmt: "0x%lx", REC->ret
"""

TASK_NEWTASK_FORMAT = """\
name: task_newtask
ID: 150
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:pid_t pid;\toffset:8;\tsize:4;\tsigned:1;
\tfield:char comm[16];\toffset:12;\tsize:16;\tsigned:0;
\tfield:unsigned long clone_flags;\toffset:32;\tsize:8;\tsigned:0;
\tfield:short oom_score_adj;\toffset:40;\tsize:2;\tsigned:1;

print fmt: "pid=%d comm=%s clone_flags=%lx oom_score_adj=%hd", REC->pid
"""

GENERIC_FORMAT = "name: {ev}\nID: 1\nformat:\n\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n"

# vmscan:* in the fake tree: one format carrying every field the reclaim probe reads
VMSCAN_FIELDS = ("nr_reclaimed", "nr_scanned", "nr_dirty", "nr_writeback", "nr_congested", "nr_immediate",
                 "nr_activate0", "nr_activate1", "nr_ref_keep", "nr_unmap_fail", "reclaim_flags", "nr_taken",
                 "nr_active", "nr_deactivated", "nr_referenced", "nr_requested", "nr_skipped")
VMSCAN_FORMAT = ("name: {ev}\nID: 1\nformat:\n\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n"
                 + "".join(f"\tfield:unsigned long {f};\toffset:{8 + 8 * i};\tsize:8;\tsigned:0;\n"
                           for i, f in enumerate(VMSCAN_FIELDS)))

# Addresses zeroed, as an unprivileged reader sees them (and no raw kernel address in the repo).
KALLSYMS_61 = """\
0000000000000000 T _stext
0000000000000000 T filemap_add_folio
0000000000000000 T mlock_folio
0000000000000000 T mlock_new_page
0000000000000000 T munlock_page
0000000000000000 t evict_folios
0000000000000000 t isolate_folios
0000000000000000 t should_run_aging
0000000000000000 t try_to_inc_max_seq
0000000000000000 t folio_inc_gen
0000000000000000 T lru_gen_look_around
0000000000000000 T workingset_eviction
0000000000000000 T workingset_refault
0000000000000000 t lru_gen_add_folio
0000000000000000 t lru_gen_add_folio
0000000000000000 t ext4_fill_super\t[ext4]
"""

KALLSYMS_612 = """\
0000000000000000 T mlock_folio
0000000000000000 T mlock_new_folio
0000000000000000 T munlock_folio
0000000000000000 t evict_folios
0000000000000000 t isolate_folios
0000000000000000 t try_to_inc_max_seq
0000000000000000 t inc_max_seq.constprop.0
0000000000000000 t folio_inc_gen
"""

def _fields_format(ev: str, fields: tuple[str, ...]) -> str:
    return GENERIC_FORMAT.format(ev=ev) + "".join(
        f"\tfield:unsigned long {f};\toffset:{16 + 8 * i};\tsize:8;\tsigned:0;\n" for i, f in enumerate(fields))


# the argument fields the mlock probe reads (its declaration names them; resolve() checks them)
MLOCK_FORMATS = {"sys_enter_mlock": ("start", "len"), "sys_enter_munlock": ("start", "len"),
                 "sys_enter_mlock2": ("start", "len", "flags"), "sys_enter_mlockall": ("flags",),
                 "sys_enter_munlockall": (), "sys_enter_munmap": ("addr", "len"),
                 "sys_enter_mmap": ("addr", "len", "prot", "flags", "fd", "off"),
                 "sys_enter_mremap": ("addr", "old_len", "new_len", "flags", "new_addr"),
                 "sched_process_exit": ("comm", "pid", "prio", "group_dead"),
                 "sched_process_exec": ("filename", "pid", "old_pid"),
                 # the reads and lru probes' argument fields
                 "sys_enter_preadv": ("fd", "vec", "vlen", "pos_l", "pos_h"),
                 "sys_enter_preadv2": ("fd", "vec", "vlen", "pos_l", "pos_h", "flags"),
                 "sys_enter_read": ("fd", "buf", "count"), "sys_enter_close": ("fd",),
                 "sys_enter_close_range": ("fd", "max_fd", "flags"),
                 "mm_lru_insertion": ("folio", "pfn", "lru", "flags"), "mm_lru_activate": ("folio", "pfn"),
                 # the evictor contexts (pagecache) and memory.reclaim (reclaim)
                 "sys_enter_write": ("fd", "buf", "count"), "sys_enter_madvise": ("start", "len_in", "behavior"),
                 "sys_enter_fadvise64": ("fd", "offset", "len", "advice"),
                 # why pages are added (pagecache, 6.11+)
                 "mm_filemap_fault": ("i_ino", "s_dev", "index")}

EVENTS_618 = {
    "filemap": ["mm_filemap_get_pages", "mm_filemap_add_to_page_cache", "mm_filemap_delete_from_page_cache",
                "mm_filemap_fault", "mm_filemap_map_pages"],
    "readahead": ["page_cache_sync_ra", "page_cache_async_ra"],
    "pagemap": ["mm_lru_insertion", "mm_lru_activate"],
    "vmscan": ["mm_vmscan_memcg_reclaim_begin", "mm_vmscan_memcg_reclaim_end", "mm_vmscan_direct_reclaim_begin",
               "mm_vmscan_direct_reclaim_end", "mm_vmscan_kswapd_wake", "mm_vmscan_kswapd_sleep",
               "mm_vmscan_lru_shrink_inactive", "mm_vmscan_lru_shrink_active", "mm_vmscan_lru_isolate"],
    "block": ["block_bio_queue", "block_io_start", "block_io_done", "block_rq_issue", "block_rq_complete",
              "block_rq_requeue"],
    "syscalls": [f"sys_{side}_{sc}" for sc in ("mlock", "mlock2", "munlock", "mlockall", "munlockall",
                                               "munmap", "mmap", "mremap", "pread64", "preadv", "preadv2", "read",
                                               "close", "close_range", "write", "fadvise64", "truncate",
                                               "ftruncate", "fallocate", "unlink", "unlinkat", "madvise")
                 for side in ("enter", "exit")],
    "task": ["task_newtask"],
    "sched": ["sched_process_exit", "sched_process_exec"],
}
# 6.1: no get_pages/fault/map_pages, no readahead events, no block_io_start
EVENTS_61 = {c: [e for e in evs if e not in ("mm_filemap_get_pages", "mm_filemap_fault", "mm_filemap_map_pages",
                                               "block_io_start", "block_io_done")]
             for c, evs in EVENTS_618.items() if c != "readahead"}

CAPEFF_ROOT = "000001fffeffffff"  # this project's root shell (CAP_SYS_RESOURCE dropped)

MOUNTS = """\
proc /proc proc rw,relatime 0 0
sysfs /sys sysfs rw,relatime 0 0
/dev/vda / ext4 rw,relatime 0 0
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""


def _w(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def make_tree(root: Path, *, osrel: str = "6.18.44-fc-v973", headers: str | None = "6.1.0-47-amd64",
              tracefs: str | None = "/sys/kernel/tracing", debugfs: bool = False, events=None,
              kallsyms: str = KALLSYMS_61, kprobes: bool = False, mglru: str | None = None,
              capeff: str = CAPEFF_ROOT, uid: int = 0, btf: bool = True, psi: bool = True,
              v2_controllers: str = "hugetlb", unpriv_bpf: str = "2", formats: dict[str, str] | None = None,
              init_private: bool | None = None) -> Path:
    """A fake kernel view under root; ``headers`` is the UTS_RELEASE of the build dir (None: no build);
    ``formats``: {event: format text} overriding the built-in ones. ``init_private``: this machine
    kind's kernel.init_private=1 (fentry refused to all but PID 1); default: where there are no
    kprobes (this host's shape; the lab kernels have kprobes and allow fentry)."""
    F.clear_cache()
    mounts = MOUNTS
    if tracefs:
        mounts += f"tracefs {tracefs} tracefs rw,relatime 0 0\n"
        t = root / tracefs.lstrip("/")
        for cat, evs in (EVENTS_618 if events is None else events).items():
            for ev in evs:
                text = {"mm_filemap_add_to_page_cache": ADD_TO_PAGE_CACHE_FORMAT,
                        "mm_filemap_delete_from_page_cache": ADD_TO_PAGE_CACHE_FORMAT.replace(
                            "mm_filemap_add_to_page_cache", "mm_filemap_delete_from_page_cache"),
                        "block_rq_issue": BLOCK_RQ_ISSUE_FORMAT,
                        "task_newtask": TASK_NEWTASK_FORMAT,
                        "sys_enter_pread64": SYS_ENTER_PREAD64_FORMAT}.get(
                    ev, (_fields_format(ev, MLOCK_FORMATS[ev]).replace("{", "{{").replace("}", "}}")
                         if ev in MLOCK_FORMATS else
                         SYS_EXIT_FORMAT if ev.startswith("sys_exit_") else
                         BLOCK_RQ_ISSUE_FORMAT.replace("block_rq_issue", ev) if cat == "block" else
                         VMSCAN_FORMAT if cat == "vmscan" else GENERIC_FORMAT).format(ev=ev))
                text = (formats or {}).get(ev, text)
                _w(t / "events" / cat / ev / "format", text)
        _w(t / "available_events", "")
        if kprobes:
            _w(t / "kprobe_events", "")
    if debugfs:
        mounts += "debugfs /sys/kernel/debug debugfs rw,relatime 0 0\n"
        (root / "sys/kernel/debug").mkdir(parents=True, exist_ok=True)
        if mglru is not None:
            _w(root / "sys/kernel/debug/lru_gen", "memcg     1 /\n node     0\n          0      65272          0           0\n")
    _w(root / "proc/mounts", mounts)
    _w(root / "proc/kallsyms", kallsyms)
    _w(root / "proc/sys/kernel/osrelease", osrel + "\n")
    _w(root / "proc/sys/kernel/unprivileged_bpf_disabled", unpriv_bpf + "\n")
    _w(root / "proc/sys/kernel/perf_event_paranoid", "2\n")
    if (not kprobes) if init_private is None else init_private:
        _w(root / "proc/sys/kernel/init_private", "1\n")
    (root / "sys/bus/event_source/devices/software").mkdir(parents=True, exist_ok=True)
    _w(root / "proc/self/status", f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nCapInh:\t0000000000000000\n"
                                  f"CapPrm:\t{capeff}\nCapEff:\t{capeff}\n")
    if headers is not None:
        _w(root / f"lib/modules/{osrel}/build/include/generated/utsrelease.h",
           f'#define UTS_RELEASE "{headers}"\n')
    if btf:
        _w(root / "sys/kernel/btf/vmlinux", "")
    if psi:
        _w(root / "proc/pressure/memory", "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
                                          "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    if mglru is not None:
        _w(root / "sys/kernel/mm/lru_gen/enabled", mglru + "\n")
        _w(root / "sys/kernel/mm/lru_gen/min_ttl_ms", "0\n")
    _w(root / "sys/fs/cgroup/unified/cgroup.controllers", v2_controllers + "\n")
    return root


@pytest.fixture(autouse=True)
def _fresh_cache():
    F.clear_cache()
    yield
    F.clear_cache()


# -- features ---------------------------------------------------------------------------------

def test_parse_real_format_file(tmp_path):
    make_tree(tmp_path)
    fmt = F.tracepoint_format("filemap", "mm_filemap_add_to_page_cache", root=tmp_path)
    assert fmt["pfn"] == FieldSpec("pfn", "unsigned long", 8, 8, False)
    assert fmt["i_ino"] == FieldSpec("i_ino", "unsigned long", 16, 8, False)
    assert fmt["index"].offset == 24
    assert fmt["s_dev"] == FieldSpec("s_dev", "dev_t", 32, 4, False)
    assert fmt["order"] == FieldSpec("order", "unsigned char", 36, 1, False)
    assert fmt["common_pid"].signed is True
    blk = F.tracepoint_format("block", "block_rq_issue", root=tmp_path)
    assert blk["rwbs"] == FieldSpec("rwbs", "char[10]", 34, 10, False)
    assert blk["cmd"] == FieldSpec("cmd", "__data_loc char[]", 60, 4, False)
    assert blk["sector"].type == "sector_t"
    sc = F.tracepoint_format("syscalls", "sys_enter_pread64", root=tmp_path)
    assert sc["buf"].type == "char *" and sc["count"].offset == 32 and sc["__syscall_nr"].signed


def test_tracefs_found_through_mounts(tmp_path):
    make_tree(tmp_path)
    assert F.tracefs_path(tmp_path) == tmp_path / "sys/kernel/tracing"
    assert F.has_tracepoint("filemap", "mm_filemap_add_to_page_cache", root=tmp_path)
    assert not F.has_tracepoint("filemap", "no_such_event", root=tmp_path)
    assert "no tracepoint filemap:no_such_event" in F.tracepoint_reason("filemap", "no_such_event", tmp_path)


def test_tracefs_under_debugfs_and_unmounted(tmp_path):
    a = make_tree(tmp_path / "a", tracefs=None, debugfs=True)
    _w(a / "sys/kernel/debug/tracing/events/filemap/mm_filemap_add_to_page_cache/format", ADD_TO_PAGE_CACHE_FORMAT)
    assert F.tracefs_path(a) == a / "sys/kernel/debug/tracing"
    assert F.has_tracepoint("filemap", "mm_filemap_add_to_page_cache", root=a)
    b = make_tree(tmp_path / "b", tracefs=None)
    assert F.tracefs_path(b) is None
    assert F.tracefs_path(b, mount=True) is None  # never mounts on a fake root
    assert F.tracepoint_format("filemap", "mm_filemap_add_to_page_cache", root=b) is None
    assert F.TRACEFS_MOUNT_CMD in F.tracepoint_reason("filemap", "mm_filemap_add_to_page_cache", b)
    assert F.debugfs_path(b) is None and F.debugfs_path(a) == a / "sys/kernel/debug"


def test_kallsyms_and_kprobes(tmp_path):
    r = make_tree(tmp_path, kallsyms=KALLSYMS_612)
    assert F.kallsyms_has("mlock_new_folio", r) and not F.kallsyms_has("mlock_new_page", r)
    assert F.kallsyms_has("inc_max_seq.constprop.0", r) and not F.kallsyms_has("inc_max_seq", r)
    assert F.kallsyms_matching("inc_max_seq", r) == ["inc_max_seq.constprop.0"]
    assert not F.kprobes_available(r)
    assert "kprobes not built" in F.kprobes_reason(r)
    r2 = make_tree(tmp_path / "k", kprobes=True)
    assert F.kprobes_available(r2)
    assert F.kallsyms_count("lru_gen_add_folio", r2) == 2
    assert F.kallsyms_has("ext4_fill_super", r2)  # module suffix dropped
    assert "static copies" in Features(r2).symbol_reason("lru_gen_add_folio")
    assert "present as inc_max_seq.constprop.0" in Features(r).symbol_reason("inc_max_seq")


def test_headers_do_not_matter(tmp_path):
    """The compiled probes relocate against BTF: no kernel headers, matching or not, change a plan."""
    plans = [{n: p.to_dict() for n, p in resolve_all(Features(make_tree(tmp_path / str(h), headers=h))).items()}
             for h in ("6.1.0-47-amd64", "6.18.44-fc-v973", None)]
    assert plans[0] == plans[1] == plans[2]
    assert not hasattr(Features(make_tree(tmp_path / "x")), "headers")


@pytest.mark.parametrize("capeff,uid,expect", [
    (CAPEFF_ROOT, 0, dict(root=True, cap_bpf=True, cap_perfmon=True, cap_sys_admin=True)),
    ("0000000000000000", 1000, dict(root=False, cap_bpf=False, cap_perfmon=False, cap_sys_admin=False)),
    ("000000c000000000", 1000, dict(root=False, cap_bpf=True, cap_perfmon=True, cap_sys_admin=False)),
    ("0000008000000000", 1000, dict(root=False, cap_bpf=True, cap_perfmon=False, cap_sys_admin=False)),
    ("0000000000200000", 1000, dict(root=False, cap_bpf=True, cap_perfmon=True, cap_sys_admin=True)),
])
def test_privileges(tmp_path, capeff, uid, expect):
    r = make_tree(tmp_path, capeff=capeff, uid=uid)
    assert F.privileges(r) == expect


def test_bpf_usable_fake(tmp_path):
    assert F.bpf_usable(make_tree(tmp_path / "a"))[0]
    ok, detail = F.bpf_usable(make_tree(tmp_path / "b", capeff="0" * 16, uid=1000))
    assert not ok and "unprivileged_bpf_disabled=2" in detail
    assert F.bpf_usable(make_tree(tmp_path / "c", capeff="0" * 16, uid=1000, unpriv_bpf="0"))[0]


def test_btf_mglru_cgroup_psi(tmp_path):
    r = make_tree(tmp_path / "a")
    assert F.btf_available(r) and F.psi_available(r)
    assert F.mglru_state(r) is None
    cg = F.cgroup_memory(r)
    assert cg == {"v1": "/sys/fs/cgroup/memory", "v2": None, "v2_mount": "/sys/fs/cgroup/unified",
                  "v2_controllers": ["hugetlb"], "preferred": "v1"}
    r = make_tree(tmp_path / "b", mglru="0x0007", debugfs=True, btf=False, psi=False,
                  v2_controllers="cpuset cpu io memory pids")
    assert not F.btf_available(r) and not F.psi_available(r)
    assert F.mglru_state(r) == {"enabled_raw": "0x0007", "enabled_mask": 7, "on": True, "min_ttl_ms": 0,
                                "debugfs_lru_gen": True}
    assert F.cgroup_memory(r)["preferred"] == "v2"
    r = make_tree(tmp_path / "c", mglru="0x0000")
    st = F.mglru_state(r)
    assert st["on"] is False and st["debugfs_lru_gen"] is False


# -- probespec --------------------------------------------------------------------------------

def test_registry_is_well_formed():
    assert {"pagecache", "lru", "reclaim", "mlock", "block", "reads", "stacks", "mglru"} <= set(PROBES)
    for name, spec in PROBES.items():
        assert spec.source_path.name == f"{name}.bpf.c" and spec.source_path.parent.name == "probes"
        groups = [g.name for g in spec.attach]
        assert len(groups) == len(set(groups)), name
        cols = [c.name for c in spec.schema]
        assert len(cols) == len(set(cols)), name
        for g in spec.attach:
            assert g.candidates, (name, g.name)
            for c in g.candidates:
                assert c.fn_name or c.kind == "debugfs"
        assert all(isinstance(v, int) for v in spec.knob_values().values()), name
    targets = {c.target for g in PROBES["mglru"].attach for c in g.candidates}
    assert {"try_to_inc_max_seq", "inc_max_seq", "inc_max_seq.constprop.0", "lru_gen"} <= targets


def test_knob_values():
    spec = PROBES["pagecache"]
    assert spec.knob_values(MOE_STREAM_EVENTS=1)["MOE_STREAM_EVENTS"] == 1
    assert spec.knob_values(MOE_N_RUNS=256)["MOE_N_RUNS"] == 256 and spec.knob_values()["MOE_RING_PAGES"] == 256
    with pytest.raises(ValueError, match="unknown knob"):
        spec.knob_values(NOPE=1)
    with pytest.raises(ValueError):
        AttachCandidate("uprobe", "x", "f")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AttachCandidate("tracepoint", "no_category", "f")


def test_resolve_this_machine_shape(tmp_path):
    """6.18 here: tracepoints yes, kprobes no, MGLRU no."""
    feats = Features(make_tree(tmp_path))
    plans = resolve_all(feats)
    pc = plans["pagecache"]
    assert pc.status == "yes"
    assert pc.entry("add").candidate.target == "filemap:mm_filemap_add_to_page_cache"
    assert all(e.candidate.kind == "tracepoint" for e in pc.entries)
    # bio_queue first: io_start sees only a request's first bio (measured -4.3 % vs diskstats)
    assert plans["block"].entry("bytes").candidate.target == "block:block_bio_queue"
    assert plans["block"].status == "yes" and plans["block"].knobs == {"MOE_BYTES_TP": 2}
    assert plans["reclaim"].status == "yes" and plans["reclaim"].knobs == {
        "MOE_HAVE_DIRECT": 1, "MOE_HAVE_KSWAPD": 1, "MOE_HAVE_SHRINK_ACTIVE": 1, "MOE_HAVE_ISOLATE": 1,
        "MOE_CTX_WRITE": 1}
    assert plans["reads"].status == "yes" and plans["stacks"].status == "yes"
    ml = plans["mlock"]
    assert ml.status == "degraded"
    assert ml.entry("mlock_enter").attached and "kprobes not built" in ml.entry("kp_mlock_folio").reason
    # fentry first, refused here with the kernel's actual reason (not "EPERM"), then the kprobe
    tried = [(c.kind, r) for c, r in ml.entry("kp_mlock_folio").tried]
    assert tried[0][0] == "fentry" and tried[0][1].startswith("kernel.init_private=1") and tried[1][0] == "kprobe"
    mg = plans["mglru"]
    assert mg.status == "no" and "MGLRU not built" in mg.entry("lru_gen").reason
    for g in ("evict_folios", "inc_max_seq", "workingset_refault"):
        assert "kprobes" in mg.entry(g).reason
    d = mg.to_dict()
    assert d["status"] == "no" and d["entries"][0]["group"] == "lru_gen" and "headers" not in d


def test_resolve_61_lab_kernel(tmp_path):
    """6.1 with exact headers and kprobes: fallbacks and old names are picked."""
    feats = Features(make_tree(tmp_path, osrel="6.1.0-47-amd64", headers="6.1.0-47-amd64", events=EVENTS_61,
                               kprobes=True, mglru="0x0000", debugfs=True))
    plans = resolve_all(feats)
    pc = plans["pagecache"]
    # no filemap:mm_filemap_fault before 6.11: the causes lack demand / readahead
    assert pc.status == "degraded" and pc.knobs == {
        "MOE_TRACK_READS": 1, "MOE_FOLLOW_FORKS": 1, "MOE_HAVE_ORDER": 1, "MOE_CTX_WRITE": 1, "MOE_CTX_INVALIDATE": 1,
        "MOE_CTX_RECLAIM": 1, "MOE_HAVE_FAULT": 0, "MOE_CTX_POPULATE": 1}
    assert "mm_filemap_fault" in pc.entry("fault").reason
    blk = plans["block"].entry("bytes")
    assert blk.candidate.target == "block:block_bio_queue" and blk.tried == []
    ml = plans["mlock"]
    assert ml.status == "yes"
    # the lab kernels allow BPF trampolines: fentry, on the 6.1 names (no mlock_new_folio there)
    assert ml.entry("kp_mlock_new").candidate.describe() == "fentry mlock_new_page"
    assert ml.entry("kp_munlock").candidate.describe() == "fentry munlock_page"
    mg = plans["mglru"]
    assert mg.entry("lru_gen").attached
    assert mg.entry("inc_max_seq").candidate.target == "try_to_inc_max_seq"
    assert mg.entry("folio_inc_gen").attached  # exact headers: may read folio flags
    assert mg.status == "yes"


def test_resolve_612_clone_and_missing_symbol(tmp_path):
    kall = KALLSYMS_612.replace("0000000000000000 t try_to_inc_max_seq\n", "")
    feats = Features(make_tree(tmp_path, osrel="6.12.95+deb12-amd64", headers="6.12.95+deb12-amd64",
                               kprobes=True, kallsyms=kall, mglru="0x0007", debugfs=True))
    mg = resolve(PROBES["mglru"], feats)
    e = mg.entry("inc_max_seq")
    assert e.candidate.target == "inc_max_seq.constprop.0"
    # fentry then kprobe for each name (fentry: the fake tree's kallsyms stands for BTF), then the clone
    assert [c.describe() for c, _r in e.tried] == ["fentry try_to_inc_max_seq", "kprobe try_to_inc_max_seq",
                                                   "fentry inc_max_seq", "kprobe inc_max_seq"]
    assert "not in /proc/kallsyms" in mg.entry("should_run_aging").reason
    assert mg.status == "degraded"
    ml = resolve(PROBES["mlock"], feats)
    assert ml.entry("kp_mlock_new").candidate.target == "mlock_new_folio"


def test_resolve_struct_readers_need_btf_not_headers(tmp_path):
    feats = Features(make_tree(tmp_path, kprobes=True, mglru="0x0007", debugfs=True))
    mg = resolve(PROBES["mglru"], feats)  # the probes read structs through BTF relocations
    assert mg.entry("evict_folios").attached and mg.entry("folio_inc_gen").attached
    ml = resolve(PROBES["mlock"], feats)
    assert ml.entry("kp_mlock_folio").candidate.describe() == "fentry mlock_folio"


def test_resolve_no_btf_blocks_every_bpf_probe_not_the_sampler(tmp_path):
    """Without BTF the compiled probes cannot be relocated (and there is no other loader); the
    debugfs sampler needs no BPF."""
    feats = Features(make_tree(tmp_path, headers=None, mglru="0x0007", debugfs=True))
    pc = resolve(PROBES["pagecache"], feats)
    assert pc.status == "yes"
    nobtf = Features(make_tree(tmp_path / "nobtf", btf=False, mglru="0x0007", debugfs=True))
    for n in PROBES:
        p = resolve(PROBES[n], nobtf)
        if n == "mglru":
            assert p.entry("lru_gen").attached and p.status == "degraded"
            assert "no kernel BTF" in p.entry("evict_folios").reason
        else:
            assert p.status == "no" and p.reason.startswith("no kernel BTF") and "CONFIG_DEBUG_INFO_BTF" in p.reason, n


def test_resolve_tracefs_unmounted_and_bpf_unusable(tmp_path):
    feats = Features(make_tree(tmp_path / "a", tracefs=None))
    pc = resolve(PROBES["pagecache"], feats)
    assert pc.status == "no" and F.TRACEFS_MOUNT_CMD in pc.entry("delete").reason
    feats = Features(make_tree(tmp_path / "b", capeff="0" * 16, uid=1000))
    pc = resolve(PROBES["pagecache"], feats)
    assert pc.status == "no" and pc.reason.startswith("BPF unusable")


def test_resolve_does_not_need_the_c_file(tmp_path):
    spec = ProbeSpec("ghost", (AttachGroup("a", (AttachCandidate("tracepoint", "filemap:mm_filemap_fault", "f"),)),),
                     schema=(Column("x_pages", "int64", "pages"),), knobs=(Knob("K", 1),),
                     source=tmp_path / "does-not-exist.c")
    plan = resolve(spec, Features(make_tree(tmp_path)))
    assert plan.status == "yes" and not spec.source_path.exists()
    assert str(plan.entries[0]) == "attached: tracepoint filemap:mm_filemap_fault"


def test_pagecache_knobs_from_format_files(tmp_path):
    """The kernel decides the pagecache knobs: no folio `order` -> MOE_HAVE_ORDER=0; one absent read
    exit -> MOE_TRACK_READS=0 and its siblings "switched off"; no task_newtask -> MOE_FOLLOW_FORKS=0; a
    format lacking a field the C reads rejects the candidate (and a required group: the probe)."""
    no_order = ADD_TO_PAGE_CACHE_FORMAT.replace("\tfield:unsigned char order;\toffset:36;\tsize:1;\tsigned:0;\n", "")
    ev = {c: list(e) for c, e in EVENTS_618.items() if c != "task"}
    ev["syscalls"].remove("sys_exit_preadv2")
    feats = Features(make_tree(tmp_path / "a", events=ev, formats={
        "mm_filemap_add_to_page_cache": no_order,
        "mm_filemap_delete_from_page_cache": no_order.replace("add_to", "delete_from")}))
    pc = resolve(PROBES["pagecache"], feats)
    assert pc.knobs == {"MOE_TRACK_READS": 0, "MOE_FOLLOW_FORKS": 0, "MOE_HAVE_ORDER": 0,
                        "MOE_CTX_WRITE": 1, "MOE_CTX_INVALIDATE": 1, "MOE_CTX_RECLAIM": 1, "MOE_HAVE_FAULT": 1,
                        "MOE_CTX_POPULATE": 1}
    assert pc.status == "degraded" and pc.entry("add").attached and pc.entry("delete").attached
    assert "no tracepoint syscalls:sys_exit_preadv2" in pc.entry("exit_preadv2").reason
    e = pc.entry("exit_pread64")
    assert not e.attached and e.reason == "switched off (MOE_TRACK_READS=0: exit_preadv2 unavailable)"
    assert not pc.entry("newtask").attached
    assert pc.to_dict()["knobs"]["MOE_HAVE_ORDER"] == 0
    assert {x.group for x in pc.attached if not x.group.startswith("ctx_")} == {"add", "delete", "fault"}
    assert {x.group for x in pc.attached if x.group.startswith("ctx_")} == {
        g.name for g in PROBES["pagecache"].attach if g.name.startswith("ctx_")}  # every evictor context
    bad = no_order.replace("\tfield:unsigned long i_ino;\toffset:16;\tsize:8;\tsigned:0;\n", "")
    feats = Features(make_tree(tmp_path / "b", formats={"mm_filemap_add_to_page_cache": bad}))
    pc = resolve(PROBES["pagecache"], feats)
    assert pc.status == "no" and "lacks i_ino" in pc.entry("add").reason
    assert pc.knobs["MOE_HAVE_ORDER"] == 1  # from delete's format only: add was not chosen
    with pytest.raises(ValueError, match="must be optional"):
        AttachGroup("x", (AttachCandidate("tracepoint", "a:b", "f"),), required=True, knob="K")


def test_block_and_reclaim_knobs_follow_the_kernel(tmp_path):
    """No block_bio_queue: bytes fall back to io_start (MOE_BYTES_TP=1); no kswapd_sleep and a
    shrink_active format without nr_referenced: their knobs are 0, kswapd_wake is switched off."""
    ev = {c: [e for e in evs if e not in ("block_bio_queue", "mm_vmscan_kswapd_sleep")]
          for c, evs in EVENTS_618.items()}
    fmt = {"mm_vmscan_lru_shrink_active": VMSCAN_FORMAT.replace(" nr_referenced;", " nr_other;")}
    feats = Features(make_tree(tmp_path, events=ev, formats=fmt))
    blk = resolve(PROBES["block"], feats)
    assert blk.entry("bytes").candidate.target == "block:block_io_start" and blk.knobs == {"MOE_BYTES_TP": 1}
    rc = resolve(PROBES["reclaim"], feats)
    assert rc.knobs == {"MOE_HAVE_DIRECT": 1, "MOE_HAVE_KSWAPD": 0, "MOE_HAVE_SHRINK_ACTIVE": 0, "MOE_HAVE_ISOLATE": 1,
                        "MOE_CTX_WRITE": 1}
    assert rc.status == "degraded" and rc.entry("kswapd_wake").reason.startswith("switched off")
    assert "lacks nr_referenced" in rc.entry("shrink_active").reason
    assert rc.entry("shrink_inactive").attached


def test_private_mounts_only_in_a_moetrace_process():
    """record / cell / sweep mount in a namespace of their own only when the process is a moetrace
    program: a click command run inside pytest or a notebook must not move its host process into
    another mount namespace for good (the host's later unmounts would miss the host's mounts)."""
    import subprocess
    import sys

    from moetrace.kernel import features as F

    F.private_mounts()
    try:
        assert F._NS["private"] is False  # pytest hosts moetrace here
    finally:
        F.private_mounts(False)
    code = "from moetrace.kernel import features as F; F.private_mounts(); print(F._NS['private'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "True", r.stderr


def test_a_mount_that_is_busy_stays_on_the_list_for_a_later_unmount(monkeypatch):
    """unmount_ours: a target still in use (umount fails) is said and kept, so the end of a session
    tries it again instead of forgetting it on the host."""
    import subprocess

    from moetrace.kernel import features as F

    calls = []

    def fake_run(argv, **kw):
        calls.append(argv[-1])
        busy = argv[-1] == "/sys/kernel/tracing" and calls.count(argv[-1]) == 1
        return subprocess.CompletedProcess(argv, 32 if busy else 0, "", "target is busy" if busy else "")

    monkeypatch.setattr(F.subprocess, "run", fake_run)
    monkeypatch.setattr(F, "_MOUNTED", ["/sys/kernel/tracing", "/x/y"])
    notes = F.unmount_ours()
    assert notes == ["unmounted /x/y (mounted by this run)", "left /sys/kernel/tracing mounted: target is busy"]
    assert F._MOUNTED == ["/sys/kernel/tracing"]
    assert F.unmount_ours() == ["unmounted /sys/kernel/tracing (mounted by this run)"] and F._MOUNTED == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["T", "t", "W", "d"]),
                          st.sampled_from(["inc_max_seq", "inc_max_seq.constprop.0", "inc_max_seq.isra.0.cold",
                                           "inc_max_seq_x", "xinc_max_seq", "inc_max", "other", "inc_max_seq."]),
                          st.sampled_from(["", "\t[kvm]", "\t[x.y]"])), max_size=12))
def test_symbol_lines_by_find_equal_the_anchored_regex(lines):
    """The kallsyms search by bytes.find gives what the line-anchored regex gives (it took 1.7 s
    under the lab's TCG)."""
    import re

    text = "".join(f"ffffffff8100{i:04x} {t} {n}{m}\n" for i, (t, n, m) in enumerate(lines)).encode()
    want = re.findall(rb"^\S+ \S (" + re.escape(b"inc_max_seq") + rb"(?:\.[\w.]+)?)(?:\t.*)?$", text, re.M)
    assert F._symbol_lines(text, "inc_max_seq") == want
    assert F._symbol_lines(text.rstrip(b"\n"), "inc_max_seq") == want  # no newline at the end


# -- tracepoint fields from BTF (no format file read at record time) ----------------------------

def _btf_blob(structs: dict[str, list[tuple[str, str]]], funcs: dict[str, str] | None = None) -> bytes:
    """A little-endian BTF blob: an int type, struct trace_entry, each struct of ``structs``
    ({name: [(member, "int" | "entry")]}) and, for ``funcs`` ({function: struct}), a FUNC whose
    one parameter ``ctx`` points to that struct (a probe object's tracepoint program)."""
    import struct as S

    from moetrace.kernel import btf as B

    strs, offs = b"\0", {"": 0}

    def s(name: str) -> int:
        nonlocal strs
        if name not in offs:
            offs[name] = len(strs)
            strs += name.encode() + b"\0"
        return offs[name]

    types: list[bytes] = []

    def add(kind: int, name: str, vlen: int, ref: int, extra: bytes = b"") -> int:
        types.append(S.pack("<III", s(name), (kind << 24) | vlen, ref) + extra)
        return len(types)

    i32 = add(B.INT, "int", 0, 4, S.pack("<I", 32))
    entry_members = [("type", i32), ("flags", i32), ("preempt_count", i32), ("pid", i32)]
    entry = add(B.STRUCT, "trace_entry", 4, 16, b"".join(S.pack("<III", s(n), t, 32 * k)
                                                         for k, (n, t) in enumerate(entry_members)))
    ids = {}
    for name, members in structs.items():
        body = b"".join(S.pack("<III", s(m), entry if t == "entry" else i32, 32 * k)
                        for k, (m, t) in enumerate(members))
        ids[name] = add(B.STRUCT, name, len(members), 4 * len(members), body)
    for fn, st in (funcs or {}).items():
        ptr = add(B.PTR, "", 0, ids[st])
        proto = add(B.FUNC_PROTO, "", 1, i32, S.pack("<II", s("ctx"), ptr))
        add(B.FUNC, fn, 0, proto)
    tdata = b"".join(types)
    return S.pack("<HBBIIIII", B.BTF_MAGIC, 1, 0, 24, 0, len(tdata), len(tdata), len(strs)) + tdata + strs


_OP_PAGE_CACHE = "trace_event_raw_mm_filemap_op_page_cache"


def _op_page_cache(order: bool) -> list[tuple[str, str]]:
    return ([("ent", "entry"), ("pfn", "int"), ("i_ino", "int"), ("index", "int"), ("s_dev", "int")]
            + ([("order", "int")] if order else []) + [("__data", "int")])


def test_btf_lists_a_tracepoints_format_fields_and_a_programs_context():
    from moetrace.kernel import btf as B

    b = B.Btf(_btf_blob({_OP_PAGE_CACHE: _op_page_cache(True),
                         "trace_event_raw_block_rq": [("ent", "entry"), ("dev", "int"), ("rwbs", "int"),
                                                      ("__data_loc_cmd", "int"), ("__data", "int")]},
                        {"tp_mm_filemap_add_to_page_cache": _OP_PAGE_CACHE}))
    assert set(b.tracepoint_fields(_OP_PAGE_CACHE)) == set(F.parse_format(ADD_TO_PAGE_CACHE_FORMAT))
    assert b.tracepoint_fields("trace_event_raw_block_rq") == (
        "common_type", "common_flags", "common_preempt_count", "common_pid", "dev", "rwbs", "cmd")
    assert b.tracepoint_fields("trace_event_raw_no_such_class") is None
    assert b.ctx_struct("tp_mm_filemap_add_to_page_cache") == _OP_PAGE_CACHE
    assert b.ctx_struct("no_such_program") is None


@pytest.mark.parametrize("btf_order,format_order", [(True, True), (False, False), (False, True), (True, False)])
def test_have_order_comes_from_btf_where_it_describes_the_event(tmp_path, monkeypatch, btf_order, format_order):
    """The struct of the event class with / without `order` decides MOE_HAVE_ORDER (and the fields a
    candidate needs), as the format file did; the format file is then not what decides (it says
    the opposite in two cases here). Without the struct in the kernel's BTF, the format decides."""
    from moetrace.kernel import btf as B

    no_order = ADD_TO_PAGE_CACHE_FORMAT.replace("\tfield:unsigned char order;\toffset:36;\tsize:1;\tsigned:0;\n", "")
    fmt = ADD_TO_PAGE_CACHE_FORMAT if format_order else no_order
    root = make_tree(tmp_path / "r", formats={
        "mm_filemap_add_to_page_cache": fmt,
        "mm_filemap_delete_from_page_cache": fmt.replace("add_to", "delete_from")})
    (root / "sys/kernel/btf/vmlinux").write_bytes(_btf_blob({_OP_PAGE_CACHE: _op_page_cache(btf_order)}))
    ctx = {f"tp_mm_filemap_{e}_page_cache": _OP_PAGE_CACHE for e in ("add_to", "delete_from")}
    monkeypatch.setattr(B, "object_ctx_structs", lambda path: ctx)
    for name in ("pagecache", "lru"):
        plan = resolve(PROBES[name], Features(root))
        assert plan.knobs["MOE_HAVE_ORDER"] == int(btf_order), (name, plan.knobs)
        assert plan.entry("add").attached
    # a BTF without the class: the format file decides, as before
    (root / "sys/kernel/btf/vmlinux").write_bytes(_btf_blob({"trace_event_raw_other": [("ent", "entry")]}))
    F.clear_cache()
    assert resolve(PROBES["pagecache"], Features(root)).knobs["MOE_HAVE_ORDER"] == int(format_order)


def test_a_field_the_btf_struct_lacks_rejects_the_candidate_with_the_same_reason(tmp_path, monkeypatch):
    from moetrace.kernel import btf as B

    root = make_tree(tmp_path / "r")
    members = [m for m in _op_page_cache(True) if m[0] != "i_ino"]
    (root / "sys/kernel/btf/vmlinux").write_bytes(_btf_blob({_OP_PAGE_CACHE: members}))
    monkeypatch.setattr(B, "object_ctx_structs", lambda path: {
        "tp_mm_filemap_add_to_page_cache": _OP_PAGE_CACHE})
    pc = resolve(PROBES["pagecache"], Features(root))
    assert pc.status == "no" and pc.entry("add").reason == (
        "format of filemap:mm_filemap_add_to_page_cache lacks i_ino (the probe reads them)")


def test_tracepoint_existence_is_asked_without_reading_the_format(tmp_path, monkeypatch):
    """A tracepoint exists when its format file does (stat): opening one takes the kernel's
    event_mutex, which an earlier recording's release may hold for seconds."""
    root = make_tree(tmp_path / "r")
    opened = []
    real_open = open

    def spy(path, *a, **k):
        if str(path).endswith("/format"):
            opened.append(str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", spy)
    feats = Features(root)
    assert feats.tracepoint_reason("filemap", "mm_filemap_add_to_page_cache") is None
    assert "no tracepoint filemap:nope" in feats.tracepoint_reason("filemap", "nope")
    assert opened == []


def test_answers_on_the_live_system_are_kept_for_this_boot(tmp_path, monkeypatch):
    """Features("/") keeps a format it had to read (syscalls: BTF does not describe them) and
    what BTF said in a file keyed by the boot id: a later process finds them there; another
    boot's file is ignored."""
    import json

    cache = tmp_path / "run" / "answers.json"
    monkeypatch.setattr(F, "BOOT_CACHE", str(cache))
    monkeypatch.setattr(F, "_boot_key", lambda: "boot-a 6.18")
    monkeypatch.setattr(F.os, "geteuid", lambda: 0)
    fmt = F.parse_format(SYS_ENTER_PREAD64_FORMAT)
    F._remember_format("syscalls", "sys_enter_pread64", fmt)
    F._disk_put("fields", _OP_PAGE_CACHE, ["pfn", "order"])
    doc = json.loads(cache.read_text())
    assert doc["key"] == "boot-a 6.18" and oct(cache.stat().st_mode & 0o777) == "0o600"
    F.clear_cache()
    assert F._disk_format("syscalls", "sys_enter_pread64") == fmt
    assert F._disk_get("fields", _OP_PAGE_CACHE) == ["pfn", "order"]
    monkeypatch.setattr(F, "_boot_key", lambda: "boot-b 6.18")
    F.clear_cache()
    assert F._disk_format("syscalls", "sys_enter_pread64") is None
    assert F._disk_get("fields", _OP_PAGE_CACHE) is None
