"""Property-based fuzzing of every reader a user feeds, but the router traces and importers
(no-kernel tier): plan.bin, pool manifests, run directories, cells and sweeps.

Each property mutates a known-good input (truncation at any offset, bit flips, wrong JSON
types, huge and negative numbers, invalid UTF-8 / latin-1, empty and deleted files; for
plan.bin also structure-aware edits with every checksum recomputed, which reach past the
CRCs) and asserts that the reader either succeeds or raises InputError (PlanFormatError,
or UsageError where that is right) naming the file (and the offset / line / key where
meaningful); through the CLI: exit status 0, 1 or 2, no traceback, no ``*.tmp-*`` left and
earlier outputs untouched when the command fails. Regression tests for every bug the fuzzer
found close the file.

Budget: tests/common/fuzz.py (``MOETRACE_FUZZ_EXAMPLES`` examples per property, default
50; derandomized when ``CI`` is set). The long run, locally::

    MOETRACE_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest tests/unit/test_fuzz_readers.py

Report rendering is stubbed in the report properties (matplotlib's savefig is ~75 % of a
report's time); the figures' data paths still run, and the CLI property renders for real.
"""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from common.fuzz import (FUZZ, Mutation, assert_typed_failure, dump_json, fuzz, is_error, leftover_temps,
                         mutated_bytes, mutated_json, run_cli, set_path, tree_state)
from common.reports import DATA as REPORTS

from moetrace.errors import InputError, PlanFormatError, UsageError
from moetrace.inputs import plan as P
from moetrace.reports.figures import png_bytes as REAL_PNG_BYTES

DATA = Path(__file__).resolve().parents[1] / "data"
SEED_PLANS = {"hinted": DATA / "plan_v1_small.bin", "plain": REPORTS / "sweep" / "plan.bin"}


# =============================================================================================
# plan.bin


def _plan_layout(data: bytes) -> dict:
    """Offsets of a pristine plan's sections and pass blocks (for structure-aware edits)."""
    h = P._parse_header(data[:P.HEADER_SIZE], "<seed>", len(data))
    idx = np.frombuffer(data, P.INDEX_DTYPE, h.n_iterations, h.index_offset).copy()
    blocks = []
    w = h.id_bytes
    for e in idx:
        pos = int(e["offset"])
        for _ in range(int(e["n_passes"])):
            nr, nh = struct.unpack_from("<II", data, pos + 12)
            body = (2 * h.n_layers if h.has_hints else h.n_layers) + nr + nh
            blen = P._align(20 + body * w, 4)
            blocks.append((pos, blen))
            pos += blen + 4
    return {"header": h, "blocks": blocks}


def _recrc(buf: bytearray, layout: dict, meta_len: int | None = None) -> bytes:
    """Recompute every checksum of ``buf`` over the seed's layout (blocks, index, meta, header)."""
    h = layout["header"]
    for pos, blen in layout["blocks"]:
        if pos + blen + 4 <= len(buf):
            struct.pack_into("<I", buf, pos + blen, zlib.crc32(bytes(buf[pos:pos + blen])))
    ml = h.meta_length if meta_len is None else meta_len
    io = P._align(P.HEADER_SIZE + ml, 8)
    struct.pack_into("<I", buf, 120, zlib.crc32(bytes(buf[P.HEADER_SIZE:P.HEADER_SIZE + ml])))
    struct.pack_into("<I", buf, 124, zlib.crc32(bytes(buf[io:io + 32 * h.n_iterations])))
    struct.pack_into("<I", buf, 156, zlib.crc32(bytes(buf[:156])))
    return bytes(buf)


# (name, offset, struct format) of the header fields after the magic
HEADER_FIELDS = [("version_major", 8, "<H"), ("version_minor", 10, "<H"), ("header_size", 12, "<I"),
                 ("flags", 16, "<I"), ("n_layers", 20, "<I"), ("n_experts", 24, "<I"), ("k", 28, "<I"),
                 ("expert_bytes", 32, "<Q"), ("id_bytes", 40, "<I"), ("n_iterations", 44, "<I"),
                 ("n_passes", 48, "<Q"), ("n_reads", 56, "<Q"), ("n_hints", 64, "<Q"),
                 ("accepted_tokens", 72, "<q"), ("meta_offset", 80, "<Q"), ("meta_length", 88, "<Q"),
                 ("index_offset", 96, "<Q"), ("blocks_offset", 104, "<Q"), ("file_size", 112, "<Q"),
                 ("n_inputs", 128, "<I"), ("hint_source", 132, "<I")]
INDEX_FIELDS = [("offset", 0, "<Q"), ("length", 8, "<Q"), ("step", 16, "<q"), ("n_reads", 24, "<I"),
                ("n_passes", 28, "<H"), ("reserved", 30, "<H")]
PASS_FIELDS = [("tag", 0, "<I"), ("iteration", 4, "<I"), ("pass", 8, "<B"), ("flags", 9, "<B"),
               ("reserved", 10, "<H"), ("n_reads", 12, "<I"), ("n_hints", 16, "<I")]


def _field_value(draw, fmt: str, orig: int) -> int:
    """An edge value for a field of struct format ``fmt`` holding ``orig`` (or any in its range)."""
    bits = struct.calcsize(fmt) * 8
    signed = fmt[-1] in "bhiq"  # struct: lower case signed, upper case unsigned
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    cands = [0, 1, 2, 3, 4, 7, 255, 0xFFFF, 0x10000, 2**31, 2**32 - 1, 2**63 - 1, hi, lo, -1,
             orig - 1, orig + 1, orig * 2, orig + 32, orig - 32, orig + 4, orig - 4]
    v = draw(st.sampled_from(cands) | st.integers(lo, hi))
    return max(lo, min(hi, v))


@st.composite
def structured_plan(draw, data: bytes) -> Mutation:
    return Mutation(*_plan_edit(draw, data))


