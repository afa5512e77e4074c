"""The one loader of compiled BPF objects: the system libbpf (``libbpf.so.1``) through ctypes.

A probe is compiled once, ahead of time, into ``probes/build/<name>.bpf.o`` (CO-RE: clang
against a vmlinux.h from BTF, ``scripts/build-probes.sh``); at record time libbpf opens it,
relocates its field reads against the running kernel's BTF, and loads it: no compiler, no
headers, milliseconds. This module is the thin, typed layer over the C API that every probe
loads through:

- :class:`BpfObject`: open, set read-only globals (``.rodata``: knobs that are constants to the
  verifier), size maps, choose which programs load (and their fentry targets), load, attach
  each program by its kind (tracepoint, tp_btf / fentry / fexit, kprobe, perf event), close;
- :class:`Map`: fd, sizes, update / lookup / batched reads into numpy;
- :class:`RingBuffer`: libbpf's ring-buffer consumer.

libbpf's own messages (the verifier log among them) are captured and the last lines are put
into the error of a failed load. Only the C API of libbpf 1.x is used (Debian bookworm ships
1.1.2, trixie 1.5); ``pylibbpf`` is pre-alpha and is not used.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import os
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from moetrace.errors import ProbeError
from moetrace.kernel.syscalls import libc

_lib = None
_lib_lock = threading.Lock()
_tls = threading.local()  # libbpf calls print from the thread that called it: one log per thread


def _log() -> list[str]:
    if not hasattr(_tls, "lines"):
        _tls.lines = []
    return _tls.lines
#: libbpf's print callback: int (*)(enum libbpf_print_level, const char *fmt, va_list ap)
_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
#: ring_buffer_sample_fn: int (*)(void *ctx, void *data, size_t size)
RING_SAMPLE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_DEBUG = bool(os.environ.get("MOETRACE_LIBBPF_LOG"))
_BTF_KIND_STRUCT = 4
_BTF_KIND_DATASEC = 15


_LIBBPF_DEBUG = 2


def _on_print(level: int, fmt: bytes, ap: int) -> int:
    """libbpf's messages (warnings and info, the verifier log on a failed load among them) into a
    bounded list; its debug messages (every CO-RE relocation: thousands a load, 2.5 s under the
    lab's TCG) only with MOETRACE_LIBBPF_LOG set."""
    if level >= _LIBBPF_DEBUG and not _DEBUG:
        return 0
    if not hasattr(_tls, "buf"):  # one message can be a whole verifier log (libbpf prints it at once)
        _tls.buf = ctypes.create_string_buffer(1 << 22)
    libc.vsnprintf(_tls.buf, ctypes.c_size_t(len(_tls.buf)), fmt, ctypes.c_void_p(ap))
    for ln in _tls.buf.value.decode(errors="replace").splitlines():
        _log().append(ln)
    del _log()[:-2000]
    return 0


_print_cb = _PRINT_FN(_on_print)

_SIGS: dict[str, tuple] = {
    # name: (restype, argtypes)
    "libbpf_set_print": (ctypes.c_void_p, [_PRINT_FN]),
    "libbpf_major_version": (ctypes.c_uint32, []),
    "libbpf_minor_version": (ctypes.c_uint32, []),
    "bpf_object__open_file": (ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_void_p]),
    "bpf_object__load": (ctypes.c_int, [ctypes.c_void_p]),
    "bpf_object__close": (None, [ctypes.c_void_p]),
    "bpf_object__btf": (ctypes.c_void_p, [ctypes.c_void_p]),
    "bpf_object__next_program": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p]),
    "bpf_object__next_map": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p]),
    "bpf_program__name": (ctypes.c_char_p, [ctypes.c_void_p]),
    "bpf_program__section_name": (ctypes.c_char_p, [ctypes.c_void_p]),
    "bpf_program__fd": (ctypes.c_int, [ctypes.c_void_p]),
    "bpf_program__set_autoload": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_bool]),
    "bpf_program__autoload": (ctypes.c_bool, [ctypes.c_void_p]),
    "bpf_program__set_attach_target": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p]),
    "bpf_program__attach": (ctypes.c_void_p, [ctypes.c_void_p]),
    "bpf_program__attach_tracepoint": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]),
    "bpf_program__attach_kprobe": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_bool, ctypes.c_char_p]),
    "bpf_program__attach_trace": (ctypes.c_void_p, [ctypes.c_void_p]),
    "bpf_program__attach_perf_event": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int]),
    "bpf_link__destroy": (ctypes.c_int, [ctypes.c_void_p]),
    "bpf_link__fd": (ctypes.c_int, [ctypes.c_void_p]),
    "bpf_map__name": (ctypes.c_char_p, [ctypes.c_void_p]),
    "bpf_map__fd": (ctypes.c_int, [ctypes.c_void_p]),
    "bpf_map__set_max_entries": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint32]),
    "bpf_map__max_entries": (ctypes.c_uint32, [ctypes.c_void_p]),
    "bpf_map__key_size": (ctypes.c_uint32, [ctypes.c_void_p]),
    "bpf_map__value_size": (ctypes.c_uint32, [ctypes.c_void_p]),
    "bpf_map__type": (ctypes.c_int, [ctypes.c_void_p]),
    "bpf_map__initial_value": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]),
    "btf__find_by_name_kind": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32]),
    "btf__type_by_id": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_uint32]),
    "btf__name_by_offset": (ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_uint32]),
    "btf__resolve_size": (ctypes.c_int64, [ctypes.c_void_p, ctypes.c_uint32]),
    "bpf_map_update_elem": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]),
    "bpf_map_lookup_elem": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]),
    "bpf_map_get_next_key": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]),
    "bpf_map_delete_elem": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]),
    "bpf_map_lookup_batch": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_void_p]),
    "bpf_map_update_batch": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.POINTER(ctypes.c_uint32), ctypes.c_void_p]),
    "libbpf_num_possible_cpus": (ctypes.c_int, []),
    "btf__load_vmlinux_btf": (ctypes.c_void_p, []),
    "ring_buffer__new": (ctypes.c_void_p, [ctypes.c_int, RING_SAMPLE_FN, ctypes.c_void_p, ctypes.c_void_p]),
    "ring_buffer__poll": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
    "ring_buffer__consume": (ctypes.c_int, [ctypes.c_void_p]),
    "ring_buffer__free": (None, [ctypes.c_void_p]),
}


