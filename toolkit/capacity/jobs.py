"""Cells as jobs: a sweep's cells serialized into its directory (a job file each), and the job
function that runs one of them, the same wherever it runs (:mod:`moetrace.capacity.dispatch`
submits them: a local subprocess each, or a Slurm job each through submitit). Merging the cell
directories gives the results, whatever the order the jobs finished in.

The sweep directory (beside the results :mod:`moetrace.reports.sweep` writes)::

    DIR/sweep.json              the spec (the cells' common inputs, capacities, repeats, seed),
                                its digest, and every cell in the seeded randomized order
    DIR/miss_curve.npz          the plan's simulated miss curve, computed once for every job
    DIR/jobs/NAME.json          one cell's job: its CellSpec and where it writes (moetrace.job/1)
    DIR/jobs/NAME.ran.json      the last attempt: host, job id, start and end, outcome
    DIR/jobs/NAME.phase         the running cell's phase (for the progress display)
    DIR/jobs/attempts.jsonl     every submission and its end, appended
    DIR/jobs/logs/              the jobs' stdout/stderr (local: NAME.aK.log; Slurm: submitit's)
    DIR/cells/NAME/             the cell directory (run_cell's), cleared before a job runs it
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

from moetrace.atomic import atomic_write
from moetrace.errors import CellInterrupted, InputError
from moetrace.jsonutil import write_json
from moetrace.run import metadata
from moetrace.run.directory import read_json
from moetrace.run.documents import CELL_SCHEMA, JOB_SCHEMA, Cell, Job, Ran


@dataclass
class CellJob:
    """One cell as a self-contained job: its spec and where everything goes."""

    name: str  # <C>-r<i>
    label: str  # the capacity as written
    repeat: int
    order: int  # its place in the seeded randomized order
    spec: Any  # moetrace.capacity.cell.CellSpec
    out: str  # the sweep directory (absolute)
    curve: str | None = None  # DIR/miss_curve.npz
    stage_pool: str | None = None  # copy the pool under this node-local directory first

    @property
    def cell_dir(self) -> Path:
        return Path(self.out) / "cells" / self.name

    @property
    def job_path(self) -> Path:
        return Path(self.out) / "jobs" / f"{self.name}.json"

    def finished(self) -> bool:
        """Nothing left to run: the cell was retained (a sweep runs the others again)."""
        doc = read_cell(self)
        return bool(doc and doc["retained"])

    def give_up(self, why: str) -> None:
        """The job failed for good: the cell is not retained, with why (its cell.json kept when
        the job wrote one, the reason added)."""
        doc = read_cell(self) or failed_cell(self.spec, [])
        doc["retained"] = False
        doc["reasons"] = [*doc["reasons"], why]
        metadata.write_cell(self.cell_dir / "cell.json", doc)

    def as_dict(self) -> Job:
        return {"schema": JOB_SCHEMA, "kind": "sweep-cell", "name": self.name, "label": self.label, "repeat": self.repeat,
                "order": self.order, "out": self.out, "curve": self.curve, "stage_pool": self.stage_pool,
                "spec": asdict(self.spec)}


def spec_from_dict(doc: Any, where: str):
    """A CellSpec from its serialized form; InputError naming ``where`` on an unknown, missing or
    mistyped key (a hand-edited job file), UsageError on contradictory inputs."""
    from moetrace.capacity.cell import CellSpec

    if not isinstance(doc, dict):
        raise InputError(f"'spec' must be an object, not {type(doc).__name__}", path=where)
    known = {f.name: f for f in fields(CellSpec)}
    unknown = sorted(set(doc) - set(known))
    if unknown:
        raise InputError(f"unknown cell spec keys: {', '.join(map(str, unknown))}", path=where)
    for k in ("plan", "pool", "capacity_bytes"):
        if k not in doc:
            raise InputError(f"the cell spec has no {k!r}", path=where)
    ints = ("capacity_bytes", "headroom_bytes", "threads", "warmup", "passes")
    for k in ints:
        if k in doc and (not isinstance(doc[k], int) or isinstance(doc[k], bool)):
            raise InputError(f"spec key {k!r} must be an integer, not {doc[k]!r}", path=where)
    for k in ("plan", "pool", "mechanism", "mode", "prefetch", "name", "python", "outside_evictions"):
        if k in doc and not isinstance(doc[k], str):
            raise InputError(f"spec key {k!r} must be a string, not {doc[k]!r}", path=where)
    spec = CellSpec(**doc)
    spec.validate()
    return spec


def job_from_dict(doc: Any, where: str) -> CellJob:
    """:meth:`CellJob.as_dict` read back (InputError naming ``where`` when it is not one)."""
    if not isinstance(doc, dict) or doc.get("schema") != JOB_SCHEMA:
        raise InputError(f"not a moetrace job (schema {doc.get('schema') if isinstance(doc, dict) else None!r})",
                         path=where, hint="job files are written by `moetrace sweep`")
    for k, t in (("name", str), ("label", str), ("repeat", int), ("order", int), ("out", str)):
        if not isinstance(doc.get(k), t):
            raise InputError(f"job key {k!r} must be a {t.__name__}, not {doc.get(k)!r}", path=where)
    return CellJob(doc["name"], doc["label"], doc["repeat"], doc["order"], spec_from_dict(doc.get("spec"), where),
                   doc["out"], doc.get("curve"), doc.get("stage_pool"))


def read_job(path: str | os.PathLike) -> CellJob:
    return job_from_dict(read_json(path, "job file"), str(path))


def read_cell(job: CellJob) -> Cell | None:
    """The cell's cell.json (None: absent or unreadable, a cell that never finished)."""
    try:
        return metadata.read_cell(job.cell_dir / "cell.json")
    except InputError:
        return None


