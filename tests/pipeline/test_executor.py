"""The executor's bookkeeping of one stage's messages."""

import itertools

from gpipe_cli.pipeline.executor import Channels, Executor


def test_every_chunk_and_micro_batch_has_its_own_message_number():
    # The number is what a receiver checks a message against (and keys what a stage holds for later): two
    # (chunk, micro-batch) pairs sharing one would let a stage take another chunk's activations unnoticed.
    for chunk_count, microbatches in ((4, 2), (8, 3), (6, 12)):
        run = Executor({}, Channels(None, None, None, None), chunk_count, microbatches, True)
        keys = [run.key(c, mb) for c, mb in itertools.product(range(chunk_count), range(microbatches))]
        assert len(set(keys)) == len(keys), (chunk_count, microbatches)
