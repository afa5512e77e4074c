"""`moetrace doctor`: JSON shape on fake trees (no kernel), and the live kernel's answers."""


from __future__ import annotations


import pytest


import json


import re


from pathlib import Path


from click.testing import CliRunner


from moetrace.kernel import features as F


from moetrace.cli.doctor import doctor
from moetrace.record.doctor import doctor as doctor_report


from moetrace.record.probes import PROBES, resolve_all


from unit.test_features import make_tree  # noqa: E402  (tests/ is on sys.path under pytest)


STATUSES = {"yes", "no", "degraded"}


CAPS = {"root", "cap_bpf", "cap_perfmon", "bpf", "tracefs", "debugfs", "kprobes", "btf",
        "perf_events", "mglru", "cgroup_v2_memory", "cgroup_v1_memory", "psi"}


def _run(*args: str) -> dict:
    res = CliRunner().invoke(doctor, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def _rows(rep: dict) -> dict[str, dict]:
    """Rows by name; probe summary rows as "probe:<name>" (the capability "mglru" is another row)."""
    return {("probe:" if r["section"] == "probe" else "") + r["name"]: r for r in rep["rows"]}


@pytest.fixture
def unmount_after():
    """Whatever a test mounted through Features(mount=True) is unmounted afterwards."""
    yield
    F.unmount_ours()


def _fake_damon(root, state="on", action="pageout", filters=(("anon", "Y", "N"), ("unmapped", "Y", "Y"))):
    """A kdamond like this machine's (sysfs layout of 6.14+, with ops_filters)."""
    kd = root / "sys/kernel/mm/damon/admin/kdamonds/0"
    files = {"state": state, "pid": "79", "refresh_ms": "0", "contexts/nr_contexts": "1",
             "contexts/0/operations": "paddr",
             "contexts/0/monitoring_attrs/intervals/sample_us": "500000",
             "contexts/0/monitoring_attrs/intervals/aggr_us": "5000000",
             "contexts/0/monitoring_attrs/intervals/update_us": "60000000",
             "contexts/0/targets/0/pid_target": "0",
             "contexts/0/targets/0/regions/0/start": str(4 << 30), "contexts/0/targets/0/regions/0/end": str(7 << 30),
             "contexts/0/schemes/0/action": action,
             "contexts/0/schemes/0/access_pattern/age/min": "12",
             "contexts/0/schemes/0/access_pattern/age/max": str(2**32 - 1),
             "contexts/0/schemes/0/access_pattern/nr_accesses/min": "0",
             "contexts/0/schemes/0/access_pattern/nr_accesses/max": "1",
             "contexts/0/schemes/0/access_pattern/sz/min": "0",
             "contexts/0/schemes/0/access_pattern/sz/max": str(2**64 - 1),
             "contexts/0/schemes/0/quotas/bytes": str(128 << 20), "contexts/0/schemes/0/quotas/ms": "50",
             "contexts/0/schemes/0/quotas/reset_interval_ms": "1000",
             "contexts/0/schemes/0/stats/sz_applied": "0"}
    for i, (typ, matching, allow) in enumerate(filters):
        files.update({f"contexts/0/schemes/0/ops_filters/{i}/type": typ,
                      f"contexts/0/schemes/0/ops_filters/{i}/matching": matching,
                      f"contexts/0/schemes/0/ops_filters/{i}/allow": allow})
    for rel, text in files.items():
        (kd / rel).parent.mkdir(parents=True, exist_ok=True)
        (kd / rel).write_text(text + "\n")
    return root


__all__ = ['CAPS', 'CliRunner', 'F', 'PROBES', 'Path', 'STATUSES', '_fake_damon', '_rows', '_run', 'doctor', 'doctor_report', 'json', 'make_tree', 'pytest', 're', 'resolve_all', 'unmount_after']