def failed_cell(spec, reasons: list[str]) -> Cell:
    """The cell.json of a cell that did not run (its setup failed, or its job did twice)."""
    return {"schema": CELL_SCHEMA, "complete": False, "capacity_bytes": spec.capacity_bytes,
            "mechanism": spec.mechanism, "mode": spec.mode, "retained": False, "reasons": reasons}


def last_run(out: str | os.PathLike, name: str) -> Ran | dict[str, Any]:
    """Job NAME's DIR/jobs/NAME.ran.json (its last attempt: host, job id, times, outcome); {} when
    absent or unreadable (a job not started yet)."""
    try:
        return metadata.read_ran(Path(out) / "jobs" / f"{name}.ran.json")
    except InputError:
        return {}


# -- the job itself: what runs on the node ---------------------------------------------------------

def stage_pool(src: str | os.PathLike, dest_root: str | os.PathLike) -> Path:
    """A copy of pool ``src`` under ``dest_root``/<manifest checksum> (a node-local path: the page
    cache a cell measures is the local one, not a network filesystem's); reused when a copy with
    the same manifest checksum and sound files is there already."""
    from moetrace.inputs.pool import MANIFEST, open_pool, verify_pool

    pool = open_pool(src)
    checksum = str(pool.manifest.get("checksum", "")).split(":")[-1][:16]
    dest = Path(dest_root) / f"pool-{checksum}"
    if (dest / MANIFEST).exists():
        try:
            have = open_pool(dest)
            if have.manifest.get("checksum") == pool.manifest.get("checksum") and not verify_pool(have):
                return dest
        except InputError:
            pass
        shutil.rmtree(dest)
    tmp = Path(dest_root) / f".pool-{checksum}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for rel in [*pool.files, MANIFEST]:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(pool.root / rel, tmp / rel)
        staged = open_pool(tmp)
        problems = verify_pool(staged)
        if staged.manifest.get("checksum") != pool.manifest.get("checksum") or problems:
            raise InputError(f"the staged pool differs from its source: {'; '.join(problems) or 'manifest'}",
                             path=str(tmp), hint="check the space and the filesystem of --stage-pool")
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def job_id() -> str:
    """This job's id: Slurm's, else this process's pid."""
    return os.environ.get("SLURM_JOB_ID") or str(os.getpid())


#: a job file's ``kind`` -> the module and function that run it: (job file's doc, phase) -> result
#: dict with ``retained`` and ``reasons`` (names, not imports: the capacity floor does not import the lab)
KINDS = {"sweep-cell": ("moetrace.capacity.jobs", "run_cell_job"),
         "matrix-cell": ("moetrace.lab.matrix", "run_matrix_job")}


