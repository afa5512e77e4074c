"""`moetrace lab build` without a kernel (no-kernel tier): a toy tree whose Makefile answers
defconfig / olddefconfig / bzImage / kernelversion stands in for a kernel tree; the real build of
Debian's 6.12 is in the closing note of issue 34 (an hour on 2 cores: not for CI)."""

from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from moetrace.errors import InputError, MoetraceError, UsageError
from moetrace.lab import build as B

MAKEFILE = """\
.PHONY: defconfig olddefconfig bzImage kernelversion
defconfig:
\tprintf 'CONFIG_MMU=y\\n' > .config
olddefconfig:
\tsed -i '/NOT_IN_TREE/d' .config
kernelversion:
\t@echo 6.12.95
bzImage:
\t@echo '  CC      mm/vmscan.o'
\t@echo '  CC      mm/filemap.o'
\t@echo '  LD [M]  fs/x.ko'
\t@echo 'not a step'
\tmkdir -p arch/x86/boot
\tcat mm/vmscan.c > arch/x86/boot/bzImage
\ttouch vmlinux
"""
#: merge_config.sh -m BASE FRAG...: append each fragment (a later value wins in the toy's reader)
MERGE = "#!/bin/sh\nshift; base=$1; shift\nfor f in \"$@\"; do cat \"$f\" >> \"$base\"; done\n"


def toy_tree(root: Path, clamp: str = "DEF_PRIORITY / 2") -> Path:
    t = root / "linux-toy"
    (t / "mm").mkdir(parents=True)
    (t / "scripts" / "kconfig").mkdir(parents=True)
    (t / "Makefile").write_text(MAKEFILE)
    (t / "scripts" / "kconfig" / "merge_config.sh").write_text(MERGE)
    (t / "mm" / "vmscan.c").write_text(f"a\nb\nc\n\tsc->priority = clamp(priority, {clamp}, DEF_PRIORITY);\nd\ne\nf\n")
    return t


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A toy tarball, its patch, a cache; LAB_FRAGMENT shrunk to what the toy's config can hold."""
    t = toy_tree(tmp_path / "a")
    toy_tree(tmp_path / "b", clamp="0")
    patch = tmp_path / "clamp.patch"
    diff = subprocess.run(["diff", "-u", "a/linux-toy/mm/vmscan.c", "b/linux-toy/mm/vmscan.c"], cwd=tmp_path,
                          capture_output=True, text=True).stdout
    patch.write_text("the 6.8 clamp\n" + diff.replace("a/linux-toy/", "a/").replace("b/linux-toy/", "b/"))
    tar = tmp_path / "linux-toy.tar.gz"
    with tarfile.open(tar, "w:gz") as tf:
        tf.add(t, arcname="linux-toy")
    monkeypatch.setattr(B, "LAB_FRAGMENT", "CONFIG_MMU=y\n")
    monkeypatch.setattr(B, "TOOLS", ("make", "patch"))
    return tar, patch, tmp_path / "cache"


def test_build_caches_applies_and_reverts(toy):
    tar, patch, cache = toy
    steps = []
    base = B.build_image(tar, cache=cache, on_step=lambda n, total: steps.append((n, total)))
    assert not base.cached and steps == [(1, B.FIRST_BUILD_STEPS), (2, B.FIRST_BUILD_STEPS),
                                         (3, B.FIRST_BUILD_STEPS)]
    assert "DEF_PRIORITY / 2" in base.image.read_text()
    d = base.doc
    assert d["steps"] == 3 and d["incremental"] is False and d["patches"] == [] and d["kernel_version"] == "6.12.95"
    assert d["schema"] == B.BUILD_SCHEMA and (base.image.parent / "config").is_file()
    assert f'CONFIG_LOCALVERSION="-mt{d["key"][:8]}"' in (base.image.parent / "config").read_text()
    cand = B.build_image(tar, [patch], cache=cache)
    assert not cand.cached and cand.doc["incremental"] is True and cand.doc["key"] != d["key"]
    assert "clamp(priority, 0, DEF_PRIORITY)" in cand.image.read_text()
    tree = cache / "trees" / d["source"]["digest"][:16]
    assert "DEF_PRIORITY / 2" in (tree / "src" / "mm" / "vmscan.c").read_text(), "the patch was not reverted"
    assert json.loads((tree / "tree.json").read_text())["applied"] == []
    again = B.build_image(tar, [patch], cache=cache)
    assert again.cached and again.image == cand.image
    assert [x["key"] for x in B.list_images(cache)] and len(B.list_images(cache)) == 2


def test_a_patch_left_applied_is_reverted_first(toy):
    tar, patch, cache = toy
    src = B.resolve_source(tar)
    tree = cache / "trees" / src.digest[:16]
    tree.mkdir(parents=True)
    B.unpack(src, tree / "src")
    B.apply_patches(tree, B.read_patches([patch]))  # a build stopped here
    base = B.build_image(tar, cache=cache)
    assert "DEF_PRIORITY / 2" in base.image.read_text()


