import pytest

from gpipe_cli.bench.options import FLAGS, BenchOptions, parse_balance, validate
from gpipe_cli.bench.plan import oversubscription
from gpipe_cli.errors import UserError


def test_every_field_has_help_for_the_cli():
    assert set(FLAGS) == set(BenchOptions.__dataclass_fields__)


def test_default_batch_gives_four_examples_per_microbatch():
    assert BenchOptions(microbatches=8).batch == 32
    assert BenchOptions(microbatches=8, sweep=True).batch == 128


@pytest.mark.parametrize("options,message", [
    (BenchOptions(batch_size=4, microbatches=8), "smaller than M=8"),
    (BenchOptions(batch_size=10, microbatches=4, compare=True), "divisible"),
    (BenchOptions(schedule="zigzag"), "--schedule"),
    (BenchOptions(checkpoint="sometimes"), "--checkpoint"),
    (BenchOptions(devices=4), "--devices needs --simulate"),
    (BenchOptions(sweep=True, compare=True), "cannot be combined"),
    (BenchOptions(steps=0), "--steps"),
    (BenchOptions(schedule="1f1b", virtual_stages=2), "needs schedule 'interleaved'"),
    (BenchOptions(schedule="interleaved", virtual_stages=2, microbatches=3, batch_size=12), "multiple of partitions"),
    (BenchOptions(schedule="interleaved", virtual_stages=2, sweep=True), "cannot be combined"),
    # One rank per stage on this machine: a typo of many digits is refused at once (it tried to size a
    # model that deep, for ever).
    (BenchOptions(partitions=10**20, microbatches=1, batch_size=1), "a bench starts one rank per stage"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(UserError, match=message):
        validate(options)


def test_balance_parsing():
    assert parse_balance("3,5", 2) == [3, 5]
    assert parse_balance(None, 2) is None
    with pytest.raises(UserError, match="has 2 entries but the pipeline has 3"):
        parse_balance("3,5", 3)
    with pytest.raises(UserError, match="commas"):
        parse_balance("3;5", 2)


def test_more_ranks_than_cores_is_oversubscribed():
    import os

    cores = len(os.sched_getaffinity(0))
    assert oversubscription(cores + 1, 1)[0]
    assert not oversubscription(1, 1)[0]