def _plan_edit(draw, data: bytes) -> tuple[str, bytes]:
    """A plan edited past its checksums: one header, meta, index or pass-block field (or id)
    set to an edge value, every CRC recomputed so that the reader's semantic checks are hit."""
    lay = _plan_layout(data)
    h = lay["header"]
    buf = bytearray(data)
    target = draw(st.sampled_from(["header", "meta", "index", "block", "ids"]))
    if target == "header":
        name, off, fmt = draw(st.sampled_from(HEADER_FIELDS))
        v = _field_value(draw, fmt, struct.unpack_from(fmt, buf, off)[0])
        struct.pack_into(fmt, buf, off, v)
        return f"header {name} = {v}", _recrc(buf, lay)
    if target == "meta":
        meta = json.loads(data[h.meta_offset:h.meta_offset + h.meta_length])
        what, meta = draw(mutated_json(meta, max_mutations=2))
        mb = json.dumps(meta).encode()
        old_io, new_io = h.index_offset, P._align(P.HEADER_SIZE + len(mb), 8)
        delta = new_io - old_io
        idx = np.frombuffer(data, P.INDEX_DTYPE, h.n_iterations, old_io).copy()
        idx["offset"] = (idx["offset"].astype(np.int64) + delta).astype("<u8")
        out = bytearray(data[:P.HEADER_SIZE]) + mb + bytes(new_io - P.HEADER_SIZE - len(mb)) + idx.tobytes() \
            + data[h.blocks_offset:]
        struct.pack_into("<QQQQ", out, 88, len(mb), new_io, h.blocks_offset + delta, h.file_size + delta)
        # the blocks moved by delta (their CRCs cover only themselves); meta, index, header re-CRCed
        struct.pack_into("<I", out, 120, zlib.crc32(mb))
        struct.pack_into("<I", out, 124, zlib.crc32(bytes(out[new_io:new_io + 32 * h.n_iterations])))
        struct.pack_into("<I", out, 156, zlib.crc32(bytes(out[:156])))
        return f"meta: {what}", bytes(out)
    if target == "index" and h.n_iterations:
        i = draw(st.integers(0, h.n_iterations - 1))
        name, off, fmt = draw(st.sampled_from(INDEX_FIELDS))
        at = h.index_offset + 32 * i + off
        v = _field_value(draw, fmt, struct.unpack_from(fmt, buf, at)[0])
        struct.pack_into(fmt, buf, at, v)
        return f"index entry {i} {name} = {v}", _recrc(buf, lay)
    if not lay["blocks"]:
        return "no blocks", data
    b = draw(st.integers(0, len(lay["blocks"]) - 1))
    pos, blen = lay["blocks"][b]
    if target == "block":
        name, off, fmt = draw(st.sampled_from(PASS_FIELDS))
        v = _field_value(draw, fmt, struct.unpack_from(fmt, buf, pos + off)[0])
        struct.pack_into(fmt, buf, pos + off, v)
        return f"pass block {b} {name} = {v}", _recrc(buf, lay)
    # an id or count of the block's body
    w = h.id_bytes
    n_ids = (blen - 20) // w
    j = draw(st.integers(0, max(0, n_ids - 1)))
    fmt = "<H" if w == 2 else "<I"
    v = _field_value(draw, fmt, struct.unpack_from(fmt, buf, pos + 20 + j * w)[0])
    struct.pack_into(fmt, buf, pos + 20 + j * w, v)
    return f"pass block {b} id/count #{j} = {v}", _recrc(buf, lay)


def _read_iterations(path):
    with P.open_plan(path) as r:
        return [r.read_iteration(i) for i in range(r.header.n_iterations)]


def _plan_readers(path: Path) -> dict:
    from moetrace.inputs import accesses as A

    return {
        "read_header": lambda: P.read_header(path),
        "verify_plan": lambda: P.verify_plan(path),
        "iter_passes": lambda: list(P.iter_passes(path)),
        "read_iteration": lambda: _read_iterations(path),
        "read_accesses": lambda: P.read_accesses(path),
        "inspect_plan": lambda: P.inspect_plan(path),
        "load_flat_plan": lambda: P.load_flat_plan(path),
        "accesses.load_accesses": lambda: A.load_accesses(path),
        "accesses.plan_expert_bytes": lambda: A.plan_expert_bytes(path),
    }


def check_plan_readers(path: Path, size: int) -> dict:
    """Every plan reader on ``path``: success or a typed error naming the file; a
    PlanFormatError names an offset inside the file (or its end); and verify_plan's promise:
    a plan it accepts, every reader reads."""
    out = {}
    for name, fn in _plan_readers(path).items():
        res = assert_typed_failure(fn, path, what=name)
        if isinstance(res, PlanFormatError):
            assert res.offset is not None and 0 <= res.offset <= max(size, P.HEADER_SIZE), (name, res.message)
            assert f"offset {res.offset}" in res.message, (name, res.message)
        out[name] = res
    if not is_error(out["verify_plan"]):
        bad = {k: v.format_message() for k, v in out.items() if is_error(v)}
        assert not bad, f"verify_plan accepted the plan but other readers failed: {bad}"
        # the whole stream agrees with the header's totals
        h = out["read_header"]
        acc = out["read_accesses"]
        assert len(acc.expert) == h.n_reads and (acc.expert.size == 0 or acc.expert.max() < h.n_experts)
        flat = out["load_flat_plan"]
        assert flat.ids.size == h.n_reads and (flat.ids.size == 0 or flat.ids.max() < h.n_layers * h.n_experts)
    return out


@pytest.mark.parametrize("seed", sorted(SEED_PLANS))
@FUZZ
@given(data=st.data())
def test_fuzz_plan_bytes(seed, data, tmp_path_factory):
    raw = SEED_PLANS[seed].read_bytes()
    what, mutated = data.draw(mutated_bytes(raw), label="mutation")
    note(what)
    p = tmp_path_factory.mktemp("plan") / "plan.bin"
    p.write_bytes(mutated)
    check_plan_readers(p, len(mutated))


