"""The §5 matrix without a guest (no-kernel tier): the spec, its cells and their order, and the
matrix directory's resume logic (a stopped matrix redoes no finished cell)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetrace.errors import InputError, UsageError
from moetrace.lab import matrix as M

SPEC = '''kernels = ["6.1", "6.12"]
mglru = ["on", "off"]
mechanisms = ["cgroup", "balloon:0.81", "vm-memory"]
capacities = ["192MiB", "320MiB"]
repeats = 2
plan = "plan.bin"
pool = "/var/tmp/pool"
mode = "mmap"
'''


def write_spec(tmp_path: Path, text: str = SPEC) -> Path:
    p = tmp_path / "spec.toml"
    p.write_text(text)
    return p


def test_cells_cover_the_product_conditions_in_turn_and_order_is_stable(tmp_path):
    spec = M.load_spec(write_spec(tmp_path))
    assert spec.plan == str((tmp_path / "plan.bin").resolve()) and spec.mode == "mmap"
    cells = spec.cells()
    assert len(cells) == 2 * 2 * 3 * 2 * 2
    conds = [c.condition for c in cells]
    assert list(dict.fromkeys(conds)) == ["6.1-mglru-on", "6.1-mglru-off", "6.12-mglru-on", "6.12-mglru-off"]
    assert conds == sorted(conds, key=list(dict.fromkeys(conds)).index)  # each condition's cells together
    for cond in set(conds):
        mine = [c for c in cells if c.condition == cond]
        assert sorted((c.mechanism.label, c.capacity_label, c.repeat) for c in mine) == sorted(
            (m, cap, r) for m in ("cgroup", "balloon0.81", "vm-memory") for cap in ("192MiB", "320MiB") for r in (0, 1))
        assert [c.order for c in mine] == list(range(12))
    assert cells == M.load_spec(write_spec(tmp_path)).cells()  # the same order on every load
    assert len({c.rel_dir for c in cells}) == len(cells)
    assert cells[0].rel_dir.startswith("cells/6.1-mglru-on/")


@pytest.mark.parametrize("edit, needle", [
    (lambda s: s.replace('plan = "plan.bin"\n', ""), "missing key.*plan"),
    (lambda s: s + "colour = 1\n", "unknown key.*colour"),
    (lambda s: s.replace('"balloon:0.81"', '"balloon:1.2"'), "unknown mechanism 'balloon:1.2'"),
    (lambda s: s.replace('mglru = ["on", "off"]', 'mglru = ["on", "maybe"]'), "maybe is not on or off"),
    (lambda s: s.replace('"320MiB"', '"192MiB"'), "repeats a capacity"),
    (lambda s: s.replace("repeats = 2", "repeats = 0"), "repeats must be an integer >= 1"),
    (lambda s: s.replace('mode = "mmap"', 'mode = "direct"'), "mode 'direct' is not one of"),
    (lambda s: s.replace('"6.12"]', '"6.1"]'), "kernels names one twice"),
    (lambda s: s + "kernels = [\n", "not TOML"),
])
def test_a_bad_spec_is_an_error_naming_the_file_and_the_key(tmp_path, edit, needle):
    with pytest.raises((InputError, UsageError), match=needle) as ei:
        M.load_spec(write_spec(tmp_path, edit(SPEC)))
    assert "spec.toml" in ei.value.format_message()


def test_resume_redoes_no_finished_cell_and_clears_a_stopped_one(tmp_path):
    spec = M.load_spec(write_spec(tmp_path))
    out = tmp_path / "m"
    work = M.prepare(out, spec, resume=False)
    assert not work.done and work.todo == spec.cells() and (out / "matrix.json").exists()
    first, second, third = work.todo[:3]
    M.mark_done(out, first, {"lab": {}, "retained": True, "reasons": [], "result": None})
    M.mark_done(out, second, {"lab": {}, "retained": False, "reasons": ["oom"], "result": None})
    (out / third.rel_dir).mkdir(parents=True)
    (out / third.rel_dir / "lab.json").write_text("{}")  # stopped part-way: no done.json
    with pytest.raises(UsageError, match="holds a matrix already"):
        M.prepare(out, spec, resume=False)
    work = M.prepare(out, spec, resume=True)
    assert work.done == [first, second] and work.todo == spec.cells()[2:]
    assert work.cleared == [third.rel_dir] and not (out / third.rel_dir).exists()
    assert [d["cell"]["name"] for d in M.finished(out)] == [first.name, second.name]
    assert M.finished(out)[1]["reasons"] == ["oom"]
    from moetrace.run.metadata import retained_matrix_cells  # calibrate and pair_checks take these

    meta, kept = retained_matrix_cells(out)
    assert [c["name"] for c in kept] == [first.name] and len(meta["cells"]) == len(spec.cells())


def test_resume_refuses_another_spec_and_a_directory_without_a_matrix(tmp_path):
    spec = M.load_spec(write_spec(tmp_path))
    out = tmp_path / "m"
    M.prepare(out, spec, resume=False)
    other = M.load_spec(write_spec(tmp_path, SPEC.replace("repeats = 2", "repeats = 3")))
    with pytest.raises(UsageError, match=r"another spec \(differs in: repeats\)"):
        M.prepare(out, other, resume=True)
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "x").write_text("")
    with pytest.raises(UsageError, match="holds no matrix.json"):
        M.prepare(stray, spec, resume=True)
    with pytest.raises(UsageError, match="is not empty"):
        M.prepare(stray, spec, resume=False)
    assert json.loads((out / "matrix.json").read_text())["digest"] == spec.digest() != other.digest()


@settings(max_examples=40, deadline=None)
@given(st.sets(st.integers(0, 47)), st.sets(st.integers(0, 47)))
def test_any_set_of_finished_and_stopped_cells_resumes_to_exactly_the_rest(tmp_path_factory, done_i, stopped_i):
    tmp = tmp_path_factory.mktemp("m")
    spec = M.load_spec(write_spec(tmp))
    out = tmp / "m"
    cells = M.prepare(out, spec, resume=False).todo
    for i in done_i:
        M.mark_done(out, cells[i], {"lab": {}, "retained": False, "reasons": [], "result": None})
    for i in stopped_i - done_i:
        (out / cells[i].rel_dir).mkdir(parents=True)
    work = M.prepare(out, spec, resume=True)
    assert work.done == [c for i, c in enumerate(cells) if i in done_i]
    assert work.todo == [c for i, c in enumerate(cells) if i not in done_i]
    assert sorted(work.cleared) == sorted(cells[i].rel_dir for i in stopped_i - done_i)


def test_guest_memory_per_mechanism(tmp_path):
    spec = M.load_spec(write_spec(tmp_path))
    by = {c.mechanism.label: M.guest_memory(c, spec) for c in spec.cells() if c.capacity_label == "192MiB"}
    need = (192 << 20) + spec.headroom + spec.guest_base
    assert by["cgroup"] == max(2 << 30, need)
    assert by["vm-memory"] == -(-(need + (320 << 20)) // (64 << 20)) * (64 << 20)  # cells are recorded
    from moetrace.capacity.cell import RECORDER_ALLOWANCE

    assert abs(by["balloon0.81"] * 0.19 - need - RECORDER_ALLOWANCE) < 64 << 20 and by["balloon0.81"] % (64 << 20) == 0
    assert M.locked_fraction({"balloon": {"vmlck_bytes": 3 << 30, "mem_total_bytes": 4 << 30,
                                          "top_up": {"vmlck_bytes": 1 << 29}}}) == 0.875
    assert M.locked_fraction({"mechanism": "cgroup"}) is None
    cmd = M.cell_command(next(c for c in spec.cells() if c.mechanism.kind == "vm-memory"), spec)
    assert cmd[:2] == ["moetrace", "cell"] and cmd[cmd.index("--mechanism") + 1] == "machine"
    assert cmd[cmd.index("--out") + 1] == M.GUEST_CELL_DIR and "--record" in cmd


class FakeGuest:
    """run_in_guest's stand-in: writes what a guest would bring back (lab.json facts and the cell's
    cell.json), or fails as asked per cell name."""

    def __init__(self, fail=(), oom=(), stop_after=None):
        self.fail, self.oom, self.stop_after, self.calls = set(fail), set(oom), stop_after, []

    def __call__(self, kernel, command, out, *, memory, mglru, timeout_s, pool, env, modules=None, **boot):
        from moetrace.errors import MoetraceError
        from moetrace.lab.run import LabResult

        name = Path(out).name
        if self.stop_after is not None and len(self.calls) == self.stop_after:
            Path(out, "cell").mkdir(parents=True)  # stopped part-way: a cell directory, no done.json
            raise KeyboardInterrupt
        self.calls.append((kernel, mglru, name, memory, env, command))
        Path(out).mkdir(parents=True, exist_ok=True)
        if name in self.fail:
            raise MoetraceError("--accel kvm: the guest did not reach COMMAND")
        doc = {"status": "ok", "exit_status": 0, "kernel": kernel, "release": kernel + ".0", "memory": memory,
               "mglru_requested": mglru, "mglru": "0x0007" if mglru == "on" else "0x0000", "accel": "tcg"}
        if name in self.oom:
            Path(out, "console.log").write_text("[ 9.1] Out of memory: Killed process 77 (python3)\n")
            return LabResult("ok", 137, dict(doc, exit_status=137))
        Path(out, "cell").mkdir()
        Path(out, "cell", "cell.json").write_text(json.dumps(
            {"schema": "moetrace.cell/1", "complete": True, "retained": True, "reasons": [], "capacity_bytes": 1,
             "mechanism": "cgroup", "mode": "mmap",
             "amplification": 1.5, "mem_available_at_loop_entry_bytes": 123}))
        return LabResult("ok", 0, doc)


def make_plan(path: Path, n_iter: int = 4) -> Path:
    """A real plan: 1 layer x 8 experts of 1 MiB, every expert read in each of ``n_iter`` iterations."""
    import numpy as np

    from moetrace.inputs.geometry import Geometry
    from moetrace.inputs.plan import write_plan
    from moetrace.inputs.trace import Accesses

    n = n_iter * 8
    acc = Accesses(np.repeat(np.arange(n_iter, dtype=np.int32), 8), np.zeros(n, np.int8), np.zeros(n, np.int16),
                   np.tile(np.arange(8, dtype=np.int32), n_iter), 1, 8, n_iter)
    write_plan(path, acc, Geometry(1, 8, 8, 1 << 20, "t"))
    return path


def test_the_miss_curve_is_computed_once_on_the_host_and_refused_for_another_plan(tmp_path, monkeypatch):
    from moetrace.capacity.cell import load_miss_curve, miss_curve, simulated_miss

    plan = make_plan(tmp_path / "plan.bin")
    spec = M.load_spec(write_spec(tmp_path))
    monkeypatch.chdir(tmp_path)
    path = M.ensure_miss_curve(Path("."), spec)  # a relative --out: the guest gets an absolute path
    assert path == tmp_path / "miss_curve.npz"
    got, want = load_miss_curve(path, plan, spec.warmup, spec.passes), miss_curve(plan, spec.warmup, spec.passes)
    for c in (3 << 20, 8 << 20):
        assert simulated_miss(got, c, 1 << 20, 1 << 20) == simulated_miss(want, c, 1 << 20, 1 << 20)
    with pytest.raises(InputError, match="belongs to another plan, warm-up or passes"):
        load_miss_curve(path, plan, spec.warmup + 1, spec.passes)
    make_plan(plan, n_iter=5)
    with pytest.raises(InputError, match="belongs to another plan"):
        load_miss_curve(path, plan, spec.warmup, spec.passes)
    assert load_miss_curve(M.ensure_miss_curve(tmp_path, spec), plan, spec.warmup, spec.passes).window.n_iterations \
        == want.window.n_iterations * 5 // 4  # made again for the changed plan


def test_run_cells_marks_each_cell_and_a_killed_matrix_resumes_where_it_stopped(tmp_path):
    make_plan(tmp_path / "plan.bin")
    spec = M.load_spec(write_spec(tmp_path, SPEC.replace('kernels = ["6.1", "6.12"]', 'kernels = ["6.12"]')
                                  .replace("repeats = 2", "repeats = 1")))
    out = tmp_path / "m"
    cells = spec.cells()  # 1 kernel x 2 MGLRU x 3 mechanisms x 2 capacities
    fail, oom = cells[1].name, cells[2].name
    guest = FakeGuest(fail=[fail], oom=[oom], stop_after=4)
    work = M.prepare(out, spec, resume=False)
    with pytest.raises(KeyboardInterrupt):
        M.run_cells(out, spec, work, run_guest=guest)
    assert [c[2] for c in guest.calls] == [c.name for c in cells[:4]]
    assert all(c[4] == {"MOETRACE_BALLOON_RESERVE": str(spec.balloon_reserve)} for c in guest.calls)
    assert all(c[5][c[5].index("--miss-curve") + 1] == str(out / "miss_curve.npz") for c in guest.calls)
    docs = M.finished(out)
    assert [d["cell"]["name"] for d in docs] == [c.name for c in cells[:4]]
    assert docs[0]["retained"] and docs[0]["result"]["amplification"] == 1.5
    assert not docs[1]["retained"] and "did not reach COMMAND" in docs[1]["reasons"][0]
    assert not docs[2]["retained"] and docs[2]["reasons"][0].endswith("the guest ran out of memory")
    from moetrace.run.documents import MatrixMeta, MatrixRow, undeclared  # every key declared (and documented)

    assert not [p for d in docs for p in undeclared(d, MatrixRow)]
    assert not undeclared(json.loads((out / "matrix.json").read_text()), MatrixMeta)
    # resume: the four finished cells are kept, the stopped fifth is run again, then the rest
    work = M.prepare(out, spec, resume=True)
    assert work.cleared == [cells[4].rel_dir] and len(work.done) == 4
    guest2 = FakeGuest()
    progress = []
    assert M.run_cells(out, spec, work, run_guest=guest2, progress=lambda d, t, c, s: progress.append((d, t))) == 8
    assert [c[2] for c in guest2.calls] == [c.name for c in cells[4:]]
    assert progress == [(i, 12) for i in range(5, 13)]
    rows = M.matrix_rows(out)
    assert len(rows) == 12 and sum(r["retained"] for r in rows) == 10
    assert {r["condition"] for r in rows} == {"6.12-mglru-on", "6.12-mglru-off"}
    assert rows[0]["mem_available_at_loop_entry_bytes"] == 123 and rows[0]["mechanism_spec"] == cells[0].mechanism.label
    assert M.write_table(out).read_text().count("\n") == 13


def test_cli_dry_run_lists_every_cell_and_a_second_start_is_refused(tmp_path):
    from click.testing import CliRunner

    from moetrace.cli import cli

    spec_path = write_spec(tmp_path)
    r = CliRunner().invoke(cli, ["lab", "matrix", str(spec_path), "--out", str(tmp_path / "m"), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert r.output.count("cells/6.1-mglru") == 24 and "48 cells in 4 conditions" in r.output
    assert not (tmp_path / "m").exists()
    M.prepare(tmp_path / "m", M.load_spec(spec_path), resume=False)
    r = CliRunner().invoke(cli, ["lab", "matrix", str(spec_path), "--out", str(tmp_path / "m")])
    assert r.exit_code == 2 and "holds a matrix already" in r.output and "Traceback" not in r.output
    bad = write_spec(tmp_path, SPEC.replace('"vm-memory"', '"vm"'))
    r = CliRunner().invoke(cli, ["lab", "matrix", str(bad), "--out", str(tmp_path / "m2")])
    assert r.exit_code == 2 and "unknown mechanism 'vm'" in r.output
    # --report reads a matrix (a running one too) and clears nothing
    spec_path = write_spec(tmp_path)
    stopped = tmp_path / "m" / M.load_spec(spec_path).cells()[0].rel_dir
    stopped.mkdir(parents=True)
    r = CliRunner().invoke(cli, ["lab", "matrix", str(spec_path), "--out", str(tmp_path / "m"), "--report"])
    assert r.exit_code == 0 and "0 of 48 cells finished" in r.output and stopped.exists(), r.output
    assert (tmp_path / "m" / "matrix_summary.md").exists()
    r = CliRunner().invoke(cli, ["lab", "matrix", str(spec_path), "--out", str(tmp_path / "m3"), "--report"])
    assert r.exit_code == 2 and "holds no matrix.json" in r.output
    (tmp_path / "o").mkdir()
    other = write_spec(tmp_path / "o", SPEC.replace("repeats = 2", "repeats = 3").replace(
        '"plan.bin"', f'"{tmp_path}/plan.bin"'))
    r = CliRunner().invoke(cli, ["lab", "matrix", str(other), "--out", str(tmp_path / "m"), "--report"])
    assert r.exit_code == 2 and "another spec (differs in: repeats)" in r.output


def test_a_cell_checks_its_miss_curve_without_importing_the_simulators(tmp_path):
    """The check runs before the replay, in the cell's own process: numba and pandas there took
    ~140 MB from a vm-memory guest's page cache (measured: a 96 MiB pool then no longer fit in 448 MiB)."""
    from moetrace.capacity.cell import check_miss_curve

    plan = make_plan(tmp_path / "plan.bin")
    spec = M.load_spec(write_spec(tmp_path))
    path = M.ensure_miss_curve(tmp_path, spec)
    code = ("import sys; from moetrace.capacity.cell import check_miss_curve; "
            f"check_miss_curve({str(path)!r}, {str(plan)!r}, {spec.warmup}, {spec.passes}); "
            "print(sorted(m for m in ('numba', 'pandas', 'moetrace.analyses.stackdist') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(InputError, match="not a saved miss curve"):
        check_miss_curve(tmp_path / "bad.npz", plan, spec.warmup, spec.passes)


def test_report_of_a_matrix_states_its_findings_with_fig3_and_every_cell(tmp_path):
    from click.testing import CliRunner

    from moetrace.cli import cli

    make_plan(tmp_path / "plan.bin")
    spec = M.load_spec(write_spec(tmp_path, SPEC.replace('kernels = ["6.1", "6.12"]', 'kernels = ["6.12"]')
                                  .replace("repeats = 2", "repeats = 1")))
    out = tmp_path / "m"
    M.run_cells(out, spec, M.prepare(out, spec, resume=False), run_guest=FakeGuest(oom=[spec.cells()[0].name]))
    r = CliRunner().invoke(cli, ["report", str(out), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    assert doc["summary"]["kind"] == "matrix" and doc["summary"]["cells"] == 12 and "fig3" in doc["figures"]
    assert {"matrix_summary", "matrix_cells"} <= set(doc["tables"])
    # FakeGuest's cells: amplification 1.5, no miss demand, no recording -> an amplified group, no detail cell
    assert any("6.12, MGLRU on, cgroup: device bytes 1.50x the miss demand" in f for f in doc["summary"]["findings"])
    # check per pair: MGLRU off -> on at each mechanism and C (FakeGuest's cells are alike: no regression)
    pairs = doc["summary"]["pairs"]
    assert len(pairs) == 6 - 1 and {p["verdict"] for p in pairs} == {"no regression"}  # one on cell OOMed
    assert {(p["base"], p["candidate"]) for p in pairs} == {("6.12 MGLRU off", "6.12 MGLRU on")}
    page = (out / "report" / "report.html").read_text()
    assert "The §5 matrix" in page and "data:image/png;base64," in page and "detail_cell" not in doc["summary"]
    r = CliRunner().invoke(cli, ["report", str(out), "--cell", "6.12-mglru-on/nope-r0", "--force"])
    assert r.exit_code == 2 and "no finished cell '6.12-mglru-on/nope-r0'" in r.output


def test_kernel_modules_of_an_own_build_reach_its_guests(tmp_path):
    text = SPEC.replace('kernels = ["6.1", "6.12"]', 'kernels = ["6.12", "/src/bzImage"]') + \
        'kernel_modules = {"/src/bzImage" = "mods"}\n'
    spec = M.load_spec(write_spec(tmp_path, text))
    assert dict(spec.kernel_modules) == {"/src/bzImage": str(tmp_path / "mods")}
    assert spec.canonical()["kernel_modules"] == {"/src/bzImage": str(tmp_path / "mods")}
    assert "kernel_modules" not in M.load_spec(write_spec(tmp_path)).canonical()  # old digests unchanged
    with pytest.raises(InputError, match="kernel_modules"):
        M.load_spec(write_spec(tmp_path, SPEC + 'kernel_modules = {"7.9" = "x"}\n'))


def test_kernel_pairs_are_checked_against_the_first_kernel(tmp_path):
    from moetrace.reports.matrix import pair_checks

    make_plan(tmp_path / "plan.bin")
    text = (SPEC.replace('mglru = ["on", "off"]', 'mglru = ["on"]').replace(
        'mechanisms = ["cgroup", "balloon:0.81", "vm-memory"]', 'mechanisms = ["cgroup"]')
        .replace('capacities = ["192MiB", "320MiB"]', 'capacities = ["192MiB"]'))
    spec = M.load_spec(write_spec(tmp_path, text))
    out = tmp_path / "m"
    M.run_cells(out, spec, M.prepare(out, spec, resume=False), run_guest=FakeGuest())
    rows = pair_checks(out)
    assert [(r["base"], r["candidate"], r["base_n"], r["cand_n"]) for r in rows] == [
        ("6.1 MGLRU on", "6.12 MGLRU on", 2, 2)]
    assert rows[0]["verdict"] == "no regression" and "cells: Welch t on logs (2 / 2)" in rows[0]["tests"]


# --- the matrix's cells as jobs (issue 22): the same cells, done.json for each, one resubmission ---

def test_matrix_cells_as_jobs_run_each_cell_once_and_give_up_after_two_failures(tmp_path, monkeypatch):
    import moetrace.lab.run as labrun
    from moetrace.capacity.dispatch import InlineExecutor, dispatch
    from moetrace.run.directory import read_json

    make_plan(tmp_path / "plan.bin")
    spec = M.load_spec(write_spec(tmp_path, SPEC.replace('kernels = ["6.1", "6.12"]', 'kernels = ["6.12"]')
                                  .replace("repeats = 2", "repeats = 1").replace('mglru = ["on", "off"]',
                                                                                  'mglru = ["off"]')))
    assert M.spec_from_canonical(M.MatrixSpec.canonical(spec)) == spec
    out = tmp_path / "m"
    work = M.prepare(out, spec, resume=False)
    cells = spec.cells()
    bad = cells[2]
    guest = FakeGuest(fail=[bad.name])
    monkeypatch.setattr(labrun, "run_in_guest", guest)
    monkeypatch.setattr(M, "ensure_miss_curve", lambda out, spec: Path(out) / "miss_curve.npz")
    jobs = M.matrix_jobs(out, work)
    assert [read_json(j.job_path)["dir"] for j in jobs] == [c.rel_dir for c in cells]
    failing = {}

    def flaky_run_one(*a, **kw):  # the first attempt of the first cell dies as a killed job would
        if not failing:
            failing["x"] = True
            raise RuntimeError("node lost")
        return real(*a, **kw)
    real = M.run_one
    monkeypatch.setattr(M, "run_one", flaky_run_one)
    res = dispatch(jobs, InlineExecutor(out), poll_s=0)
    assert res.submitted == [j.name for j in jobs] + [jobs[0].name]
    assert [c[2] for c in guest.calls] == [c.name for c in cells[1:]] + [cells[0].name]
    docs = {d["cell"]["name"]: d for d in M.finished(out)}
    assert len(docs) == len(cells) and all(docs[c.name]["retained"] for c in cells if c != bad)
    # a guest that did not come up is a finished cell not retained (as in-process): not resubmitted
    assert not docs[bad.name]["retained"] and "did not reach COMMAND" in docs[bad.name]["reasons"][0]
    assert M.prepare(out, spec, resume=True).todo == []
