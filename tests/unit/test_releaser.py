"""The releaser that finishes a recording's detach after record returned (kernel/bpf.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from moetrace.kernel.bpf import Releaser, wait_pid_exit


def _poll(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_releaser_is_a_session_leader_holding_no_streams_until_released():
    r, w = os.pipe()  # a caller's pipe the releaser must not keep open
    rel = Releaser()
    try:
        pid = rel.pid
        assert pid and pid != os.getpid()
        # not our child (nobody has to reap it), its own session (no terminal signals)
        assert _poll(lambda: os.getsid(pid) == pid)
        with open(f"/proc/{pid}/status") as f:
            ppid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
        assert ppid != os.getpid()

        def streams_null() -> bool:
            return all(os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/null" for fd in (0, 1, 2))

        assert _poll(streams_null)
        ours = {os.readlink(f"/proc/self/fd/{fd}") for fd in (r, w)}
        assert _poll(lambda: not ours & _open_files(pid))
        assert os.path.exists(f"/proc/{pid}")  # it waits for release()
    finally:
        took = rel.wait(timeout=30)
        os.close(r)
        os.close(w)
    assert took >= 0 and _exited(pid)  # (a zombie until init reaps it: nothing held)


def _open_files(pid: int) -> set[str]:
    """What the process's fds point to now (an fd closed while listing is skipped: the releaser
    closes its files while we look)."""
    out = set()
    for x in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.add(os.readlink(f"/proc/{pid}/fd/{x}"))
        except FileNotFoundError:
            pass
    return out


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_caller_reading_the_output_is_not_held_by_the_releaser():
    # the process that made the releaser exits without releasing it: its exit is the release,
    # and the caller's pipes see EOF at once (the releaser closed its copies of them first)
    code = ("import os; from moetrace.kernel.bpf import Releaser; rel = Releaser(); "
            "print(rel.pid, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert wait_pid_exit(int(out.stdout), timeout=30)


def test_wait_pid_exit_of_a_gone_process_and_a_timeout():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert wait_pid_exit(p.pid, timeout=0.2) is False
    finally:
        p.kill()
        p.wait()
    assert wait_pid_exit(p.pid, timeout=1) is True


def test_a_releaser_closes_nothing_while_a_recording_attaches(tmp_path, monkeypatch):
    """AttachGate held: the releaser's threads wait before their next close, and go on once it is
    released (a recording's start-up then does not queue behind their RCU grace periods)."""
    import threading

    from moetrace.kernel import bpf

    monkeypatch.setattr(bpf, "ATTACH_GATE", str(tmp_path / "attach.lock"))
    gate = bpf.AttachGate()
    assert gate.held
    r, w = os.pipe()
    done = threading.Event()

    def closer() -> None:
        fd = bpf._open_gate()
        try:
            bpf._wait_gate_free(fd, time.monotonic() + 30)
            os.close(r)
        finally:
            os.close(fd)
            done.set()

    th = threading.Thread(target=closer)
    th.start()
    try:
        assert not done.wait(0.3)  # waiting for the attacher
        assert os.fstat(r)
    finally:
        gate.release()
        gate.release()  # idempotent
    assert done.wait(10)
    th.join()
    os.close(w)
    assert not gate.held


def test_a_releaser_waits_for_the_gate_no_longer_than_its_deadline(tmp_path, monkeypatch):
    from moetrace.kernel import bpf

    monkeypatch.setattr(bpf, "ATTACH_GATE", str(tmp_path / "attach.lock"))
    gate = bpf.AttachGate()
    fd = bpf._open_gate()
    try:
        t0 = time.monotonic()
        bpf._wait_gate_free(fd, t0 + 0.2)
        assert 0.15 < time.monotonic() - t0 < 5
        bpf._wait_gate_free(None, t0 + 60)  # no gate file (not root): no wait
    finally:
        os.close(fd)
        gate.release()


def test_no_gate_file_means_no_gate(tmp_path, monkeypatch):
    from moetrace.kernel import bpf

    (tmp_path / "a-file").write_text("")  # a gate that cannot be made (not root: /run is not ours)
    monkeypatch.setattr(bpf, "ATTACH_GATE", str(tmp_path / "a-file" / "attach.lock"))
    gate = bpf.AttachGate()
    assert not gate.held
    gate.release()
