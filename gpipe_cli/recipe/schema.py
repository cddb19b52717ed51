"""The typed recipe: every key a recipe may hold, its type, default and allowed values."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PositiveInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
Probability = Annotated[float, Field(ge=0.0, lt=1.0)]


class Section(BaseModel):
    """A recipe section: unknown keys are errors, values are checked on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AmoebaNetModel(Section):
    """AmoebaNet-D(L, D) or -B(N, F) image classifier."""

    kind: Literal["amoebanet"] = "amoebanet"
    preset: str | None = None
    variant: Literal["d", "b"] = "d"
    layers: PositiveInt = 18
    filters: PositiveInt = 256
    num_classes: Annotated[int, Field(ge=2)] = 1000
    image_size: Annotated[int, Field(ge=32)] = 224
    dropout: Probability = 0.0
    aux_head: bool = False
    label_smoothing: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.1


class TransformerModel(Section):
    """The GPipe Transformer: encoder-decoder for translation or decoder-only for language modelling."""

    kind: Literal["transformer"] = "transformer"
    preset: str | None = None
    arch: Literal["encoder-decoder", "decoder-only"] = "encoder-decoder"
    layers: PositiveInt = 6
    d_model: PositiveInt = 1024
    ff: PositiveInt = 8192
    heads: PositiveInt = 16
    vocab_size: Annotated[int, Field(ge=8)] = 32000
    max_len: PositiveInt = 256
    dropout: Probability = 0.1
    positions: Literal["sinusoidal", "learned"] = "sinusoidal"
    tie_embeddings: bool = False
    scaled_init: bool = False
    logit_clip: Annotated[float, Field(gt=0.0)] | None = None
    label_smoothing: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.1

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TransformerModel:
        if self.d_model % self.heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.heads ({self.heads})")
        return self


Model = Annotated[AmoebaNetModel | TransformerModel, Field(discriminator="kind")]


BALANCE_MODES = ("auto", "params", "time", "memory")


class Pipeline(Section):
    """How the model is cut and scheduled: K stages, M micro-batches, D replicas."""

    partitions: PositiveInt = 1
    microbatches: PositiveInt = 1
    schedule: Literal["gpipe", "1f1b"] = "gpipe"
    checkpoint: Literal["always", "except_last", "never"] = "except_last"
    balance: Literal["auto", "params", "time", "memory"] | list[PositiveInt] = "auto"
    data_parallel: PositiveInt = 1
    backend: Literal["auto", "gloo", "nccl"] = "auto"

    @field_validator("balance", mode="before")
    @classmethod
    def _balance_value(cls, value: object) -> object:
        if isinstance(value, str) and value in BALANCE_MODES:
            return value
        if isinstance(value, list):
            bad = [v for v in value if isinstance(v, bool) or not isinstance(v, int) or v < 1]
            if not bad:
                return value
            raise ValueError(f"pipeline.balance: every entry must be a positive number of layers "
                             f"(got {bad[0]!r} in {value})")
        raise ValueError(f"pipeline.balance: must be {', '.join(BALANCE_MODES)} or a list of layer counts "
                         f"per stage (got {value!r})")

    @model_validator(mode="after")
    def _balance_matches_partitions(self) -> Pipeline:
        if isinstance(self.balance, list) and len(self.balance) != self.partitions:
            raise ValueError(f"pipeline.balance has {len(self.balance)} entries but pipeline.partitions "
                             f"is {self.partitions}; give one layer count per stage")
        return self


class Data(Section):
    """Where examples come from and how they are batched."""

    source: Literal["synthetic", "imagefolder", "hub", "parquet", "jsonl", "tsv", "text"] = "synthetic"
    path: str | None = None
    name: str | None = None
    config: str | None = None
    train_split: str = "train"
    eval_split: str | None = None
    eval_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.05
    batch_size: PositiveInt = 32
    tokens_per_batch: PositiveInt | None = None
    seq_len: PositiveInt = 128
    source_field: str = "source"
    target_field: str = "target"
    text_field: str = "text"
    image_field: str = "image"
    label_field: str = "label"
    tokenizer: str | None = None
    vocab_size: Annotated[int, Field(ge=8)] | None = None
    augment: bool = True
    synthetic_size: PositiveInt = 2048
    drop_last: bool = True
    shuffle: bool = True

    @model_validator(mode="after")
    def _path_for_local_sources(self) -> Data:
        if self.source in ("imagefolder", "parquet", "jsonl", "tsv", "text") and not self.path:
            raise ValueError(f"data.path is required for data.source '{self.source}'")
        if self.source == "hub" and not self.name:
            raise ValueError("data.name (a Hugging Face dataset name) is required for data.source 'hub'")
        return self


class Train(Section):
    """How long to train and in what precision."""

    steps: PositiveInt | None = None
    epochs: PositiveInt | None = None
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    grad_clip: Annotated[float, Field(gt=0.0)] | None = None
    log_every: PositiveInt = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a non-finite loss or gradient (fp32, bf16)
    max_skipped: PositiveInt = 10  # consecutive skipped steps that stop the run (fp16 overflows too)

    @model_validator(mode="after")
    def _some_length(self) -> Train:
        if self.steps is None and self.epochs is None:
            raise ValueError("give train.steps or train.epochs (or both: training stops at whichever comes first)")
        return self


class Optimizer(Section):
    """The optimizer; `amoebanet-rmsprop` is the paper's RMSProp (decay 0.9, momentum 0.9)."""

    name: Literal["sgd", "adam", "adamw", "rmsprop", "amoebanet-rmsprop"] = "sgd"
    lr: Annotated[float, Field(gt=0.0)] = 0.1
    lr_per_256: bool = False
    momentum: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.9
    weight_decay: Annotated[float, Field(ge=0.0)] = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    eps: Annotated[float, Field(gt=0.0)] = 1e-8
    decay: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.9


class Schedule(Section):
    """The learning-rate schedule, applied per optimizer step."""

    name: Literal["constant", "inverse_sqrt", "exponential", "cosine"] = "constant"
    warmup_steps: NonNegInt = 0
    decay_rate: Annotated[float, Field(gt=0.0, le=1.0)] = 0.97
    decay_epochs: Annotated[float, Field(gt=0.0)] = 2.4
    min_lr: Annotated[float, Field(ge=0.0)] = 0.0


class Checkpoint(Section):
    """How often to save and how many checkpoints to keep."""

    every: PositiveInt | None = None
    keep: PositiveInt = 3


class Eval(Section):
    """How often to evaluate on the held-out split, and on how many batches."""

    every: PositiveInt | None = None
    batches: PositiveInt | None = None


class Recipe(Section):
    """A whole training recipe."""

    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")] = "run"
    seed: NonNegInt = 0
    model: Model = Field(default_factory=AmoebaNetModel)
    pipeline: Pipeline = Field(default_factory=Pipeline)
    data: Data = Field(default_factory=Data)
    train: Train = Field(default_factory=lambda: Train(steps=100))
    optimizer: Optimizer = Field(default_factory=Optimizer)
    schedule: Schedule = Field(default_factory=Schedule)
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    eval: Eval = Field(default_factory=Eval)

    @model_validator(mode="after")
    def _microbatches_fit_batch(self) -> Recipe:
        if self.data.tokens_per_batch is None and self.pipeline.microbatches > self.data.batch_size:
            raise ValueError(f"pipeline.microbatches ({self.pipeline.microbatches}) must be <= "
                             f"data.batch_size ({self.data.batch_size}): every micro-batch needs an example")
        return self
