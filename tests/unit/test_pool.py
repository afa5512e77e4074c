"""Pools: layouts, manifest integrity, path containment, interrupted creation."""

from __future__ import annotations

import json
import zlib

import pytest
from click.testing import CliRunner

from moetrace.cli import cli
from moetrace.errors import InputError, UsageError
from moetrace.inputs.geometry import Geometry
from moetrace.inputs.pool import MANIFEST, _checksum, create_pool, open_pool, verify_pool

GEO = Geometry(2, 3, 2, 10_000, "tiny")  # 10,000 bytes: not page-aligned on purpose


def test_files_layout(tmp_path):
    p = create_pool(tmp_path / "p", GEO, layout="files", seed=1)
    assert len(p.files) == 6 and verify_pool(p) == []
    assert p.path_of(4).read_bytes().__len__() == 10_000
    assert p.path_of(4).name == "E0001.bin" and p.path_of(4).parent.name == "L001"
    # incompressible fill, different per expert
    data = p.path_of(0).read_bytes()
    assert len(zlib.compress(data)) > 0.99 * len(data)
    assert data != p.path_of(1).read_bytes()


def test_pool_layout_extents_page_aligned(tmp_path):
    p = create_pool(tmp_path / "p", GEO, layout="pool")
    assert p.extent_bytes == 12_288 and p.offset_of(5) == 5 * 12_288
    assert (tmp_path / "p" / "pool.bin").stat().st_size == 6 * 12_288
    assert verify_pool(p) == []


def test_layers_layout_one_file_per_layer_read_at_offsets(tmp_path):
    p = create_pool(tmp_path / "p", GEO, layout="layers")
    assert p.files == ["L000.bin", "L001.bin"] and p.extent_bytes == 12_288 and verify_pool(p) == []
    assert (p.file_of(4), p.offset_of(4), p.path_of(4).name) == (1, 12_288, "L001.bin")
    assert p.experts_in_file(1) == (3, 3) and p.file_min_bytes() == 2 * 12_288 + 10_000
    assert (tmp_path / "p" / "L001.bin").stat().st_size == 3 * 12_288
    (tmp_path / "p" / "L001.bin").write_bytes(b"x" * 30_000)
    assert verify_pool(p) == ["L001.bin: 30000 bytes, expected at least 34576"]


def test_a_pool_relaid_out_holds_the_same_bytes_per_expert_and_is_made_once(tmp_path):
    from moetrace.inputs.pool import relayout_pool
    from moetrace.record.poolmap import pool_map

    src = create_pool(tmp_path / "src", GEO, layout="files", seed=5)
    lay = relayout_pool(tmp_path / "src", tmp_path / "lay", "layers")
    for eid in range(GEO.n_total):
        with open(lay.path_of(eid), "rb") as fh:
            fh.seek(lay.offset_of(eid))
            assert fh.read(GEO.expert_bytes) == src.path_of(eid).read_bytes(), eid
    assert lay.manifest["derived_from"]["checksum"] == src.manifest["checksum"]
    made = (tmp_path / "lay" / "L000.bin").stat().st_mtime_ns
    assert relayout_pool(tmp_path / "src", tmp_path / "lay", "layers").manifest == lay.manifest
    assert (tmp_path / "lay" / "L000.bin").stat().st_mtime_ns == made  # kept, not made again
    assert sorted(pool_map(lay).inodes.values()) == [(0, 3), (3, 3)]  # what the probes attribute by
    assert relayout_pool(tmp_path / "src", tmp_path / "lay", "pool").layout == "pool"  # another layout: made anew


def test_manifest_tamper_and_escape(tmp_path):
    create_pool(tmp_path / "p", GEO, layout="files")
    m = tmp_path / "p" / MANIFEST
    doc = json.loads(m.read_text())
    doc["geometry"]["n_experts"] = 4
    m.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="checksum"):
        open_pool(tmp_path / "p")
    doc["geometry"]["n_experts"] = 3
    doc["files"][0] = "../../etc/passwd"
    doc["checksum"] = _checksum(doc)
    m.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="outside the pool"):
        open_pool(tmp_path / "p")
    (tmp_path / "p" / "L000").rename(tmp_path / "elsewhere")
    (tmp_path / "p" / "L000").symlink_to(tmp_path / "elsewhere")
    doc["files"][0] = "L000/E0000.bin"
    doc["checksum"] = _checksum(doc)
    m.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="resolves outside"):
        open_pool(tmp_path / "p")


def test_verify_reports_size_and_missing(tmp_path):
    p = create_pool(tmp_path / "p", GEO, layout="files")
    p.path_of(2).write_bytes(b"x")
    p.path_of(3).unlink()
    probs = verify_pool(p)
    assert any("1 bytes, expected 10000" in x for x in probs) and any("missing" in x for x in probs)
    r = CliRunner().invoke(cli, ["pool", "verify", str(tmp_path / "p")])
    assert r.exit_code == 1 and "2 problem" in r.output


def test_interrupted_creation_leaves_nothing(tmp_path):
    seen = []

    def boom(n):
        seen.append(n)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        create_pool(tmp_path / "p", GEO, layout="files", progress=boom)
    assert list((tmp_path / "p").iterdir()) == []


def test_refuses_existing_pool_without_force(tmp_path):
    create_pool(tmp_path / "p", GEO)
    with pytest.raises(UsageError, match="already holds a pool"):
        create_pool(tmp_path / "p", GEO)
    assert create_pool(tmp_path / "p", GEO, layout="pool", force=True).layout == "pool"
    assert not (tmp_path / "p" / "L000").exists()


def test_cli_create_scaled(tmp_path):
    r = CliRunner().invoke(cli, ["pool", "create", str(tmp_path / "p"), "--geometry", "kimi-k3", "--layers", "2",
                                 "--experts", "5", "--expert-bytes", "64KiB", "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["experts"] == 10 and info["scaled_from"]["n_experts"] == 896
    assert open_pool(tmp_path / "p").geometry.expert_bytes == 65536


def test_a_pools_runs_attribute_pages_as_the_extent_formula_does(tmp_path):
    """The runs of every layout (record/poolmap.py): page p of a file of n experts from base is
    expert base + p // ppe below n x ppe, unattributed above; another inode is unattributed."""
    import numpy as np

    from moetrace.record.poolmap import PoolMap

    pm = PoolMap({11: (0, 1), 12: (1, 3), 13: (4, 1)}, 0, 3 * 4096 + 5, 5, 5)
    ppe = pm.pages_per_expert
    assert ppe == 4 and pm.n_slots == 8
    pages = np.arange(30)
    for ino, (base, n) in pm.inodes.items():
        want = np.where(pages < n * ppe, base + pages // ppe, 5)
        assert pm.classify(np.full(30, ino), pages).tolist() == want.tolist()
        assert pm.expert_ids(np.full(30, ino), pages).tolist() == np.where(want < 5, want, -1).tolist()
    assert pm.classify([99], [0]).tolist() == [5]
    assert pm.windows == {11: (0, 2, 0, 4), 12: (2, 4, 64, 12), 13: (6, 2, 128, 4)}
    assert pm.search_steps == 2 and pm.bitmap_words == 3
