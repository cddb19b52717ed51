"""Which torch schedule answers each of ours, and where its chunks go (no processes)."""

import pytest
from torch.distributed.pipelining import schedules

from gpipe_cli.bench.baseline import counterpart
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline import schedules as ours
from gpipe_cli.pipeline.placement import chunks_of
from gpipe_cli.pipeline.schedule import REMAT_MODES, SCHEDULES, Kind


def test_each_schedule_of_ours_has_a_counterpart_or_a_reason():
    for name in SCHEDULES:
        cls_name, cls, missing = counterpart(name)
        assert cls_name == (ours.get(name).torch_counterpart or "")
        assert (cls is None) == bool(missing)


def test_a_class_this_torch_lacks_is_a_reason_not_an_error(monkeypatch):
    monkeypatch.delattr(schedules, "ScheduleInterleavedZeroBubble")
    cls_name, cls, missing = counterpart("zero-bubble")
    assert cls is None and "ScheduleInterleavedZeroBubble" in missing
    assert counterpart("no-such-schedule")[1] is None


@pytest.mark.parametrize("stages,chunks", [(2, 2), (2, 4), (3, 9)])
def test_every_chunk_lives_on_exactly_one_rank_as_ours(stages, chunks):
    held = [c for rank in range(stages) for c in chunks_of(rank, stages, chunks // stages)]
    assert sorted(held) == list(range(chunks))
    assert all(c % stages == rank for rank in range(stages) for c in chunks_of(rank, stages, chunks // stages))


# What the baseline records of torch's work: a forward, a backward (whole or of the input), a weight gradient.
_WORK = {Kind.FWD: Kind.FWD, Kind.BWD: Kind.BWD, Kind.BWD_INPUT: Kind.BWD, Kind.BWD_WEIGHT: Kind.BWD_WEIGHT}


@pytest.mark.parametrize("name,virtual", [(name, 2 if ours.get(name).chunked else 1) for name in SCHEDULES])
@pytest.mark.parametrize("mode", REMAT_MODES)
def test_the_mode_on_our_own_order_picks_what_our_action_lists_mark(name, virtual, mode):
    """Torch's side applies the rule of our lists to its order; on our order it must give our choice."""
    for stage in range(2):
        actions = sched.build(name, stage, 2, 4, mode, virtual)
        order = [(_WORK[a.kind], a.microbatch, a.chunk) for a in actions if a.kind in _WORK]
        assert sched.remat_pairs(mode, order) == sched.rematerialised(actions)
