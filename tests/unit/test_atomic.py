"""moetrace.atomic.atomic_write: the file appears whole or not at all, with the mode asked for."""

from __future__ import annotations

import os
import stat

import pytest

from moetrace.atomic import atomic_write
from moetrace.errors import InputError


def test_a_clean_block_moves_the_content_onto_the_name(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("old")
    with atomic_write(p) as tmp:
        assert tmp.parent == tmp_path and tmp != p
        tmp.write_text("new")
        assert p.read_text() == "old"  # not there before the block ends
    assert p.read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["x.json"]


def test_a_failing_block_leaves_the_old_file_and_no_temporary(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("old")
    with pytest.raises(ValueError), atomic_write(p) as tmp:
        tmp.write_text("half")
        raise ValueError("writer failed")
    assert p.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["x.json"]


def test_the_mode_holds_from_creation_whatever_the_umask(tmp_path):
    p = tmp_path / "m.parquet"
    old = os.umask(0)
    try:
        with atomic_write(p, mode=0o600, fsync=True) as tmp:
            assert stat.S_IMODE(tmp.stat().st_mode) == 0o600  # before any content
            tmp.write_bytes(b"abc")
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and p.read_bytes() == b"abc"


def test_what_names_the_file_in_an_input_error(tmp_path):
    p = tmp_path / "missing-dir" / "t.parquet"
    with pytest.raises(InputError, match=r"missing-dir/t.parquet: cannot write the typed trace"):
        with atomic_write(p, mode=0o600, what="typed trace") as tmp:
            tmp.write_text("x")
    with pytest.raises(FileNotFoundError), atomic_write(p) as tmp:  # without `what`: the OSError itself
        tmp.write_text("x")
