"""Cut a sequence of layers into K contiguous stages: explicit balances and the optimal min-max split."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence

from gpipe_cli.pipeline import placement as placement_


class PartitionError(ValueError):
    """A balance that cannot describe a K-stage split of these layers."""


class TooManyChunks(PartitionError):
    """K x V chunks, V > 1, more than the layers: the line names both settings, so callers add no key of their own."""


def check_balance(balance: Sequence[int], num_layers: int, partitions: int | None = None) -> list[int]:
    """Validate an explicit balance (layers per stage) and return it as a list."""
    balance = list(balance)
    if partitions is not None and len(balance) != partitions:
        raise PartitionError(f"balance {balance} has {len(balance)} stages but {partitions} partitions "
                             f"were asked for (the model has {num_layers} pipeline layers)")
    if not balance:
        raise PartitionError("balance is empty: give the number of layers of each stage")
    bad = [b for b in balance if not isinstance(b, int) or b < 1]
    if bad:
        raise PartitionError(f"balance {balance} has a non-positive entry {bad[0]}: every stage needs at "
                             f"least one layer (the model has {num_layers} pipeline layers)")
    if sum(balance) != num_layers:
        raise PartitionError(f"balance {balance} sums to {sum(balance)} but the model has {num_layers} "
                             f"pipeline layers")
    return balance


def check_partitions(num_layers: int, partitions: int) -> None:
    """Refuse K < 1 and K larger than the number of layers."""
    if partitions < 1:
        raise PartitionError(f"partitions must be >= 1 (got {partitions})")
    if partitions > num_layers:
        raise PartitionError(f"cannot cut {num_layers} pipeline layers into {partitions} partitions: "
                             f"partitions must be <= {num_layers}")


def check_chunks(num_layers: int, partitions: int, virtual: int,
                 names: tuple[str, str] = ("pipeline.partitions", "pipeline.virtual_stages")) -> None:
    """`check_partitions` for K x V chunks; past V = 1 a refusal names the chunks and the two `names` making them."""
    # The user set K, not K x V: "8 partitions" for K = 4 read as a number never given.
    if virtual <= 1 or partitions < 1:
        check_partitions(num_layers, partitions * max(virtual, 1))
    elif partitions * virtual > num_layers:
        raise TooManyChunks(f"cannot cut {num_layers} pipeline layers into {partitions * virtual} chunks ({names[0]} "
                             f"{partitions} x {names[1]} {virtual}): at most {num_layers}")


def balance_by_cost(costs: Sequence[float], partitions: int) -> list[int]:
    """The contiguous K-way split minimising the largest stage cost (exact, O(K·L))."""
    # best[k][j], the least largest cost of the first j layers as k stages: best[k-1][i] grows with i while the
    # cost of layers i..j shrinks, so the best cut is where they cross, which only moves later as j grows (one
    # pointer per k). Ties go to later cuts: earlier stages carry no more than needed.
    check_partitions(len(costs), partitions)
    if any(c < 0 for c in costs):
        raise PartitionError("layer costs must be non-negative")
    n = len(costs)
    prefix = [0.0, *itertools.accumulate(float(c) for c in costs)]
    best = [prefix[:]]  # one stage: everything so far
    cut: list[list[int]] = [[], [0] * (n + 1)]  # cut[k][j]: where the last of k stages starts
    for k in range(2, partitions + 1):
        row, cuts = [float("inf")] * (n + 1), [0] * (n + 1)
        prev = best[-1]
        lo = pos = k - 1
        for j in range(k, n + 1):
            hi = j - 1  # the last stage is layers i..j-1, i in [k-1, j-1]
            # first i where the previous stages cost at least as much as the last one (hi + 1: none)
            while pos <= hi and prev[pos] < prefix[j] - prefix[pos]:
                pos += 1
            for i in (pos - 1, pos):
                if lo <= i <= hi:
                    value = max(prev[i], prefix[j] - prefix[i])
                    if value < row[j] or (value == row[j] and i > cuts[j]):
                        row[j], cuts[j] = value, i
        best.append(row)
        cut.append(cuts)
    return _unwind(cut, n, partitions)


def _unwind(cut: list[list[int]], n: int, partitions: int) -> list[int]:
    """The layers per stage of the best split, from each k-stage prefix's last cut (`cut[k][j]`)."""
    bounds, j = [n], n
    for k in range(partitions, 1, -1):
        j = cut[k][j]
        bounds.append(j)
    return [b - a for a, b in itertools.pairwise([0, *reversed(bounds)])]