def run_job(job_path: str, on_phase: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run job file ``job_path``: the job function, the same for every executor and every kind
    (:data:`KINDS`: a sweep's cell, a matrix's cell). Writes NAME.ran.json (host, job id, start,
    end, outcome) and NAME.phase as phases start. SIGINT/SIGTERM (Ctrl-C, scancel) end it as the
    cell does (CellInterrupted, everything it made removed) and the job fails. Returns the
    cell's retained flag, reasons and host."""
    import importlib

    from moetrace.capacity.cell import interrupt_handlers

    doc = read_json(job_path, "job file")
    kind = doc.get("kind", "sweep-cell") if isinstance(doc, dict) else None
    if kind not in KINDS or not isinstance(doc.get("name"), str) or not isinstance(doc.get("out"), str):
        raise InputError(f"not a moetrace job (kind {kind!r})", path=str(job_path),
                         hint="job files are written by `moetrace sweep` and `moetrace lab matrix`")
    jobs = Path(doc["out"]) / "jobs"
    ran: Ran = {"name": doc["name"], "host": socket.gethostname(), "job_id": job_id(), "started_at": time.time(),
                "ended_at": None, "outcome": "running"}
    metadata.write_ran(jobs / f"{doc['name']}.ran.json", ran)

    def phase(name: str) -> None:
        with atomic_write(jobs / f"{doc['name']}.phase") as tmp:
            tmp.write_text(name + "\n")
        if on_phase is not None:
            on_phase(name)

    module, func = KINDS[kind]
    try:
        with interrupt_handlers():
            res = getattr(importlib.import_module(module), func)(doc, str(job_path), phase)
        ran["outcome"] = "retained" if res["retained"] else "not retained"
    except CellInterrupted as e:
        ran["outcome"] = str(e)
        raise
    finally:
        ran["ended_at"] = time.time()
        metadata.write_ran(jobs / f"{doc['name']}.ran.json", ran)
    return {"name": doc["name"], "retained": bool(res["retained"]), "reasons": res["reasons"], "host": ran["host"]}


def run_cell_job(doc: Job, where: str, phase: Callable[[str], None]) -> Cell:
    """A sweep's cell: the pool staged when asked, the saved miss curve loaded, run_cell into the
    cell directory (cleared first: a stopped attempt's leftovers). A cell whose setup fails is a
    cell.json that is not retained, with the reason (the job succeeds)."""
    import click

    from moetrace.capacity.cell import load_miss_curve, run_cell

    job = job_from_dict(doc, where)
    spec = job.spec
    if job.cell_dir.exists():
        shutil.rmtree(job.cell_dir)
    try:
        if job.stage_pool:
            phase("stage pool")
            spec = replace(spec, pool=str(stage_pool(spec.pool, job.stage_pool)))
        curve = load_miss_curve(job.curve, spec.plan, spec.warmup, spec.passes) if job.curve else None
        return run_cell(spec, job.cell_dir, curve=curve, on_phase=phase)
    except click.ClickException as e:  # the cell could not be set up: recorded, not retained
        res = failed_cell(spec, [f"error: {e.format_message()}"])
        metadata.write_cell(job.cell_dir / "cell.json", res)
        return res


def slurm_job(job_path: str) -> dict[str, Any]:
    """The function submitit runs on a Slurm node: :func:`run_job` in a process of its own (the
    probes' debugfs/tracefs mounts go with it)."""
    from moetrace.kernel.features import private_mounts

    private_mounts(dedicated=True)
    return run_job(job_path)


def main(argv: list[str] | None = None) -> int:
    """``python -m moetrace.capacity.jobs JOB.json``: the local executor's job process."""
    from moetrace.errors import MoetraceError
    from moetrace.kernel.features import private_mounts

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m moetrace.capacity.jobs JOB.json", file=sys.stderr)
        return 2
    private_mounts()
    try:
        res = run_job(args[0])
    except CellInterrupted as e:
        print(f"moetrace job: {e}", file=sys.stderr)
        return e.exit_code
    except MoetraceError as e:
        print(f"moetrace job: {e.format_message()}", file=sys.stderr)
        return 1
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
