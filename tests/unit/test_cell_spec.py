"""Cell inputs are checked before anything is created (no kernel needed)."""

from __future__ import annotations

import pytest

from moetrace.capacity.cell import CellSpec
from moetrace.errors import UsageError

MIB = 1 << 20


def spec(**kw):
    base = dict(plan="p.bin", pool="pool", capacity_bytes=512 * MIB)
    base.update(kw)
    return CellSpec(**base)


def test_pinned_needs_headroom_for_misses():
    with pytest.raises(UsageError, match="thrash") as ei:
        spec(mode="pinned", headroom_bytes=64 * MIB).validate()
    assert "--headroom 80MiB" in ei.value.format_message()
    spec(mode="pinned", headroom_bytes=80 * MIB).validate()
    spec(mode="hybrid", headroom_bytes=64 * MIB).validate()  # half of C stays page cache
    spec(mode="pagecache", headroom_bytes=0).validate()


@pytest.mark.parametrize("kw, needle", [
    (dict(mode="nope"), "unknown mode"),
    (dict(mechanism="vm"), "unknown mechanism"),
    (dict(capacity_bytes=0), "--capacity"),
    (dict(arena_fraction=0.5), "hybrid only"),
    (dict(mode="hybrid", arena_fraction=1.5), "(0, 1)"),
    (dict(passes=0), "--passes"),
    (dict(stream_events=True), "needs --record"),
    (dict(duration_s=3600.0), "below --timeout"),
    (dict(record_probes="+vmscan"), "needs --record"),
    (dict(balloon_thp="on"), "balloon only"),
    (dict(mechanism="balloon", balloon_thp="maybe"), "--balloon-thp 'maybe'"),
])
def test_bad_specs(kw, needle):
    with pytest.raises(UsageError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        spec(**kw).validate()


def test_stream_events_reach_the_recording_not_the_watch(tmp_path):
    from moetrace.capacity.cell import _record_argv

    sp = spec(record=True, stream_events=True)
    sp.validate()
    argv = _record_argv(sp, tmp_path / "run", tmp_path / "cg")
    assert argv[argv.index("--stream-events") + 1] == "--"
    assert "--stream-events" not in _record_argv(sp, tmp_path / "watch", tmp_path / "cg", probes="pagecache")
    assert "--stream-events" not in _record_argv(spec(record=True), tmp_path / "run", tmp_path / "cg")


def test_a_long_window_its_probes_and_the_balloons_thp_reach_the_commands(tmp_path):
    """--duration goes to the replay, --probes to the recording (watch keeps pagecache), and the
    balloon's madvise to its child (issue 34)."""
    from moetrace.capacity.cell import _record_argv, _replay_argv
    from moetrace.record.recorder import DEFAULT_RECORD, probe_list

    sp = spec(record=True, record_probes="+vmscan", duration_s=480.0, mechanism="balloon", balloon_thp="off")
    sp.validate()
    argv = _replay_argv(sp, tmp_path / "replay", 5)
    assert argv[argv.index("--duration") + 1] == "480.0" and argv[argv.index("--passes") + 1] == "1"
    rec = _record_argv(sp, tmp_path / "run", tmp_path / "cg")
    assert rec[rec.index("--probes") + 1] == "+vmscan"
    assert _record_argv(sp, tmp_path / "w", tmp_path / "cg", probes="pagecache")[-3:] == ["--probes", "pagecache", "--"]
    assert "--duration" not in _replay_argv(spec(), tmp_path / "r", 5)
    assert probe_list("+vmscan") == DEFAULT_RECORD + ("vmscan",) and probe_list(None) == DEFAULT_RECORD
    assert probe_list("pagecache, vmscan") == ("pagecache", "vmscan")
    assert probe_list("+pagecache") == DEFAULT_RECORD  # already in the set
    with pytest.raises(UsageError, match="mixes"):
        probe_list("pagecache,+vmscan")


def test_the_balloon_child_madvises_before_it_locks(monkeypatch):
    from moetrace.capacity import scope as S

    seen = []

    class _P:
        def __init__(self, argv, **kw):
            seen.append(argv)
            raise OSError("stop here")

    monkeypatch.setattr(S.subprocess, "Popen", _P)
    for thp, tail in (("on", ["on"]), (None, [])):
        with pytest.raises(OSError):
            S.Balloon(4096, None, python="py", thp=thp).start()
        assert seen[-1][5:] == tail
    code = S._BALLOON_CODE
    assert code.index("m.madvise(") < code.index("libc.mlock(")


def test_a_cell_without_out_on_a_read_only_root_is_a_usage_error(tmp_path, monkeypatch):
    """`moetrace cell` without --out where its run root cannot be made (a lab guest's read-only
    /var/tmp before the lab exported its share): a usage error naming the place and the fix, and
    no traceback; with a writable root, a new cell-<time> directory there."""
    from click.testing import CliRunner

    from moetrace.cli import cli
    from moetrace.cli.cell import default_cell_dir

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MOETRACE_RUN_ROOT", str(blocker / "runs"))
    with pytest.raises(UsageError, match="cannot make a cell directory under .*/file/runs") as ei:
        default_cell_dir()
    assert "--out DIR" in ei.value.format_message()
    plan, pool = tmp_path / "plan.bin", tmp_path / "pool"
    plan.write_bytes(b"x")
    pool.mkdir()
    r = CliRunner().invoke(cli, ["cell", "--plan", str(plan), "--pool", str(pool), "--capacity", "64MiB"])
    assert r.exit_code == 2 and "cannot make a cell directory" in r.output and "Traceback" not in r.output
    monkeypatch.setenv("MOETRACE_RUN_ROOT", str(tmp_path / "runs"))
    d = default_cell_dir()
    assert d.startswith(str(tmp_path / "runs" / "cell-"))


def test_the_balloon_reserve_is_the_rule_unless_a_disposable_machine_sets_it(monkeypatch):
    from moetrace.capacity.scope import RESERVE_ENV, safe_reserve_bytes

    monkeypatch.delenv(RESERVE_ENV, raising=False)
    assert safe_reserve_bytes(4 << 30) == (256 << 20) + (4 << 30) // 20
    assert safe_reserve_bytes(64 << 30) == (1 << 30) + (64 << 30) // 20
    monkeypatch.setenv(RESERVE_ENV, "160MiB")
    assert safe_reserve_bytes(4 << 30) == 160 << 20
    assert spec(mechanism="machine").validate() is None


class _FakeBalloon:
    made: list[int] = []

    def __init__(self, size, scope, python=None, thp=None):
        self.size, self.pid, self.vmlck_bytes = size, 4242, size

    def start(self):
        _FakeBalloon.made.append(self.size)
        return self

    def verified(self):
        return True


class _NoScope:
    def exists(self):
        return False


@pytest.mark.parametrize("avail_mib,target_mib,reserve_mib,want_mib", [
    (900, 384, 160, 516),  # the recorder took less than its allowance: lock the rest
    (386, 384, 160, 0),    # within TOP_UP_MIN: no top-up
    (300, 384, 160, 0),    # the recorder took more: noted, nothing locked
    (900, 100, 160, 740),  # C + headroom below the reserve: the top-up stops at the reserve
])
def test_the_balloon_top_up_leaves_c_plus_headroom_and_never_less_than_the_reserve(
        monkeypatch, avail_mib, target_mib, reserve_mib, want_mib):
    from moetrace.capacity import cell as K

    MIB = 1 << 20
    monkeypatch.setattr(K, "read_meminfo", lambda root: {"MemAvailable_bytes": avail_mib * MIB,
                                                         "MemTotal_bytes": 4096 * MIB})
    monkeypatch.setattr(K, "Balloon", _FakeBalloon)
    monkeypatch.setenv("MOETRACE_BALLOON_RESERVE", f"{reserve_mib}MiB")
    _FakeBalloon.made = []
    spec = CellSpec(plan="p", pool="q", capacity_bytes=(target_mib - 64) * MIB, mechanism="balloon")
    result = {"balloon": {}, "notes": []}
    b = K._top_up_balloon(spec, _NoScope(), _NoScope(), result)
    t = result["balloon"]["top_up"]
    assert t["bytes"] == want_mib * MIB and t["verified"] is True
    assert (b is not None) == (want_mib > 0) and _FakeBalloon.made == ([want_mib * MIB] if want_mib else [])
    assert any("more than its allowance" in n for n in result["notes"]) == (avail_mib < target_mib)
    assert any("safe reserve" in n for n in result["notes"]) == (target_mib < reserve_mib)