# `owners[c]` is the stage of chunk c (None: one chunk per stage, where `balance_by_cost` is the answer).
def balance_stages(costs: Sequence[float], chunks: int, owners: Sequence[int] | None = None,
                   microbatches: int = 1) -> list[int]:
    """The cut into `chunks` with the shortest step: M x the busiest stage, plus fill and drain at the slowest chunk."""
    start = balance_by_cost(costs, chunks)
    if owners is None or len(set(owners)) == chunks:
        return start
    prefix = [0.0, *itertools.accumulate(float(c) for c in costs)]

    def key(balance: list[int]) -> tuple[float, float]:
        bounds = list(itertools.accumulate([0, *balance]))
        per_chunk = [prefix[b] - prefix[a] for a, b in itertools.pairwise(bounds)]
        per_stage = [0.0] * (max(owners) + 1)
        for chunk, cost in enumerate(per_chunk):
            per_stage[owners[chunk]] += cost
        return microbatches * max(per_stage) + (chunks - 1) * max(per_chunk), max(per_stage)

    n = len(costs)
    if math.comb(n - 1, chunks - 1) <= EXHAUSTIVE:  # a local search stalls between far-apart chunks: try every cut
        every = [[b - a for a, b in itertools.pairwise((0, *c, n))]
                 for c in itertools.combinations(range(1, n), chunks - 1)]
        return min(every, key=key)
    return descend(start, key)


EXHAUSTIVE = 20_000  # cuts into chunks few enough to price every one


# A value may depend on the stage's place and need not add up over layers (a memory peak); `inf` marks a stage
# that cannot be, and None a problem where every split has one. Exact, at most O(K·L²) calls of `value`: a pair
# that cannot beat the best split found so far is not priced, nor, past a `floor` that reaches it, any longer stage.
def min_max_split(layers: int, partitions: int, value: Callable[[int, int, int], float],
                  floor: Callable[[int, int], float] | None = None,
                  below: float = float("inf")) -> tuple[float, list[int]] | None:
    """The contiguous K-way split minimising the largest `value(stage, start, stop)`, and that largest value."""
    # `floor(start, stop)`: at most `value`, and never smaller for a longer stage (a sum of non-negative costs).
    # `below`: only a split whose largest value is less counts (None if none is): what cannot beat it goes unpriced.
    check_partitions(layers, partitions)
    n, inf = layers, float("inf")
    # best[k][j]: the smallest largest value of the first j layers as stages 0..k-1.
    best = [[0.0] + [inf] * n]
    cut: list[list[int]] = [[0] * (n + 1)]
    for k in range(1, partitions + 1):
        before = best[k - 1]
        row, cuts = [below] * (n + 1), [0] * (n + 1)
        seed = -1
        # Starts past the last that k - 1 stages can reach are never priced: a stop out of reach is found at once.
        reached = max((i for i, v in enumerate(before) if v < below), default=-1)
        # The last stage ends at the last layer: of its row only that entry is read.
        for j in range(k, n - (partitions - k) + 1) if k < partitions else (n,):
            # The start that served j - 1 is priced first: a bound near the best at once leaves most pairs unpriced
            # (a deep model's L² pairs took minutes). Of equal splits the latest start is kept, as without it.
            tie = n  # a later start that only equals the seed's value replaces it; past the seed, only a better one
            if seed >= 0:
                found = max(before[seed], value(k - 1, seed, j))
                if found < below:
                    row[j], cuts[j], tie = found, seed, seed
            for i in range(min(j - 1, reached), k - 2, -1) if k > 1 else (0,):  # the first stage starts at 0
                bound = row[j]
                if before[i] > bound or (before[i] == bound and i <= tie):
                    continue
                if floor is not None:
                    least = floor(i, j)
                    if least > bound or (least == bound and i <= tie):
                        break
                if i == seed:
                    continue
                found = max(before[i], value(k - 1, i, j))
                if found < bound or (found == bound and i > tie):
                    row[j], cuts[j], tie = found, i, n
            seed = cuts[j] if row[j] < below else -1
        best.append(row)
        cut.append(cuts)
    return None if best[partitions][n] >= below else (best[partitions][n], _unwind(cut, n, partitions))


# `fits(stage, start, stop)`: whether layers start..stop-1 fit as stage `stage`; `may_fit(start, stop)`: False
# only where no stage of those layers fits, nor of any longer run ending at `stop` (a bound, spared the pricing).
def balance_within(costs: Sequence[float], partitions: int, fits: Callable[[int, int, int], bool],
                   may_fit: Callable[[int, int], bool] = lambda start, stop: True) -> list[int] | None:
    """The contiguous K-way split minimising the largest stage cost among those where every stage fits, or None."""
    prefix = [0.0, *itertools.accumulate(float(c) for c in costs)]
    found = min_max_split(len(costs), partitions,
                          lambda stage, i, j: prefix[j] - prefix[i] if fits(stage, i, j) else float("inf"),
                          lambda i, j: prefix[j] - prefix[i] if may_fit(i, j) else float("inf"))
    return None if found is None else found[1]


