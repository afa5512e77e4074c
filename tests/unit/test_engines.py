"""The engine record (engines/llamacpp.py) on a fake unpacked tree, no kernel: the command
line through sid's loader, the backend in the environment, and errors that say how to fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from moetrace.engines import llamacpp as LC
from moetrace.errors import InputError, MoetraceError


def _tree(root: Path, **over) -> Path:
    v = root / "llama.cpp" / "0.7.0+dfsg-2"
    lib = v / "root" / "usr" / "lib" / "x86_64-linux-gnu"
    (v / "root" / "usr" / "bin").mkdir(parents=True)
    lib.mkdir(parents=True)
    for n in ("llama-cli", "llama-simple"):
        (v / "root" / "usr" / "bin" / n).write_text("")
    (lib / "ld-linux-x86-64.so.2").write_text("")
    doc = {"schema": "moetrace.engine/1", "engine": "llama.cpp", "version": "1:0.7.0+dfsg-2",
           "build": "0.7.0 (build 11669, commit Debian)", "root": str(v / "root"),
           "loader": str(lib / "ld-linux-x86-64.so.2"), "library_path": [str(lib), str(lib / "llama")],
           "backend": str(lib / "ggml" / "backends0" / "libggml-cpu-zen4.so"), "cpu": "AMD EPYC",
           "packages": {"libc6": "2.43-7"}, **over}
    (v / "engine.json").write_text(json.dumps(doc))
    (root / "llama.cpp" / "current").symlink_to("0.7.0+dfsg-2")
    return v


def test_the_command_runs_the_tool_through_sids_loader(tmp_path, monkeypatch):
    v = _tree(tmp_path)
    monkeypatch.setenv("MOETRACE_ENGINE_ROOT", str(tmp_path))
    e = LC.require_engine()
    lib = v / "root" / "usr" / "lib" / "x86_64-linux-gnu"
    assert e.command("llama-simple", "-m", "m.gguf") == [
        str(lib / "ld-linux-x86-64.so.2"), "--inhibit-cache", "--library-path", f"{lib}:{lib}/llama",
        str(v / "root" / "usr" / "bin" / "llama-simple"), "-m", "m.gguf"]
    env = e.env({"PATH": "/bin"})
    # the tools load the set-up's backend; the routing logger scores the variants on its own CPU
    assert env == {"PATH": "/bin", "GGML_BACKEND_PATH": str(lib / "ggml" / "backends0" / "libggml-cpu-zen4.so"),
                   "MOETRACE_GGML_BACKENDS": str(lib / "ggml" / "backends0")}
    assert e.describe()["version"] == "1:0.7.0+dfsg-2" and e.path == v.resolve()
    with pytest.raises(MoetraceError, match="has no llama-server") as err:
        e.command("llama-server")
    assert "llama-cli, llama-simple" in err.value.format_message()


def test_no_engine_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRACE_ENGINE_ROOT", str(tmp_path / "none"))
    assert LC.find_engine() is None
    with pytest.raises(MoetraceError, match="engine-setup.sh"):
        LC.require_engine()
    from moetrace.record.doctor import engine_rows

    (row,) = engine_rows()
    assert row["status"] == "no" and "engine-setup.sh" in row["fix"]


def test_a_damaged_record_names_the_file(tmp_path, monkeypatch):
    v = _tree(tmp_path, loader=str(tmp_path / "gone"))
    monkeypatch.setenv("MOETRACE_ENGINE_ROOT", str(tmp_path))
    with pytest.raises(InputError, match="its loader .*gone is gone") as err:
        LC.find_engine()
    assert str(v / "engine.json") in err.value.format_message()
    (v / "engine.json").write_text("{")
    from moetrace.record.doctor import engine_rows

    (row,) = engine_rows()
    assert row["status"] == "no" and "not a usable engine record" in row["detail"]


def test_the_routing_loggers_command_and_what_it_needs(tmp_path, monkeypatch):
    v = _tree(tmp_path)
    monkeypatch.setenv("MOETRACE_ENGINE_ROOT", str(tmp_path))
    e = LC.require_engine()
    with pytest.raises(MoetraceError, match="no routing logger") as err:
        LC.route_command(e, "m.gguf", "r.jsonl")
    assert "engine-setup.sh" in err.value.format_message()
    (v / "bin").mkdir()
    (v / "bin" / "moetrace-route-log").write_text("")
    argv = LC.route_command(e, "m.gguf", "r.jsonl", tokens=8, load_mode="none", repack=False)
    assert argv[:4] == [str(e.loader), "--inhibit-cache", "--library-path", ":".join(e.library_path)]
    assert argv[4:] == [str(v.resolve() / "bin" / "moetrace-route-log"), "-m", "m.gguf", "-o", "r.jsonl", "-n", "8",
                        "-p", "the a b", "-l", "none", "-t", "1", "-r", "r0", "--no-repack"]
    with pytest.raises(MoetraceError, match="load mode 'fast' is not one of"):
        LC.route_command(e, "m.gguf", "r.jsonl", load_mode="fast")


def test_the_engines_mappings_of_the_model_by_device_and_inode(tmp_path):
    from moetrace.engines.pageout import file_mappings

    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    st = f.stat()
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    maps = "\n".join([
        f"7f0000000000-7f0000400000 r--s 00000000 {dev} {st.st_ino}                    {f}",
        f"7f0000400000-7f0000401000 r--p 00000000 {dev} {st.st_ino + 1}                 /other",
        "7f0000500000-7f0000600000 rw-p 00000000 00:00 0 ",
        f"7f0000600000-7f0000800000 r--s 00400000 {dev} {st.st_ino}                    {f} (deleted)",
        "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]"])
    assert file_mappings(1, f, maps) == [(0x7F0000000000, 0x7F0000400000), (0x7F0000600000, 0x7F0000800000)]
    with pytest.raises(MoetraceError, match="cannot read the mappings of process"):
        file_mappings(2 ** 22 + 7, f)
