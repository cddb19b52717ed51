"""How a model runs as a pipeline, as one value (K, V, D, M, schedule, remat, cut), its constraints checked once."""

# Imports nothing heavy, so commands check their flags with it before torch loads.
from __future__ import annotations

from dataclasses import dataclass, field

from gpipe_cli.pipeline import schedules

REMAT_MODES = ("always", "except_last", "never")
OFFLOAD_MODES = ("none", "activations")


def microbatch_problem(microbatches: int, examples: int | None = None, name: str = "microbatches",
                       batch: str = "the batch size", least: int = 1, why: str = "") -> str | None:
    """What keeps M micro-batches from splitting `examples`, `least` each (M >= 1, M x least <= examples), or None."""
    # `name` and `batch` are the caller's words for M and the examples, as its error message says them; `why`
    # says why a micro-batch needs more than one example.
    if microbatches < 1:
        return f"{name} must be >= 1 (got {microbatches})"
    if examples is not None and microbatches * least > examples:
        if least == 1:
            return f"{name} ({microbatches}) must be <= {batch} ({examples}): every micro-batch needs an example"
        return (f"{name} ({microbatches}) must be <= {batch} ({examples}) / {least}: every micro-batch needs "
                f"{least} examples{f' ({why})' if why else ''}")
    return None


def sizes(examples: int, chunks: int) -> list[int]:
    """How many examples each of `chunks` micro-batches gets (the first ones get one more)."""
    problem = microbatch_problem(chunks, examples)
    if problem:
        raise ValueError(problem if chunks < 1 else f"a mini-batch of {examples} examples cannot be split into "
                         f"{chunks} micro-batches: each needs an example")
    base, extra = divmod(examples, chunks)
    return [base + (i < extra) for i in range(chunks)]


@dataclass(frozen=True)
class PipelineConfig:
    """K, D, M, V, schedule, remat, offload and balance (layers per chunk, placed on stages as the schedule says)."""

    stages: int = 1          # K: pipeline stages, one rank each
    microbatches: int = 1    # M: micro-batches per mini-batch
    replicas: int = 1        # D: data-parallel pipelines
    virtual: int = 1         # V: chunks of layers per stage (interleaved schedules)
    schedule: str = "gpipe"
    checkpoint: str = "except_last"
    balance: tuple[int, ...] = field(default=())  # layers per chunk; empty: not cut yet
    offload: str = "none"    # "activations": stored activations wait in host memory for their backward

    def __post_init__(self) -> None:
        object.__setattr__(self, "balance", tuple(self.balance))
        self.check()

    @property
    def chunks(self) -> int:
        """K x V: how many pieces the model is cut into."""
        return self.stages * self.virtual

    @property
    def placement(self) -> str:
        """Which stage runs which chunk: the schedule's "loop" (chunk c on stage c mod K) or "v"."""
        return schedules.get(self.schedule).placement

    @property
    def ranks(self) -> int:
        """K x D."""
        return self.stages * self.replicas

    def check(self) -> None:
        """Refuse, in one line, values that cannot run together."""
        for name, value in (("partitions", self.stages), ("data_parallel", self.replicas),
                            ("virtual_stages", self.virtual)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1 (got {value})")
        if problem := microbatch_problem(self.microbatches):
            raise ValueError(problem)
        if self.checkpoint not in REMAT_MODES:
            raise ValueError(f"unknown checkpoint mode '{self.checkpoint}': allowed are {', '.join(REMAT_MODES)}")
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"unknown offload mode '{self.offload}': allowed are {', '.join(OFFLOAD_MODES)}")
        schedules.get(self.schedule).check(self.stages, self.microbatches, self.virtual)
        if self.balance and len(self.balance) != self.chunks:
            raise ValueError(f"balance {list(self.balance)} has {len(self.balance)} entries, the pipeline has "
                             f"{self.stages} stages x {self.virtual} virtual stages")
        if any(b < 1 for b in self.balance):
            raise ValueError(f"every chunk of balance {list(self.balance)} needs at least one layer")