@pytest.mark.parametrize("seed", sorted(SEED_PLANS))
@FUZZ
@given(data=st.data())
def test_fuzz_plan_structured(seed, data, tmp_path_factory):
    raw = SEED_PLANS[seed].read_bytes()
    what, mutated = data.draw(structured_plan(raw), label="edit")
    note(what)
    p = tmp_path_factory.mktemp("plan") / "plan.bin"
    p.write_bytes(mutated)
    check_plan_readers(p, len(mutated))


def test_plan_missing_and_directory(tmp_path):
    for p in (tmp_path / "absent.bin", tmp_path):
        check_plan_readers(p, 0)


@fuzz(0.5)
@given(data=st.data())
def test_fuzz_plan_cli(data, tmp_path_factory):
    """`plan inspect` and `sim` on a mutated plan: exit 0, 1 or 2, one clean line, and `sim
    --plot` leaves no half-written PNG."""
    seed = data.draw(st.sampled_from(sorted(SEED_PLANS)), label="seed")
    raw = SEED_PLANS[seed].read_bytes()
    what, mutated = data.draw(mutated_bytes(raw) | structured_plan(raw), label="mutation")
    note(what)
    d = tmp_path_factory.mktemp("plancli")
    p = d / "plan.bin"
    p.write_bytes(mutated)
    for args in (["plan", "inspect", p], ["plan", "inspect", p, "--json"]):
        r = run_cli(args)
        if r.exit_code:
            assert str(p) in r.output
    plot = d / "out" / "fig.png"
    plot.parent.mkdir()
    plot.write_bytes(b"earlier")
    r = run_cli(["sim", p, "--budgets", "1,2", "--json", "--plot", plot])
    if r.exit_code:
        assert str(p) in r.output and plot.read_bytes() == b"earlier"
    assert not leftover_temps(d)


# =============================================================================================
# pool manifests


@pytest.fixture(scope="module")
def seed_pools(tmp_path_factory):
    from moetrace.inputs.geometry import Geometry
    from moetrace.inputs.pool import create_pool

    base = tmp_path_factory.mktemp("pools")
    geo = Geometry(2, 3, 2, 5000, "tiny")
    return {layout: create_pool(base / layout, geo, layout=layout, seed=3).root for layout in ("files", "pool")}


def _copy_pool(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


@st.composite
def pool_mutation(draw, root: Path) -> Mutation:
    return Mutation(*_pool_edit(draw, root))


def _pool_edit(draw, root: Path) -> tuple[str, list]:
    """Edits of a pool directory: the manifest's bytes, its JSON (checksum left stale, or
    recomputed: anyone can), a data file truncated or deleted, the manifest deleted."""
    from moetrace.inputs.pool import MANIFEST, _checksum

    text = (root / MANIFEST).read_bytes()
    kind = draw(st.sampled_from(["bytes", "json", "json_rechecksum", "data", "delete_manifest"]))
    if kind == "bytes":
        what, b = draw(mutated_bytes(text))
        return f"manifest: {what}", [(MANIFEST, b)]
    if kind in ("json", "json_rechecksum"):
        doc = json.loads(text)
        what, doc = draw(mutated_json(doc))
        if kind == "json_rechecksum" and isinstance(doc, dict):
            try:
                doc["checksum"] = _checksum(doc)
            except (TypeError, ValueError):
                pass
            what += " (checksum recomputed)"
        return f"manifest: {what}", [(MANIFEST, dump_json(doc))]
    if kind == "delete_manifest":
        return "manifest deleted", [(MANIFEST, None)]
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.bin"))
    f = draw(st.sampled_from(files))
    size = (root / f).stat().st_size
    if draw(st.booleans()):
        return f"{f} deleted", [(f, None)]
    cut = draw(st.integers(0, size - 1))
    return f"{f} truncated to {cut}", [(f, (root / f).read_bytes()[:cut])]


def _apply(root: Path, edits: list) -> None:
    for rel, content in edits:
        p = root / rel
        if content is None:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
        else:
            p.write_bytes(content)


@FUZZ
@given(data=st.data())
def test_fuzz_pool_manifest(data, seed_pools, tmp_path_factory):
    from moetrace.inputs.pool import MANIFEST, open_pool, verify_pool

    layout = data.draw(st.sampled_from(sorted(seed_pools)), label="layout")
    root = _copy_pool(seed_pools[layout], tmp_path_factory.mktemp("pool") / "p")
    what, edits = data.draw(pool_mutation(root), label="edit")
    note(what)
    _apply(root, edits)
    mpath = root / MANIFEST
    pool = assert_typed_failure(lambda: open_pool(root), mpath, what="open_pool")
    if not is_error(pool):
        problems = verify_pool(pool)
        assert isinstance(problems, list) and all(isinstance(x, str) for x in problems)
        # what open_pool accepts, the replay can address
        assert all(isinstance(f, str) for f in pool.files) and pool.extent_bytes >= pool.geometry.expert_bytes
        for e in (0, pool.n_total - 1):
            assert (pool.path_of(e).resolve()).is_relative_to(root.resolve())
            assert pool.offset_of(e) >= 0
    for args in (["pool", "verify", root], ["pool", "verify", root, "--json"]):
        r = run_cli(args)
        if r.exit_code:
            assert str(root) in r.output


# =============================================================================================
# run directories, cells and sweeps (manifest, JSON side files, tables) through open_run,
# open_run, open_sweep, the report and check


def _fast_png(fig) -> bytes:
    """figures.png_bytes without the rendering (the plotting code still ran)."""
    import matplotlib.pyplot as plt

    plt.close(fig)
    return b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """Known-good inputs: the golden run (all tables), a run with the pagecache tables only,
    the pinned cell and the golden sweep (report rendering stubbed while the module runs)."""
    from moetrace.reports import figures

    base = tmp_path_factory.mktemp("seeds")
    few = base / "few"
    shutil.copytree(REPORTS / "run", few)
    for p in few.glob("*.parquet"):
        if p.stem not in ("experts", "epochs", "expert_epochs"):
            p.unlink()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(figures, "png_bytes", _fast_png)
        yield {"run": REPORTS / "run", "few": few, "pinned": REPORTS / "pinned", "sweep": REPORTS / "sweep"}


def _files(root: Path, exts: tuple[str, ...]) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and p.suffix in exts and "report" not in p.parts)


