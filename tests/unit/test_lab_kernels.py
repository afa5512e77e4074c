"""`moetrace lab kernels` without a kernel: the config parser, the BTF reader on a BTF blob
built here by hand (the kernel's own layout, include/uapi/linux/btf.h), facts from a fake root."""

from __future__ import annotations

import struct

import pytest

from moetrace.errors import InputError
from moetrace.kernel import btf as B
from moetrace.kernel.kconfig import parse_config
from moetrace.lab.kernels import kernel_facts


def _btf(types: list[tuple[int, str, int, int, bytes]]) -> bytes:
    """A little-endian BTF blob: types as (kind, name, vlen, size_or_type, extra bytes)."""
    strs = b"\0"
    offs = {}

    def s(name: str) -> int:
        nonlocal strs
        if not name:
            return 0
        if name not in offs:
            offs[name] = len(strs)
            strs += name.encode() + b"\0"
        return offs[name]

    tdata = b""
    for kind, name, vlen, ref, extra in types:
        tdata += struct.pack("<III", s(name), (kind << 24) | vlen, ref) + extra
    # FUNC_PROTO param names are string offsets inside extra: resolved by the caller via s()
    hdr = struct.pack("<HBBIIIII", B.BTF_MAGIC, 1, 0, 24, 0, len(tdata), len(tdata), len(strs))
    return hdr + tdata + strs, s


def test_btf_signatures_by_hand():
    names = {}
    # ids: 1 int "bool", 2 struct lruvec, 3 ptr -> 2, 4 int "long unsigned int", 5 proto, 6 func
    strs_probe = [("bool",), ("lruvec",), ("long unsigned int",), ("lruvec_p",), ("seq",), ("try_to_inc_max_seq",)]
    blob = None
    # two passes: the first learns the string offsets, the second writes them into the proto
    for _ in range(2):
        lv, seq = names.get("lruvec_p", 0), names.get("seq", 0)
        types = [(B.INT, "bool", 0, 1, struct.pack("<I", 8)),
                 (B.STRUCT, "lruvec", 0, 0, b""),
                 (B.PTR, "", 0, 2, b""),
                 (B.INT, "long unsigned int", 0, 8, struct.pack("<I", 64)),
                 (B.FUNC_PROTO, "", 2, 1, struct.pack("<IIII", lv, 3, seq, 4)),
                 (B.FUNC, "try_to_inc_max_seq", 0, 5, b"")]
        blob, s = _btf(types + [(B.TYPEDEF, n[0], 0, 0, b"") for n in strs_probe])
        names = {n[0]: s(n[0]) for n in strs_probe}
    b = B.Btf(blob)
    assert b.funcs == {"try_to_inc_max_seq": 5}
    assert b.signature("try_to_inc_max_seq") == \
        "bool try_to_inc_max_seq(struct lruvec *lruvec_p, long unsigned int seq)"
    assert b.params("try_to_inc_max_seq") == ["lruvec_p", "seq"] and b.signature("inc_max_seq") is None
    with pytest.raises(InputError, match="not BTF"):
        B.Btf(b"\0" * 40, "x")
    bad = bytearray(blob)
    struct.pack_into("<I", bad, 24 + 4, 25 << 24)  # kind 25 does not exist
    with pytest.raises(InputError, match="unknown BTF kind 25"):
        B.Btf(bytes(bad), "x")


def test_config_and_facts_from_a_fake_root(tmp_path):
    cfg = "CONFIG_LRU_GEN=y\n# CONFIG_LRU_GEN_ENABLED is not set\nCONFIG_KPROBES=y\nCONFIG_DEBUG_INFO_BTF=y\n" \
          "CONFIG_BPF_SYSCALL=y\nCONFIG_LOCALVERSION=\"-lab\"\n"
    assert parse_config(cfg)["CONFIG_LRU_GEN_ENABLED"] == "n" and parse_config(cfg)["CONFIG_LOCALVERSION"] == "-lab"
    (tmp_path / "boot").mkdir()
    (tmp_path / "boot" / "config-9.9.9-lab").write_text(cfg)
    hdr = tmp_path / "lib" / "modules" / "9.9.9-lab" / "build" / "include" / "generated"
    hdr.mkdir(parents=True)
    (hdr / "utsrelease.h").write_text('#define UTS_RELEASE "9.9.9-lab"\n')
    k = kernel_facts("9.9.9-lab", tmp_path)
    assert (k.mglru_built, k.mglru_default, k.kprobes, k.btf, k.bpf) == (True, "off", True, True, True)
    assert k.headers == "exact" and k.running is False and k.image is None and k.functions == {}
    (tmp_path / "boot" / "config-9.9.9-lab").write_text(cfg.replace("# CONFIG_LRU_GEN_ENABLED is not set",
                                                                     "CONFIG_LRU_GEN_ENABLED=y"))
    assert kernel_facts("9.9.9-lab", tmp_path).mglru_default == "on"
    (tmp_path / "boot" / "vmlinuz-9.9.9-lab").write_bytes(b"MZ not a kernel")
    k = kernel_facts("9.9.9-lab", tmp_path)
    assert k.btf is False and any("BTF not read" in n for n in k.notes)


