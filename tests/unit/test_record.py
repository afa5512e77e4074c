"""`moetrace record` with the pagecache probe (unit tier)."""

from __future__ import annotations

from common.record import *  # noqa: F401,F403
from common import read_run


def test_run_dir_is_private_and_refuses_reuse(tmp_path):
    old = os.umask(0o022)
    try:
        d = rundir.create_run_dir(tmp_path / "a" / "run")
        assert rundir.is_private(d)
        rundir.write_manifest(d, {"complete": False})
        assert rundir.is_private(d / rundir.MANIFEST)
        with pytest.raises(Exception, match="not empty"):
            rundir.create_run_dir(d)
        doc, tables = read_run(d)
        assert doc["schema"] == "moetrace.run/1" and doc["complete"] is False and tables == {}
    finally:
        os.umask(old)


def test_newer_run_schema_is_refused(tmp_path):
    d = rundir.create_run_dir(tmp_path / "r")
    rundir.write_manifest(d, {"schema": "moetrace.run/99"})
    with pytest.raises(Exception, match="newer"):
        rundir.read_manifest(d)


def test_privilege_refusal_names_what_is_missing():
    with pytest.raises(bpf.PrivilegeError, match="CAP_BPF and CAP_PERFMON"):
        bpf.require_privileges({"root": False, "cap_bpf": False, "cap_perfmon": False})
    with pytest.raises(bpf.PrivilegeError, match="lacks CAP_PERFMON"):
        bpf.require_privileges({"root": False, "cap_bpf": True, "cap_perfmon": False})
    bpf.require_privileges({"root": False, "cap_bpf": True, "cap_perfmon": True})
    bpf.require_privileges({"root": True, "cap_bpf": False, "cap_perfmon": False})


def test_tracefs_refusal_says_the_mount_command(tmp_path):
    class F:  # a fake tree with no tracefs: never mounted (not the live root)
        root, tracefs, notes = str(tmp_path), None, []

    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "mounts").write_text("")
    with pytest.raises(bpf.PrivilegeError, match="mount -t tracefs nodev /sys/kernel/tracing"):
        bpf.require_tracefs(F())


def test_recorder_uses_the_one_declaration():
    """No second declaration: the recorder's probe is probespec's, its ring dtype is the declared struct."""
    from moetrace.record import spec as probespec
    from moetrace.record import probes as probe_registry
    from moetrace.record import recorder

    from moetrace.record.probes import recorder_class

    assert recorder_class("pagecache").spec is probe_registry.PROBES["pagecache"]
    assert not hasattr(recorder, "ProbeDecl") and not hasattr(recorder, "resolve_attach")
    # every recorded probe goes through the one interface
    from moetrace.record.probe import ProbeRecorder

    assert all(issubclass(recorder_class(p), ProbeRecorder) for p in recorder.RECORDED)
    assert recorder.PAGE_EVENT_DTYPE == probe_registry.PROBES["pagecache"].struct("page_event").dtype()
    assert set(recorder.RECORDED) <= set(probe_registry.PROBES)


def test_unknown_probes_are_refused():
    from moetrace.errors import UsageError
    from moetrace.record.recorder import RecordOptions, record

    with pytest.raises(UsageError, match="no such probe: nope"):
        record(RecordOptions(["true"], probes=("pagecache", "nope")))


def test_a_declared_probe_without_recorder_is_refused(monkeypatch):
    """A probe declared (doctor resolves it) but without a recorder module: an error, or a note
    under --missing-probes warn."""
    from moetrace.record import recorder
    from moetrace.errors import UsageError
    from moetrace.record.recorder import RecordOptions, record

    monkeypatch.setattr(recorder, "RECORDED", tuple(p for p in recorder.RECORDED if p != "lru"))
    with pytest.raises(UsageError, match="probe lru: not recorded"):
        record(RecordOptions(["true"], probes=("pagecache", "lru")))


def test_small_helpers():
    assert kernel_dev(os.makedev(254, 3)) == (254 << 20) | 3
    assert pool_from_command(["replay", "p.bin", "--pool", "/x"]) == "/x"
    assert pool_from_command(["replay", "--pool=/y"]) == "/y"
    assert pool_from_command(["dd"]) is None
