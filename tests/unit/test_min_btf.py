"""The probes' minimal BTF cache (moetrace.kernel.minbtf) without a kernel (unit tier)."""

from __future__ import annotations

from moetrace.kernel import minbtf


def test_names_follow_kernel_and_objects(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRACE_BTF_CACHE", str(tmp_path / "c"))
    a, b = tmp_path / "a.bpf.o", tmp_path / "b.bpf.o"
    a.write_bytes(b"A" * 100)
    b.write_bytes(b"B" * 100)
    k1 = bytes(range(256)) * 1000
    k2 = k1[:-1] + b"\x00"  # one byte at the end differs: another build
    n = minbtf.file_name(k1, [a, b])
    assert n == minbtf.file_name(k1, [b, a]) and n.endswith(".btf")
    assert n != minbtf.file_name(k2, [a, b]) and n != minbtf.file_name(k1, [a])
    b.write_bytes(b"C" * 100)  # a rebuilt object
    assert n != minbtf.file_name(k1, [a, b])


def test_found_in_the_cache_without_bpftool(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRACE_BTF_CACHE", str(tmp_path / "c"))
    monkeypatch.setattr(minbtf.shutil, "which", lambda _n: None)
    o = tmp_path / "x.bpf.o"
    o.write_bytes(b"obj")
    k = b"\x9f\xeb" + b"k" * 5000
    assert minbtf.ensure([o], k) is None  # not cached, no bpftool: the kernel's own BTF is used
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").iterdir())
    made = tmp_path / "c" / minbtf.file_name(k, [o])
    made.parent.mkdir(parents=True)
    made.write_bytes(b"\x9f\xebmin")
    assert minbtf.ensure([o], k) == made
    assert minbtf.cache_dirs()[0] == tmp_path / "c"
