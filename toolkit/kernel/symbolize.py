"""Symbolization of sampled stacks, in user space, and the run-directory leak check.

The stacks probe (probes/stacks.bpf.c) hands user space stack ids; the instruction
pointers behind them are kernel addresses (which reveal the KASLR offset) and user
addresses (meaningless once the process is gone). Nothing raw may reach a run
directory, so every frame becomes a name here:

- kernel frames: :class:`Kallsyms` (``/proc/kallsyms``, readable with addresses as
  root; when it shows zeros, e.g. kptr_restrict or no privilege, every kernel frame
  is ``[kernel]``);
- user frames: :class:`ProcMaps` (executable file mappings of ``/proc/<pid>/maps``,
  snapshotted while the process runs, since it may have exited when the probe closes)
  and :class:`ElfSymbols` (``.symtab`` and ``.dynsym`` read with pyelftools, cached per
  file); an address in a file without a covering symbol is ``module+0x<file offset>``
  (a file offset, never a kernel address); one in no known mapping is ``[unknown]``.

:func:`find_kernel_addresses` is the checker: it scans every file of a run directory
(text and JSON as text, Parquet column by column) for hex numbers in the kernel half
of the x86-64 address space and for integers that are (or fall among) kallsyms
addresses. Every reader takes a ``root=`` (a fake /proc tree in tests).
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

#: the lowest kernel-half address on x86-64 (4-level and 5-level paging alike)
KERNEL_HALF = 0xFFFF800000000000
#: 0xffffffffffffffff is the all-ones sentinel (-1 as u64), never a mapped address
ALL_ONES = (1 << 64) - 1
#: kallsyms types that are code (text, weak text)
_TEXT_TYPES = frozenset("tTwW")
_TEXT_TYPES_B = frozenset(t.encode() for t in _TEXT_TYPES)
UNKNOWN_KERNEL = "[kernel]"
UNKNOWN_USER = "[unknown]"


def _p(root: str | os.PathLike, rel: str) -> Path:
    return Path(root) / rel.lstrip("/")


# ---------------------------------------------------------------------------
# kernel


class AddressSet:
    """A sorted array of addresses with set-like membership (``in``, ``len``, truth)."""

    def __init__(self, values: np.ndarray):
        self.values = np.unique(np.asarray(values, dtype=np.uint64))
        self.lo = int(self.values[0]) if len(self.values) else None
        self.hi = int(self.values[-1]) if len(self.values) else None

    def __contains__(self, v: object) -> bool:
        if not isinstance(v, (int, np.integer)) or not 0 <= int(v) < 1 << 64 or not len(self.values):
            return False
        i = int(np.searchsorted(self.values, np.uint64(int(v))))
        return i < len(self.values) and int(self.values[i]) == int(v)

    def __len__(self) -> int:
        return len(self.values)


_HEXVAL = np.full(256, 255, np.uint8)  # a byte's value as a hex digit (255: not one)
_HEXVAL[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10, dtype=np.uint8)
_HEXVAL[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16, dtype=np.uint8)
_HEXVAL[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16, dtype=np.uint8)


def _parse_kallsyms(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Lines "ADDR T NAME[\t[module]]" of /proc/kallsyms as arrays, in numpy alone (a regex and
    Python lists over the ~200k lines took 0.3 s here at every recording's end, seconds in the
    lab's TCG): addresses (u64), type characters (u8), and each name's start and end offsets in
    ``data``. Lines that are not of that shape are left out."""
    buf = np.frombuffer(data, np.uint8)
    if not len(buf):
        z = np.zeros(0, np.int64)
        return np.zeros(0, np.uint64), np.zeros(0, np.uint8), z, z
    nl = np.flatnonzero(buf == 10)
    if not len(nl) or nl[-1] != len(buf) - 1:
        nl = np.append(nl, len(buf))
    starts = np.concatenate([[0], nl[:-1] + 1])
    width = np.flatnonzero(buf[: nl[0]] == 32)  # the address's width: the first line's first space
    w = int(width[0]) if len(width) else 0
    ok = (nl - starts > w + 3) & (w > 0) & (w <= 16)
    starts, ends = starts[ok], nl[ok]
    ok = (buf[starts + w] == 32) & (buf[starts + w + 2] == 32)
    starts, ends = starts[ok], ends[ok]
    chars = buf[starts[:, None] + np.arange(w)]
    ok = (_HEXVAL[chars] < 16).all(axis=1)
    starts, ends, chars = starts[ok], ends[ok], chars[ok]
    if w % 2:  # an odd width: a leading 0 makes whole bytes
        chars = np.concatenate([np.full((len(chars), 1), 48, np.uint8), chars], axis=1)
    raw = np.frombuffer(bytes.fromhex(chars.tobytes().decode("ascii")), np.uint8).reshape(len(chars), -1)
    full = np.zeros((len(chars), 8), np.uint8)  # right-aligned in 8 big-endian bytes
    full[:, 8 - raw.shape[1]:] = raw
    addrs = full.view(">u8").ravel().astype(np.uint64)
    types = buf[starts + w + 1]
    names = starts + w + 3
    tab = np.flatnonzero(buf == 9)  # "\t[module]" after a module's symbol: the name ends there
    j = np.searchsorted(tab, names)
    nxt = np.where(j < len(tab), tab[np.minimum(j, len(tab) - 1)] if len(tab) else 0, ends)
    ends = np.where((j < len(tab)) & (nxt < ends), nxt, ends)
    return addrs, types, names.astype(np.int64), ends.astype(np.int64)


