"""The examples run as shipped (live tier)."""

from __future__ import annotations

from common.examples import *  # noqa: F401,F403


def test_record_run_example(live, tmp_path):
    """examples/record_run.py records a cold 64 MiB pool: every expert page lands in the first
    warm-up iteration's epoch, the other iterations add none, the pool is removed after."""
    import pytest

    from conftest import io_lock

    from moetrace.run import directory as rundir

    with io_lock():
        r = subprocess.run([sys.executable, str(ROOT / "examples" / "record_run.py"), str(tmp_path)],
                           capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "expert pages added to the page cache per epoch" in r.stdout
    doc, t = rundir.load_run(tmp_path / "run")
    ee, meta = t["expert_epochs"], t["epochs"]
    e = ee[ee["kind"] == "expert"].merge(meta, on="epoch")
    first = e[(e["phase"] == "warmup") & (e["iteration"] == 0)]
    assert int(first["added_pages"].sum()) == 2 * 32 * 256  # 64 MiB, cold
    assert int(e["added_pages"].sum()) == int(first["added_pages"].sum())
    assert doc["bpf_runtime"]["stats_enabled"] is True
    assert not (tmp_path / "pool").exists()