@st.composite
def dir_mutation(draw, root: Path, exts: tuple[str, ...] = (".json", ".parquet", ".folded")) -> Mutation:
    """One file of a run / cell / sweep directory edited: JSON values of the wrong type, huge or
    negative (for .json), its bytes mutated, or the file deleted."""
    rel = draw(st.sampled_from(_files(root, exts)), label="file")
    data = (root / rel).read_bytes()
    ops = ["bytes", "delete"] + (["json", "json", "json"] if rel.endswith(".json") else [])
    op = draw(st.sampled_from(ops))
    if op == "delete":
        return Mutation(f"{rel} deleted", (rel, None))
    if op == "json":
        what, doc = draw(mutated_json(json.loads(data)))
        return Mutation(f"{rel}: {what}", (rel, dump_json(doc)))
    what, b = draw(mutated_bytes(data))
    return Mutation(f"{rel}: {what}", (rel, b))


def _mutated_copy(src: Path, dst: Path, mutation: Mutation) -> tuple[Path, Path]:
    """A copy of ``src`` at ``dst`` with ``mutation`` applied; returns (dst, the edited file)."""
    shutil.copytree(src, dst)
    rel, content = mutation[1]
    _apply(dst, [(rel, content)])
    return dst, dst / rel


def _names(edited: Path, root: Path, deleted: bool) -> list[Path]:
    """What a typed error about ``edited`` may name: the file; for a deleted file also the
    directories it was in (a directory without its manifest is no run at all)."""
    out = [edited]
    if deleted:
        p = edited.parent
        while True:
            out.append(p)
            if p == root:
                break
            p = p.parent
    return out


def _touch_run(run) -> None:
    """Everything a notebook or report reads of an opened run."""
    for name in list(run.tables):
        run.tables[name]
    run.meta, run.name, run.folded, run.plan_path()


SECTION_SETS = st.sets(st.sampled_from(["amp", "hitpath", "age", "reclaim", "flame", "timeline"]), min_size=1,
                       max_size=2)


@fuzz(0.5)
@given(data=st.data())
def test_fuzz_run_directory(data, seeds, tmp_path_factory):
    """A run or cell with one JSON file, table or folded stack edited: open_run (and every table
    read), the report of the chosen sections and check against the pristine copy."""
    from moetrace.reports.check import run_check
    from moetrace.reports.report import build_report
    from moetrace.run.handle import open_run

    seed = data.draw(st.sampled_from(["few", "run", "pinned"]), label="seed")
    m = data.draw(dir_mutation(seeds[seed]), label="mutation")
    d, edited = _mutated_copy(seeds[seed], tmp_path_factory.mktemp("run") / seed, m)
    names = _names(edited, d, m[1][1] is None)
    run = assert_typed_failure(lambda: open_run(d), *names, what="open_run")
    if not is_error(run):
        assert_typed_failure(lambda: _touch_run(run), *names, what="run tables")
    sections = data.draw(SECTION_SETS, label="sections")
    out = tmp_path_factory.mktemp("out") / "report"
    assert_typed_failure(lambda: build_report(d, out, sections=sorted(sections)), *names, what="build_report")
    res = assert_typed_failure(lambda: run_check(d, seeds[seed]), *names, what="run_check")
    if not is_error(res):
        assert res.status in (0, 1, 2)
        if res.status == 2:
            assert res.reason


@fuzz(0.3)
@given(data=st.data())
def test_fuzz_sweep(data, seeds, tmp_path_factory):
    """A sweep with results.parquet, capacity.parquet or a cell's cell.json / manifest edited:
    open_sweep, the sweep report (Table 2, the detail cell) and check against the pristine sweep."""
    from moetrace.reports.check import run_check
    from moetrace.reports.report import build_report
    from moetrace.run.handle import open_sweep

    src = seeds["sweep"]
    files = [f for f in _files(src, (".json", ".parquet"))
             if "/" not in f or f.endswith(("cell.json", "run/manifest.json", "replay.json"))]
    rel = data.draw(st.sampled_from(files), label="file")
    raw = (src / rel).read_bytes()
    op = data.draw(st.sampled_from(["bytes", "delete"] + (["json", "json"] if rel.endswith(".json") else [])))
    if op == "delete":
        m = Mutation(f"{rel} deleted", (rel, None))
    elif op == "json":
        what, doc = data.draw(mutated_json(json.loads(raw)))
        m = Mutation(f"{rel}: {what}", (rel, dump_json(doc)))
    else:
        what, b = data.draw(mutated_bytes(raw))
        m = Mutation(f"{rel}: {what}", (rel, b))
    note(m[0])
    d, edited = _mutated_copy(src, tmp_path_factory.mktemp("sweep") / "sweep", m)
    names = _names(edited, d, m[1][1] is None)
    assert_typed_failure(lambda: open_sweep(d), *names, what="open_sweep")  # the report reads its cells
    out = tmp_path_factory.mktemp("out") / "report"
    sections = data.draw(SECTION_SETS, label="sections")
    assert_typed_failure(lambda: build_report(d, out, sections=sorted(sections)), *names, what="build_report")
    res = assert_typed_failure(lambda: run_check(d, src), *names, what="run_check")
    if not is_error(res):
        assert res.status in (0, 1, 2)