class Kallsyms:
    """Kernel text symbols of ``<root>/proc/kallsyms``, sorted by address.

    ``available`` is False when the file is unreadable or shows only zero addresses
    (non-root, kptr_restrict): :meth:`name` then answers ``[kernel]`` for everything.
    ``addresses`` (every nonzero kernel-half address of any type) feeds the leak check."""

    def __init__(self, root: str | os.PathLike = "/", path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else _p(root, "proc/kallsyms")
        self.reason = ""
        try:
            data = self.path.read_bytes()
        except OSError as e:
            self.reason = f"{self.path} unreadable ({e.strerror})"
            data = b""
        addrs, types, starts, ends = _parse_kallsyms(data)
        keep = addrs != 0
        text = keep & np.isin(types, np.frombuffer(b"".join(sorted(_TEXT_TYPES_B)), np.uint8))
        order = np.argsort(addrs[text], kind="stable")
        self._addrs = addrs[text][order].tolist()
        #: each text symbol's name as (start, end) in ``_data``, decoded when first asked for
        self._data = data
        self._spans = np.stack([starts[text][order], ends[text][order]], axis=1) if len(order) else \
            np.zeros((0, 2), np.int64)
        #: every nonzero kernel-half address of any type (the leak check's)
        self.addresses = AddressSet(addrs[keep & (addrs >= np.uint64(KERNEL_HALF))])
        if not self._addrs and not self.reason:
            self.reason = f"{self.path} shows no addresses (needs root and kptr_restrict < 2)"
        self.lo = self.addresses.lo
        self.hi = self.addresses.hi

    @property
    def available(self) -> bool:
        return bool(self._addrs)

    def name(self, addr: int) -> str:
        """The function containing ``addr`` (``[kernel]`` when unknown)."""
        if not self._addrs or addr < self._addrs[0]:
            return UNKNOWN_KERNEL
        i = bisect.bisect_right(self._addrs, addr) - 1
        st, en = self._spans[i]
        return self._data[int(st):int(en)].decode(errors="replace")

    def covers(self, value: int) -> bool:
        """True when ``value`` is a kallsyms address or lies between the lowest and
        highest of them (kernel text, data and module space)."""
        return self.lo is not None and (value in self.addresses or self.lo <= value <= self.hi)


# ---------------------------------------------------------------------------
# user


@dataclass(frozen=True)
class Mapping:
    """One executable mapping of /proc/<pid>/maps."""

    start: int
    end: int
    offset: int  # file offset of ``start``
    path: str  # a file path, or a pseudo name: [vdso], [anon], ...

    @property
    def is_file(self) -> bool:
        return self.path.startswith("/") and not self.path.endswith(" (deleted)")

    @property
    def module(self) -> str:
        return os.path.basename(self.path) if self.path.startswith("/") else self.path


def parse_maps(text: str) -> list[Mapping]:
    """The executable mappings of a /proc/<pid>/maps text, sorted by start."""
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5 or "x" not in parts[1]:
            continue
        lo, _, hi = parts[0].partition("-")
        try:
            start, end, off = int(lo, 16), int(hi, 16), int(parts[2], 16)
        except ValueError:
            continue
        path = parts[5].strip() if len(parts) > 5 else "[anon]"
        out.append(Mapping(start, end, off, path or "[anon]"))
    out.sort(key=lambda m: m.start)
    return out


class ProcMaps:
    """Snapshots of the executable mappings of processes, taken while they run.

    :meth:`snapshot` reads ``<root>/proc/<pid>/maps`` (a process that is gone is skipped);
    identical consecutive snapshots are kept once. :meth:`find` searches the newest
    snapshot first, then older ones (a library unmapped later still resolves samples
    taken before)."""

    def __init__(self, root: str | os.PathLike = "/"):
        self.root = root
        self.snaps: dict[int, list[list[Mapping]]] = {}
        self._starts: dict[int, list[list[int]]] = {}
        self.reads = 0

    def snapshot(self, pid: int) -> bool | None:
        """Read one process's maps: True when its executable mappings changed since the
        last snapshot, False when not, None when it cannot be read (exited)."""
        try:
            text = _p(self.root, f"proc/{pid}/maps").read_text()
        except OSError:
            return None
        self.reads += 1
        maps = parse_maps(text)
        if not maps:
            return None
        hist = self.snaps.setdefault(pid, [])
        if hist and hist[-1] == maps:
            return False
        hist.append(maps)
        self._starts.setdefault(pid, []).append([m.start for m in maps])
        return True

    def add(self, pid: int, maps: list[Mapping]) -> None:
        """Add a snapshot directly (tests, or maps captured elsewhere)."""
        maps = sorted(maps, key=lambda m: m.start)
        self.snaps.setdefault(pid, []).append(maps)
        self._starts.setdefault(pid, []).append([m.start for m in maps])

    def find(self, pid: int, addr: int) -> Mapping | None:
        hist = self.snaps.get(pid)
        if not hist:
            return None
        for maps, starts in zip(reversed(hist), reversed(self._starts[pid])):
            i = bisect.bisect_right(starts, addr) - 1
            if i >= 0 and maps[i].start <= addr < maps[i].end:
                return maps[i]
        return None


@dataclass
class _ElfTable:
    loads: list[tuple[int, int, int]]  # (p_offset, p_filesz, p_vaddr) of PT_LOAD segments
    values: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)