def test_errors_name_the_cause(toy, tmp_path):
    tar, patch, cache = toy
    bad = tmp_path / "bad.patch"
    bad.write_text(patch.read_text().replace("DEF_PRIORITY / 2", "DEF_PRIORITY / 3"))
    with pytest.raises(InputError, match="does not apply"):
        B.build_image(tar, [bad], cache=cache)
    with pytest.raises(UsageError, match="not a kernel tree"):
        B.resolve_source(tmp_path / "a")
    frag = tmp_path / "frag"
    frag.write_text("hello\n")
    with pytest.raises(InputError, match="no CONFIG_ symbols"):
        B.build_image(tar, fragments=[frag], cache=cache)
    frag.write_text("CONFIG_NOT_IN_TREE=y\n")  # the toy's olddefconfig drops it, as Kconfig drops unknowns
    with pytest.raises(MoetraceError, match="did not stick.*CONFIG_NOT_IN_TREE=y \\(got n\\)"):
        B.build_image(tar, fragments=[frag], cache=cache)


def test_a_failed_make_quotes_its_log(toy, tmp_path):
    tar, patch, cache = toy
    t = tmp_path / "broken" / "linux-toy"
    toy_tree(tmp_path / "broken")
    (t / "Makefile").write_text(MAKEFILE.replace("\tmkdir -p arch/x86/boot\n", "\t@echo 'vmscan.c:1: error: boom'\n"
                                                                           "\t@false\n"))
    with pytest.raises(MoetraceError, match="(?s)make bzImage failed.*error: boom"):
        B.build_image(t, cache=cache)


def test_unmet():
    f = B.parse_config("CONFIG_A=y\n# CONFIG_B is not set\nCONFIG_C=\"x\"\n# comment\nCONFIG_D=n\n")
    assert B.unmet("CONFIG_A=y\nCONFIG_C=\"x\"\n", f) == []
    assert B.unmet("CONFIG_A=m\nCONFIG_B=y\n", f) == ['CONFIG_A=y (got m)', 'CONFIG_B=n (got y)',
                                                       'CONFIG_C=x (got n)']


def test_the_lab_fragment_holds_the_guests_drivers():
    from moetrace.lab.run import GUEST_DRIVERS

    frag = B.parse_config(B.LAB_FRAGMENT)
    assert all(frag.get(sym) == "y" for sym in GUEST_DRIVERS.values())
    for sym in ("CONFIG_DEBUG_INFO_BTF", "CONFIG_BPF_SYSCALL", "CONFIG_KPROBES", "CONFIG_LRU_GEN", "CONFIG_MEMCG"):
        assert frag[sym] == "y"


def test_the_shipped_patch_is_the_one_line_clamp():
    p = Path(__file__).resolve().parents[2] / "examples" / "patches" / "mglru-6.8-initial-priority.patch"
    lines = p.read_text().splitlines()
    assert [ln for ln in lines if ln.startswith(("-\t", "+\t"))] == [
        "-\tsc->priority = clamp(priority, DEF_PRIORITY / 2, DEF_PRIORITY);",
        "+\tsc->priority = clamp(priority, 0, DEF_PRIORITY);"]


def test_a_gzip_image_with_data_after_its_vmlinux():
    """defconfig's bzImage is gzip (Debian's: zstd), and the setup code's data follows the stream:
    the reader must stop at the member's end (it called the first built image BTF-less)."""
    import gzip

    from moetrace.kernel.btf import vmlinux_from_image

    elf = b"\x7fELF" + bytes(range(256)) * 64
    image = b"MZ" + b"\0" * 500 + gzip.compress(elf) + b"\xff\xfe trailing setup data \0" * 10
    assert vmlinux_from_image(image) == elf


def test_two_images_of_one_tree_are_two_conditions(tmp_path):
    """`lab build` names every image bzImage: a matrix over an A/B pair must not put both
    kernels' cells in one condition directory (the release in the header names them, else the
    image's directory)."""
    import struct

    from moetrace.lab.matrix import MatrixCell, Mechanism

    a, b = tmp_path / "k1" / "bzImage", tmp_path / "k2" / "bzImage"
    for img, rel in ((a, b"6.12.95-mtaaaa"), (b, None)):
        img.parent.mkdir()
        head = bytearray(0x400)
        head[0x202:0x206] = b"HdrS"
        struct.pack_into("<H", head, 0x20E, 0x100)  # the version string at 0x300
        if rel:
            head[0x300:0x300 + len(rel) + 5] = rel + b" (x)\0"
        img.write_bytes(bytes(head) if rel else b"not an image")
    conds = {MatrixCell(str(p), "on", Mechanism("balloon", 0.81), "320MiB", 320 << 20, 0, 0).condition
             for p in (a, b)}
    assert conds == {"6.12.95-mtaaaa-mglru-on", "k2-bzImage-mglru-on"}
