"""Determinism, exact resume, data-parallel shards and token-budget batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datagen import data

from gpipe_cli.data import Batch, build_data
from gpipe_cli.data.loader import pack_by_budget, shard_bounds


def _flat(b: Batch) -> list[torch.Tensor]:
    ins = b.inputs if isinstance(b.inputs, tuple) else (b.inputs,)
    return [t for t in (*ins, b.targets) if t is not None]


def _same(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(
        x.index == y.index and x.ids == y.ids
        and all(torch.equal(p, q) for p, q in zip(_flat(x), _flat(y), strict=True))
        for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def images():  # type: ignore[no-untyped-def]
    return build_data(data(synthetic_size=40, batch_size=8), "image", seed=3, image_size=32, num_classes=4)


@pytest.fixture(scope="module")
def translation():  # type: ignore[no-untyped-def]
    return build_data(data(synthetic_size=120, batch_size=8), "translation", seed=3, vocab_size=400,
                      max_len=64)


def test_same_seed_same_batches_and_augmentations(images) -> None:  # type: ignore[no-untyped-def]
    again = build_data(data(synthetic_size=40, batch_size=8), "image", seed=3, image_size=32, num_classes=4)
    assert _same(list(images.train_batches(epoch=1)), list(again.train_batches(epoch=1)))
    # The global torch RNG does not leak in: touching it changes nothing.
    torch.manual_seed(1234)
    torch.rand(10)
    assert _same(list(images.train_batches(epoch=1)), list(again.train_batches(epoch=1)))


def test_epochs_and_seeds_differ(images) -> None:  # type: ignore[no-untyped-def]
    e0, e1 = list(images.train_batches(epoch=0)), list(images.train_batches(epoch=1))
    assert [b.ids for b in e0] != [b.ids for b in e1]
    assert sorted(i for b in e0 for i in b.ids) == list(range(40))  # every example once per epoch
    other = build_data(data(synthetic_size=40, batch_size=8), "image", seed=4, image_size=32, num_classes=4)
    assert [b.ids for b in other.train_batches(epoch=0)] != [b.ids for b in e0]
    # The same example is augmented differently in different epochs.
    img0 = images.train.image(5, 0)
    assert torch.equal(img0, images.train.image(5, 0)) and not torch.equal(img0, images.train.image(5, 1))


@pytest.mark.parametrize("name", ["images", "translation"])
def test_resume_equals_the_tail_of_a_full_epoch(name: str, request: pytest.FixtureRequest) -> None:
    ds = request.getfixturevalue(name)
    full = list(ds.train_batches(epoch=2))
    tail = list(ds.train_batches(epoch=2, start=3))
    assert _same(full[3:], tail) and [b.index for b in tail] == list(range(3, len(full)))
    assert list(ds.train_batches(epoch=2, start=len(full))) == []
    with pytest.raises(ValueError):
        ds.train_batches(epoch=2, start=len(full) + 1)


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("name", ["images", "translation"])
def test_shards_concatenate_to_the_global_batch(name: str, replicas: int,
                                                request: pytest.FixtureRequest) -> None:
    ds = request.getfixturevalue(name)
    whole = list(ds.train_batches(epoch=0))
    parts = [list(ds.train_batches(epoch=0, shard=(r, replicas))) for r in range(replicas)]
    for k, g in enumerate(whole):
        shards = [p[k] for p in parts]
        assert [s.offset for s in shards] == [sum(x.size for x in shards[:r]) for r in range(replicas)]
        assert sum(s.size for s in shards) == g.size == shards[0].global_size
        expect = [list(t) for t in torch.tensor_split(torch.tensor(g.ids), replicas)]
        assert [s.ids for s in shards] == [[int(i) for i in e] for e in expect]
        for t_whole, *t_parts in zip(_flat(g), *(_flat(s) for s in shards), strict=True):
            assert torch.equal(torch.cat(t_parts), t_whole)
        if g.tokens is not None:
            assert sum(s.tokens for s in shards) == g.tokens == shards[0].global_tokens


def test_stages_get_only_what_they_need(translation) -> None:  # type: ignore[no-untyped-def]
    mid = next(translation.train_batches(need_inputs=False, need_targets=False))
    last = next(translation.train_batches(need_inputs=False))
    full = next(translation.train_batches())
    assert mid.inputs is None and mid.targets is None and mid.size == full.size and mid.tokens == full.tokens
    assert last.inputs is None and torch.equal(last.targets, full.targets)


def test_drop_last_and_steps_per_epoch() -> None:
    kw = dict(synthetic_size=43, batch_size=8, eval_fraction=0.1)
    keep = build_data(data(**kw, drop_last=False), "image", seed=0, image_size=32, num_classes=3)
    drop = build_data(data(**kw, drop_last=True), "image", seed=0, image_size=32, num_classes=3)
    assert drop.steps_per_epoch() == 5 and keep.steps_per_epoch() == 6
    assert [b.size for b in keep.train_batches()][-1] == 3
    # A last batch smaller than min_batch is folded into the previous one instead of starving micro-batches.
    merged = build_data(data(**kw, drop_last=False), "image", seed=0, image_size=32, num_classes=3,
                        min_batch=4)
    assert [b.global_size for b in merged.train_batches(need_inputs=False)] == [8, 8, 8, 8, 11]
    assert merged.joined == 3 and keep.joined == drop.joined == 0  # said in the data line: it depends on M x D
    assert sum(b.size for b in keep.eval_batches()) == keep.eval_size == 4


def test_unshuffled_order_is_sequential() -> None:
    ds = build_data(data(synthetic_size=16, batch_size=4, shuffle=False), "image", seed=0, image_size=32,
                    num_classes=3)
    assert [b.ids for b in ds.train_batches(epoch=5, need_inputs=False)] == [list(range(i, i + 4))
                                                                              for i in range(0, 16, 4)]


def test_token_budget_batches() -> None:
    budget = 200
    ds = build_data(data(synthetic_size=300, tokens_per_batch=budget), "translation", seed=0, vocab_size=400,
                    max_len=64)
    steps = ds.steps_per_epoch()
    lengths = ds.train.lengths
    for epoch in (0, 1):
        batches = list(ds.train_batches(epoch=epoch))
        assert len(batches) == steps
        # Nothing is dropped in budget mode (the last run holds the longest examples).
        assert sorted(i for b in batches for i in b.ids) == list(range(ds.train_size))
        sizes = {b.size for b in batches}
        assert len(sizes) > 1  # length-bucketed: short sentences make bigger batches
        for b in batches:
            src, tgt_in = b.inputs
            assert b.size * max(src.shape[1], tgt_in.shape[1]) <= budget
            assert max(src.shape[1], tgt_in.shape[1]) == int(lengths[b.ids].max())
    shapes = {tuple(b.targets.shape) for b in ds.train_batches()}
    assert len({s[1] for s in shapes}) > 1  # padded per batch, not to a global length
    assert [b.ids for b in ds.train_batches(epoch=0)] != [b.ids for b in ds.train_batches(epoch=1)]
    assert sum(b.size for b in ds.eval_batches()) == ds.eval_size
    # The batches come in a new order each epoch, not shortest first: a model shown the lengths ascending
    # would see every epoch end on its longest sentences.
    longest = [[int(lengths[b.ids].max()) for b in ds.train_batches(epoch=e, need_inputs=False)] for e in (0, 1)]
    assert longest[0] != sorted(longest[0]) and longest[0] != longest[1]
    assert sorted(longest[0]) == sorted(longest[1])


def test_the_heaviest_batch_is_a_real_step_s_shard_under_a_token_budget() -> None:
    budget = 200
    ds = build_data(data(synthetic_size=300, batch_size=64, tokens_per_batch=budget), "translation", seed=0,
                    vocab_size=400, max_len=64, min_batch=2)
    steps = list(ds.train_batches(epoch=0))
    padded = [b.size * int(ds.train.lengths[b.ids].max()) for b in steps]
    heaviest = steps[padded.index(max(padded))]
    for replica in range(2):
        got = ds.heaviest_batch(shard=(replica, 2))
        real = list(ds.train_batches(epoch=0, shard=(replica, 2)))[heaviest.index]
        assert got.ids == real.ids and got.offset == real.offset
        assert [t.shape for t in _flat(got)] == [t.shape for t in _flat(real)]
    whole = ds.heaviest_batch()
    assert whole.size * max(t.shape[1] for t in whole.inputs) <= budget < 64 * 64  # not batch_size x max_len


def test_pack_by_budget_and_shard_bounds() -> None:
    bounds = pack_by_budget(np.array([1, 2, 2, 3, 5, 9]), budget=6, min_batch=1)
    assert bounds == [(0, 3), (3, 4), (4, 5), (5, 6)]
    assert pack_by_budget(np.array([9, 9]), budget=6, min_batch=2) == [(0, 2)]
    for n in range(0, 9):
        for r in range(1, 5):
            cuts = [shard_bounds(n, i, r) for i in range(r)]
            assert [hi - lo for lo, hi in cuts] == [len(t) for t in torch.tensor_split(torch.arange(n), r)]
    with pytest.raises(ValueError):
        shard_bounds(4, 2, 2)


def test_eval_batches_limit_and_shards(translation) -> None:  # type: ignore[no-untyped-def]
    all_eval = list(translation.eval_batches())
    assert len(list(translation.eval_batches(limit=1))) == 1 == translation.eval_steps(limit=1)
    parts = [list(translation.eval_batches(shard=(r, 2))) for r in range(2)]
    assert [a.ids + b.ids for a, b in zip(*parts, strict=True)] == [b.ids for b in all_eval]
    refs = [r for b in all_eval for r in b.references]
    assert len(refs) == translation.eval_size


def test_a_limit_on_eval_batches_scores_batches_spread_over_the_held_out_lengths() -> None:
    # Under a token budget the held-out examples are sorted by length: the first two batches held only the
    # shortest (one-word sentences), so BLEU and perplexity spoke of them alone.
    ds = build_data(data(synthetic_size=2000, tokens_per_batch=200), "translation", seed=0, vocab_size=400,
                    max_len=64)
    every = list(ds.eval_batches())
    picked = list(ds.eval_batches(limit=2))
    assert len(every) >= 4 and len(picked) == 2 == ds.eval_steps(limit=2)
    assert picked[0].ids == every[0].ids and picked[-1].ids == every[len(every) // 2].ids
    lengths = ds.eval.lengths
    longest = [int(lengths[b.ids].max()) for b in picked]
    assert longest == sorted(longest) and longest[-1] > longest[0]


@pytest.mark.parametrize("budget", [None, 200])
def test_the_held_out_batches_do_not_depend_on_micro_batches_or_replicas(budget: int | None) -> None:
    # The same parameters are scored on the same examples at any M x D, also when `eval.batches` picks a subset.
    def plan(min_batch: int) -> list[list[int]]:
        ds = build_data(data(synthetic_size=2000, batch_size=7, tokens_per_batch=budget), "translation", seed=0,
                        vocab_size=400, max_len=64, min_batch=min_batch)
        return [b.ids for b in ds.eval_batches(limit=3)]
    assert plan(1) == plan(6) == plan(16)


def test_a_resume_can_tell_whether_earlier_versions_scored_other_held_out_examples() -> None:
    from gpipe_cli.train.resume import eval_cut_changed

    def loader(min_batch: int):  # 200 held out in batches of 7: the last, of 4, joined the one before at M x D = 6
        return build_data(data(synthetic_size=2000, batch_size=7), "translation", seed=0, vocab_size=400,
                          max_len=64, min_batch=min_batch)
    assert loader(6).earlier_eval_differs(limit=3) and not loader(6).earlier_eval_differs(limit=None)
    assert not loader(1).earlier_eval_differs(limit=3)  # nothing was joined at M x D = 1
    assert not loader(6).earlier_eval_differs(limit=1000)  # every batch is scored either way
    assert eval_cut_changed(None) and eval_cut_changed({"held_out": 3})
    assert not eval_cut_changed({"held_out": 3, "held_out_batches": "any size"})


def test_the_unigram_baseline_is_over_the_held_out_batches_scored(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gpipe_cli.data.text import unigram_perplexity

    ds = build_data(data(source="pydoc", seq_len=32, vocab_size=300, eval_fraction=0.1, batch_size=8), "lm",
                    seed=0, vocab_size=300, max_len=32, run_dir=tmp_path / "run")
    subset = np.concatenate(ds.eval_subset(2))
    assert ds.eval_baselines(2)["unigram_perplexity"] == unigram_perplexity(ds.train, ds.eval, 300, subset)
    assert ds.eval_baselines(2) != ds.eval_baselines()
    assert ds.eval_baselines(10**6) == ds.eval_baselines() == {
        "unigram_perplexity": unigram_perplexity(ds.train, ds.eval, 300)}


def test_worker_processes_give_the_same_batches() -> None:
    kw = dict(synthetic_size=24, batch_size=8)
    inline = build_data(data(**kw), "image", seed=0, image_size=32, num_classes=3)
    workers = build_data(data(**kw), "image", seed=0, image_size=32, num_classes=3, workers=2)
    assert _same(list(inline.train_batches(epoch=1, start=1)), list(workers.train_batches(epoch=1, start=1)))


def test_a_short_last_language_window_is_padded_to_its_whole_batch_on_every_shard() -> None:
    # Each shard is cut from the batch one replica would see, as for every task: the same width on each.
    from gpipe_cli.data.loader import Loader
    from gpipe_cli.data.text import LMExamples

    examples = LMExamples(np.arange(2 * 8 + 5, dtype=np.int64), seq_len=8)  # windows of 8, 8 and 4
    loader = Loader(train=examples, eval=None, tokenizer=None, batch_size=3, tokens_per_batch=None,
                    drop_last=False, shuffle=False, seed=0)
    whole = next(loader.train_batches(epoch=0))
    shards = [next(loader.train_batches(epoch=0, shard=(r, 2))) for r in range(2)]
    assert shards[1].ids == [2] and [s.inputs.shape[1] for s in shards] == [8, 8]
    assert torch.equal(torch.cat([s.targets for s in shards]), whole.targets)
