"""Greedy translation through the pipeline, and BLEU on the held-out split.

Rank 0 holds the sources and the growing target prefix; each decoding step is one evaluation pass
through every stage, whose logits come back to rank 0. Rank 0 tells every rank after each step whether
another is needed. With data parallelism, replica 0 decodes the whole split and the others pass empty
batches, so every rank takes part in the same collective calls.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gpipe_cli.data import BOS, Batch, Loader, corpus_bleu
from gpipe_cli.models.transformer.decode import greedy_step, translation_limit
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.topology import Topology


def greedy_decode(pipe: Pipeline, topo: Topology, source: torch.Tensor | None, microbatches: int,
                  max_len: int, vocab: int | None = None) -> list[list[int]]:
    """Translate `source` greedily; rank 0 gets the token ids.

    First stages give their source (replicas other than 0 an empty one); other stages give None.
    `vocab` limits the choice to the tokenizer's pieces (the model's vocabulary may be larger).
    """
    prefix = torch.full((source.shape[0], 1), BOS, dtype=torch.long) if source is not None else None
    finished = torch.zeros(prefix.shape[0] if prefix is not None else 0, dtype=torch.bool)
    while True:
        inputs = (source, prefix) if source is not None else None
        result = pipe.evaluate(inputs, None, microbatches=microbatches, return_outputs=True)
        more = False
        if topo.layout.rank == 0 and prefix is not None and result.outputs is not None:
            logits = result.outputs[0] if isinstance(result.outputs, tuple) else result.outputs
            prefix, finished = greedy_step(logits, prefix, finished, vocab)
            more = bool((~finished).any()) and prefix.shape[1] <= max_len
        if not topo.share(more):  # rank 0's decision, on every rank
            break
    return [row[1:].tolist() for row in prefix] if topo.layout.rank == 0 and prefix is not None else []


def bleu(pipe: Pipeline, topo: Topology, data: Loader | None, batches: int, microbatches: int,
         max_len: int) -> float | None:
    """Corpus BLEU of greedy translations of the held-out split (rank 0 returns it; others None)."""
    layout = topo.layout
    first_of_replica_0 = layout.is_first and layout.replica == 0
    items: Iterator[Batch | None] = iter([None] * batches)
    if layout.is_first and data is not None:
        # Replica 0 decodes everything; other replicas' first stages pass empty batches alongside.
        items = data.eval_batches(shard=(0, 1), limit=batches, need_inputs=True, need_targets=False)
    hypotheses: list[str] = []
    references: list[str] = []
    for batch in items:
        source = batch.inputs[0] if batch is not None and layout.is_first else None
        if source is not None and not first_of_replica_0:
            source = source[:0]
        limit = translation_limit(source.shape[1], max_len) if source is not None else max_len - 1
        vocab = data.tokenizer.vocab_size if data is not None and data.tokenizer is not None else None
        ids = greedy_decode(pipe, topo, source, microbatches, limit, vocab)
        if layout.rank == 0 and batch is not None and data is not None and data.tokenizer is not None:
            hypotheses += [data.tokenizer.decode(row) for row in ids]
            references += batch.references or []
    if layout.rank != 0:
        return None
    return corpus_bleu(hypotheses, references) if hypotheses else 0.0