def lib():
    """The system libbpf with typed signatures (loaded once), or a ProbeError naming the package."""
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                L = ctypes.CDLL("libbpf.so.1", use_errno=True)
            except OSError as e:
                raise ProbeError(f"libbpf.so.1 cannot be loaded ({e})",
                                 hint="apt-get install libbpf1 (make setup installs it)") from None
            for name, (res, args) in _SIGS.items():
                fn = getattr(L, name)
                fn.restype, fn.argtypes = res, args
            L.libbpf_set_print(_print_cb)
            _lib = L
    return _lib


def version() -> str:
    L = lib()
    return f"{L.libbpf_major_version()}.{L.libbpf_minor_version()}"


def _err(what: str, e: int | None = None) -> ProbeError:
    e = ctypes.get_errno() if e is None else e
    tail = [ln for ln in _log()[-12:] if ln.strip()]
    detail = f": {os.strerror(e)}" if e else ""
    msg = f"{what}{detail}"
    if tail:
        msg += " (libbpf: " + " | ".join(tail[-6:]) + ")"
    return ProbeError(msg, hint="`moetrace doctor` says what this kernel offers; MOETRACE_LIBBPF_LOG=1 "
                                "prints libbpf's whole log")


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise _err(what, -rc if rc != -1 else None)


