"""Read a kernel's BTF (the BPF Type Format, include/uapi/linux/btf.h) for function
signatures: from /sys/kernel/btf/vmlinux (raw BTF) or from a kernel image (the vmlinux ELF
inside a bzImage, decompressed, its ``.BTF`` section).

Only what `moetrace lab kernels` needs: every FUNC with its prototype, rendered as C
(``try_to_inc_max_seq(struct lruvec *lruvec, unsigned long max_seq, ...)``). Debian ships a
stub System.map, so BTF is also how a kernel's functions are listed without booting it.
"""

from __future__ import annotations

import io
import lzma
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from moetrace.errors import InputError

BTF_MAGIC = 0xEB9F
# kinds (btf.h BTF_KIND_*) and the bytes each adds after the 12-byte btf_type
INT, PTR, ARRAY, STRUCT, UNION, ENUM, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FUNC_PROTO, VAR, DATASEC, \
    FLOAT, DECL_TAG, TYPE_TAG, ENUM64 = range(1, 20)
_EXTRA_FIXED = {INT: 4, ARRAY: 12, VAR: 4, DECL_TAG: 4}
_EXTRA_PER_MEMBER = {STRUCT: 12, UNION: 12, ENUM: 8, FUNC_PROTO: 8, DATASEC: 12, ENUM64: 12}


@dataclass(frozen=True)
class Type:
    kind: int
    name: str
    vlen: int
    ref: int  # size or type id (kind-dependent)
    params: tuple[tuple[str, int], ...] = ()  # FUNC_PROTO: (name, type id)
    kflag: bool = False
    #: STRUCT / UNION: (name, type id, bit offset); ARRAY: () with ``nelems``
    members: tuple[tuple[str, int, int], ...] = ()
    nelems: int = 0
    #: ENUM / ENUM64: (enumerator, value)
    values: tuple[tuple[str, int], ...] = ()


class _Types:
    """``Btf.types``: a sequence of :class:`Type` parsed on first access (vmlinux holds ~127k
    types; parsing them all took 0.43 s here and 7-12 s under the lab's TCG)."""

    def __init__(self, btf: "Btf"):
        self._btf = btf

    def __len__(self) -> int:
        return len(self._btf._kinds)

    def __getitem__(self, tid: int) -> Type:
        return self._btf._type(tid)

    def __iter__(self):
        return (self._btf._type(i) for i in range(len(self._btf._kinds)))


