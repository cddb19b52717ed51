"""Batching, sharding and epoch positions."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from gpipe_cli.data.rng import rng
from gpipe_cli.data.tokenizer import Tokenizer

Baseline = Callable[[np.ndarray | None], float]  # a figure over the held-out examples of these ids (None: all)


@dataclass
class Batch:
    """One data-parallel shard of a global mini-batch."""

    index: int  # position in the epoch (or in the eval pass)
    size: int  # examples in this shard
    offset: int  # global index of this shard's first example within the global mini-batch
    global_size: int  # examples in the whole global mini-batch
    inputs: Any = None  # tensor or tuple of tensors; None when not requested
    targets: torch.Tensor | None = None
    tokens: int | None = None  # non-pad target tokens in this shard (text), else None
    global_tokens: int | None = None  # the same over the whole global mini-batch
    ids: list[int] = field(default_factory=list)  # example indices within the split
    references: list[str] | None = None  # raw target sentences (translation eval batches)
    epoch: int | None = None  # None for eval batches


class Examples(ABC):
    """One split's examples: counts and lengths up front, tensors only when asked for."""

    lengths: np.ndarray | None = None  # padded cost of each example in tokens (text only)
    left_out: str | None = None  # what reading the split passed over, in words for the run's data line
    held_none: str | None = None  # why data.eval_fraction held none of the split out, where it could not
    origin: str | None = None  # where a held-out split comes from, in words for the run's data line
    by_content = False  # a held-out split chosen by each example's text or file path (not given as a split)

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def collate(self, ids: np.ndarray, group: np.ndarray, *, epoch: int | None, need_inputs: bool,
                need_targets: bool) -> tuple[Any, torch.Tensor | None]:
        """(inputs, targets) of `ids`, padded to the longest of `group`; epoch None: no augmentation."""

    def target_tokens(self, ids: np.ndarray) -> int | None:
        """Non-pad target tokens of `ids` (None for images)."""
        return None

    def references(self, ids: np.ndarray) -> list[str] | None:
        """Raw target strings of `ids` where the task has them."""
        return None


def shard_bounds(n: int, replica: int, replicas: int) -> tuple[int, int]:
    """[lo, hi) of shard `replica` of n items, as torch.tensor_split cuts them."""
    if replicas < 1 or not 0 <= replica < replicas:
        raise ValueError(f"shard ({replica}, {replicas}) is not a valid (replica, replicas) pair")
    q, r = divmod(n, replicas)
    lo = replica * q + min(replica, r)
    return lo, lo + q + (1 if replica < r else 0)


T = TypeVar("T")


