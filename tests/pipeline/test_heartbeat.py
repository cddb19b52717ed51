"""Stall judgement from successive views of every rank's heartbeat (pure: no processes)."""

import pytest

from gpipe_cli.pipeline.heartbeat import INTERVAL_S, Beat, Judge, Waits, default_timeout


def beat(count: int, progress: int = 0, steps: int = 0, slowest: float = 0.1, paused: bool = False,
         started: bool = False) -> Beat:
    return Beat(count, progress, steps, slowest, paused, 100, "host", started)


def name(rank: int) -> str:
    return f"rank {rank} (stage {rank})"


def test_default_timeout_is_a_minute_or_ten_slowest_steps():
    assert default_timeout(0.5) == 60.0
    assert default_timeout(30.0) == 300.0


def test_the_default_follows_recent_steps_so_one_pause_is_forgotten(monkeypatch):
    from collections import deque

    from gpipe_cli.pipeline import heartbeat
    monkeypatch.setattr(heartbeat, "_recent", deque(maxlen=heartbeat.RECENT_STEPS))
    monkeypatch.setattr(heartbeat, "_steps", 0)
    monkeypatch.setattr(heartbeat, "_slowest", 0.0)
    heartbeat.step_done(600.0)  # the whole job was suspended for ten minutes in this step
    assert heartbeat._slowest == 600.0
    for _ in range(heartbeat.RECENT_STEPS - 1):
        heartbeat.step_done(2.0)
    assert heartbeat._slowest == 600.0
    heartbeat.step_done(2.0)
    assert heartbeat._slowest == 2.0 and default_timeout(heartbeat._slowest) == 60.0


def test_a_rank_that_stops_beating_is_named_after_the_timeout():
    judge = Judge(rank=0, timeout=5.0, name=name)
    assert judge.verdict([beat(1, started=True), beat(1, started=True)], now=0.0) is None
    # rank 1 silent for exactly the timeout
    assert judge.verdict([beat(4, started=True), beat(1, started=True)], now=5.0) is None
    found = judge.verdict([beat(5, started=True), beat(1, started=True)], now=5.5)
    assert found is not None and found[1] == [1]
    assert "rank 1 (stage 1) stopped responding: no heartbeat for 5 s" in found[0]
    assert Beat.decode(beat(3, 7, 2, 1.5, True).encode()) == beat(3, 7, 2, 1.5, True)


def test_silence_during_set_up_is_not_judged():
    judge = Judge(rank=0, timeout=5.0, name=name)  # rank 1 trains a tokenizer, holding the interpreter lock
    for second in range(30):
        assert judge.verdict([beat(second, started=True), beat(1)], now=float(second)) is None


def test_no_progress_names_the_ranks_furthest_behind():
    judge = Judge(rank=0, timeout=5.0, name=name)
    for second in range(7):  # everyone beats, nobody progresses
        found = judge.verdict([beat(second, 9, 3), beat(second, 8, 2), beat(second, 9, 3)], now=float(second))
    assert found is not None and found[1] == [1]
    assert found[0].startswith("no progress for 5 s: rank 1 (stage 1) stuck in step 3")
    assert found[0].endswith("(steps this slow on purpose: raise train.stall_timeout)")  # the way on


def test_progress_is_not_judged_before_the_first_step_nor_during_a_checkpoint():
    judge = Judge(rank=0, timeout=5.0, name=name)
    for second in range(20):
        assert judge.verdict([beat(second, 0, 0), beat(second, 0, 0)], now=float(second)) is None
    for second in range(20, 40):
        assert judge.verdict([beat(second, 5, 1, paused=True), beat(second, 5, 1)], now=float(second)) is None
    for second in range(40, 60):  # a rank writing a checkpoint may fall silent for a while
        assert judge.verdict([beat(second, 5, 1), beat(40, 5, 1, paused=True)], now=float(second)) is None


def test_the_default_timeout_grows_with_the_slowest_step():
    judge = Judge(rank=1, timeout=None, name=name)  # rank 0 stops beating after a 20 s step
    slow = [beat(1, 1, 1, slowest=20.0, started=True), beat(1, 1, 1, started=True)]
    judge.verdict(slow, now=0.0)
    for second in range(1, 201):  # the judge looks every second, as it does
        assert judge.verdict([slow[0], beat(1 + second, 1, 1, started=True)], now=float(second)) is None
    found = judge.verdict([slow[0], beat(202, 1, 1, started=True)], now=201.0)
    assert found is not None and found[0].startswith("rank 0 (stage 0) stopped responding: no heartbeat for 200 s")


def test_a_job_suspended_whole_and_continued_goes_on_and_a_rank_stopped_after_is_still_named():
    # `scontrol suspend`, or SIGSTOP to every process: the first judge to wake saw the others' beats unchanged
    # for the 90 s it was stopped too, and ended the job at once.
    judge = Judge(rank=0, timeout=60.0, name=name)
    for second in range(5):
        assert judge.verdict([beat(second, 1, 1, started=True), beat(second, 1, 1, started=True)], float(second)) \
            is None
    assert judge.verdict([beat(5, 1, 1, started=True), beat(4, 1, 1, started=True)], now=95.0) is None
    for second in range(96, 157):  # then rank 1 stops for good: named once the limit has passed since the resume
        found = judge.verdict([beat(second, 1, 1, started=True), beat(4, 1, 1, started=True)], float(second))
        assert found is None or second > 155, second
    assert found is not None and found[1] == [1]