class Btf:
    """Parsed BTF: ``types[id]`` (id 0 is void) and ``funcs`` (name -> FUNC_PROTO id).

    The constructor only walks the records (their kinds and where each starts, which checks
    the whole section); a type is decoded when first asked for."""

    def __init__(self, data: bytes, source: str = "<btf>"):
        if len(data) < 24:
            raise InputError("BTF too short", path=source)
        magic, version, _flags, hdr_len = struct.unpack_from("<HBBI", data, 0)
        endian = "<"
        if magic != BTF_MAGIC:
            magic, version, _flags, hdr_len = struct.unpack_from(">HBBI", data, 0)
            endian = ">"
            if magic != BTF_MAGIC:
                raise InputError(f"not BTF (magic {magic:#x})", path=source, offset=0)
        type_off, type_len, str_off, str_len = struct.unpack_from(endian + "IIII", data, 8)
        base = hdr_len
        self._endian = endian
        self._strs = data[base + str_off: base + str_off + str_len]
        self._tdata = tdata = data[base + type_off: base + type_off + type_len]
        fixed = [_EXTRA_FIXED.get(k, 0) for k in range(32)]
        per = [_EXTRA_PER_MEMBER.get(k, 0) for k in range(32)]
        info_at = struct.Struct(endian + "I").unpack_from
        positions: list[int] = [0]  # id 0: void
        kinds = bytearray(1)
        add_pos, add_kind = positions.append, kinds.append
        pos, n = 0, len(tdata)
        while pos + 12 <= n:
            info = info_at(tdata, pos + 4)[0]
            kind = (info >> 24) & 0x1F
            if kind == 0 or kind > ENUM64:
                raise InputError(f"unknown BTF kind {kind} (type {len(kinds)})", path=source,
                                 offset=base + type_off + pos)
            add_pos(pos)
            add_kind(kind)
            pos += 12 + fixed[kind] + per[kind] * (info & 0xFFFF)
        self._pos = positions
        self._kinds = bytes(kinds)
        self._cache: dict[int, Type] = {0: Type(0, "void", 0, 0)}
        self.types = _Types(self)

    def _name(self, off: int) -> str:
        strs = self._strs
        end = strs.find(b"\0", off)
        return strs[off:end].decode("utf-8", "replace") if off < len(strs) else ""

    def _header(self, tid: int) -> tuple[str, int, int]:
        """(name, vlen, size or type id) of type ``tid`` without decoding its members."""
        name_off, info, ref = struct.unpack_from(self._endian + "III", self._tdata, self._pos[tid])
        return self._name(name_off), info & 0xFFFF, ref

    def _type(self, tid: int) -> Type:
        t = self._cache.get(tid)
        if t is not None:
            return t
        if not 0 <= tid < len(self._kinds):
            raise IndexError(tid)
        endian, tdata, name = self._endian, self._tdata, self._name
        pos = self._pos[tid]
        name_off, info, ref = struct.unpack_from(endian + "III", tdata, pos)
        pos += 12
        kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, bool(info >> 31)
        params: tuple[tuple[str, int], ...] = ()
        members: tuple[tuple[str, int, int], ...] = ()
        nelems = 0
        values: tuple[tuple[str, int], ...] = ()
        if kind == FUNC_PROTO:
            params = tuple((name(struct.unpack_from(endian + "I", tdata, pos + 8 * i)[0]),
                            struct.unpack_from(endian + "I", tdata, pos + 8 * i + 4)[0]) for i in range(vlen))
        elif kind in (STRUCT, UNION):
            # member offset: bits; with kflag, the low 24 bits (the high 8 are a bitfield size)
            mask = 0xFFFFFF if kflag else 0xFFFFFFFF
            members = tuple((name(m[0]), m[1], m[2] & mask) for m in
                            (struct.unpack_from(endian + "III", tdata, pos + 12 * i) for i in range(vlen)))
        elif kind == ARRAY:
            ref, _index_type, nelems = struct.unpack_from(endian + "III", tdata, pos)  # element type
        elif kind == ENUM:  # kflag: signed values
            values = tuple((name(n), v) for n, v in (struct.unpack_from(endian + ("Ii" if kflag else "II"), tdata,
                                                                           pos + 8 * i) for i in range(vlen)))
        elif kind == ENUM64:
            values = tuple((name(n), (hi << 32) | lo) for n, lo, hi in
                           (struct.unpack_from(endian + "III", tdata, pos + 12 * i) for i in range(vlen)))
        t = Type(kind, name(name_off), vlen, ref, params, kflag, members, nelems, values)
        self._cache[tid] = t
        return t

    def _ids(self, *kinds: int):
        return (i for i, k in enumerate(self._kinds) if k in kinds)

    @property
    def funcs(self) -> dict[str, int]:
        """{function name: its FUNC_PROTO id} (the first FUNC of a name)."""
        f = self.__dict__.get("_funcs")
        if f is None:
            f = {}
            for i in self._ids(FUNC):
                fname, _vlen, proto = self._header(i)
                f.setdefault(fname, proto)
            self.__dict__["_funcs"] = f
        return f

    # -- layout ---------------------------------------------------------------------------------
    def _strip(self, tid: int) -> int:
        """Through typedefs and qualifiers to the type itself."""
        for _ in range(40):
            t = self.types[tid]
            if t.kind not in (TYPEDEF, CONST, VOLATILE, RESTRICT, TYPE_TAG):
                return tid
            tid = t.ref
        raise InputError(f"BTF type {tid}: a typedef chain that does not end")

    def struct_id(self, name: str) -> int | None:
        """The id of ``struct name`` with a body (not a forward declaration)."""
        cache = self.__dict__.setdefault("_structs", {})
        if not cache:
            for i in self._ids(STRUCT, UNION):
                sname, vlen, size = self._header(i)
                if sname and (vlen or size):
                    cache.setdefault(sname, i)
        return cache.get(name)

    def ctx_struct(self, func: str) -> str | None:
        """The name of the struct FUNC ``func``'s first parameter points to: a BPF program's
        context (``struct trace_event_raw_<class> *ctx`` for a tracepoint program); None when
        ``func`` is absent or takes no struct pointer."""
        proto = self.funcs.get(func)
        if proto is None or self.types[proto].kind != FUNC_PROTO or not self.types[proto].params:
            return None
        ptr = self.types[self._strip(self.types[proto].params[0][1])]
        if ptr.kind != PTR:
            return None
        t = self.types[self._strip(ptr.ref)]
        return t.name if t.kind in (STRUCT, UNION) and t.name else None

    def tracepoint_fields(self, struct_name: str) -> tuple[str, ...] | None:
        """The fields a tracepoint's ``format`` file lists, from the raw record struct of its
        event class (``trace_event_raw_<class>``: TRACE_EVENT's TP_STRUCT__entry, in order): the
        ``ent`` header (struct trace_entry) as ``common_<member>``, ``__data_loc_<f>`` and
        ``__rel_loc_<f>`` (dynamic arrays, strings) as ``f``, the trailing ``__data[]`` left
        out. None when this BTF has no such struct (a class renamed, or a module's event)."""
        tid = self.struct_id(struct_name)
        if tid is None:
            return None
        out: list[str] = []
        for name, mtid, _bits in self.types[tid].members:
            if name == "ent":
                out += [f"common_{m[0]}" for m in self.types[self._strip(mtid)].members]
            elif name.startswith(("__data_loc_", "__rel_loc_")):
                out.append(name.split("_loc_", 1)[1])
            elif name and name != "__data":
                out.append(name)
        return tuple(out)

    def enum_value(self, enumerator: str) -> int | None:
        """The value of a C enumerator (``PG_head`` of enum pageflags): enumerators share one
        namespace in C, so the name alone says which. None when this BTF has no such one."""
        cache = self.__dict__.setdefault("_enumerators", {})
        if not cache:
            for i in self._ids(ENUM, ENUM64):
                for n, v in self._type(i).values:
                    cache.setdefault(n, v)
        return cache.get(enumerator)

    def sizeof(self, tid: int) -> int:
        t = self.types[self._strip(tid)]
        if t.kind == PTR:
            return 8
        if t.kind == ARRAY:
            return t.nelems * self.sizeof(t.ref)
        if t.kind in (INT, STRUCT, UNION, ENUM, ENUM64, FLOAT):
            return t.ref
        raise InputError(f"BTF: no size for {self.type_name(tid)}")

    def _member(self, tid: int, name: str) -> tuple[int, int] | None:
        """(byte offset, type id) of member ``name`` of struct/union ``tid``, looking through
        anonymous struct/union members (struct folio's fields live in one)."""
        t = self.types[self._strip(tid)]
        for m_name, m_type, bits in t.members:
            if m_name == name:
                return bits // 8, m_type
            if not m_name:
                inner = self.types[self._strip(m_type)]
                if inner.kind in (STRUCT, UNION):
                    hit = self._member(m_type, name)
                    if hit is not None:
                        return bits // 8 + hit[0], hit[1]
        return None

    def offset_of(self, struct_name: str, path: str) -> int:
        """Byte offset of ``path`` ("lruvec.lrugen.min_seq[1]", "id.id") inside ``struct
        struct_name``, through embedded structs, anonymous members and array indices (not
        through pointers). Raises InputError naming the part that is missing."""
        tid = self.struct_id(struct_name)
        if tid is None:
            raise InputError(f"BTF has no struct {struct_name}")
        off = 0
        for part in path.split("."):
            name, _, idx = part.partition("[")
            hit = self._member(tid, name)
            if hit is None:
                raise InputError(f"BTF: struct {struct_name} has no member {path} (no {name!r} in "
                                 f"{self.type_name(tid)})")
            off += hit[0]
            tid = hit[1]
            if idx:
                arr = self.types[self._strip(tid)]
                if arr.kind != ARRAY:
                    raise InputError(f"BTF: {struct_name}.{path}: {name} is not an array")
                off += int(idx.rstrip("]")) * self.sizeof(arr.ref)
                tid = arr.ref
        return off

    # -- rendering ------------------------------------------------------------------------------
    def type_name(self, tid: int, depth: int = 0) -> str:
        """C spelling of type ``tid`` (pointers to functions abbreviated)."""
        if depth > 20 or tid >= len(self.types):
            return "?"
        t = self.types[tid]
        if t.kind == 0:
            return "void"
        if t.kind in (INT, TYPEDEF, FLOAT):
            return t.name
        if t.kind == STRUCT:
            return f"struct {t.name}"
        if t.kind == UNION:
            return f"union {t.name}"
        if t.kind in (ENUM, ENUM64):
            return f"enum {t.name}"
        if t.kind == FWD:
            return f"{'union' if t.kflag else 'struct'} {t.name}"
        if t.kind == PTR:
            inner = self.types[t.ref] if t.ref < len(self.types) else None
            if inner is not None and inner.kind == FUNC_PROTO:
                return "void (*)(...)"
            return self.type_name(t.ref, depth + 1) + " *"
        if t.kind == CONST:
            return "const " + self.type_name(t.ref, depth + 1)
        if t.kind == VOLATILE:
            return "volatile " + self.type_name(t.ref, depth + 1)
        if t.kind in (RESTRICT, TYPE_TAG):
            return self.type_name(t.ref, depth + 1)
        if t.kind == ARRAY:
            return self.type_name(t.ref, depth + 1) + " []"
        return t.name or "?"

    def signature(self, func: str) -> str | None:
        """``ret func(type name, ...)`` or None when BTF has no such function."""
        proto_id = self.funcs.get(func)
        if proto_id is None:
            return None
        p = self.types[proto_id]
        args = ", ".join(f"{self.type_name(tid)}{'' if self.type_name(tid).endswith('*') else ' '}{n}".rstrip()
                         if n else self.type_name(tid) for n, tid in p.params) or "void"
        return f"{self.type_name(p.ref)} {func}({args})"

    def params(self, func: str) -> list[str] | None:
        proto_id = self.funcs.get(func)
        return None if proto_id is None else [n for n, _ in self.types[proto_id].params]


