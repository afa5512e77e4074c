"""The §5 matrix without a guest (no-kernel tier): the spec, its cells and their order, and the
matrix directory's resume logic (a stopped matrix redoes no finished cell)."""

from __future__ import annotations

import json
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
    M.mark_done(out, first, {"retained": True})
    M.mark_done(out, second, {"retained": False, "reasons": ["oom"]})
    (out / third.rel_dir).mkdir(parents=True)
    (out / third.rel_dir / "lab.json").write_text("{}")  # stopped part-way: no done.json
    with pytest.raises(UsageError, match="holds a matrix already"):
        M.prepare(out, spec, resume=False)
    work = M.prepare(out, spec, resume=True)
    assert work.done == [first, second] and work.todo == spec.cells()[2:]
    assert work.cleared == [third.rel_dir] and not (out / third.rel_dir).exists()
    assert [d["cell"]["name"] for d in M.finished(out)] == [first.name, second.name]
    assert M.finished(out)[1]["reasons"] == ["oom"]


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
        M.mark_done(out, cells[i], {})
    for i in stopped_i - done_i:
        (out / cells[i].rel_dir).mkdir(parents=True)
    work = M.prepare(out, spec, resume=True)
    assert work.done == [c for i, c in enumerate(cells) if i in done_i]
    assert work.todo == [c for i, c in enumerate(cells) if i not in done_i]
    assert sorted(work.cleared) == sorted(cells[i].rel_dir for i in stopped_i - done_i)
