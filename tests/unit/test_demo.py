"""The README's demo command runs end to end and writes its artifacts (unit tier)."""

from __future__ import annotations

from common.demo import *  # noqa: F401,F403


def test_demo_offline(tmp_path):
    out = tmp_path / "demo"
    r = run_demo(out, "--no-capacity")
    for name in ("trace.jsonl", "typed.parquet", "plan.bin", "sim.png", "REPORT.md", "stats.json", "sim.json"):
        assert (out / name).stat().st_size > 0, name
    parse = json.loads((out / "parse.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert plan["accepted_tokens"] == parse["accepted_tokens"]
    assert parse["steps_by_kind"]["spec_fallback"] > 0 and parse["steps_by_kind"]["spec_accept"] > 0
    assert "accepted tokens" in r.output and "belady" in r.output
    assert not list(out.glob("*.tmp*"))
    assert not (out / "sweep").exists()
