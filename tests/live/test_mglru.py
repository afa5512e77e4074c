"""The mglru probe: the lru_gen parser (moetrace.kernel.lru_gen), the sampler (moetrace.record.probes.mglru), (live tier)."""

from __future__ import annotations

from common.mglru import *  # noqa: F401,F403
from common import read_run


def test_record_mglru_on_this_host(live, tmp_path):
    from moetrace.run import directory as rundir
    from moetrace.kernel.features import mglru_state

    here = mglru_state("/")
    cmd = [sys.executable, "-c", "import time; time.sleep(1.5)"]
    r = subprocess.run([*RECORD, "--probes", "mglru", "--missing-probes", "warn", "--out", str(tmp_path / "run"),
                        "--", *cmd], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc, tables = read_run(tmp_path / "run")
    ap = doc["attach_plan"]["mglru"]
    if here is None:  # this project's machines: no MGLRU built
        assert doc["mglru"] is None
        assert ap["status"] == "no" and ap["recorded"] is False
        assert ap["skip_reason"] == "required lru_gen unavailable: MGLRU not built (no /sys/kernel/mm/lru_gen)"
        assert "probe mglru skipped: " + ap["skip_reason"] in doc["notes"]
        assert "lru_gen" not in tables and "lru_gen" not in doc["tables"]
        assert "mglru" not in doc.get("summaries", {}) and "mglru" not in doc["lost"]
        # doctor says the same, from the same declaration
        from moetrace.record.doctor import doctor as doctor_report

        plan = doctor_report(mount=True)["plans"]["mglru"]
        assert plan["status"] == "no" and plan["reason"] == ap["reason"]
    else:  # a kernel with MGLRU (the lab): samples at open, ~1 s, close
        assert ap["recorded"] is True
        df = tables["lru_gen"]
        assert df["sample"].nunique() >= 2 and doc["lost"]["mglru"]["failed_samples"] == 0
