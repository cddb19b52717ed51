"""AmoebaNet cell genotypes (Real et al. 2018, as defined by the TensorFlow TPU reference models)."""

from __future__ import annotations

from dataclasses import dataclass


# A cell starts with two hidden states: 0 is the cell's input (the previous cell's output) after a 1x1 convolution,
# 1 is the input of the previous cell, matched to the same shape. Combination k applies `operations[2k]` to state
# `inputs[2k]` and `operations[2k + 1]` to state `inputs[2k + 1]`, adds the results and appends the sum as state
# 2 + k. The cell's output is the channel concatenation of the states listed in `concat`.
@dataclass(frozen=True)
class CellGenotype:
    """The operations, their input states and the concatenated output states of one cell type."""

    operations: tuple[str, ...]
    inputs: tuple[int, ...]
    concat: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.operations) != 10 or len(self.inputs) != 10:
            raise ValueError("an AmoebaNet cell has exactly 5 pairwise combinations (10 operations)")
        for k, index in enumerate(self.inputs):
            if not 0 <= index < 2 + k // 2:
                raise ValueError(f"operation {k} reads state {index}, which does not exist yet")


@dataclass(frozen=True)
class Genotype:
    """A normal cell and a reduction cell."""

    normal: CellGenotype
    reduction: CellGenotype


# `concat` follows the reference's used-state flags. For the reduction cells that is exactly the set
# of states no combination reads; both normal cells also concatenate state 0 although combinations
# read it. That is what the reference builds (and what the published parameter counts need), so it
# is kept rather than "corrected" to the paper's figure.
AMOEBANET_D = Genotype(
    normal=CellGenotype(
        operations=("1x1", "max_pool_3x3", "none", "1x7_7x1", "1x1",
                    "1x7_7x1", "max_pool_3x3", "none", "avg_pool_3x3", "1x1"),
        inputs=(1, 1, 1, 0, 0, 0, 2, 2, 1, 5),
        concat=(0, 3, 4, 6),
    ),
    reduction=CellGenotype(
        operations=("max_pool_2x2", "max_pool_3x3", "none", "3x3", "1x7_7x1",
                    "max_pool_3x3", "none", "max_pool_2x2", "avg_pool_3x3", "1x1"),
        inputs=(0, 0, 2, 1, 2, 2, 3, 1, 2, 3),
        concat=(4, 5, 6),
    ),
)

AMOEBANET_B = Genotype(
    normal=CellGenotype(
        operations=("1x1", "max_pool_3x3", "none", "separable_3x3_2", "1x1",
                    "separable_3x3_2", "1x1", "none", "avg_pool_3x3", "1x1"),
        inputs=(1, 1, 1, 0, 1, 0, 2, 2, 1, 5),
        concat=(0, 3, 4, 6),
    ),
    reduction=CellGenotype(
        operations=("max_pool_2x2", "max_pool_3x3", "none", "3x3", "dil_2_separable_5x5_2",
                    "max_pool_3x3", "none", "separable_3x3_2", "avg_pool_3x3", "1x1"),
        inputs=(0, 0, 2, 1, 2, 2, 3, 1, 4, 3),
        concat=(5, 6),
    ),
)

GENOTYPES: dict[str, Genotype] = {"d": AMOEBANET_D, "b": AMOEBANET_B}