class ElfSymbols:
    """Function symbols of ELF files (``.symtab`` and ``.dynsym``), cached per file.

    :meth:`lookup` takes a *file offset* (address - mapping start + mapping offset),
    turns it into a virtual address through the PT_LOAD program headers and returns
    the covering function, or None (file unreadable, not ELF, no covering symbol)."""

    def __init__(self):
        self._cache: dict[tuple[str, int, int, int], _ElfTable | None] = {}
        self.errors: dict[str, str] = {}

    def _table(self, path: str) -> _ElfTable | None:
        try:
            st = os.stat(path)
        except OSError as e:
            self.errors[path] = e.strerror or str(e)
            return None
        key = (path, st.st_dev, st.st_ino, st.st_mtime_ns)
        if key in self._cache:
            return self._cache[key]
        tab = self._load(path)
        self._cache[key] = tab
        return tab

    def _load(self, path: str) -> _ElfTable | None:
        """PT_LOAD segments (pyelftools reads the headers) and the function symbols of
        .symtab and .dynsym, parsed as numpy arrays straight from the section bytes (tens of
        thousands of symbols per library: pyelftools' per-symbol parsing took seconds)."""
        try:
            from elftools.common.exceptions import ELFError
            from elftools.elf.elffile import ELFFile
        except ImportError:  # pragma: no cover - a declared dependency
            self.errors[path] = "pyelftools not installed"
            return None
        import numpy as np

        try:
            with open(path, "rb") as fh:
                elf = ELFFile(fh)
                loads = [(s["p_offset"], s["p_filesz"], s["p_vaddr"]) for s in elf.iter_segments()
                         if s["p_type"] == "PT_LOAD"]
                e = "<" if elf.little_endian else ">"
                if elf.elfclass == 64:
                    dt = np.dtype([("name", e + "u4"), ("info", "u1"), ("other", "u1"), ("shndx", e + "u2"),
                                   ("value", e + "u8"), ("size", e + "u8")])
                else:
                    dt = np.dtype([("name", e + "u4"), ("value", e + "u4"), ("size", e + "u4"), ("info", "u1"),
                                   ("other", "u1"), ("shndx", e + "u2")])
                vals, sizes, names = [], [], []
                for sec_name in (".symtab", ".dynsym"):
                    sec = elf.get_section_by_name(sec_name)
                    if sec is None or sec["sh_type"] not in ("SHT_SYMTAB", "SHT_DYNSYM"):
                        continue
                    strsec = elf.get_section(sec["sh_link"])
                    fh.seek(sec["sh_offset"])
                    raw = fh.read(sec["sh_size"])
                    fh.seek(strsec["sh_offset"])
                    strtab = fh.read(strsec["sh_size"])
                    n = len(raw) // dt.itemsize
                    sym = np.frombuffer(raw[: n * dt.itemsize], dt)
                    typ = sym["info"] & 0xF
                    keep = ((typ == 2) | (typ == 10)) & (sym["shndx"] != 0) & (sym["value"] != 0) & (sym["name"] != 0)
                    sym = sym[keep]
                    zeros = np.flatnonzero(np.frombuffer(strtab, np.uint8) == 0)
                    offs = sym["name"].astype(np.int64)
                    ends = zeros[np.minimum(np.searchsorted(zeros, offs), len(zeros) - 1)] if len(zeros) else offs
                    for o, q, v, z in zip(offs.tolist(), ends.tolist(), sym["value"].tolist(), sym["size"].tolist()):
                        if q > o:
                            vals.append(v)
                            sizes.append(z)
                            names.append(strtab[o:q].decode("utf-8", "replace"))
        except (OSError, ELFError, ValueError) as e:
            self.errors[path] = str(e)
            return None
        except Exception as e:  # noqa: BLE001 - odd files raise assorted errors
            self.errors[path] = f"{type(e).__name__}: {e}"
            return None
        syms: dict[int, tuple[int, str]] = {}
        for v, size, name in zip(vals, sizes, names):
            old = syms.get(v)
            if old is None or (old[0] == 0 and size) or (size and len(name) < len(old[1])):
                syms[v] = (size, name)
        tab = _ElfTable(loads)
        for v in sorted(syms):
            size, name = syms[v]
            tab.values.append(v)
            tab.ends.append(v + size)
            tab.names.append(name)
        # unsized symbols extend to the next symbol
        for i in range(len(tab.values)):
            if tab.ends[i] == tab.values[i]:
                tab.ends[i] = tab.values[i + 1] if i + 1 < len(tab.values) else tab.values[i] + 1
        return tab

    def lookup(self, path: str, file_offset: int) -> str | None:
        tab = self._table(path)
        if tab is None:
            return None
        vaddr = None
        for off, size, va in tab.loads:
            if off <= file_offset < off + size:
                vaddr = file_offset - off + va
                break
        if vaddr is None:
            return None
        i = bisect.bisect_right(tab.values, vaddr) - 1
        if i >= 0 and vaddr < tab.ends[i]:
            return tab.names[i]
        return None