@fuzz(0.5)
@given(data=st.data())
def test_fuzz_thresholds(data, tmp_path_factory):
    """`check --thresholds FILE`: a mutated TOML file reads or fails naming the file (and line)."""
    from moetrace.analyses.compare import load_thresholds

    text = b'alpha = 0.05\n\n[metrics.iteration_time_ns]\nthreshold = 0.10\n\n[metrics.amplification]\n' \
           b'threshold = 0.2\n'
    kind = data.draw(st.sampled_from(["bytes", "value"]))
    if kind == "bytes":
        what, b = data.draw(mutated_bytes(text))
    else:
        key = data.draw(st.sampled_from(["alpha", "metrics", "metrics.amplification",
                                         "metrics.amplification.threshold", "metrics.bogus.threshold"]))
        val = data.draw(st.sampled_from(['"x"', "[]", "{}", "-1", "1e23", "inf", "nan", "true", "3e9",
                                         "9223372036854775807", '{threshold = "x"}', "[1, 2]"]))
        what = f"{key} = {val}"
        b = (f"{key} = {val}\n" if "." not in key else
             f"[{key.rsplit('.', 1)[0]}]\n{key.rsplit('.', 1)[1]} = {val}\n").encode() \
            if key != "metrics" else f"metrics = {val}\n".encode()
    note(what)
    p = tmp_path_factory.mktemp("th") / "thresholds.toml"
    p.write_bytes(b)
    res = assert_typed_failure(lambda: load_thresholds(p), p, what="load_thresholds")
    if not is_error(res):
        assert 0 < res.alpha < 1 and all(isinstance(v, float) and v >= 0 for v in res.per_metric.values())


def _earlier_report(out: Path) -> dict:
    """An earlier report in ``out`` (what `report --out` may replace) and a file of the user's."""
    (out / "tables").mkdir(parents=True)
    (out / "report.json").write_text('{"schema": "moetrace.report/1"}\n')
    (out / "report.html").write_text("earlier report\n")
    (out / "tables" / "old.json").write_text("[]\n")
    (out / "notes.txt").write_text("mine\n")
    return tree_state(out)


@fuzz(0.2)
@given(data=st.data())
def test_fuzz_report_check_flame_cli(data, seeds, tmp_path_factory):
    """`report`, `check --html` and `flame` on a mutated run or cell, figures rendered for real:
    exit 0, 1 or 2, no traceback, the edited file named on failure, no temporary left, and an
    earlier report (or check page) untouched when the command fails, replaced when it succeeds."""
    from moetrace.reports import figures

    seed = data.draw(st.sampled_from(["few", "pinned"]), label="seed")
    m = data.draw(dir_mutation(seeds[seed]), label="mutation")
    base = tmp_path_factory.mktemp("cli")
    d, edited = _mutated_copy(seeds[seed], base / seed, m)
    names = [str(p) for p in _names(edited, d, m[1][1] is None)]
    sections = ",".join(sorted(data.draw(SECTION_SETS, label="sections")))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(figures, "png_bytes", REAL_PNG_BYTES)
        out = base / "out"
        before = _earlier_report(out)
        r = run_cli(["report", d, "--out", out, "--only", sections])
        if r.exit_code:
            assert tree_state(out) == before, "a failed report changed the earlier one"
            assert any(n in r.output for n in names), r.output
        else:
            assert (out / "notes.txt").read_text() == "mine\n" and not (out / "tables" / "old.json").exists()
            assert json.loads((out / "report.json").read_text())["html"] == str(out / "report.html")
        html = base / "check"
        html.mkdir()
        (html / "notes.txt").write_text("mine\n")
        before = tree_state(html)
        r = run_cli(["check", d, seeds[seed], "--html", html, "--json"])
        if r.exit_code == 2 and "could not compare" not in r.output or r.exit_code == 1 and "Error:" in r.output:
            assert tree_state(html) == before
        r = run_cli(["flame", d, "-o", base / "f.svg"])
        if r.exit_code:
            assert not (base / "f.svg").exists()
    assert not leftover_temps(base)


# =============================================================================================
# regressions: one deterministic test per bug the fuzzer found


def _plan_bytes(seed: str = "hinted") -> bytes:
    return SEED_PLANS[seed].read_bytes()


def _write(tmp_path: Path, data: bytes, name: str = "plan.bin") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _edit_header(data: bytes, fmt: str, off: int, value) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, off, value)
    return _recrc(buf, _plan_layout(data))


@pytest.mark.parametrize("cut", [12, 13, 15])
def test_plan_cut_inside_header_size_is_truncation(tmp_path, cut):
    """Cut between the version and header_size fields: was struct.error."""
    p = _write(tmp_path, _plan_bytes()[:cut])
    with pytest.raises(PlanFormatError, match="truncated header") as e:
        P.read_header(p)
    assert e.value.offset == cut and str(p) in e.value.format_message()


def test_plan_meta_that_is_not_an_object(tmp_path):
    """A meta section of valid JSON that is not an object (null): was AttributeError in inspect_plan."""
    data = _plan_bytes()
    lay = _plan_layout(data)
    h = lay["header"]
    buf = bytearray(data)
    buf[h.meta_offset:h.meta_offset + h.meta_length] = b"null".ljust(h.meta_length)
    p = _write(tmp_path, _recrc(buf, lay))
    with pytest.raises(PlanFormatError, match="not a JSON object") as e:
        P.inspect_plan(p)
    assert e.value.offset == h.meta_offset


