"""What evaluation measures: image accuracy; token accuracy and perplexity for text; BLEU of greedy translations."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from gpipe_cli.data import BOS, Batch, Loader, corpus_bleu
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.models.losses import PAD_ID
from gpipe_cli.models.transformer.decode import encodings_reused, greedy_step, translation_limit
from gpipe_cli.pipeline import heartbeat
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.topology import Topology
from gpipe_cli.records import EvalFigures


def _logits(output: Any) -> torch.Tensor:
    # A classifier with an auxiliary head returns (logits, aux_logits); the first is the prediction.
    return output[0] if isinstance(output, tuple) else output


def correct_examples(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Examples whose top prediction is the label."""
    return (_logits(output).argmax(-1) == targets).sum()


def correct_tokens(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Non-padding target tokens predicted exactly."""
    keep = targets != PAD_ID
    return ((_logits(output).argmax(-1) == targets) & keep).sum()


def token_nll(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of the non-padding target tokens, without label smoothing (nats)."""
    logits = _logits(output)
    # The training loss may be label-smoothed; perplexity is defined on the plain likelihood.
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           ignore_index=PAD_ID, reduction="sum")


def metrics_for(spec: ModelSpec) -> dict[str, Callable[[Any, torch.Tensor], torch.Tensor | float]]:
    """The summed metrics the engine computes on the last stage for this model."""
    if spec.task == "image":
        return {"correct": correct_examples}
    return {"correct": correct_tokens, "nll": token_nll}


def summarise(sums: dict[str, float], units: float, baselines: Mapping[str, float] | None = None) -> EvalFigures:
    """Turn metric sums into the figures reported: accuracy, and for text the held-out perplexity (and its baseline)."""
    if not units:
        return {}
    out: EvalFigures = {"accuracy": sums["correct"] / units}
    if "nll" in sums:
        mean = sums["nll"] / units
        out["perplexity"] = math.exp(mean) if mean < 700 else math.inf  # exp overflows a float past ~709
    if baselines and "unigram_perplexity" in baselines:
        out["unigram_perplexity"] = baselines["unigram_perplexity"]
    return out


# Each decoding step is one evaluation pass through every stage, its logits back on rank 0, which holds the growing
# prefix and tells every rank whether another step is needed. First stages give their source, the others None; with
# data parallelism replica 0 decodes the whole split and the other replicas an empty one, so every rank makes the
# same collective calls. `vocab`: the tokenizer's pieces, where the model's vocabulary may be larger. `stopped` is
# asked before each step, alike on every rank (a stop waited for the whole batch's translations).
def greedy_decode(pipe: Pipeline, topo: Topology, source: torch.Tensor | None, microbatches: int,
                  max_len: int, vocab: int | None = None,
                  stopped: Callable[[], bool] = lambda: False) -> list[list[int]] | None:
    """Translate `source` greedily; rank 0 gets the token ids (None: a stop ended it first)."""
    prefix = torch.full((source.shape[0], 1), BOS, dtype=torch.long) if source is not None else None
    finished = torch.zeros(prefix.shape[0] if prefix is not None else 0, dtype=torch.bool)
    while True:
        if stopped():
            return None
        inputs = (source, prefix) if source is not None else None
        result = pipe.evaluate(inputs, None, microbatches=microbatches, return_outputs=True)
        heartbeat.evaluated()  # progress: with one stage, no transfer says so
        more = False
        if topo.layout.rank == 0 and prefix is not None and result.outputs is not None:
            prefix, finished = greedy_step(_logits(result.outputs), prefix, finished, vocab)
            more = bool((~finished).any()) and prefix.shape[1] <= max_len
        if not topo.share(more):  # rank 0's decision, on every rank
            break
    return [row[1:].tolist() for row in prefix] if topo.layout.rank == 0 and prefix is not None else []


def bleu(pipe: Pipeline, topo: Topology, data: Loader | None, batches: int, microbatches: int,
         max_len: int, stopped: Callable[[], bool] = lambda: False) -> float | None:
    """Corpus BLEU of greedy translations of the held-out split (rank 0 returns it; others None).

    `stopped` is asked before each decoding step, alike on every rank; once true, decoding ends and the score is
    partial.
    """
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
        with encodings_reused(pipe.module):
            ids = greedy_decode(pipe, topo, source, microbatches, limit, vocab, stopped)
        if ids is None:
            break
        if layout.rank == 0 and batch is not None and data is not None and data.tokenizer is not None:
            hypotheses += [data.tokenizer.decode(row) for row in ids]
            references += batch.references or []
    if layout.rank != 0:
        return None
    return corpus_bleu(hypotheses, references) if hypotheses else 0.0
