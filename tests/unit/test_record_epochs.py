"""Per-iteration counters: the replay writes each iteration's epoch into the pagecache probe's (unit tier)."""

from __future__ import annotations

from common.record_epochs import *  # noqa: F401,F403


def test_one_epoch_per_iteration_when_they_fit():
    wr = _replay_like(1, 2, 3, 64)
    assert wr.mode == "iteration" and wr.error is None
    assert wr.writes == list(range(1, 11))  # 9 iterations + after; epoch 0 (setup) is the map's initial 0
    ph = [(e[1], e[2], e[3]) for e in wr.assigned]
    assert ph[0] == ("setup", None, None) and ph[-1] == ("after", None, None)
    assert ph[1:4] == [("warmup", 0, 0), ("warmup", 0, 1), ("warmup", 0, 2)]
    assert ph[4] == ("measured", 0, 0) and ph[9] == ("measured", 1, 2)
    eps = epochs_from_replay({"epochs": wr.summary()}, 5, 10 ** 18)
    assert eps[0].start_ns == 5 and all(a.end_ns == b.start_ns for a, b in zip(eps, eps[1:]))
    assert eps[-1].end_ns == 10 ** 18 and [e.epoch for e in eps] == list(range(11))


def test_falls_back_to_passes_then_phases():
    wr = _replay_like(1, 3, 100, 8)  # 400 iterations do not fit, 4 passes do
    assert wr.mode == "pass"
    assert [(e[1], e[2]) for e in wr.assigned] == [("setup", None), ("warmup", 0), ("measured", 0),
                                                   ("measured", 1), ("measured", 2), ("after", None)]
    assert len(wr.writes) == 5  # one write per pass and one at the end, not one per iteration
    wr = _replay_like(2, 5, 10, 4)
    assert wr.mode == "phase" and [e[1] for e in wr.assigned] == ["setup", "warmup", "measured", "after"]
    assert epoch_mode(4, 2, 5, 10) == "phase" and epoch_mode(9, 2, 5, 10) == "pass"


def test_epochs_are_bounded_by_the_slot_budget():
    assert epochs_for(24) == 4096
    assert epochs_for(92 * 896 + 1) == (1 << 20) // (92 * 896 + 1)
    assert epochs_for(10_000_000) == 4


def test_a_failing_map_write_turns_the_writer_off_not_the_replay():
    r, w = os.pipe()  # an fd that is not a BPF map
    wr = EpochWriter(r, 16)
    wr.start(1, 1, 2)
    wr.iteration("warmup", 0, 0)
    assert wr.error and "BPF_MAP_UPDATE_ELEM" in wr.error
    wr.iteration("warmup", 0, 1)  # no-ops from now on
    wr.done()
    assert [e[1] for e in wr.assigned] == ["setup"]
    os.close(r)
    os.close(w)


def test_replay_without_the_env_has_no_writer(monkeypatch):
    monkeypatch.delenv("MOETRACE_EPOCH_MAP_FD", raising=False)
    assert EpochWriter.from_env() is None
    monkeypatch.setenv("MOETRACE_EPOCH_MAP_FD", "not-a-number")
    monkeypatch.setenv("MOETRACE_EPOCHS", "8")
    assert EpochWriter.from_env() is None


def test_an_open_ended_window_keeps_one_epoch_a_pass_and_the_last_slot_for_after():
    """A measured window of a duration (issue 34): its passes are not known before, so one epoch
    per pass, the passes beyond the slots folded into the last measured one, "after" its own."""
    wr = _Recorded(6)
    wr.start(1, 1, 3, open_ended=True)
    assert wr.mode == "pass" and epoch_mode(6, 1, 1, 3, open_ended=True) == "pass"
    for ph, reps in (("warmup", 1), ("measured", 5)):
        for r in range(reps):
            for i in range(3):
                wr.iteration(ph, r, i)
    wr.done()
    rows = [(e[1], e[2], e[5]) for e in wr.assigned]
    assert rows == [("setup", None, False), ("warmup", 0, False), ("measured", 0, False), ("measured", 1, False),
                    ("measured", 2, True), ("after", None, False)]  # passes 3 and 4 folded into 2
    assert epoch_mode(3, 1, 1, 3, open_ended=True) == "phase"