def test_plan_meta_sources_of_other_types_are_listed_as_unknown(tmp_path):
    """meta "sources" holding null or a path-less object: was AttributeError (inspect_plan) and
    TypeError (`plan inspect` joining None)."""
    data = _plan_bytes("plain")
    lay = _plan_layout(data)
    h = lay["header"]
    meta = json.loads(data[h.meta_offset:h.meta_offset + h.meta_length])
    meta["sources"] = [None, {"path": 3}, {"path": "t.jsonl"}]
    mb = json.dumps(meta).encode()
    assert len(mb) <= h.meta_length
    buf = bytearray(data)
    buf[h.meta_offset:h.meta_offset + h.meta_length] = mb.ljust(h.meta_length)
    p = _write(tmp_path, _recrc(buf, lay))
    assert P.inspect_plan(p)["sources"] == [None, None, "t.jsonl"]
    r = run_cli(["plan", "inspect", p], codes=(0,))
    assert "t.jsonl" in r.output


def test_plan_expert_id_beyond_the_geometry(tmp_path):
    """A pass block (CRC recomputed) naming expert 255 of 8: was IndexError in inspect_plan and
    load_flat_plan; now a PlanFormatError at the block's offset from every streaming reader."""
    data = _plan_bytes()
    lay = _plan_layout(data)
    pos, _ = lay["blocks"][0]
    buf = bytearray(data)
    struct.pack_into("<H", buf, pos + 20 + 2 * 3 + 2 * 2, 255)  # after the 3 layer counts: an expert id
    p = _write(tmp_path, _recrc(buf, lay))
    for fn in (P.verify_plan, P.inspect_plan, P.load_flat_plan, P.read_accesses):
        with pytest.raises(PlanFormatError, match="expert index >= n_experts=8") as e:
            fn(p)
        assert e.value.offset == pos


def test_plan_header_fewer_experts_than_its_blocks_name(tmp_path):
    """header n_experts = 1 (header CRC recomputed): was IndexError in inspect_plan."""
    p = _write(tmp_path, _edit_header(_plan_bytes(), "<I", 24, 1))
    with pytest.raises(PlanFormatError):
        P.inspect_plan(p)


@pytest.mark.parametrize("field, off, fmt, value", [("n_layers", 20, "<I", 2**31), ("n_layers", 20, "<I", 40000),
                                                     ("n_experts", 24, "<I", 2**32 - 1)])
def test_plan_header_geometry_beyond_the_file(tmp_path, field, off, fmt, value):
    """n_layers = 2**31 with every CRC recomputed: read_accesses tried to allocate 672 GiB
    (MemoryError); now an inconsistent-header PlanFormatError before anything is allocated."""
    p = _write(tmp_path, _edit_header(_plan_bytes("plain"), fmt, off, value))
    with pytest.raises(PlanFormatError, match="inconsistent header") as e:
        P.read_accesses(p)
    assert e.value.offset in (20, 40, 48)


def test_plan_header_totals_must_fit_the_file(tmp_path):
    data = _plan_bytes("plain")
    h = _plan_layout(data)["header"]
    # more layers than the blocks hold counts for (each pass would need 4000 more bytes)
    p = _write(tmp_path, _edit_header(data, "<I", 20, h.n_layers + 2000))
    with pytest.raises(PlanFormatError, match="need at least") as e:
        P.read_header(p)
    assert e.value.offset == 48


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_sim_plan_helpers_on_a_missing_file_or_directory(tmp_path, what):
    """inputs.accesses.plan_expert_bytes / is_plan: were FileNotFoundError / IsADirectoryError."""
    from moetrace.inputs import accesses as A

    p = tmp_path / "absent.bin" if what == "missing" else tmp_path
    with pytest.raises(InputError) as e:
        A.plan_expert_bytes(p)
    assert str(p) in e.value.format_message()


# -- pools ---------------------------------------------------------------------------------------

def _pool_doc(root: Path) -> dict:
    return json.loads((root / "pool.json").read_text())


def _rewrite_pool(root: Path, doc: dict, rechecksum: bool = True) -> Path:
    from moetrace.inputs.pool import _checksum

    if rechecksum:
        doc["checksum"] = _checksum(doc)
    (root / "pool.json").write_text(json.dumps(doc))
    return root / "pool.json"


def test_pool_manifest_not_utf8(seed_pools, tmp_path):
    """A latin-1 pool.json: was UnicodeDecodeError; now InputError with the byte offset."""
    from moetrace.inputs.pool import open_pool

    root = _copy_pool(seed_pools["files"], tmp_path / "p")
    raw = (root / "pool.json").read_bytes()
    (root / "pool.json").write_bytes(raw[:5] + b"caf\xe9" + raw[5:])
    with pytest.raises(InputError, match="not UTF-8") as e:
        open_pool(root)
    assert e.value.offset == 8 and str(root / "pool.json") in e.value.format_message()


@pytest.mark.parametrize("key, value, text", [
    (("geometry", "n_experts"), 0.5, "'geometry.n_experts' must be an integer"),
    (("geometry", "n_layers"), -1e23, "'geometry.n_layers' must be an integer"),
    (("geometry", "k"), 9, "k=9 > n_experts=3"),
    (("geometry", "n_layers"), True, "'geometry.n_layers' must be an integer"),
    (("geometry",), [1], "'geometry' must be an object"),
    (("page_size",), 0, "'page_size' must be an integer in [1"),
    (("page_size",), "x", "'page_size' must be an integer"),
    (("extent_bytes",), "8192", "'extent_bytes' must be an integer"),
    (("extent_bytes",), 2**63, "'extent_bytes' must be an integer"),
    (("files",), [1, 2, 3, 4, 5, 6], "'files' must be a list of relative paths"),
    (("files",), "L000/E0000.bin", "'files' must be a list of relative paths"),
])
def test_pool_manifest_values_of_the_wrong_type(seed_pools, tmp_path, key, value, text):
    """Checksum recomputed, so only the values are wrong. Geometry values were a UsageError from
    Geometry (exit 2, the manifest not named); page_size 0 a ZeroDivisionError; page_size "x" a
    ValueError; non-string files a TypeError; "8192" extents were accepted as numbers."""
    from moetrace.inputs.pool import open_pool

    root = _copy_pool(seed_pools["files"], tmp_path / "p")
    mpath = _rewrite_pool(root, set_path(_pool_doc(root), key, value))
    with pytest.raises(InputError) as e:
        open_pool(root)
    assert not isinstance(e.value, UsageError)
    assert text in e.value.format_message() and str(mpath) in e.value.format_message()
    r = run_cli(["pool", "verify", root], codes=(1,))
    assert str(mpath) in r.output