# -- sources ---------------------------------------------------------------------------------------

def vmlinux_from_image(image: bytes, source: str = "<image>") -> bytes:
    """The vmlinux ELF inside a bzImage: the first compressed stream that decompresses to an
    ELF (xz, gzip; zstd and lz4 are named in the error)."""
    if image[:4] == b"\x7fELF":
        return image
    import zlib

    import zstandard

    def unxz(b: bytes) -> bytes:
        return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(b)

    def ungzip(b: bytes) -> bytes:  # one member: what follows it in the image is not gzip
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(b)

    def unzstd(b: bytes) -> bytes:
        return zstandard.ZstdDecompressor().decompressobj().decompress(b)

    for magic, unpack in ((b"\xfd7zXZ\x00", unxz), (b"\x28\xb5\x2f\xfd", unzstd), (b"\x1f\x8b\x08", ungzip)):
        start = 0
        while (i := image.find(magic, start)) >= 0:
            start = i + 1
            try:
                out = unpack(image[i:])
            except (lzma.LZMAError, OSError, EOFError, zlib.error, zstandard.ZstdError):
                continue
            if out[:4] == b"\x7fELF":
                return out
    if image.find(b"\x02\x21\x4c\x18") >= 0:
        raise InputError("the kernel image is lz4-compressed, which moetrace cannot unpack", path=source,
                         hint="give the uncompressed vmlinux instead")
    raise InputError("no compressed vmlinux found in the kernel image", path=source)


