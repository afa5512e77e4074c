"""The probes' minimal BTF (moetrace.kernel.minbtf): made once per kernel and set of objects,
found again without bpftool, and every object loads against it (probe-build tier)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from moetrace.kernel import minbtf
from moetrace.kernel.bpf import probe_objects

pytestmark = pytest.mark.probe_build


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRACE_BTF_CACHE", str(tmp_path / "btf"))
    return tmp_path / "btf"


def test_made_once_then_found(live, cache):
    objs = probe_objects()
    assert len(objs) >= 8
    p = minbtf.ensure(objs)
    assert p is not None and p.parent == cache and 0 < p.stat().st_size < (1 << 16)  # KiB, not the kernel's MiB
    kernel = minbtf.KERNEL_BTF.read_bytes()
    assert p.name == f"{minbtf.kernel_digest(kernel)}-{minbtf.objects_digest(objs)}.btf"
    t = p.stat().st_mtime_ns
    assert minbtf.ensure(objs) == p and p.stat().st_mtime_ns == t  # a hit: not made again
    assert not list(cache.glob(".*"))  # no temporary file left
    # another set of objects (a rebuilt probe) is another file
    assert minbtf.ensure(objs[:-1]) != p


def test_every_object_loads_against_it(live, cache):
    """Each probe's object, every program loaded (not attached), relocated against the minimal BTF:
    it holds every type the objects relocate against."""
    from common.backends import loaded_object
    from moetrace.kernel import bpf
    from moetrace.kernel.bpf import prog_id_exists, prog_info
    from moetrace.kernel.libbpf import BpfObject
    from moetrace.record.probes import PROBES

    custom = minbtf.ensure(probe_objects())
    ids = []
    for name, spec in PROBES.items():
        if not bpf.object_path(name).exists():
            continue
        knobs = {k: int(v) for k, v in spec.knob_values().items()}
        with BpfObject(bpf.object_path(name)) as o:  # fentry needs what this host refuses: kprobes stand in
            progs = [p for p, sec in o.sections().items() if not sec.startswith(("fentry", "fexit"))]
        with loaded_object(spec, knobs, progs, custom) as o:
            ids += [prog_info(fd)["id"] for fd in o.prog_fds().values()]
    assert ids and not any(prog_id_exists(i) for i in ids)


def test_a_lab_kernel_image_is_unpacked_once(live, cache):
    image = Path("/boot/vmlinuz-6.12.95+deb12-amd64")
    if not image.is_file():
        pytest.fail(f"{image} missing: bash scripts/lab-setup.sh")
    objs = probe_objects()
    t0 = time.perf_counter()
    p = minbtf.ensure_for_image(image, objs)
    first = time.perf_counter() - t0
    assert p is not None and p.is_file() and len(list(cache.glob("image-*"))) == 1
    t0 = time.perf_counter()
    assert minbtf.ensure_for_image(image, objs) == p
    again = time.perf_counter() - t0
    print(f"\nminimal BTF of {image.name}: made in {first:.2f} s, found in {again * 1e3:.1f} ms")
    assert p != minbtf.ensure(objs)  # another kernel, another file