# -- run directories, cells, sweeps ---------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("rel", ["cell.json", "run/snapshots.json", "replay/replay.json", "snapshots/pre.json"])
def test_cell_side_files_that_are_not_objects(seeds, tmp_path, rel):
    """cell.json or snapshots.json holding `true`: was AttributeError ('bool' has no .get) in
    the report and check; now InputError naming the file."""
    from moetrace.reports.report import build_report
    from moetrace.run.handle import open_run

    d = _copy(seeds["pinned"], tmp_path / "cell")
    (d / rel).write_text("true\n")
    with pytest.raises(InputError, match="not an object") as e:
        open_run(d, unrecorded=True) if rel.startswith("snapshots/") else open_run(d)
        if rel.startswith("snapshots/"):
            (d / "run" / "manifest.json").unlink()
            open_run(d, unrecorded=True)
    assert str(d / rel) in e.value.format_message()
    if not rel.startswith("snapshots/"):
        with pytest.raises(InputError):
            build_report(d, tmp_path / "out")


def test_json_side_file_not_utf8(seeds, tmp_path):
    """snapshots.json with a byte that is not UTF-8: was UnicodeDecodeError."""
    from moetrace.run.handle import open_run

    d = _copy(seeds["pinned"], tmp_path / "cell")
    raw = (d / "run" / "snapshots.json").read_bytes()
    (d / "run" / "snapshots.json").write_bytes(raw[:40] + b"\x8a" + raw[40:])
    with pytest.raises(InputError, match="not UTF-8") as e:
        open_run(d)
    assert e.value.offset == 40


# (seed, file, key, value, what the old readers raised)
WRONG_TYPED_JSON = [
    ("few", "manifest.json", ("pool", "geometry", "n_experts"), 3e9, "MemoryError (22.4 TiB)"),
    ("few", "manifest.json", ("pool", "pages_per_expert"), -1, "UsageError naming no file"),
    ("few", "manifest.json", ("pool",), [1], "AttributeError"),
    ("few", "manifest.json", ("interval", "armed_ns"), "x", "ValueError"),
    ("few", "manifest.json", ("plan", "path"), 5, "TypeError"),
    ("few", "manifest.json", ("replay_dir",), 5, "TypeError"),
    ("few", "manifest.json", ("lost", "pagecache"), 5, "AttributeError"),
    ("few", "manifest.json", ("lost", "pagecache", "stream", "lost_kernel"), "x", "ValueError"),
    ("few", "manifest.json", ("notes",), 5, "TypeError"),
    ("pinned", "cell.json", ("capacity_bytes",), "x", "ValueError"),
    ("pinned", "cell.json", ("device_bytes",), 1e308, "OverflowError"),
    ("pinned", "cell.json", ("amplification",), "x", "TypeError"),
    ("pinned", "cell.json", ("measured_iterations",), "x", "ValueError (check)"),
    ("pinned", "cell.json", ("refault_file_pages",), "x", "ValueError"),
    ("pinned", "cell.json", ("notes",), 5, "TypeError"),
    ("pinned", "run/snapshots.json", ("post",), 5, "AttributeError"),
    ("pinned", "run/snapshots.json", ("post", "monotonic_ns"), "x", "ValueError"),
]


@pytest.mark.parametrize("seed, rel, key, value, old", WRONG_TYPED_JSON,
                         ids=[f"{r}:{'.'.join(k)}={v!r}" for _, r, k, v, _ in WRONG_TYPED_JSON])
def test_run_json_values_of_the_wrong_type(seeds, tmp_path, seed, rel, key, value, old):
    """A run's or cell's JSON with a value of the wrong type where an analysis reads it (the
    ``old`` exception escaped the report or check): now InputError naming the file and the key
    (the kinds: moetrace.run.validate); check cannot compare, and says why."""
    from moetrace.reports.check import CANNOT_COMPARE, run_check
    from moetrace.reports.report import build_report

    d = _copy(seeds[seed], tmp_path / "d")
    doc = json.loads((d / rel).read_text())
    (d / rel).write_text(json.dumps(set_path(doc, key, value)))
    dotted_key = ".".join(key)
    with pytest.raises(InputError) as e:
        build_report(d, tmp_path / "out")
    msg = e.value.format_message()
    assert f"'{dotted_key}'" in msg and str(d / rel) in msg
    res = run_check(d, seeds[seed])
    assert res.status == CANNOT_COMPARE and str(d / rel) in res.reason and f"'{dotted_key}'" in res.reason


def test_stacks_folded_not_utf8(seeds, tmp_path):
    """stacks.folded starting with 0x80: Run.folded was UnicodeDecodeError."""
    from moetrace.run.handle import open_run

    d = _copy(seeds["run"], tmp_path / "run")
    (d / "stacks.folded").write_bytes(b"\x80" + (d / "stacks.folded").read_bytes()[1:])
    with pytest.raises(InputError, match="not UTF-8") as e:
        open_run(d).folded
    assert e.value.offset == 0 and str(d / "stacks.folded") in e.value.format_message()


