"""The README's demo command runs end to end and writes its artifacts."""

from __future__ import annotations

import json

from click.testing import CliRunner

from moetrace.cli import cli


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    r = CliRunner().invoke(cli, ["demo", "--out", str(out), "--steps", "120"])
    assert r.exit_code == 0, r.output
    for name in ("trace.jsonl", "typed.parquet", "plan.bin", "sim.png", "REPORT.md", "stats.json", "sim.json"):
        assert (out / name).stat().st_size > 0, name
    parse = json.loads((out / "parse.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert plan["accepted_tokens"] == parse["accepted_tokens"]
    assert parse["steps_by_kind"]["spec_fallback"] > 0 and parse["steps_by_kind"]["spec_accept"] > 0
    assert "accepted tokens" in r.output and "belady" in r.output
    assert not list(out.glob("*.tmp*"))