def _spread(plan: list[T], limit: int | None) -> list[T]:
    """`limit` of the batches, spread evenly over them (all when `limit` is None or not below their number)."""
    if limit is None or limit >= len(plan):
        return plan
    # The first `limit` alone were the shortest examples under a token budget, which sorts them by length.
    return [plan[i * len(plan) // limit] for i in range(limit)]


def pack_by_budget(sorted_lengths: np.ndarray, budget: int, min_batch: int) -> list[tuple[int, int]]:
    """Greedy [lo, hi) runs of ascending lengths whose padded size (count x longest) fits `budget`."""
    # A run closes only once it holds `min_batch` examples, so one over-long example still forms a batch.
    bounds: list[tuple[int, int]] = []
    lo = 0
    for i, length in enumerate(sorted_lengths.tolist()):
        n = i - lo
        if n >= min_batch and (n + 1) * max(int(length), 1) > budget:
            bounds.append((lo, i))
            lo = i
    if lo < len(sorted_lengths):
        bounds.append((lo, len(sorted_lengths)))
    return bounds


@dataclass(kw_only=True)
class Loader:
    """Train/eval mini-batches of one task, identical on every rank for a given seed."""

    train: Examples
    eval: Examples | None
    tokenizer: Tokenizer | None
    batch_size: int
    tokens_per_batch: int | None
    drop_last: bool
    shuffle: bool
    seed: int
    min_batch: int = 1
    workers: int = 0
    # Figures a trained model should beat on the held-out examples it is scored on (text: unigram).
    baselines: dict[str, Baseline] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.min_batch = max(1, self.min_batch)
        if self.tokens_per_batch is not None and self.train.lengths is None:
            raise ValueError("tokens_per_batch needs examples with lengths (text)")
        self._bounds = self._batch_bounds(self.train, self.drop_last, self.min_batch)  # the same for every epoch
        self._cache: tuple[int, list[np.ndarray]] | None = None
        self._eval_plan: list[np.ndarray] | None = None
        self._baselines: dict[int | None, dict[str, float]] = {}  # by limit: the same batches at every evaluation

    def _batch_bounds(self, examples: Examples, drop_last: bool, min_batch: int) -> list[tuple[int, int]]:
        """[lo, hi) of each mini-batch over the examples in order (by a token budget: sorted by length)."""
        n = len(examples)
        if self.tokens_per_batch is None or examples.lengths is None:
            bounds = [(lo, min(lo + self.batch_size, n)) for lo in range(0, n, self.batch_size)]
            if bounds and drop_last and bounds[-1][1] - bounds[-1][0] < self.batch_size:
                bounds.pop()
        else:
            # drop_last does not apply: budget batches vary in size by design, and the last run always holds
            # the longest examples, so dropping it would never train on them.
            bounds = pack_by_budget(np.sort(examples.lengths, kind="stable"), self.tokens_per_batch, min_batch)
        # A last run shorter than min_batch joins the one before it, so that no shard's micro-batch is empty.
        if len(bounds) >= 2 and bounds[-1][1] - bounds[-1][0] < min_batch:
            bounds = bounds[:-2] + [(bounds[-2][0], bounds[-1][1])]
        return bounds

    @property
    def joined(self) -> int:
        """The examples of a short last batch that joined the one before (which depends on M x D): 0 if none."""
        if self.tokens_per_batch is not None or len(self._bounds) < 2:
            return 0  # budget batches are joined by design (documented), not by M x D alone
        lo, hi = self._bounds[-1]
        return hi - lo - self.batch_size if hi - lo > self.batch_size else 0

    def steps_per_epoch(self) -> int:
        """Number of training mini-batches per epoch (the same for every epoch)."""
        return len(self._bounds)

    def plan(self, epoch: int) -> list[np.ndarray]:
        """Example ids of each global training mini-batch of `epoch`, in order."""
        # From (seed, epoch) alone: ranks agree without communicating, and `start=i` resumes an epoch exactly.
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        n = len(self.train)
        r = rng(self.seed, "epoch-order", epoch)
        order = r.permutation(n) if self.shuffle else np.arange(n)
        if self.tokens_per_batch is not None:
            assert self.train.lengths is not None
            # Sort by length; the shuffled order breaks ties, so equal-length examples mix between epochs
            # while the boundaries (which depend only on the sorted lengths) stay fixed.
            order = order[np.argsort(self.train.lengths[order], kind="stable")]
        batches = [order[lo:hi] for lo, hi in self._bounds]
        if self.tokens_per_batch is not None and self.shuffle:
            batches = [batches[i] for i in r.permutation(len(batches))]
        self._cache = (epoch, batches)
        return batches

    def eval_plan(self) -> list[np.ndarray]:
        """Example ids of each eval mini-batch: fixed order, nothing dropped."""
        if self._eval_plan is None and self.eval is not None:
            order = np.arange(len(self.eval))
            if self.tokens_per_batch is not None and self.eval.lengths is not None:
                order = np.argsort(self.eval.lengths, kind="stable")
            # Not by M x D (min_batch): an evaluation takes batches of any size, and the same parameters must be
            # scored on the same examples whatever the pipeline, also when `eval.batches` picks a subset.
            bounds = self._batch_bounds(self.eval, drop_last=False, min_batch=1)
            self._eval_plan = [order[lo:hi] for lo, hi in bounds]
        return self._eval_plan or []

    def eval_subset(self, limit: int | None = None) -> list[np.ndarray]:
        """The eval mini-batches scored under a limit of `limit`: spread evenly over the held-out split."""
        return _spread(self.eval_plan(), limit)

    def earlier_eval_differs(self, limit: int | None) -> bool:
        """Whether earlier versions, which joined held-out batches up to `min_batch`, scored others under `limit`."""
        if self.eval is None or limit is None:
            return False
        scored = [{i for lo, hi in _spread(self._batch_bounds(self.eval, False, least), limit) for i in range(lo, hi)}
                  for least in (self.min_batch, 1)]
        return scored[0] != scored[1]

    def eval_steps(self, limit: int | None = None) -> int:
        """Number of eval mini-batches (at most `limit`)."""
        return len(self.eval_subset(limit))

    def eval_baselines(self, limit: int | None = None) -> dict[str, float]:
        """The baselines over the held-out examples scored under a limit of `limit`."""
        if limit not in self._baselines:  # a pass over the training stream: once, not at each evaluation
            subset = self.eval_subset(limit)
            ids = None if len(subset) == len(self.eval_plan()) else np.concatenate(subset)
            self._baselines[limit] = {name: baseline(ids) for name, baseline in self.baselines.items()}
        return self._baselines[limit]

    @property
    def train_size(self) -> int:
        """Examples in the training split."""
        return len(self.train)

    @property
    def eval_size(self) -> int:
        """Examples in the held-out split."""
        return 0 if self.eval is None else len(self.eval)

    def train_batches(self, epoch: int = 0, start: int = 0, shard: tuple[int, int] = (0, 1), *,
                      need_inputs: bool = True, need_targets: bool = True) -> Iterator[Batch]:
        """This shard's part of each training mini-batch of `epoch`, from position `start`."""
        plan = self.plan(epoch)
        if not 0 <= start <= len(plan):
            raise ValueError(f"start {start} is outside the epoch's {len(plan)} batches")
        shard_bounds(0, *shard)
        return self._run(_BatchJob(self.train, plan, start, epoch, shard, need_inputs, need_targets))

    def heaviest_batch(self, shard: tuple[int, int] = (0, 1), *, need_inputs: bool = True,
                       need_targets: bool = True) -> Batch:
        """This shard's part of the training mini-batch that pads to the most tokens (images: the most examples)."""
        # Trial steps time and size a real step from it: under a token budget far fewer than batch_size examples.
        plan = self.plan(0)
        lengths = self.train.lengths
        padded = [len(group) * (max(int(lengths[group].max()), 1) if lengths is not None and len(group) else 1)
                  for group in plan]
        position = max(range(len(plan)), key=padded.__getitem__)
        shard_bounds(0, *shard)
        return _BatchJob(self.train, plan, position, 0, shard, need_inputs, need_targets)[0]

    def eval_batches(self, shard: tuple[int, int] = (0, 1), limit: int | None = None, *,
                     need_inputs: bool = True, need_targets: bool = True) -> Iterator[Batch]:
        """This shard's part of each eval mini-batch (no augmentation, fixed order)."""
        plan = self.eval_subset(limit)
        shard_bounds(0, *shard)
        if self.eval is None or not plan:
            return iter(())
        return self._run(_BatchJob(self.eval, plan, 0, None, shard, need_inputs, need_targets))

    def _run(self, job: _BatchJob) -> Iterator[Batch]:
        """Build batches in this process, or in `workers` background processes (order preserved)."""
        if self.workers <= 0 or len(job) == 0:
            return (job[k] for k in range(len(job)))
        # Without batching, the default collate hands each Batch over unchanged.
        return iter(torch.utils.data.DataLoader(job, batch_size=None, shuffle=False, num_workers=self.workers))


@dataclass
class _BatchJob(torch.utils.data.Dataset):
    """The plan's batches from position `start` on, to turn into Batches (picklable, for worker processes)."""

    examples: Examples
    plan: Sequence[np.ndarray]
    start: int
    epoch: int | None
    shard: tuple[int, int]
    need_inputs: bool
    need_targets: bool

    def __len__(self) -> int:
        return len(self.plan) - self.start

    def __getitem__(self, k: int) -> Batch:
        pos = self.start + k
        group = self.plan[pos]
        lo, hi = shard_bounds(len(group), *self.shard)
        ids = group[lo:hi]
        inputs, targets = self.examples.collate(ids, group, epoch=self.epoch, need_inputs=self.need_inputs,
                                                need_targets=self.need_targets)
        refs = self.examples.references(ids) if self.epoch is None else None  # eval batches (no epoch) carry them
        return Batch(index=pos, size=hi - lo, offset=lo, global_size=len(group), inputs=inputs,
                     targets=targets, tokens=self.examples.target_tokens(ids),
                     global_tokens=self.examples.target_tokens(group), ids=[int(i) for i in ids],
                     references=refs, epoch=self.epoch)