class Symbolizer:
    """Names for the frames of one recording: kernel via kallsyms, user via maps + ELF."""

    def __init__(self, maps: ProcMaps, kallsyms: Kallsyms | None = None, root: str | os.PathLike = "/"):
        self.maps = maps
        self.kallsyms = kallsyms if kallsyms is not None else Kallsyms(root)
        self.elf = ElfSymbols()
        self.unresolved_user = 0
        self.resolved_user = 0
        self._ucache: dict[tuple[int, int], str] = {}

    def kernel_frames(self, addrs: Iterable[int]) -> list[str]:
        """Leaf-first kernel addresses -> root-first names (``[kernel]`` runs merged).
        Return addresses (every frame but the leaf) are looked up at addr - 1, inside
        the call instruction."""
        names = []
        for i, a in enumerate(addrs):
            names.append(self.kallsyms.name(a - 1 if i else a))
        names.reverse()
        out: list[str] = []
        for n in names:
            if n == UNKNOWN_KERNEL and out and out[-1] == UNKNOWN_KERNEL:
                continue
            out.append(n)
        return out

    def user_frame(self, pid: int, addr: int) -> str:
        key = (pid, addr)
        hit = self._ucache.get(key)
        if hit is not None:
            return hit
        m = self.maps.find(pid, addr)
        if m is None:
            name = UNKNOWN_USER
        else:
            off = addr - m.start + m.offset
            sym = self.elf.lookup(m.path, off) if m.is_file else None
            name = f"{m.module}`{sym}" if sym else (f"{m.module}+{off:#x}" if m.is_file else m.module)
        if name == UNKNOWN_USER or "`" not in name:
            self.unresolved_user += 1
        else:
            self.resolved_user += 1
        self._ucache[key] = name
        return name

    def user_frames(self, pid: int, addrs: Iterable[int]) -> list[str]:
        """Leaf-first user addresses -> root-first names. The walk stops at the first
        address in no known mapping (one ``[unknown]`` frame): user stacks are walked by
        frame pointers, and past a frame built without them the chain is garbage."""
        out: list[str] = []
        for i, a in enumerate(addrs):
            name = self.user_frame(pid, a - 1 if i else a)
            out.append(name)
            if name == UNKNOWN_USER:
                break
        out.reverse()
        return out