def test_btf_member_offsets_through_anonymous_unions_typedefs_and_arrays():
    """struct folio { unsigned long flags; union { struct { void *lru; void *mapping; }; long x; };
    unsigned long gens[2]; } — offset_of looks through the anonymous union and struct, indexes
    the array, and names what is missing."""
    names = ["", "long unsigned int", "folio", "flags", "lru", "mapping", "x", "gens", "ul", "outer", "inner",
             "f"]
    strs = b"".join(n.encode() + b"\0" for n in names)
    so = {n: strs.index(n.encode() + b"\0") if n else 0 for n in names}

    def t(kind, name, vlen, ref, extra=b""):
        return struct.pack("<III", so[name], (kind << 24) | vlen, ref) + extra

    def mem(name, tid, bits):
        return struct.pack("<III", so[name], tid, bits)

    tdata = b"".join([
        t(B.INT, "long unsigned int", 0, 8, struct.pack("<I", 64)),           # 1
        t(B.TYPEDEF, "ul", 0, 1),                                            # 2 typedef -> 1
        t(B.PTR, "", 0, 0),                                                  # 3 void *
        t(B.STRUCT, "", 2, 16, mem("lru", 3, 0) + mem("mapping", 3, 64)),    # 4 anonymous struct
        t(B.UNION, "", 2, 16, mem("", 4, 0) + mem("x", 1, 0)),               # 5 anonymous union
        t(B.ARRAY, "", 0, 0, struct.pack("<III", 2, 1, 2)),                  # 6 ul[2]
        t(B.STRUCT, "folio", 3, 40, mem("flags", 1, 0) + mem("", 5, 64) + mem("gens", 6, 192)),  # 7
        t(B.STRUCT, "outer", 1, 48, mem("f", 7, 64)),                        # 8 embeds a folio at 8
    ])
    blob = struct.pack("<HBBIIIII", B.BTF_MAGIC, 1, 0, 24, 0, len(tdata), len(tdata), len(strs)) + tdata + strs
    b = B.Btf(blob)
    assert b.offset_of("folio", "flags") == 0
    assert b.offset_of("folio", "mapping") == 16 and b.offset_of("folio", "lru") == 8
    assert b.offset_of("folio", "gens[1]") == 32 and b.offset_of("outer", "f.gens[1]") == 40
    assert b.offset_of("outer", "f.mapping") == 24 and b.sizeof(6) == 16
    with pytest.raises(InputError, match="no member f.nope"):
        b.offset_of("outer", "f.nope")
    with pytest.raises(InputError, match="no struct lruvec"):
        b.offset_of("lruvec", "lrugen")
    with pytest.raises(InputError, match="not an array"):
        b.offset_of("folio", "flags[1]")


def test_btf_enum_values_signed_unsigned_and_64_bit():
    """enum pageflags { PG_locked, ..., PG_head = 6 } (PG_head moved from 16 on 6.1 to 6 on 6.12: the
    mlock probe takes it from BTF); a signed enum (kflag) and an ENUM64 read right; a name no enum
    holds is None."""
    names = ["", "pageflags", "PG_locked", "PG_head", "neg", "MINUS", "big", "HUGE"]
    strs = b"".join(n.encode() + b"\0" for n in names)
    so = {n: strs.index(n.encode() + b"\0") if n else 0 for n in names}

    def t(kind, name, vlen, size, extra, kflag=0):
        return struct.pack("<III", so[name], (kflag << 31) | (kind << 24) | vlen, size) + extra

    tdata = b"".join([
        t(B.ENUM, "pageflags", 2, 4, struct.pack("<IIII", so["PG_locked"], 0, so["PG_head"], 6)),
        t(B.ENUM, "neg", 1, 4, struct.pack("<Ii", so["MINUS"], -3), kflag=1),
        t(B.ENUM64, "big", 1, 8, struct.pack("<III", so["HUGE"], 1, 2)),
    ])
    blob = struct.pack("<HBBIIIII", B.BTF_MAGIC, 1, 0, 24, 0, len(tdata), len(tdata), len(strs)) + tdata + strs
    b = B.Btf(blob)
    assert (b.enum_value("PG_head"), b.enum_value("PG_locked")) == (6, 0)
    assert b.enum_value("MINUS") == -3 and b.enum_value("HUGE") == (2 << 32) | 1
    assert b.enum_value("PG_nope") is None
