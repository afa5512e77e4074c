"""Submitting a sweep's cell jobs (:mod:`moetrace.capacity.jobs`) and following them to the end.

Executors: ``local`` runs each job function in a subprocess of its own, one at a time (a cell
needs the machine alone); ``slurm`` submits every job at once through submitit (``--exclusive``:
each cell has its node alone; the scheduler keeps the seeded order on one node). Job states come
from the job itself (local: its exit status) or ``squeue --states=all`` (Slurm; submitit's own
watcher needs ``sacct``, i.e. an accounting database a small cluster may not run). A job that
fails (an error, a cancel, its node lost) is reported with its log path and resubmitted once; a
second failure leaves the cell not retained with the reason. Ctrl-C (or SIGTERM) cancels the
jobs still queued or running and waits for them to clean up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from moetrace.capacity.cell import check_interrupted
from moetrace.capacity.jobs import CellJob, run_job, slurm_job
from moetrace.errors import CellInterrupted, UsageError

EXECUTORS = ("local", "slurm")
#: a failed job is submitted this many times in all: the first time and one resubmission
ATTEMPTS = 2
POLL_S = 1.0
#: how long a cancelled job may take to clean up its cell (Slurm's KillWait is 30 s by default)
CANCEL_WAIT_S = 90.0
PENDING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED"}
RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"}


@dataclass
class Submitted:
    """One attempt of one job."""

    job: CellJob
    attempt: int
    job_id: str
    log: str
    handle: Any = None  # a Popen (local), a submitit Job (slurm)
    state: str = "pending"  # pending | running | done | failed
    error: str | None = None


def log_tail(path: str | os.PathLike, n: int = 1) -> str:
    """The last ``n`` non-empty lines of a log ('' when unreadable)."""
    try:
        lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


class LocalExecutor:
    """Each job in a subprocess of this machine (``python -m moetrace.capacity.jobs JOB.json``),
    one at a time; the job dies with this process (PR_SET_PDEATHSIG SIGTERM: it cleans up)."""

    name, serial = "local", True

    def __init__(self, out: str | os.PathLike):
        self.logs = Path(out) / "jobs" / "logs"

    def submit(self, job: CellJob, attempt: int) -> Submitted:
        from moetrace.kernel.syscalls import set_pdeathsig

        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{job.name}.a{attempt}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "moetrace.capacity.jobs", str(job.job_path)],
                                    stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                    preexec_fn=lambda: set_pdeathsig(signal.SIGTERM))
        return Submitted(job, attempt, str(proc.pid), str(log), proc, "running")

    def poll(self, subs: list[Submitted]) -> None:
        for s in subs:
            rc = s.handle.poll()
            if rc is not None:
                s.state = "done" if rc == 0 else "failed"
                s.error = None if rc == 0 else f"exit status {rc}: {log_tail(s.log) or 'no output'}"

    def cancel(self, subs: list[Submitted]) -> None:
        for s in subs:
            if s.handle.poll() is None:
                s.handle.send_signal(signal.SIGTERM)

    def wait(self, subs: list[Submitted], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for s in subs:
            try:
                s.handle.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                s.handle.kill()
                s.handle.wait()


class InlineExecutor:
    """Each job function called in this process (no-kernel tests with a faked cell; debugging)."""

    name, serial = "inline", True

    def __init__(self, out: str | os.PathLike, on_phase: Callable[[str, str], None] | None = None):
        self.on_phase = on_phase

    def submit(self, job: CellJob, attempt: int) -> Submitted:
        s = Submitted(job, attempt, str(os.getpid()), "", None, "running")
        hook = None if self.on_phase is None else (lambda p: self.on_phase(job.name, p))
        try:
            run_job(str(job.job_path), on_phase=hook)
            s.state = "done"
        except Exception as e:  # noqa: BLE001 - a job's failure is reported, as a job process's is
            s.state, s.error = "failed", f"{type(e).__name__}: {e}"
        return s

    def poll(self, subs: list[Submitted]) -> None:
        pass

    def cancel(self, subs: list[Submitted]) -> None:
        pass

    def wait(self, subs: list[Submitted], timeout_s: float) -> None:
        pass


class SlurmExecutor:
    """Each job a Slurm job through submitit: one node, exclusive by default (the cell has the
    node alone), all submitted at once in the seeded order."""

    name, serial = "slurm", False

    def __init__(self, out: str | os.PathLike, partition: str | None = None, time_min: int = 120,
                 exclusive: bool = True, extra: dict[str, Any] | None = None):
        import shutil

        import submitit

        if shutil.which("sbatch") is None or shutil.which("squeue") is None:
            raise UsageError("--executor slurm needs Slurm's client commands (sbatch, squeue, scancel) on PATH",
                             hint="install slurm-client (a test cluster on this machine: scripts/slurm-local.sh up)")
        self.ex = submitit.AutoExecutor(folder=str(Path(out) / "jobs" / "logs" / "%j"), cluster="slurm")
        params: dict[str, Any] = {"timeout_min": int(time_min), "nodes": 1, "tasks_per_node": 1,
                                  "name": "moetrace-cell", "slurm_additional_parameters": dict(extra or {})}
        if partition:
            params["slurm_partition"] = partition
        if exclusive:
            params["slurm_exclusive"] = True
            params["slurm_additional_parameters"].setdefault("mem", "0")  # all of the node's memory
        self.ex.update_parameters(**params)

    def submit(self, job: CellJob, attempt: int) -> Submitted:
        try:
            j = self.ex.submit(slurm_job, str(job.job_path))
        except Exception as e:  # submitit raises its own errors with sbatch's message
            raise UsageError(f"sbatch refused the job of cell {job.name}: {e}",
                             hint="check the partition and time limit (`sinfo`), and SLURM_CONF") from None
        return Submitted(job, attempt, str(j.job_id), str(j.paths.stdout), j, "pending")

    def queue_states(self, ids: list[str]) -> dict[str, str] | None:
        """{job id: state} from squeue (completed jobs stay listed for MinJobAge); None when squeue
        could not answer (the controller restarting): no job is judged on that."""
        if not ids:
            return {}
        try:
            r = subprocess.run(["squeue", "-h", "--states=all", "-o", "%i %T", "-j", ",".join(ids)],
                               capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            return None
        if r.returncode != 0 and "Invalid job id" not in r.stderr:
            return None
        states = {}
        for line in r.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    def poll(self, subs: list[Submitted]) -> None:
        states = self.queue_states([s.job_id for s in subs])
        if states is None:
            return
        for s in subs:
            st = states.get(s.job_id)
            if s.handle.paths.result_pickle.exists():
                try:
                    s.handle.result()
                    s.state = "done"
                except Exception as e:  # noqa: BLE001 - the job raised: its traceback is in the log
                    s.state = "failed"
                    s.error = (str(e).strip().splitlines() or ["failed"])[-1]
            elif st in PENDING:
                s.state = "pending"
            elif st in RUNNING:
                s.state = "running"
            else:
                s.state, s.error = "failed", f"Slurm job {s.job_id} ended {st or 'gone from the queue'} without a result"

    def cancel(self, subs: list[Submitted]) -> None:
        for s in subs:
            try:
                s.handle.cancel(check=False)
            except Exception:  # noqa: BLE001 - scancel of a job that ended meanwhile
                pass

    def wait(self, subs: list[Submitted], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self.queue_states([s.job_id for s in subs])
            if states is not None and not any(states.get(s.job_id) in PENDING | RUNNING for s in subs):
                return
            time.sleep(POLL_S)


def make_executor(name: str, out: str | os.PathLike, **slurm: Any):
    if name == "local":
        return LocalExecutor(out)
    if name == "slurm":
        return SlurmExecutor(out, **slurm)
    raise UsageError(f"unknown executor {name!r}", hint="use --executor local or slurm")


@dataclass
class Dispatched:
    """What a dispatch did: cells whose jobs finished, those that failed twice (name -> why), the
    jobs submitted (attempts, resubmissions included), and the interruption that stopped it."""

    done: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    submitted: list[str] = field(default_factory=list)
    stopped: CellInterrupted | None = None


@dataclass
class Status:
    """The progress display's view: cells pending (queued here or in the scheduler), running (with
    their phase) and done, of ``total``."""

    total: int
    pending: int = 0
    running: dict[str, str] = field(default_factory=dict)
    done: int = 0
    failed: int = 0


def phase_of(job) -> str:
    try:
        return (Path(job.out) / "jobs" / f"{job.name}.phase").read_text().strip()
    except OSError:
        return ""


def _log(job, doc: dict[str, Any]) -> None:
    from moetrace.jsonutil import json_default

    path = Path(job.out) / "jobs" / "attempts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps({"name": job.name, "at": time.time(), **doc}, default=json_default) + "\n")


def dispatch(jobs: list, executor, on_status: Callable[[Status], None] | None = None,
             on_event: Callable[[str], None] | None = None, on_end: Callable[[Submitted], None] | None = None,
             poll_s: float = POLL_S) -> Dispatched:
    """Submit ``jobs`` (in their order; a job has ``name``, ``out``, ``job_path`` and
    ``give_up(why)``: :class:`moetrace.capacity.jobs.CellJob`, a matrix's cell job) to
    ``executor`` and follow them until each is done or has failed :data:`ATTEMPTS` times.
    ``on_status`` is told the counts after every change, ``on_event`` a line for each failure
    and resubmission, ``on_end`` each attempt that ended (done, or failed for good). Ctrl-C / SIGTERM (inside
    :func:`moetrace.capacity.cell.interrupt_handlers`): the jobs still queued or running are
    cancelled and waited for; ``stopped`` says so."""
    queue, active, out = deque(jobs), [], Dispatched()
    tries: dict[str, int] = {}
    status = Status(len(jobs))

    def tell(text: str) -> None:
        if on_event is not None:
            on_event(text)

    def show() -> None:
        if on_status is not None:
            try:
                on_status(status)
            except Exception:  # noqa: BLE001 - a failing display never stops the sweep
                pass

    def relay(name: str, phase: str) -> None:  # an in-process job's phases, as they start
        status.running = {name: phase}
        show()

    if hasattr(executor, "on_phase") and executor.on_phase is None:
        executor.on_phase = relay
    try:
        while queue or active:
            check_interrupted()  # a Ctrl-C swallowed while a local job was forked
            while queue and not (executor.serial and active):
                job = queue.popleft()
                tries[job.name] = tries.get(job.name, 0) + 1
                sub = executor.submit(job, tries[job.name])
                active.append(sub)
                out.submitted.append(job.name)
                _log(job, {"event": "submitted", "attempt": sub.attempt, "executor": executor.name,
                           "job_id": sub.job_id, "log": sub.log})
            executor.poll(active)
            for sub in [s for s in active if s.state in ("done", "failed")]:
                active.remove(sub)
                _log(sub.job, {"event": sub.state, "attempt": sub.attempt, "job_id": sub.job_id, "error": sub.error})
                if sub.state == "done":
                    out.done.append(sub.job.name)
                    if on_end is not None:
                        on_end(sub)
                elif tries[sub.job.name] < ATTEMPTS:
                    tell(f"cell {sub.job.name}: job {sub.job_id} failed ({sub.error}); log {sub.log}; resubmitting")
                    queue.append(sub.job)
                else:
                    why = f"job failed {ATTEMPTS} times, the last: {sub.error} (log: {sub.log})"
                    sub.job.give_up(why)
                    out.failed[sub.job.name] = why
                    tell(f"cell {sub.job.name}: {why}")
                    if on_end is not None:
                        on_end(sub)
            status.pending = len(queue) + sum(s.state == "pending" for s in active)
            status.running = {s.job.name: phase_of(s.job) for s in active if s.state == "running"}
            status.done, status.failed = len(out.done), len(out.failed)
            show()
            if active:
                time.sleep(poll_s)
    except CellInterrupted as e:
        out.stopped = e
        stop(executor, active)
    except BaseException:  # an error here (sbatch refused a job): nothing submitted is left behind
        stop(executor, active)
        raise
    return out


def stop(executor, active: list[Submitted]) -> None:
    """Cancel the jobs still queued or running and wait for their cells to clean up."""
    executor.cancel(active)
    executor.wait(active, CANCEL_WAIT_S)
    for s in active:
        _log(s.job, {"event": "cancelled", "attempt": s.attempt, "job_id": s.job_id})