# ---------------------------------------------------------------------------
# the leak check

#: 16 hex digits (with or without 0x) not inside a longer run of letters/digits
_HEX = re.compile(rb"(?<![0-9A-Za-z])(?:0[xX])?([0-9a-fA-F]{16})(?![0-9A-Za-z])")
#: decimals of 10-20 digits (shorter ones are below any kernel address, also as int64)
_DEC = re.compile(rb"(?<![0-9A-Za-z.])(-?)([0-9]{10,20})(?![0-9A-Za-z.])")


def _is_kernel_hex(v: int) -> bool:
    return KERNEL_HALF <= v < ALL_ONES


def _int_hit(v: int, ks: Kallsyms | None, signed_ok: bool) -> bool:
    """An integer that is a kernel address: in the kernel half (unsigned) or, read as
    the two's complement of an int64, among the kallsyms addresses."""
    if v < 0:
        if not signed_ok:
            return False
        v += 1 << 64
        return ks is not None and ks.covers(v)
    if ks is not None and ks.covers(v):
        return True
    return _is_kernel_hex(v)


def scan_text(data: bytes, ks: Kallsyms | None = None) -> Iterator[tuple[int, str]]:
    """(byte offset, matched text) of every kernel address in ``data``."""
    for m in _HEX.finditer(data):
        if _is_kernel_hex(int(m.group(1), 16)):
            yield m.start(), m.group(0).decode("ascii")
    for m in _DEC.finditer(data):
        v = int(m.group(2))
        if m.group(1):
            v = -v
        if _int_hit(v, ks, signed_ok=True):
            yield m.start(), m.group(0).decode("ascii")


#: RE2 prefilter of string cells worth a full scan (RE2 has no look-around)
_PREFILTER = r"[0-9a-fA-F]{16}|[0-9]{10}"