def btf_from_elf(elf: bytes, source: str = "<vmlinux>") -> bytes | None:
    """The ``.BTF`` section of a vmlinux ELF (None when the kernel was built without BTF)."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    try:
        sec = ELFFile(io.BytesIO(elf)).get_section_by_name(".BTF")
    except ELFError as e:
        raise InputError(f"not a vmlinux ELF: {e}", path=source) from None
    return None if sec is None else sec.data()


_VMLINUX: dict[str, Btf | None] = {}
_VMLINUX_LOCK = threading.Lock()


def vmlinux(path: str = "/sys/kernel/btf/vmlinux") -> Btf | None:
    """The running kernel's BTF, parsed once per process (several probes read it; the recorder
    parses it in a thread while the first probes load); None when the kernel has none.
    A second caller waits for the first one's parse."""
    with _VMLINUX_LOCK:
        if path not in _VMLINUX:
            _VMLINUX[path] = load(path) if Path(path).exists() else None
        return _VMLINUX[path]


def raw(path: str | Path) -> bytes | None:
    """The raw BTF of ``path``: raw BTF itself (/sys/kernel/btf/vmlinux), a vmlinux ELF's .BTF or a
    bzImage's (/boot/vmlinuz-*). None when the kernel has no BTF."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror}", path=str(p)) from None
    if len(data) >= 2 and struct.unpack_from("<H", data, 0)[0] == BTF_MAGIC:
        return data
    return btf_from_elf(vmlinux_from_image(data, str(p)), str(p))


_CTX: dict[tuple[str, int], dict[str, str]] = {}


def object_ctx_structs(path: str | Path) -> dict[str, str]:
    """{program: the struct its context points to} of a compiled probe object's BTF (its .BTF
    section): which ``trace_event_raw_<class>`` each tracepoint program reads. {} when the object
    is absent or has no BTF. Cached per process by path and modification time."""
    p = Path(path)
    try:
        key = (str(p), p.stat().st_mtime_ns)
    except OSError:
        return {}
    if key not in _CTX:
        try:
            data = btf_from_elf(p.read_bytes(), str(p))
            b = Btf(data, str(p)) if data is not None else None
        except (InputError, OSError):
            b = None
        _CTX[key] = {} if b is None else {f: s for f in b.funcs if (s := b.ctx_struct(f)) is not None}
    return _CTX[key]


def load(path: str | Path) -> Btf | None:
    """BTF of ``path`` (as :func:`raw` finds it), parsed. None when the kernel has no BTF."""
    data = raw(path)
    return None if data is None else Btf(data, str(path))