@pytest.mark.parametrize("table", ["epochs", "experts", "results"])
def test_damaged_parquet_through_open_run_and_open_sweep(seeds, tmp_path, table):
    """A truncated table read through open_run's tables or by open_sweep: was pyarrow's OSError / ArrowInvalid
    (pandas-metadata damage: KeyError 'numpy_type', UnicodeDecodeError, JSONDecodeError)."""
    from moetrace.run.handle import open_run, open_sweep

    if table == "results":
        d = _copy(seeds["sweep"], tmp_path / "sweep")
        f = d / "results.parquet"
        f.write_bytes(f.read_bytes()[:-9])
        fn = lambda: open_sweep(d)  # noqa: E731
    else:
        d = _copy(seeds["few"], tmp_path / "run")
        f = d / f"{table}.parquet"
        f.write_bytes(f.read_bytes()[:100])
        fn = lambda: dict(open_run(d).tables)  # noqa: E731
    with pytest.raises(InputError, match=f"cannot read table '{table}'") as e:
        fn()
    assert str(f) in e.value.format_message()


def _rewrite_table(path: Path, fn) -> None:
    import pandas as pd

    df = pd.read_parquet(path)
    fn(df).to_parquet(path, index=False)


@pytest.mark.parametrize("table, edit, text", [
    ("replay/iterations", lambda df: df.assign(iteration=df["iteration"].where(df.index != 3, 2)),
     "repeats the key (phase, repeat, iteration)"),
    ("replay/iterations", lambda df: df.rename(columns={"start_ns": "start_nz"}), "lacks column 'start_ns'"),
    ("experts", lambda df: df.assign(expert=df["expert"].where(df.index != 5, 67108875)),
     "lies outside the run's geometry 8 x 16"),
    ("epochs", lambda df: df.assign(epoch=df["epoch"].where(df.index != 2, 1)), "repeats the key (epoch)"),
    ("experts", lambda df: df.assign(layer=df["layer"].astype(str)), "column 'layer' has type"),
])
def test_tables_that_decode_but_break_their_readers(seeds, tmp_path, table, edit, text):
    """Parquet pages carry no checksum: a damaged page can decode into duplicate keys (was
    ValueError 'Length of values (62) does not match length of index (60)' in the amplification
    table), a renamed column (KeyError 'start_ns'), an expert outside the geometry (IndexError in
    the heatmap) or duplicate epochs (an InputError naming no file). Now InputError naming the table."""
    from moetrace.reports.report import build_report

    d = _copy(seeds["run"], tmp_path / "run")
    f = d / f"{table}.parquet"
    _rewrite_table(f, edit)
    with pytest.raises(InputError) as e:
        build_report(d, tmp_path / "out", sections=["amp", "timeline"])
    assert text in e.value.format_message() and str(f) in e.value.format_message()


def test_table_strings_that_are_not_utf8(seeds, tmp_path):
    """stacks.parquet whose string page decodes to invalid UTF-8: was a bare ArrowException in
    the flame section."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moetrace.run.handle import open_run

    d = _copy(seeds["run"], tmp_path / "run")
    f = d / "stacks.parquet"
    t = pq.read_table(f)
    i = t.schema.get_field_index("who")
    typ = t.column(i).type
    off = np.int64 if typ == pa.large_string() else np.int32
    bad = pa.Array.from_buffers(typ, 1, [None, pa.py_buffer(np.array([0, 2], off).tobytes()),
                                         pa.py_buffer(b"\xff\xfe")])
    col = pa.chunked_array([bad] + [t.column(i).slice(1).combine_chunks()])
    pq.write_table(t.set_column(i, "who", col), f)
    with pytest.raises(InputError, match="invalid strings") as e:
        open_run(d).tables["stacks"]
    assert str(f) in e.value.format_message()


def test_sweep_capacity_table_without_a_column(seeds, tmp_path):
    """capacity.parquet lacking iteration_time_median_ns: was KeyError in Table 2."""
    from moetrace.reports.report import build_report

    d = _copy(seeds["sweep"], tmp_path / "sweep")
    _rewrite_table(d / "capacity.parquet", lambda df: df.drop(columns=["iteration_time_median_ns"]))
    with pytest.raises(InputError, match="column 'iteration_time_median_ns' is missing") as e:
        build_report(d, tmp_path / "out")
    assert str(d / "capacity.parquet") in e.value.format_message()


@pytest.mark.parametrize("text, match", [
    (b'metrics = "x"\n', "metrics must be a table"),
    (b"alpha = 0.05 # caf\xe9\n", "not UTF-8"),
    (b"[metrics.amplification]\nthreshold = nan\n", "threshold must be a number >= 0"),
    (b"[metrics.amplification]\nthreshold = inf\n", "threshold must be a number >= 0"),
    (b"[metrics.amplification]\nthreshold = true\n", "threshold must be a number >= 0"),
    (b"alpha = true\n", "alpha must be a number"),
])
def test_thresholds_of_the_wrong_type(tmp_path, text, match):
    """`check --thresholds`: metrics = "x" was AttributeError, a latin-1 file UnicodeDecodeError,
    and nan / inf / true thresholds were taken as numbers."""
    from moetrace.analyses.compare import load_thresholds

    p = _write(tmp_path, text, "th.toml")
    with pytest.raises(InputError, match=match) as e:
        load_thresholds(p)
    assert str(p) in e.value.format_message()


def test_failed_report_leaves_the_earlier_one_untouched(seeds, tmp_path):
    """`report --out` removed the earlier report's tables/ and figures/ before building the new
    one: a report that then failed left a half-replaced directory. Now it builds aside."""
    d = _copy(seeds["few"], tmp_path / "run")
    out = tmp_path / "out"
    before = _earlier_report(out)
    (d / "epochs.parquet").write_bytes(b"PAR1 not a table")
    r = run_cli(["report", d, "--out", out, "--only", "amp"], codes=(1,))
    assert str(d / "epochs.parquet") in r.output
    assert tree_state(out) == before and not leftover_temps(out)
    fresh = tmp_path / "fresh"
    run_cli(["report", d, "--out", fresh, "--only", "amp"], codes=(1,))
    assert not fresh.exists()  # a directory the failed report created is gone again