def test_a_hang_in_the_first_step_is_caught_with_a_fixed_timeout_only():
    fixed, default = Judge(rank=0, timeout=5.0, name=name), Judge(rank=0, timeout=None, name=name)
    found = None
    for second in range(8):  # every rank started training, none finished a step or a transfer
        beats = [beat(second, 2, 0, started=True), beat(second, 1, 0, started=True)]
        found = fixed.verdict(beats, now=float(second))
        assert default.verdict(beats, now=float(second)) is None, "the default waits for a step's duration"
    assert found is not None and found[1] == [0, 1] and "stuck in step 1" in found[0]
    assert Beat.decode(beat(3, 7, 0, started=True).encode()).started


def test_a_stuck_rank_is_named_with_what_it_waits_for():
    judge = Judge(rank=0, timeout=5.0, name=name)
    waiting = "receiving gradients of micro-batch 3 from rank 1"
    for second in range(7):
        beats = [Beat(second, 4, 2, 0.1, False, 100, "host", True, waiting), beat(second, 4, 2, started=True)]
        found = judge.verdict(beats, now=float(second))
    assert found is not None and found[1] == [0, 1]
    assert f"rank 0 (stage 0) ({waiting}), rank 1 (stage 1) stuck in step 3" in found[0]
    assert Beat.decode(beats[0].encode()) == beats[0]


class FakeEvent:
    def __init__(self) -> None:
        self.passed = False

    def query(self) -> bool:
        return self.passed


def test_progress_counts_device_waits_only_once_the_device_passed_them():
    waits = Waits()
    first, second = FakeEvent(), FakeEvent()
    waits.device(first, "receiving activations of micro-batch 0 from rank 0")
    waits.device(second, "receiving activations of micro-batch 1 from rank 0")
    assert waits.poll() == (0, "receiving activations of micro-batch 0 from rank 0")
    first.passed = True
    assert waits.poll() == (1, "receiving activations of micro-batch 1 from rank 0")
    with waits.host("sending gradients of micro-batch 0 to rank 0"):
        assert waits.poll() == (1, "sending gradients of micro-batch 0 to rank 0")
    second.passed = True
    assert waits.poll() == (3, None)


def test_the_least_stall_timeout_a_recipe_takes_spans_many_beats():
    # At 1 s, below two beats, a healthy run was ended as frozen before its final checkpoint.
    from gpipe_cli.limits import LEAST_STALL_S

    assert LEAST_STALL_S >= 5 * INTERVAL_S


def test_a_stall_timeout_set_longer_than_the_transports_is_not_cut_short_by_it(monkeypatch):
    # --set train.stall_timeout=900 and a 640 s step: the transfer waiting on it gave up at 600 s all the same.
    from gpipe_cli.pipeline import topology
    from gpipe_cli.recipe.load import load_recipe
    from gpipe_cli.train import worker

    assert topology.transport_timeout(None) == topology.transport_timeout(60.0) == 600.0
    assert topology.transport_timeout(900.0) == 1800.0
    seen = {}

    def init(*args, **kwargs):
        seen.update(kwargs)
        raise KeyboardInterrupt  # as far as this test goes

    monkeypatch.setattr(topology, "init", init)
    recipe = load_recipe(None, ["train.stall_timeout=900"]).model_dump(mode="json")
    with pytest.raises(KeyboardInterrupt):
        worker._run(worker.Job(recipe))
    assert seen["timeout"] == 1800.0


def test_a_stall_names_the_step_the_hosts_work_on_not_the_one_before():
    # Rank 0 read step 60's data slowly while rank 1 waited for its activations: "stuck in step 59", the last
    # step each had finished being 58 (a step finishes once its figures are read, after the next launch).
    judge = Judge(rank=0, timeout=5.0, name=name)
    waiting = "receiving activations of micro-batch 1 from rank 0"
    for second in range(7):
        beats = [Beat(second, 58, 58, 0.1, False, 100, "host", True, None, 60),
                 Beat(second, 58, 58, 0.1, False, 101, "host", True, waiting, 60)]
        found = judge.verdict(beats, now=float(second))
    assert found is not None and "stuck in step 60" in found[0]
    assert Beat.decode(beats[1].encode()) == beats[1]


def test_an_evaluation_counts_as_progress_and_a_stall_in_it_is_named_so(monkeypatch):
    # With one stage and two replicas an evaluation has no transfer: a long one was ended as "stuck in step 3" of
    # a two-step run.
    from gpipe_cli.pipeline import heartbeat
    monkeypatch.setattr(heartbeat, "_evaluated", 0)
    before = heartbeat.progress(transfers=5)
    heartbeat.evaluated()
    assert heartbeat.progress(transfers=5) == before + 1
    judge = Judge(rank=0, timeout=5.0, name=name)
    for second in range(7):
        beats = [Beat(second, 2, 2, 0.1, False, 100 + r, "host", True, None, -2) for r in range(2)]
        found = judge.verdict(beats, now=float(second))
    assert found is not None and "rank 1 (stage 1) stuck in the evaluation after step 2 (" in found[0]
    assert "no step, transfer or held-out batch finished" in found[0]
