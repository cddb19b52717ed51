"""Evaluation figures: perplexity is the plain (unsmoothed) likelihood per target token, padding excluded."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gpipe_cli.models.losses import token_cross_entropy
from gpipe_cli.train import evaluation


def test_perplexity_is_exp_of_the_unsmoothed_mean_token_cross_entropy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(1, 11, (3, 5))
    targets[0, 3:] = 0  # padding, not scored
    targets[2, 1:] = 0
    kept = targets != 0
    expected = F.cross_entropy(logits[kept], targets[kept])
    smoothed = token_cross_entropy(logits, targets, label_smoothing=0.1)
    assert not torch.isclose(smoothed, expected)  # so the check below can tell them apart

    # Two micro-batches summed as the engine sums them.
    sums = {k: 0.0 for k in ("correct", "nll")}
    for part in (slice(0, 1), slice(1, 3)):
        for key, metric in evaluation.metrics_for(_lm_spec()).items():
            sums[key] += float(metric(logits[part], targets[part]))
    out = evaluation.summarise(sums, float(kept.sum()), {"unigram_perplexity": 42.0})
    assert math.isclose(out["perplexity"], math.exp(float(expected)), rel_tol=1e-5)
    argmax_right = ((logits.argmax(-1) == targets) & kept).sum()
    assert math.isclose(out["accuracy"], float(argmax_right) / float(kept.sum()))
    assert out["unigram_perplexity"] == 42.0


def test_images_report_accuracy_only_and_no_units_report_nothing() -> None:
    spec = _lm_spec()
    spec.task = "image"
    assert set(evaluation.metrics_for(spec)) == {"correct"}
    assert evaluation.summarise({"correct": 3.0}, 4.0) == {"accuracy": 0.75}
    assert evaluation.summarise({"correct": 0.0, "nll": 0.0}, 0.0, {"unigram_perplexity": 9.0}) == {}


def _lm_spec():  # type: ignore[no-untyped-def]
    from gpipe_cli.recipe.schema import Recipe, TransformerModel
    from gpipe_cli.recipe_model import model_spec

    model = TransformerModel(arch="decoder-only", layers=1, d_model=8, ff=16, heads=2, vocab_size=11, max_len=8)
    return model_spec(Recipe(model=model))


def test_a_stop_ends_greedy_decoding_before_its_next_step() -> None:
    # A stop waited for every step of the BLEU batch in progress: up to the longest translation's length of passes.
    from gpipe_cli.models.registry import build_model
    from gpipe_cli.pipeline import topology
    from gpipe_cli.pipeline.config import PipelineConfig
    from gpipe_cli.pipeline.engine import Pipeline

    torch.manual_seed(0)
    spec = build_model("transformer", layers=1, d_model=8, ff=16, heads=2, vocab_size=11, max_len=16)
    layers = list(spec.build_all())
    topo = topology.local()
    pipe = Pipeline(layers, topo, PipelineConfig(balance=(len(layers),)), spec.loss, tied=spec.tied)
    source = torch.randint(4, 11, (3, 6))
    whole = evaluation.greedy_decode(pipe, topo, source, 1, 12)
    assert whole is not None and len(whole) == 3
    asked = []

    def stopped() -> bool:
        asked.append(len(asked))
        return len(asked) > 2

    passes = []
    evaluate = pipe.evaluate
    pipe.evaluate = lambda *args, **kwargs: passes.append(1) or evaluate(*args, **kwargs)  # type: ignore[method-assign]
    assert evaluation.greedy_decode(pipe, topo, source, 1, 12, stopped=stopped) is None
    assert len(passes) == 2 and len(asked) == 3


def test_the_eval_loss_is_the_mean_over_every_scored_unit_of_its_batches() -> None:
    # Batches' mean losses weighted by what each scored (images, or tokens): a batch of 10 at 1.0 and one of 30 at
    # 3.0 score 2.5, not their plain mean 2.0.
    from types import SimpleNamespace

    from gpipe_cli.recipe.schema import Recipe
    from gpipe_cli.train.loop import Trainer

    written: list[dict] = []
    results = iter([SimpleNamespace(loss=1.0, units=10.0, metrics={"correct": 4.0}),
                    SimpleNamespace(loss=3.0, units=30.0, metrics={"correct": 6.0})])
    spec = _lm_spec()
    spec.task = "image"
    trainer = SimpleNamespace(
        layout=SimpleNamespace(replica=0, replicas=1, is_first=True, is_last=True, rank=0), eval_steps=2,
        data=SimpleNamespace(eval_batches=lambda **kw: iter([None, None]), eval_baselines=lambda limit: None),
        recipe=Recipe(), spec=spec, pipe=SimpleNamespace(evaluate=lambda *a, **kw: next(results)),
        _stop_agreed=lambda final: False, metrics=SimpleNamespace(write=written.append),
        summary=SimpleNamespace(add=lambda *a: None), view=SimpleNamespace(show=lambda r: None),
        topo=SimpleNamespace(share=lambda x: x), stopped_by=None)
    assert Trainer.evaluate(trainer, 4)  # type: ignore[arg-type]
    assert written == [{"kind": "eval", "step": 4, "loss": 2.5, "accuracy": 0.25}]


def _never_ending(vocab: int = 11):  # type: ignore[no-untyped-def]
    """A stand-in translation model whose most likely next token is always 5 (never eos), and its topology."""
    from types import SimpleNamespace

    def logits(prefix: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(prefix.shape[0], prefix.shape[1], vocab)
        out[..., 5] = 1.0
        return out

    pipe = SimpleNamespace(evaluate=lambda inputs, targets, **kw: SimpleNamespace(outputs=logits(inputs[1])),
                           module=torch.nn.Identity())
    topo = SimpleNamespace(layout=SimpleNamespace(rank=0, is_first=True, replica=0), share=lambda value: value)
    return pipe, topo, logits


def test_the_training_decoder_writes_as_many_tokens_as_predicts():
    # BLEU at each evaluation scores what gpipe predict would answer: the same limit, token for token.
    from gpipe_cli.models.transformer.decode import translate

    pipe, topo, logits = _never_ending()
    source = torch.randint(4, 11, (2, 3))
    decoded = evaluation.greedy_decode(pipe, topo, source, 1, 6)  # type: ignore[arg-type]
    assert decoded == translate(lambda inputs: logits(inputs[1]), source, 6) == [[5] * 6] * 2


def test_bleu_scores_the_batches_the_loss_does_and_replica_0_translates_them_all(monkeypatch):
    # eval.batches held-out batches, not the whole split; with data parallelism the whole of each, not a shard.
    from types import SimpleNamespace

    asked: list[dict] = []

    def eval_batches(**kw):  # type: ignore[no-untyped-def]
        asked.append(kw)
        return iter([SimpleNamespace(inputs=(torch.randint(4, 11, (2, 3)),), references=["a b", "c"])])

    pipe, topo, _ = _never_ending()
    topo.layout.replicas = 2
    tokenizer = SimpleNamespace(vocab_size=11, decode=lambda ids: "a b")
    data = SimpleNamespace(eval_batches=eval_batches, tokenizer=tokenizer)
    monkeypatch.setattr(evaluation, "greedy_decode", lambda *args, **kw: [[5], [5]])
    assert evaluation.bleu(pipe, topo, data, 1, 1, 12) is not None  # type: ignore[arg-type]
    assert [(kw["shard"], kw["limit"]) for kw in asked] == [((0, 1), 1)]


def test_evaluation_runs_the_model_in_eval_mode():
    # Dropout off and batch-norm statistics left alone: the same batch evaluates to the same loss every time, and a
    # training step after it finds the model in training mode again.
    from gpipe_cli.pipeline import topology
    from gpipe_cli.pipeline.config import PipelineConfig
    from gpipe_cli.pipeline.engine import Pipeline
    from gpipe_cli.pipeline.layers import build_layers

    factories = [lambda: torch.nn.Linear(8, 8), lambda: torch.nn.Dropout(0.5), lambda: torch.nn.Linear(8, 2)]
    pipe = Pipeline(build_layers(factories, [0, 1, 2], 0), topology.local(), PipelineConfig(balance=(3,)),
                    torch.nn.MSELoss())
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    losses = {pipe.evaluate(x, y, microbatches=1).loss for _ in range(3)}
    pipe.module.eval()
    with torch.no_grad():
        expected = float(torch.nn.functional.mse_loss(pipe.module(x), y))
    pipe.module.train()
    assert len(losses) == 1 and math.isclose(losses.pop(), expected, rel_tol=1e-6)
    assert pipe.module.training