class Map:
    """One map of a loaded object: fd, sizes, element access and batched reads."""

    def __init__(self, name: str, ptr: int):
        L = lib()
        self.name, self._ptr = name, ptr
        self.fd = L.bpf_map__fd(ptr)
        self.key_size = L.bpf_map__key_size(ptr)
        self.value_size = L.bpf_map__value_size(ptr)
        self.max_entries = L.bpf_map__max_entries(ptr)
        self.type = L.bpf_map__type(ptr)

    def __len__(self) -> int:
        return self.max_entries

    def update(self, key: bytes, value: bytes, flags: int = 0) -> None:
        if len(key) != self.key_size or len(value) != self.value_size:
            raise ValueError(f"map {self.name}: key {len(key)} B / value {len(value)} B, "
                             f"the map has {self.key_size} / {self.value_size}")
        kb, vb = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value, len(value))
        rc = lib().bpf_map_update_elem(self.fd, kb, vb, flags)
        if rc != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"map {self.name} update: {os.strerror(e)}")

    def lookup(self, key: bytes) -> bytes | None:
        kb = ctypes.create_string_buffer(key, self.key_size)
        vb = ctypes.create_string_buffer(self.value_size)
        if lib().bpf_map_lookup_elem(self.fd, kb, vb) != 0:
            return None
        return vb.raw

    def delete(self, key: bytes) -> bool:
        """Remove one element; False when it was not there."""
        kb = ctypes.create_string_buffer(key, self.key_size)
        return lib().bpf_map_delete_elem(self.fd, kb) == 0

    def update_batch(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Write many elements in one syscall (BPF_MAP_UPDATE_BATCH); per element where the
        kernel lacks it."""
        keys, values = np.ascontiguousarray(keys), np.ascontiguousarray(values)
        n = len(keys)
        if n == 0:
            return
        if keys.dtype.itemsize != self.key_size or values.dtype.itemsize != self.value_size:
            raise ValueError(f"map {self.name}: batch dtypes {keys.dtype}/{values.dtype} do not match "
                             f"{self.key_size}/{self.value_size} B")
        cnt = ctypes.c_uint32(n)
        rc = lib().bpf_map_update_batch(self.fd, keys.ctypes.data, values.ctypes.data, ctypes.byref(cnt), None)
        if rc == 0 and cnt.value == n:
            return
        kb, vb = keys.tobytes(), values.tobytes()
        ks, vs = self.key_size, self.value_size
        for i in range(cnt.value if rc == 0 else 0, n):
            self.update(kb[i * ks:(i + 1) * ks], vb[i * vs:(i + 1) * vs])

    def read_array(self, dtype, value_size: int | None = None) -> np.ndarray:
        """Every value of an array map (u32 keys 0..max_entries-1) as numpy, by
        BPF_MAP_LOOKUP_BATCH. ``value_size``: bytes the kernel copies per entry when it is not
        the map's value size (a per-CPU array: the 8-byte-rounded value x possible CPUs)."""
        return read_array_fd(self.fd, self.max_entries, np.dtype(dtype),
                             self.value_size if value_size is None else value_size)

    def read_percpu(self, dtype, start: int = 0, n: int | None = None) -> np.ndarray:
        """A per-CPU array map (``n`` entries from ``start``; default all) as numpy: shape
        (entries, possible CPUs) of ``dtype`` (the kernel copies each value rounded up to 8
        bytes, once per possible CPU)."""
        dtype = np.dtype(dtype)
        ncpu = possible_cpus()
        slot = -(-self.value_size // 8) * 8
        if dtype.itemsize != self.value_size:
            raise ValueError(f"map {self.name}: dtype {dtype} is not {self.value_size} B")
        padded = np.dtype({"names": ["v"], "formats": [dtype], "offsets": [0], "itemsize": slot})
        n = self.max_entries - start if n is None else n
        raw = read_array_fd(self.fd, n, np.dtype((padded, (ncpu,))), slot * ncpu, start)
        return raw["v"]

    def percpu_sums(self, start: int = 0, n: int | None = None) -> np.ndarray:
        """Per-index sums over CPUs of a per-CPU array of u64 (``n`` entries from ``start``), as int64."""
        return self.read_percpu(np.uint64, start, n).sum(axis=1, dtype=np.uint64).astype(np.int64)

    def keys(self, key_dtype) -> np.ndarray:
        """Every key of a hash map (BPF_MAP_GET_NEXT_KEY walk)."""
        return hash_keys(self.fd, np.dtype(key_dtype))


def possible_cpus() -> int:
    n = lib().libbpf_num_possible_cpus()
    if n <= 0:
        raise OSError(-n, "libbpf_num_possible_cpus")
    return n


def hash_keys(fd: int, key_dtype: np.dtype) -> np.ndarray:
    """The keys of hash map ``fd``, walked with bpf_map_get_next_key."""
    L = lib()
    out = []
    cur = np.zeros(1, key_dtype)
    nxt = np.zeros(1, key_dtype)
    prev = None
    while L.bpf_map_get_next_key(fd, prev, nxt.ctypes.data) == 0:
        out.append(nxt[0].copy())
        cur[:] = nxt
        prev = cur.ctypes.data
    return np.array(out, dtype=key_dtype)


def read_array_fd(fd: int, n: int, dtype: np.dtype, size: int, start: int = 0) -> np.ndarray:
    """The values of array map ``fd`` (``n`` entries from index ``start``) into a numpy array of
    ``dtype`` by BPF_MAP_LOOKUP_BATCH, 64 Ki entries a call; per-entry lookups where batch ops are
    missing."""
    if dtype.itemsize != size:
        raise ValueError(f"dtype {dtype} ({dtype.itemsize} B) != the map's value size {size} B")
    L = lib()
    out = np.zeros(n, dtype)
    chunk = min(max(n, 1), 65536)
    keys = np.zeros(chunk, np.uint32)
    vals = np.zeros(chunk, dtype)
    # an array's batch token is the last key read: the next call goes on after it
    in_b, out_b = ctypes.c_uint32(max(start - 1, 0)), ctypes.c_uint32(0)
    got, first = 0, True
    while got < n:
        cnt = ctypes.c_uint32(min(chunk, n - got))
        res = L.bpf_map_lookup_batch(fd, None if first and start == 0 else ctypes.byref(in_b), ctypes.byref(out_b),
                                     keys.ctypes.data, vals.ctypes.data, ctypes.byref(cnt), None)
        err = ctypes.get_errno() if res != 0 else 0
        k = cnt.value
        if k:
            idx = keys[:k].astype(np.int64) - start
            inside = idx < n
            out[idx[inside]] = vals[:k][inside]
            got += k
        if res != 0:
            if err == errno_mod.ENOENT:
                break
            if first and err in (errno_mod.EINVAL, 524):  # 524: ENOTSUPP, no batch ops
                return _read_array_slow(fd, n, dtype, start)
            raise OSError(err, f"BPF_MAP_LOOKUP_BATCH: {os.strerror(err)}")
        first = False
        in_b.value = out_b.value
        if k == 0:
            break
    return out


def _read_array_slow(fd: int, n: int, dtype: np.dtype, start: int = 0) -> np.ndarray:
    L = lib()
    out = np.zeros(n, dtype)
    key = ctypes.c_uint32(0)
    val = np.zeros(1, dtype)
    for i in range(n):
        key.value = start + i
        if L.bpf_map_lookup_elem(fd, ctypes.byref(key), val.ctypes.data) == 0:
            out[i] = val[0]
    return out


class RingBuffer:
    """libbpf's consumer of one BPF_MAP_TYPE_RINGBUF map; ``callback(data_ptr, size)`` per record."""

    def __init__(self, m: Map, callback: Callable[[int, int], None]):
        def sample(_ctx, data, size):
            callback(data, size)
            return 0

        self._cb = RING_SAMPLE_FN(sample)  # kept alive as long as the consumer
        self._ptr = lib().ring_buffer__new(m.fd, self._cb, None, None)
        if not self._ptr:
            raise _err(f"ring buffer on map {m.name}")

    def poll(self, timeout_ms: int) -> int:
        return lib().ring_buffer__poll(self._ptr, timeout_ms) if self._ptr else 0

    def consume(self) -> int:
        return lib().ring_buffer__consume(self._ptr) if self._ptr else 0

    def free(self) -> None:
        if self._ptr:
            lib().ring_buffer__free(self._ptr)
            self._ptr = None


class _OpenOpts(ctypes.Structure):
    """struct bpf_object_open_opts of libbpf 1.1 (80 bytes on 64-bit; ``sz`` says how much)."""
    _fields_ = [("sz", ctypes.c_size_t), ("object_name", ctypes.c_char_p), ("relaxed_maps", ctypes.c_bool),
                ("pin_root_path", ctypes.c_char_p), ("_attach_prog_fd", ctypes.c_uint32),
                ("kconfig", ctypes.c_char_p), ("btf_custom_path", ctypes.c_char_p),
                ("kernel_log_buf", ctypes.c_char_p), ("kernel_log_size", ctypes.c_size_t),
                ("kernel_log_level", ctypes.c_uint32)]


class BpfObject:
    """One compiled BPF object (``.bpf.o``) from open to close.

    Before :meth:`load`: :meth:`set_globals` (read-only ``const volatile`` globals, by name),
    :meth:`set_max_entries`, :meth:`set_autoload`, :meth:`set_attach_target`. After:
    ``attach_*`` (each returns the link's fd, detached at :meth:`close`), :meth:`map`,
    :meth:`prog_fds`, :meth:`global_view` (a writable view of ``.bss``/``.data``)."""

    def __init__(self, path: str | os.PathLike, name: str | None = None, btf_custom_path: Path | None = None):
        """``btf_custom_path``: a BTF that replaces the kernel's for CO-RE relocations (a
        minimal one: moetrace.kernel.minbtf), sparing libbpf the parse of the kernel's whole BTF."""
        L = lib()
        self.path = Path(path)
        self.name = name or self.path.name.split(".", 1)[0]
        if not self.path.is_file():
            raise ProbeError(f"no compiled probe object {self.path}",
                             hint="build the probes: bash scripts/build-probes.sh (make setup runs it)")
        del _log()[:]
        self._opts = None
        if btf_custom_path is not None:
            self._opts = _OpenOpts(sz=ctypes.sizeof(_OpenOpts), btf_custom_path=os.fsencode(btf_custom_path))
        self.btf_custom_path = btf_custom_path
        self._obj = L.bpf_object__open_file(os.fsencode(self.path),
                                            ctypes.addressof(self._opts) if self._opts is not None else None)
        if not self._obj:
            raise _err(f"libbpf cannot open {self.path}")
        self._links: list[int] = []
        self._mmaps: list = []
        self._views: dict[str, tuple[memoryview, dict[str, tuple[int, int]]]] = {}
        self.loaded = False
        self.programs: dict[str, int] = {}
        p = L.bpf_object__next_program(self._obj, None)
        while p:
            self.programs[L.bpf_program__name(p).decode()] = p
            p = L.bpf_object__next_program(self._obj, p)
        self._maps: dict[str, int] = {}
        m = L.bpf_object__next_map(self._obj, None)
        while m:
            self._maps[L.bpf_map__name(m).decode()] = m
            m = L.bpf_object__next_map(self._obj, m)

    # -- before load ----------------------------------------------------------------------------
    def _prog(self, name: str) -> int:
        return self._named("program", self.programs, name)

    def _map_ptr(self, name: str) -> int:
        return self._named("map", self._maps, name)

    def _named(self, what: str, table: dict[str, int], name: str) -> int:
        """The object's ``what`` (program or map) called ``name``, or an error listing what it has."""
        try:
            return table[name]
        except KeyError:
            raise ProbeError(f"{self.path.name} has no {what} {name!r}; it has {sorted(table)}",
                             hint="rebuild the probes (bash scripts/build-probes.sh)") from None

    def section_globals(self, section: str = ".rodata") -> dict[str, tuple[int, int]]:
        """{variable: (offset, size)} of the object's ``section`` from its BTF DATASEC."""
        L = lib()
        btf = L.bpf_object__btf(self._obj)
        if not btf:
            return {}
        tid = L.btf__find_by_name_kind(btf, section.encode(), _BTF_KIND_DATASEC)
        if tid <= 0:
            return {}
        t = L.btf__type_by_id(btf, tid)
        info = ctypes.c_uint32.from_address(t + 4).value
        out = {}
        for i in range(info & 0xFFFF):
            vtype, off, size = (ctypes.c_uint32 * 3).from_address(t + 12 + 12 * i)
            v = L.btf__type_by_id(btf, vtype)
            name = L.btf__name_by_offset(btf, ctypes.c_uint32.from_address(v).value)
            out[name.decode()] = (off, size)
        return out

    def struct_layout(self, name: str) -> list[tuple[str, int, int]] | None:
        """[(field, byte offset, size)] of ``struct name`` in the object's BTF (None: absent).
        The declaration tests hold each probe's Python structs to these."""
        L = lib()
        btf = L.bpf_object__btf(self._obj)
        tid = L.btf__find_by_name_kind(btf, name.encode(), _BTF_KIND_STRUCT) if btf else -1
        if tid <= 0:
            return None
        t = L.btf__type_by_id(btf, tid)
        info = ctypes.c_uint32.from_address(t + 4).value
        kflag = info >> 31
        out = []
        for i in range(info & 0xFFFF):
            name_off, mtype, off = (ctypes.c_uint32 * 3).from_address(t + 12 + 12 * i)
            bits = off & 0xFFFFFF if kflag else off
            out.append((L.btf__name_by_offset(btf, name_off).decode(), bits // 8, L.btf__resolve_size(btf, mtype)))
        return out

    def _section_map(self, section: str) -> int:
        for n, p in self._maps.items():
            if n.endswith(section):  # libbpf names internal maps "<obj prefix>.rodata"
                return p
        raise ProbeError(f"{self.path.name} has no {section} section")

    def set_globals(self, values: dict[str, int], section: str = ".rodata") -> None:
        """Write integer globals of ``section`` before load (little-endian, each its own size).
        Unknown names raise: a knob the C file does not declare is a mismatch, not a no-op."""
        if not values:
            return
        where = self.section_globals(section)
        missing = sorted(set(values) - set(where))
        if missing:
            raise ProbeError(f"{self.path.name} declares no global {', '.join(missing)} in {section}",
                             hint="the probe's Python declaration and its C file disagree; rebuild the probes")
        size = ctypes.c_size_t(0)
        base = lib().bpf_map__initial_value(self._section_map(section), ctypes.byref(size))
        if not base:
            raise _err(f"{self.path.name}: no initial value for {section}")
        for name, v in values.items():
            off, n = where[name]
            ctypes.memmove(base + off, int(v).to_bytes(n, "little", signed=int(v) < 0), n)

    def global_view(self, section: str = ".bss") -> tuple[memoryview, dict[str, tuple[int, int]]]:
        """After load: (a writable view of ``section``'s memory, shared with the kernel, and its
        variables' offsets). A u32 stored there is seen by the programs at once, no syscall.
        The map is mmapped here (libbpf 1.1 remaps internal maps only for skeletons)."""
        import mmap

        ptr = self._section_map(section)
        L = lib()
        size = L.bpf_map__value_size(ptr)
        length = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        mm = mmap.mmap(L.bpf_map__fd(ptr), length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._mmaps.append(mm)
        return memoryview(mm)[:size], self.section_globals(section)

    def _global_slice(self, name: str, section: str) -> tuple[memoryview, slice]:
        if section not in self._views:
            self._views[section] = self.global_view(section)
        view, where = self._views[section]
        off, n = where[name]
        return view, slice(off, off + n)

    def store_u32(self, name: str, value: int, section: str = ".bss") -> None:
        """Set one u32 global of ``section`` in the loaded object (e.g. ``armed``)."""
        view, at = self._global_slice(name, section)
        view[at] = int(value).to_bytes(at.stop - at.start, "little")

    def load_u32(self, name: str, section: str = ".bss") -> int:
        """One u32 global of ``section`` in the loaded object, as the programs left it."""
        view, at = self._global_slice(name, section)
        return int.from_bytes(view[at], "little")

    def set_max_entries(self, name: str, n: int) -> None:
        _check(lib().bpf_map__set_max_entries(self._map_ptr(name), max(1, int(n))), f"map {name} size {n}")

    def sections(self) -> dict[str, str]:
        """{program: its ELF section} ("tracepoint/filemap/...", "fentry/...", "kprobe/...")."""
        return {n: (lib().bpf_program__section_name(p) or b"").decode() for n, p in self.programs.items()}

    def set_autoload(self, prog: str, on: bool) -> None:
        _check(lib().bpf_program__set_autoload(self._prog(prog), bool(on)), f"autoload of {prog}")

    def set_attach_target(self, prog: str, func: str) -> None:
        """The kernel function of an fentry/fexit program (names differ between kernels)."""
        _check(lib().bpf_program__set_attach_target(self._prog(prog), 0, func.encode()),
               f"attach target {func} of {prog}")

    def load(self) -> None:
        del _log()[:]
        rc = lib().bpf_object__load(self._obj)
        if os.environ.get("MOETRACE_LIBBPF_LOG"):
            print("\n".join(_log()), file=__import__("sys").stderr)
        if rc != 0:
            raise _err(f"probe {self.name} failed to load", -rc)
        self.loaded = True

    # -- after load -----------------------------------------------------------------------------
    def _link(self, link: int, what: str) -> int:
        if not link:
            raise _err(f"cannot attach {what}")
        self._links.append(link)
        return lib().bpf_link__fd(link)

    def attach_tracepoint(self, prog: str, category: str, event: str) -> int:
        return self._link(lib().bpf_program__attach_tracepoint(self._prog(prog), category.encode(), event.encode()),
                          f"{prog} to tracepoint {category}:{event}")

    def attach_kprobe(self, prog: str, symbol: str, retprobe: bool = False) -> int:
        return self._link(lib().bpf_program__attach_kprobe(self._prog(prog), retprobe, symbol.encode()),
                          f"{prog} to {'kretprobe' if retprobe else 'kprobe'} {symbol}")

    def attach_trace(self, prog: str) -> int:
        """tp_btf, fentry, fexit: the target was fixed at load."""
        return self._link(lib().bpf_program__attach_trace(self._prog(prog)), f"{prog} (BTF trace)")

    def attach_perf_event(self, prog: str, perf_fd: int) -> int:
        return self._link(lib().bpf_program__attach_perf_event(self._prog(prog), perf_fd),
                          f"{prog} to perf event fd {perf_fd}")

    def map(self, name: str) -> Map:
        return Map(name, self._map_ptr(name))

    def map_names(self) -> list[str]:
        return sorted(self._maps)

    def prog_fds(self) -> dict[str, int]:
        """{program: fd} of the loaded programs."""
        L = lib()
        out = {}
        for n, p in self.programs.items():
            fd = L.bpf_program__fd(p)
            if fd >= 0:
                out[n] = fd
        return out

    def close(self) -> None:
        """Detach every link, free programs and maps (idempotent)."""
        L = lib()
        for view, _w in self._views.values():
            view.release()
        self._views = {}
        for mm in self._mmaps:
            try:
                mm.close()
            except BufferError:  # a view a caller still holds: the mapping goes with the process
                pass
        self._mmaps = []
        links, self._links = self._links, []
        for ln in links:
            L.bpf_link__destroy(ln)
        if self._obj:
            L.bpf_object__close(self._obj)
            self._obj = None

    def __enter__(self) -> "BpfObject":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------
# asking the kernel: can a BPF trampoline (fentry) be loaded here?

_BTF_KIND_FUNC = 12
_BTF_KIND_ENUM = 6
_vmlinux_btf = None


def vmlinux_func_id(func: str) -> int | None:
    """The BTF id of kernel function ``func`` in the running kernel's BTF, or None (no BTF, or
    no such function: inlined, static with several copies, or not built)."""
    btf = _vmlinux()
    tid = lib().btf__find_by_name_kind(btf, func.encode(), _BTF_KIND_FUNC) if btf else -1
    return tid if tid > 0 else None


def _vmlinux() -> int:
    """The running kernel's BTF, loaded by libbpf once (0 when the kernel has none)."""
    global _vmlinux_btf
    if _vmlinux_btf is None:
        _vmlinux_btf = lib().btf__load_vmlinux_btf() or 0
    return _vmlinux_btf


def vmlinux_enum_value(enum: str, enumerator: str) -> int | None:
    """The value of ``enumerator`` of ``enum <enum>`` in the running kernel's BTF (libbpf parses it
    in C: a fraction of a second where the Python BTF reader takes seconds under the lab's TCG)."""
    L, btf = lib(), _vmlinux()
    tid = L.btf__find_by_name_kind(btf, enum.encode(), _BTF_KIND_ENUM) if btf else -1
    if tid <= 0:
        return None
    t = L.btf__type_by_id(btf, tid)
    vlen = ctypes.c_uint32.from_address(t + 4).value & 0xFFFF
    for i in range(vlen):
        name_off, val = (ctypes.c_uint32 * 2).from_address(t + 12 + 8 * i)
        if L.btf__name_by_offset(btf, name_off).decode() == enumerator:
            return ctypes.c_int32(val).value
    return None


_BPF_PROG_LOAD = 5
_BPF_PROG_TYPE_TRACING = 26
_BPF_TRACE_FENTRY = 24


def trial_fentry(func: str) -> tuple[int, str]:
    """Load (and at once close) a two-instruction fentry program on ``func``: (0, "") when the
    kernel accepts it, else (errno, the verifier log). Needs CAP_BPF + CAP_PERFMON (root)."""
    import struct as st

    from moetrace.kernel.syscalls import sys_bpf

    btf_id = vmlinux_func_id(func)
    if btf_id is None:
        return errno_mod.ENOENT, f"no BTF for function {func}"
    insns = ctypes.create_string_buffer(st.pack("<BBhiBBhi", 0xB7, 0, 0, 0, 0x95, 0, 0, 0), 16)  # r0 = 0; exit
    lic = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(1 << 16)
    attr = (ctypes.c_uint8 * 128)()
    # union bpf_attr, BPF_PROG_LOAD: prog_type, insn_cnt, insns, license, log_level, log_size,
    # log_buf, ..., expected_attach_type at 68, attach_btf_id at 108 (UAPI, append-only)
    st.pack_into("<IIQQIIQ", attr, 0, _BPF_PROG_TYPE_TRACING, 2, ctypes.addressof(insns),
                 ctypes.addressof(lic), 1, len(log), ctypes.addressof(log))
    st.pack_into("<I", attr, 68, _BPF_TRACE_FENTRY)
    st.pack_into("<I", attr, 108, btf_id)
    fd = sys_bpf(_BPF_PROG_LOAD, attr)
    if fd >= 0:
        os.close(fd)
        return 0, ""
    return -fd, log.value.decode(errors="replace").strip()


# ---------------------------------------------------------------------------
# draining a ring buffer without a Python call per record

_RINGBUF_BUSY = 1 << 31
_RINGBUF_DISCARD = 1 << 30
_RINGBUF_HDR = 8


class MmapRing:
    """A BPF_MAP_TYPE_RINGBUF read in place: the consumer page (read-write), the producer page
    and the data area (mapped twice by the kernel, so a run of records that wraps is contiguous
    here) mmapped from the map's fd, and every ready record taken in one numpy step.

    Records of one size (every moetrace stream): ``[consumer, producer)`` is a sequence of
    8-byte headers (length, busy and discard bits) each followed by the record rounded up to 8
    bytes; the records up to the first one still being written (busy) are copied out at once and
    the consumer position is advanced past them. A header of another length (never written by
    moetrace's programs) falls back to walking that batch record by record. ``poll`` waits on the
    map's fd (the kernel wakes it when records are submitted)."""

    def __init__(self, m: Map, record_size: int):
        import mmap

        self.map, self.size = m, int(record_size)
        self.stride = -(-(self.size + _RINGBUF_HDR) // 8) * 8
        self._rec_dtype = np.dtype({"names": ["hdr", "rec"], "formats": ["<u4", f"V{self.size}"],
                                    "offsets": [0, _RINGBUF_HDR], "itemsize": self.stride})
        page = mmap.PAGESIZE
        data = m.max_entries
        self._cons = mmap.mmap(m.fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._prod = mmap.mmap(m.fd, page + 2 * data, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self._cpos = np.frombuffer(self._cons, np.uint64, 1)
        self._ppos = np.frombuffer(self._prod, np.uint64, 1)
        self._data = np.frombuffer(self._prod, np.uint8, 2 * data, page)
        self._mask = data - 1
        import select

        self._poller = select.poll()
        self._poller.register(m.fd, select.POLLIN)

    def read(self) -> bytes:
        """Every complete record now in the ring (``size`` bytes each, concatenated), consumed."""
        cons, prod = int(self._cpos[0]), int(self._ppos[0])
        if prod <= cons:
            return b""
        start = cons & self._mask
        raw = self._data[start:start + (prod - cons)]
        n = len(raw) // self.stride
        if n * self.stride == len(raw):
            # each record one element (its header, its bytes as one void): copies are a memcpy per
            # record, not a byte at a time (an uint8 (n, stride) view copied ~100 MB/s)
            recs = raw.view(self._rec_dtype)
            hdr = recs["hdr"].copy()
            busy = np.flatnonzero(hdr & _RINGBUF_BUSY)
            k = int(busy[0]) if len(busy) else n
            if (hdr[:k] & ~np.uint32(_RINGBUF_DISCARD) == self.size).all():
                body = recs["rec"][:k]
                drop = (hdr[:k] & _RINGBUF_DISCARD) != 0
                out = (body[~drop] if drop.any() else body).tobytes()
                self._cpos[0] = cons + k * self.stride  # release: x86-64 and arm64 order this store
                return out
        return self._walk(cons, prod)

    def _walk(self, cons: int, prod: int) -> bytes:
        """Record by record (a batch with a record of another size)."""
        chunks = []
        while cons < prod:
            at = cons & self._mask
            hdr = int(self._data[at:at + 4].view(np.uint32)[0])
            if hdr & _RINGBUF_BUSY:
                break
            ln = hdr & ~(_RINGBUF_BUSY | _RINGBUF_DISCARD)
            if not hdr & _RINGBUF_DISCARD:
                chunks.append(self._data[at + _RINGBUF_HDR:at + _RINGBUF_HDR + min(ln, self.size)].tobytes())
            cons += -(-(ln + _RINGBUF_HDR) // 8) * 8
        self._cpos[0] = cons
        return b"".join(chunks)

    def wake_on(self, fd: int) -> None:
        """Also end :meth:`wait` when ``fd`` turns readable (the recorded command's pidfd: its end
        is seen at once, not after the wait's timeout; Python's poll resumes after SIGCHLD)."""
        import select

        self._poller.register(fd, select.POLLIN)

    def wait(self, timeout_ms: int) -> None:
        """Until the kernel signals records (or ``timeout_ms`` passes, or a :meth:`wake_on` fd
        turns readable); returns at once when the ring already holds some."""
        if int(self._ppos[0]) > int(self._cpos[0]):
            return
        self._poller.poll(max(0, int(timeout_ms)))

    def close(self) -> None:
        for name in ("_cpos", "_ppos", "_data"):
            setattr(self, name, None)
        for mm in (self._cons, self._prod):
            try:
                mm.close()
            except BufferError:
                pass
