"""Which torch schedule answers each of ours, and where its chunks go (no processes)."""

import pytest
from torch.distributed.pipelining import schedules

from gpipe_cli.bench.baseline import COUNTERPARTS, checkpointed, chunks_of, counterpart
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline.schedule import REMAT_MODES, SCHEDULES, Kind


def test_each_schedule_of_ours_has_a_counterpart_or_a_reason():
    for name in SCHEDULES:
        cls_name, cls, missing = counterpart(name)
        assert cls_name == COUNTERPARTS.get(name, ("",))[0]
        assert (cls is None) == bool(missing)
    assert {"gpipe", "1f1b", "interleaved", "zero-bubble"} <= set(COUNTERPARTS)


def test_a_class_this_torch_lacks_is_a_reason_not_an_error(monkeypatch):
    monkeypatch.delattr(schedules, "ScheduleInterleavedZeroBubble")
    cls_name, cls, missing = counterpart("zero-bubble")
    assert cls is None and "ScheduleInterleavedZeroBubble" in missing
    assert counterpart("no-such-schedule")[1] is None


@pytest.mark.parametrize("stages,chunks,style", [(2, 2, "loop"), (2, 4, "loop"), (3, 9, "loop"), (2, 4, "v"),
                                                 (4, 8, "v")])
def test_every_chunk_lives_on_exactly_one_rank(stages, chunks, style):
    held = [c for rank in range(stages) for c in chunks_of(rank, stages, chunks, style)]
    assert sorted(held) == list(range(chunks))
    if style == "loop":  # as our engine places them
        assert all(c % stages == rank for rank in range(stages) for c in chunks_of(rank, stages, chunks, style))
    else:  # a V: the first and the last chunk share rank 0
        assert {0, chunks - 1} == set(chunks_of(0, stages, chunks, style))


_WORK = {Kind.FWD: "F", Kind.BWD: "B", Kind.BWD_INPUT: "B", Kind.BWD_WEIGHT: "W"}


@pytest.mark.parametrize("name,virtual", [(name, 2 if name == "interleaved" else 1) for name in SCHEDULES])
@pytest.mark.parametrize("mode", REMAT_MODES)
def test_the_mode_on_our_own_order_picks_what_our_action_lists_mark(name, virtual, mode):
    """Torch's side applies the rule of our lists to its order; on our order it must give our choice."""
    for stage in range(2):
        actions = sched.build(name, stage, 2, 4, mode, virtual)
        order = [(_WORK[a.kind], a.microbatch, a.chunk) for a in actions if a.kind in _WORK]
        assert checkpointed(mode, order) == sched.rematerialised(actions)
