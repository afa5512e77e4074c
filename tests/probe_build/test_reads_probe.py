"""The reads probe (probes/reads.bpf.c + moetrace.record.probes.reads)
(probe-build tier)."""

from __future__ import annotations

import struct

from common.backends import *  # noqa: F401,F403
from common.reads_probe import *  # noqa: F401,F403


@pytest.mark.probe_build
@pytest.mark.parametrize("name", list(KNOB_SETS))
def test_reads_loads_attaches_and_detaches(live, name):
    from moetrace.kernel.bpf import prog_id_exists, prog_info

    full = {k: int(v) for k, v in SPEC.knob_values(**KNOB_SETS[name]).items()}
    probe = load_first(SPEC, full)
    try:
        tps = set(probe.tracepoints)
        assert {"syscalls:sys_enter_pread64", "syscalls:sys_exit_pread64",
                "filemap:mm_filemap_add_to_page_cache"} <= tps
        assert ("syscalls:sys_enter_preadv2" in tps) == bool(full["MOE_HAVE_PREADV2"])
        assert ("syscalls:sys_exit_read" in tps) == bool(full["MOE_HAVE_READ"])
        assert ("syscalls:sys_enter_close" in tps) == bool(full["MOE_TRACK_CLOSE"])
        assert ("task:task_newtask" in tps) == bool(full["MOE_FOLLOW_FORKS"])
        assert len(tps) == 3 + 2 * sum(full[k] for k in ("MOE_HAVE_PREADV", "MOE_HAVE_PREADV2", "MOE_HAVE_READ")) \
            + sum(full[k] for k in ("MOE_TRACK_CLOSE", "MOE_TRACK_CLOSE_RANGE", "MOE_TRACK_EXEC", "MOE_FOLLOW_FORKS"))
        assert len(probe.table("stats")) == len(SPEC.stats)
        assert len(probe.table("classes")) == len(CLASSES)
        ids = [prog_info(fd)["id"] for fd in probe.prog_fds().values()]
        assert len(ids) == len(tps) and all(prog_id_exists(i) for i in ids)
    finally:
        probe.close()
    print(f"\nreads {name}: load+attach {probe.load_attach_s:.3f} s")
    assert not any(prog_id_exists(i) for i in ids), "programs still loaded after close()"


@pytest.mark.probe_build
def test_nested_structs_match_the_object():
    """struct fd_agg and struct live (nested: no Struct declares them) have the layout the recorder
    reads them with: the object's BTF says so."""
    from moetrace.kernel.bpf import object_path, stale_object
    from moetrace.kernel.libbpf import BpfObject
    from moetrace.record.probes.reads import FD_AGG_DTYPE, LIVE_DTYPE

    assert stale_object("reads") is None, stale_object("reads")
    with BpfObject(object_path("reads")) as o:
        for name, dt in (("fd_agg", FD_AGG_DTYPE), ("live", LIVE_DTYPE)):
            assert o.struct_layout(name) == [(f, dt.fields[f][1], dt.fields[f][0].itemsize) for f in dt.names], name


@pytest.mark.probe_build
def test_recorder_open_close_abort_are_idempotent(live, tmp_path):
    """The recorder's own path (knobs from the live attach plan), a pid of our own followed: our preads are counted and classed; close() and abort()
    leave no program behind."""
    from moetrace.kernel.features import Features
    from moetrace.record.probe import RecordContext
    from moetrace.record.probes.reads import ReadsRecorder
    from moetrace.kernel.bpf import prog_id_exists

    feats = Features("/")
    rec = ReadsRecorder(RecordContext(features=feats, plan=resolve(SPEC, feats), log_dir=tmp_path))
    rec.open()
    ids = rec.prog_ids()
    try:
        f = tmp_path / "x.bin"
        f.write_bytes(b"y" * 8192)
        fd = os.open(f, os.O_RDONLY)
        rec.follow(os.getpid())
        for _ in range(3):
            assert len(os.pread(fd, 4096, 0)) == 4096
        with pytest.raises(OSError):
            os.pread(-1, 10, 0)
        rec.poll(50)
        assert rec.probe.delete("tgids", struct.pack("<I", os.getpid()))  # stop following before pytest goes on
        os.close(fd)
        rec.close()
        rec.close()
        rec.abort()
    finally:
        rec.abort()
    assert ids and not any(prog_id_exists(i) for i in ids)
    assert rec.collected
    tables, summary = rec.tables()
    assert summary["calls_by_syscall"]["pread64"] == 4
    assert summary["classes"]["error"]["calls"] == 1
    files = tables["reads_files"]
    mine = files[(files["fd"] == fd) & (files["path"] == str(f))]
    assert int(mine["calls"].sum()) == 3 and int(mine["hit_only_calls"].sum()) == 3  # just written: cached
    assert int(mine["bytes"].sum()) == 3 * 4096
