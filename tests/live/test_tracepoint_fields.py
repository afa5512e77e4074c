"""Tracepoint fields from the kernel's BTF agree with the format files (live tier): for every
declared tracepoint candidate whose fields BTF describes, the same field names, and so the same
candidates and field knobs (HAVE_ORDER, ...), as reading the format file."""

from __future__ import annotations

import pytest

from moetrace.kernel import features as F
from moetrace.kernel.bpf import object_path
from moetrace.kernel.btf import object_ctx_structs
from moetrace.record.probes import PROBES
from moetrace.record.spec import resolve


@pytest.fixture
def unmount_after():
    """Whatever the test mounted through Features(mount=True) is unmounted afterwards."""
    yield
    F.unmount_ours()


class _FormatOnly(F.Features):
    """The same kernel, every field read from the format files (the way before BTF)."""

    def tracepoint_fields(self, category, event, ctx_struct=None):
        return super().tracepoint_fields(category, event, None)


def test_btf_fields_equal_the_format_files_for_every_declared_candidate(live, unmount_after):
    F.clear_cache()
    feats = F.Features("/", mount=True)
    assert feats.tracefs is not None and feats.vmlinux_btf() is not None
    btf = feats.vmlinux_btf()
    compared = []
    for name, spec in PROBES.items():
        ctx = object_ctx_structs(object_path(name))
        for g in spec.attach:
            for c in g.candidates:
                if c.kind != "tracepoint" or not (c.fields or c.field_knobs):
                    continue
                cat, ev = c.target.split(":", 1)
                fmt = F.tracepoint_format(cat, ev)
                if cat == "syscalls" or fmt is None:
                    continue  # one generic struct for every syscall event; absent here
                assert c.fn_name in ctx, f"{name}: no program {c.fn_name} in its object"
                names = btf.tracepoint_fields(ctx[c.fn_name])
                assert names is not None, f"{c.target}: no struct {ctx[c.fn_name]} in the kernel's BTF"
                assert set(names) == set(fmt), (c.target, set(names) ^ set(fmt))
                for fld, _knob in c.field_knobs:
                    assert (fld in names) == (fld in fmt)
                compared.append(c.target)
    assert {"filemap:mm_filemap_add_to_page_cache", "task:task_newtask"} <= set(compared), compared
    print(f"{len(compared)} candidates compared: {sorted(set(compared))}")
    old = _FormatOnly("/")
    for name, spec in PROBES.items():
        assert resolve(spec, feats).to_dict() == resolve(spec, old).to_dict(), name