def _int_hits(arr, ks: Kallsyms | None, signed64: bool):
    """Row indices of a 64-bit integer numpy array that hold kernel addresses (vectorized
    :func:`_int_hit`)."""
    import numpy as np

    u = arr.astype(np.int64).view(np.uint64) if signed64 else arr.astype(np.uint64)
    hit = np.zeros(len(u), dtype=bool)
    if ks is not None and ks.lo is not None:
        hit |= (u >= np.uint64(ks.lo)) & (u <= np.uint64(ks.hi))
    if not signed64:  # a negative int64 is only an address when among kallsyms'
        hit |= (u >= np.uint64(KERNEL_HALF)) & (u != np.uint64(ALL_ONES))
    return np.flatnonzero(hit)


def _scan_parquet(path: Path, ks: Kallsyms | None) -> Iterator[tuple[int, str]]:
    """(row, "column: value") of kernel addresses in a Parquet file's columns: strings
    (prefiltered in Arrow, then :func:`scan_text`), 64-bit integers (vectorized), nested
    columns as their Python text; the schema metadata is reported at row -1."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    meta = pf.schema_arrow.metadata or {}
    for k, v in meta.items():
        for off, text in scan_text(bytes(k) + b" " + bytes(v), ks):
            yield -1, f"schema metadata: {text} (byte {off})"
    base = 0
    for batch in pf.iter_batches():
        for name, col in zip(batch.schema.names, batch.columns):
            t = col.type
            if pa.types.is_dictionary(t):
                col = col.dictionary_decode()
                t = col.type
            if pa.types.is_string(t) or pa.types.is_large_string(t):
                mask = pc.fill_null(pc.match_substring_regex(col, _PREFILTER), False)
                rows = pc.indices_nonzero(mask).to_pylist()
                for i in rows:
                    b = col[i].as_py().encode("utf-8", "replace")
                    for _off, text in scan_text(b, ks):
                        yield base + i, f"{name}: {text}"
            elif pa.types.is_integer(t):
                if t.bit_width < 64:
                    continue  # cannot hold an address
                arr = col.fill_null(0).to_numpy(zero_copy_only=False)
                for i in _int_hits(arr, ks, pa.types.is_signed_integer(t)):
                    yield base + int(i), f"{name}: {col[int(i)].as_py()}"
            elif pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_temporal(t) \
                    or pa.types.is_decimal(t) or pa.types.is_null(t):
                continue
            else:  # binary, nested (list, struct, map): their Python text
                for i, v in enumerate(col.to_pylist()):
                    if v is None:
                        continue
                    b = bytes(v) if isinstance(v, (bytes, bytearray)) else repr(v).encode("utf-8", "replace")
                    for _off, text in scan_text(b, ks):
                        yield base + i, f"{name}: {text}"
        base += batch.num_rows


def find_kernel_addresses(run_dir: str | os.PathLike, kallsyms: Kallsyms | None = None,
                          root: str | os.PathLike = "/") -> list[tuple[str, int, str]]:
    """Every kernel address written anywhere under ``run_dir``: (file relative to
    ``run_dir``, offset, text).

    Text files (JSON, folded stacks, logs: anything that is not Parquet) are scanned
    as bytes and the offset is a byte offset; Parquet files column by column and the
    offset is the row (-1: the schema metadata). A hit is a 16-digit hex number (with
    or without 0x) in the kernel half, >= 0xffff800000000000 (the all-ones -1 excepted),
    a decimal integer in the kernel half, or an integer equal to a kallsyms address or
    between the lowest and highest of them (int64 Parquet columns also read as u64, so a
    stored address that wrapped negative is found). ``kallsyms`` defaults to
    ``<root>/proc/kallsyms``; without readable addresses only the kernel-half rule
    applies."""
    ks = kallsyms if kallsyms is not None else Kallsyms(root)
    if not ks.addresses:
        ks = None
    d = Path(run_dir)
    out: list[tuple[str, int, str]] = []
    for p in sorted(d.rglob("*")):
        if not p.is_file():
            continue
        rel = str(p.relative_to(d))
        if p.suffix == ".parquet":
            try:
                out.extend((rel, off, text) for off, text in _scan_parquet(p, ks))
                continue
            except Exception:  # noqa: BLE001 - not readable as Parquet: scan its bytes instead
                pass
        out.extend((rel, off, text) for off, text in scan_text(p.read_bytes(), ks))
    return out