TRIALS = 20_000  # cuts one search may price: a bound on its time for deep models and many chunks
FIT_TRIALS = 100  # cuts a search for any cut that fits may price at least (a model search asks it many times)


def _moves(chunks: int) -> Iterator[list[tuple[int, int]]]:
    """Every move of one cut by one layer; then (tried only where none of those helps) of a run of cuts."""
    for first in range(chunks - 1):
        for step in (-1, 1):
            yield [(first, step)]
    for first in range(chunks - 1):
        for last in range(first + 1, chunks - 1):
            for step in (-1, 1):
                yield [(cut, step) for cut in range(first, last + 1)]


# With `enough`, the first cut whose key is enough is returned, pricing at most half of layers x chunks cuts
# (`FIT_TRIALS` at least). Runs of cuts shift memory between stages whose interleaved chunks lie far apart.
def descend(balance: Sequence[int], key: Callable[[list[int]], tuple[float, ...]],
            enough: Callable[[tuple[float, ...]], bool] | None = None) -> list[int]:
    """From `balance`, take the move that lowers `key` most, until none does (or `TRIALS` cuts were priced)."""
    current, best, trials = list(balance), key(list(balance)), 0
    # A fit search may walk every cut across half its chunk: deep models need more trials than shallow ones.
    bound = TRIALS if enough is None else min(max(FIT_TRIALS, sum(balance) * len(balance) // 2), TRIALS)
    while trials < bound:
        found: tuple[tuple[float, ...], list[int]] | None = None
        for move in _moves(len(current)):
            if len(move) > 1 and found is not None:
                break  # a single move helps: no need for runs
            trial = current[:]
            for cut, step in move:  # the cut after chunk `cut` moves one layer left or right
                trial[cut] += step
                trial[cut + 1] -= step
            if min(trial) < 1:
                continue
            trials += 1
            value = key(trial)
            if enough is not None and enough(value):
                return trial
            if value < (found[0] if found is not None else best):
                found = (value, trial)
                if enough is not None:
                    break  # a search for any cut that fits takes the first move that helps: more moves per trial
        if found is None:
            return current
        best, current = found
    return current


def interleaved_within(costs: Sequence[float], chunks: int, needs: Callable[[list[int]], Sequence[float]],
                       budget: float) -> list[int] | None:
    """A cut of K x V chunks whose every stage fits `budget` (`needs(balance)`: every stage's bytes), or None."""
    prefix = [0.0, *itertools.accumulate(float(c) for c in costs)]

    def key(balance: list[int]) -> tuple[float, float, float]:
        peak = max(needs(balance))
        slowest = max(prefix[b] - prefix[a] for a, b in itertools.pairwise(itertools.accumulate([0, *balance])))
        return max(peak - budget, 0.0), slowest, peak

    start = balance_by_cost(costs, chunks)
    if max(needs(start)) <= budget:
        return start
    found = descend(start, key)
    if max(needs(found)) > budget:  # then from the least memory found (as `gpipe plan` names it when none fits)
        found = descend(least_memory(start, needs), key)
    return found if max(needs(found)) <= budget else None


def least_memory(balance: Sequence[int], needs: Callable[[list[int]], Sequence[float]],
                 budget: float | None = None) -> list[int]:
    """From `balance`, `descend`'s moves that lower the fullest stage's `needs`, while they do."""
    # With `budget`, only until the fullest stage fits it: a search for a cut that fits need not find the leanest.
    if budget is not None and max(needs(list(balance))) <= budget:
        return list(balance)
    return descend(balance, lambda b: (max(needs(b)),), None if budget is None else lambda key: key[0] <= budget)


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """The summed cost of each stage under a balance."""
    return [float(sum(costs[r.start:r.stop])) for r in stage_ranges(balance)]


def stage_ranges(balance: Sequence[int]) -> list[range]:
    """The global layer indices of each stage."""
    return [range(a, b) for a, b in itertools.pairwise(itertools.accumulate(balance, initial=0))]


def stage_layers(balance: Sequence[int], stages: int, stage: int, placement: str = "loop") -> list[int]:
    """The global indices of the layers a stage holds when `balance` cuts K x V chunks placed by `placement`."""
    ranges = stage_ranges(balance)
    return [i for c in placement_.chunks_of(stage, stages, len(ranges) // stages, placement) for i in ranges[c]]
