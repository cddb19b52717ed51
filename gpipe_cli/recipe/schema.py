"""The typed recipe: every key a recipe may hold, its type, default and allowed values."""

from __future__ import annotations

import math
import os
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from gpipe_cli.data.image_folder import split_name
from gpipe_cli.errors import shown
from gpipe_cli.limits import (
    AMOEBANET_STEPS,
    LEAST_STALL_S,
    MAX_COUNT,
    MAX_LAYERS,
    MAX_RANKS,
    MAX_REAL,
    MAX_SEED,
    MAX_SIZE,
    MAX_VIRTUAL,
    choices,
)
from gpipe_cli.models import families
from gpipe_cli.pipeline import schedules
from gpipe_cli.pipeline.config import microbatch_problem
from gpipe_cli.recipe.yamlio import reads_as_number


def _real(value: object, *, kind: str = "float_parsing") -> object:
    """YAML `true` and the string "0.1" are not numbers."""
    if isinstance(value, bool):
        raise PydanticCustomError("bool_number", "must be a number, not true or false")
    if isinstance(value, str):  # pydantic would read "0.1", and "1_000", which YAML does not, as numbers
        if value.strip().lower().lstrip("+-.") in ("nan", "inf", "infinity"):  # quoted or not, never finite
            raise PydanticCustomError("finite_number", "must be a finite number")
        if reads_as_number(value):  # quoted in YAML
            raise PydanticCustomError("str_number", "must be a number, not a string (remove the quotes)")
        raise PydanticCustomError(kind, "not a number")
    return value


def _number(value: object) -> object:
    """YAML `true` and the string "5" are not numbers; an integral float such as 1e20 is range-checked as an int."""
    _real(value, kind="int_parsing")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


Number = BeforeValidator(_number)
Real = BeforeValidator(_real)
PositiveInt = Annotated[int, Number, Field(ge=1, le=MAX_COUNT)]
NonNegInt = Annotated[int, Number, Field(ge=0, le=MAX_COUNT)]
Size = Annotated[int, Number, Field(ge=1, le=MAX_SIZE)]
Layers = Annotated[int, Number, Field(ge=1, le=MAX_LAYERS)]
Ranks = Annotated[int, Number, Field(ge=1, le=MAX_RANKS)]
Vocabulary = Annotated[int, Number, Field(ge=8, le=MAX_SIZE * 16)]
Probability = Annotated[float, Real, Field(ge=0.0, lt=1.0)]
Text = Annotated[str, Field(min_length=1, max_length=128)]
# A folder or W&B name: `.` and `..` would name a folder that is not the run's.
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]*[A-Za-z0-9_-][A-Za-z0-9._-]*$")]
PositiveReal = Annotated[float, Real, Field(gt=0.0, le=MAX_REAL)]
NonNegReal = Annotated[float, Real, Field(ge=0.0, le=MAX_REAL)]


def bounds(field: FieldInfo) -> dict[str, Any]:
    """The numeric bounds (ge, gt, le, lt) a schema field declares, wherever pydantic keeps them."""
    constraints = list(field.metadata)
    for member in get_args(field.annotation):  # `X | None`: the constraints live on X
        constraints += list(get_args(member)[1:]) if get_origin(member) is Annotated else []
    items = [m for c in constraints for m in getattr(c, "metadata", [c])]  # Field(...) holds a list
    return {attr: getattr(item, attr) for item in items for attr in ("ge", "gt", "le", "lt")
            if getattr(item, attr, None) is not None}


class Section(BaseModel):
    """A recipe section: unknown keys are errors, numbers are finite, values are checked on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# Both model kinds have layers: one description, which the `--layers` flag shows.
LAYERS = (f"Layers: AmoebaNet L (normal cells, a multiple of {AMOEBANET_STEPS['layers']}), Transformer encoder and "
          "decoder layers (each)")


class AmoebaNetModel(Section):
    """AmoebaNet-D(L, D) or -B(N, F) image classifier."""

    kind: Literal["amoebanet"] = "amoebanet"
    preset: str | None = None
    variant: Literal["d", "b"] = "d"
    layers: Layers = Field(default=18, description=LAYERS)
    filters: Size = Field(default=256, description="AmoebaNet filters D (F): of the first stack, doubled by each "
                                                   f"reduction (a multiple of {AMOEBANET_STEPS['filters']})")
    num_classes: Annotated[int, Number, Field(ge=2, le=MAX_SIZE * 16)] = Field(default=1000,
                                                                              description="AmoebaNet classes")
    image_size: Annotated[int, Number, Field(ge=32, le=MAX_SIZE)] = Field(
        default=224, description="AmoebaNet image side in pixels")
    dropout: Probability = 0.0
    aux_head: StrictBool = False
    label_smoothing: Probability = 0.1

    @field_validator("layers", "filters")
    @classmethod
    def _whole_cells(cls, value: int, info: ValidationInfo) -> int:
        step = AMOEBANET_STEPS[str(info.field_name)]
        if value % step:
            raise ValueError(f"model.{info.field_name}: must be a positive multiple of {step} (got {value})")
        return value


class TransformerModel(Section):
    """The GPipe Transformer: encoder-decoder for translation or decoder-only for language modelling."""

    kind: Literal["transformer"] = "transformer"
    preset: str | None = None
    arch: Literal["encoder-decoder", "decoder-only"] = "encoder-decoder"
    layers: Layers = Field(default=6, description=LAYERS)
    d_model: Size = Field(default=1024, description="Transformer model width")
    ff: Size = Field(default=8192, description="Transformer feed-forward width")
    heads: Size = Field(default=16, description="Transformer attention heads (they divide d_model)")
    vocab_size: Vocabulary = Field(default=32000, description="Transformer vocabulary")
    max_len: Size = Field(default=256, description="Transformer sequence length: the longest example")
    dropout: Probability = 0.1
    positions: Literal["sinusoidal", "learned"] = "sinusoidal"
    tie_embeddings: StrictBool = False
    scaled_init: StrictBool = False
    logit_clip: PositiveReal | None = None
    label_smoothing: Probability = 0.1

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TransformerModel:
        if self.d_model % self.heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.heads ({self.heads})")
        return self


Model = Annotated[AmoebaNetModel | TransformerModel, Field(discriminator="kind")]
MODEL_SECTIONS: dict[str, type[Section]] = {"amoebanet": AmoebaNetModel, "transformer": TransformerModel}
DEFAULT_KIND = "amoebanet"  # the kind of a recipe without a model section (`Recipe.model`)


BALANCE_MODES = ("auto", "params", "time", "memory")
PLANNING = "planning"  # the validation context's key set by `gpipe plan`, which picks M and D itself
# Set where the model section only stands in for the model a command resolves itself (bench's and profile-memory's
# flags are checked as recipe keys): no check of its kind's own applies.
STAND_IN = "stand-in model"


class Pipeline(Section):
    """How the model is cut and scheduled: K stages, M micro-batches, D replicas."""

    partitions: Ranks = Field(default=1, description="K: pipeline stages, one process each")
    microbatches: Size = Field(default=1, description="M: micro-batches per mini-batch")
    schedule: str = Field(default="gpipe", description=f"The schedule: {', '.join(schedules.names()[:-1])} or "
                                                       f"{schedules.names()[-1]}")
    virtual_stages: Annotated[int, Number, Field(ge=1, le=MAX_VIRTUAL)] = Field(
        default=1, description="V: chunks of layers per stage: for interleaved; 2 for zero-bubble-v and v-half")
    checkpoint: Literal["always", "except_last", "never"] = Field(
        default="except_last", description="Rematerialization: always, except_last or never")
    offload: Literal["none", "activations"] = Field(
        default="none", description="none, or activations: what a stage stores for a backward waits in host memory "
                                    "(boundary inputs until their recompute, saved tensors layer by layer until "
                                    "the backward reaches them)")
    balance: Literal["auto", "params", "time", "memory"] | list[Layers] = Field(
        default="auto", description="Layers per stage, e.g. [5, 5], or how to cut: auto, params, time or memory")
    data_parallel: Ranks = 1
    backend: Literal["auto", "gloo", "nccl"] = "auto"

    @field_validator("schedule", mode="before")
    @classmethod
    def _known_schedule(cls, value: object) -> object:
        if isinstance(value, str) and value in schedules.names():
            return value
        raise ValueError(f"pipeline.schedule: must be {choices(schedules.names())} (got {shown(value)})")

    @field_validator("balance", mode="before")
    @classmethod
    def _balance_value(cls, value: object) -> object:
        if isinstance(value, str) and value in BALANCE_MODES:
            return value
        if isinstance(value, list):
            value = [_number(v) if isinstance(v, float) else v for v in value]  # `20.0` is 20, as in every count
            bad = [v for v in value if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_LAYERS]
            if not bad:
                return value
            raise ValueError(f"pipeline.balance: every entry must be a number of layers from 1 to {MAX_LAYERS} "
                             f"(got {shown(bad[0])} in {shown(value)})")
        raise ValueError(f"pipeline.balance: must be {choices(BALANCE_MODES, 'a list of layer counts per stage')} "
                         f"(got {shown(value)})")

    @model_validator(mode="after")
    def _balance_matches_partitions(self) -> Pipeline:
        chunks = self.partitions * self.virtual_stages
        if isinstance(self.balance, list) and len(self.balance) != chunks:
            per = "per stage" if self.virtual_stages == 1 else "per chunk (partitions x virtual_stages)"
            raise ValueError(f"pipeline.balance has {len(self.balance)} entr{'y' if len(self.balance) == 1 else 'ies'} "
                             f"but the pipeline has {chunks}; "
                             f"give one layer count {per}")
        chunked = [name for name in schedules.names() if schedules.get(name).chunked]
        if self.virtual_stages > 1 and self.schedule not in chunked:
            raise ValueError(f"pipeline.virtual_stages {self.virtual_stages} needs pipeline.schedule: "
                             f"{' or '.join(chunked)} (got {self.schedule})")
        if schedules.get(self.schedule).placement == "v":
            if self.virtual_stages != 2:
                raise ValueError(f"pipeline.schedule {self.schedule} runs 2 chunks per stage in a V: "
                                 f"set pipeline.virtual_stages: 2 (got {self.virtual_stages})")
            return self
        if self.virtual_stages > 1 and self.partitions < 2:
            # Each key with its value, as `aliases.by_flag` finds it to name the flag that gave it.
            raise ValueError(f"pipeline.virtual_stages ({self.virtual_stages}) needs pipeline.partitions "
                             f"({self.partitions}) to be 2 or more for {self.schedule}, whose chunks loop over the "
                             f"stages (at K=1, zero-bubble-v and v-half run 2 in a V)")
        if self.virtual_stages > 1 and self.microbatches % self.partitions:
            raise ValueError(f"pipeline.microbatches ({self.microbatches}) must be a multiple of "
                             f"pipeline.partitions ({self.partitions}) for the interleaved schedule")
        return self


LOCAL_SOURCES = ("imagefolder", "parquet", "jsonl", "tsv", "text")  # the data sources read from data.path
# The files each local text source reads (in a folder, those only; .txt is both tsv's and text's).
SOURCE_FILES = {"jsonl": (".jsonl", ".json"), "tsv": (".tsv", ".txt"), "text": (".txt", ".text", ".raw"),
                "parquet": (".parquet",)}
IMAGE_SOURCES = ("synthetic", "imagefolder", "parquet", "hub")
TEXT_SOURCES = ("synthetic", "jsonl", "tsv", "text", "parquet", "pydoc", "hub")
LM_ONLY_SOURCES = ("text", "pydoc")  # plain text: nothing to translate


class Data(Section):
    """Where examples come from and how they are batched."""

    source: Literal["synthetic", "imagefolder", "hub", "parquet", "jsonl", "tsv", "text", "pydoc"] = "synthetic"
    path: str | None = None
    name: str | None = None
    config: str | None = None
    train_split: str = "train"
    eval_split: str | None = None
    eval_fraction: Probability = 0.05
    batch_size: Size = Field(default=32, description="Examples per mini-batch (over all replicas)")
    tokens_per_batch: Annotated[int, Number, Field(ge=1, le=MAX_SIZE * 1024)] | None = None
    seq_len: Size = 128
    source_field: str = "source"
    target_field: str = "target"
    text_field: str = "text"
    image_field: str = "image"
    label_field: str = "label"
    tokenizer: str | None = None
    vocab_size: Vocabulary | None = None
    augment: StrictBool = True
    synthetic_size: PositiveInt = 2048
    drop_last: StrictBool = True
    shuffle: StrictBool = True

    @field_validator("path", "tokenizer")
    @classmethod
    def _home(cls, value: str | None) -> str | None:
        # As a shell would: `~/data` was refused as no such file by the checks before launch.
        return os.path.expanduser(value) if value and value.startswith("~") else value

    @model_validator(mode="after")
    def _path_for_local_sources(self) -> Data:
        if self.source in LOCAL_SOURCES and not self.path:
            raise ValueError(f"data.path is required for data.source '{self.source}'")
        if self.source == "hub" and not self.name:
            raise ValueError("data.name (a Hugging Face dataset name) is required for data.source 'hub'")
        same = self.eval_split is not None and (self.eval_split.lower() == self.train_split.lower() or
                                                self.source == "imagefolder" and
                                                split_name(self.eval_split) == split_name(self.train_split))
        if same:
            raise ValueError(f"data.eval_split '{self.eval_split}' is the training split: evaluation would score "
                             "examples trained on; name another split, or leave it out to hold out "
                             "data.eval_fraction of the training data")
        return self


class Profile(Section):
    """Steps to record with torch.profiler on every rank (gzip'd Chrome traces in RUN_DIR/profile)."""

    steps: tuple[PositiveInt, PositiveInt] | None = None
    skip_first: NonNegInt = 0
    wait: NonNegInt = 0
    warmup: NonNegInt = 1
    active: PositiveInt | None = None
    repeat: NonNegInt = 1
    profile_memory: StrictBool = False  # tensor allocations and frees (the trace's memory view)
    with_stack: StrictBool = False      # Python and C++ stacks of each operator
    record_shapes: StrictBool = False   # the input shapes of each operator

    @model_validator(mode="after")
    def _one_way(self) -> Profile:
        schedule = ("skip_first", "wait", "warmup", "active", "repeat")
        # Values, not keys: a recipe written back (to the run directory, to the ranks) carries every field.
        given = [key for key in schedule if getattr(self, key) != type(self).model_fields[key].default]
        if self.steps is not None:
            if self.steps[1] < self.steps[0]:
                raise ValueError(f"train.profile.steps: [start, end] with start <= end (got {list(self.steps)})")
            if given:
                raise ValueError(f"train.profile: give steps: [start, end] or the schedule ({', '.join(schedule)}), "
                                 f"not both (got steps and {', '.join(given)})")
        elif self.active is None:
            raise ValueError("train.profile: give steps: [start, end], or active (with wait, warmup, repeat)")
        return self

    def cycle(self) -> tuple[int, int, int, int, int]:
        """(skip_first, wait, warmup, active, repeat) in steps from 1, `steps: [start, end]` made one cycle."""
        if self.steps is None:
            assert self.active is not None
            return self.skip_first, self.wait, self.warmup, self.active, self.repeat
        start, end = self.steps
        warmup = min(1, start - 1)
        return 0, start - 1 - warmup, warmup, end - start + 1, 1


class Train(Section):
    """How long to train and in what precision."""

    steps: PositiveInt | None = None
    epochs: PositiveInt | None = None
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    grad_clip: PositiveReal | None = None
    log_every: PositiveInt = 1
    # Steps between exact counts of the stored activations (a Python call per saved tensor): the first step
    # and every memory_every-th; 1 counts every step. A GPU's allocator peak is read every step regardless.
    memory_every: PositiveInt = 10
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Seconds without progress before a stalled rank ends the job; null: max(60, 10x the slowest of the last 100
    # steps).
    stall_timeout: Annotated[float, Real, Field(ge=LEAST_STALL_S, le=MAX_REAL)] | None = None
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a non-finite loss or gradient (fp32, bf16)
    max_skipped: PositiveInt = 10  # consecutive skipped steps that stop the run (fp16 overflows too)
    profile: Profile | None = None  # steps [start, end] (from 1), or a schedule, traced with torch.profiler
    peak_tflops: PositiveReal | None = Field(
        default=None, description="Peak TFLOP/s of one rank that MFU is measured against; null: the data sheet "
                                  "of a known GPU at train.precision, or on a CPU its measured matrix-product rate")

    @model_validator(mode="after")
    def _some_length(self) -> Train:
        if self.steps is None and self.epochs is None:
            raise ValueError("give train.steps or train.epochs; with both, training stops at whichever comes first")
        return self

    @model_validator(mode="after")
    def _profile_within_run(self) -> Train:
        first = self.profile.steps[0] if self.profile is not None and self.profile.steps is not None else None
        if first is not None and self.steps is not None and first > self.steps:
            raise ValueError(f"train.profile.steps starts at step {first}, after the run's last (train.steps "
                             f"{self.steps}): nothing would be traced")
        return self


class Optimizer(Section):
    """The optimizer; `amoebanet-rmsprop` is the paper's RMSProp (decay 0.9, momentum 0.9)."""

    name: Literal["sgd", "adam", "adamw", "rmsprop", "amoebanet-rmsprop"] = "sgd"
    lr: PositiveReal = 0.1
    lr_per_256: StrictBool = False
    momentum: Probability = 0.9
    weight_decay: NonNegReal = 0.0
    betas: tuple[Probability, Probability] = (0.9, 0.98)
    eps: Annotated[float, Real, Field(gt=0.0, le=1.0)] = 1e-8
    decay: Annotated[float, Real, Field(gt=0.0, lt=1.0)] = 0.9


FLOORED = ("cosine", "exponential")  # the schedules that read schedule.min_lr
# The optimizer keys that only some optimizers read (the paper's RMSProp fixes decay and momentum at 0.9), and
# the schedule keys only exponential reads: one set elsewhere changes nothing, which `unread_settings` says.
OPTIMIZER_READS = {"sgd": ("momentum",), "adam": ("betas", "eps"), "adamw": ("betas", "eps"),
                   "rmsprop": ("momentum", "eps", "decay"), "amoebanet-rmsprop": ("eps",)}
SCHEDULE_READS = {"exponential": ("decay_rate", "decay_epochs")}


class Schedule(Section):
    """The learning-rate schedule, applied per optimizer step."""

    name: Literal["constant", "inverse_sqrt", "exponential", "cosine"] = "constant"
    warmup_steps: NonNegInt = 0
    decay_rate: Annotated[float, Real, Field(gt=0.0, le=1.0)] = 0.97
    decay_epochs: PositiveReal = 2.4
    min_lr: NonNegReal = 0.0


class Checkpoint(Section):
    """How often to save and how many checkpoints to keep."""

    every: PositiveInt | None = None
    keep: Annotated[int, Number, Field(ge=1, le=1_000_000)] = 3


class Eval(Section):
    """How often to evaluate on the held-out split, and on how many batches."""

    every: PositiveInt | None = None
    batches: PositiveInt | None = None


class Wandb(Section):
    """Weights & Biases logging; offline writes a local run folder that `wandb sync` uploads later."""

    project: Name
    mode: Literal["offline", "online"] = "offline"
    name: Text | None = Field(
        default=None, description="The W&B run's display name; null: the run directory's name")
    entity: Name | None = Field(
        default=None, description="The W&B user or team the run goes to; null: the logged-in user's default")
    group: Text | None = Field(
        default=None, description="Runs of one group are shown together (e.g. the members of a sweep)")
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=64, description="Labels to filter runs by in the W&B interface")
    artifact: StrictBool = Field(
        default=False, description="At the end, export the final model to RUN_DIR/model.safetensors and log it "
                                   "as a W&B artifact")


class Metrics(Section):
    """Where train and eval records go besides metrics.jsonl (rank 0 only)."""

    tensorboard: StrictBool = False
    wandb: Wandb | None = None


class Recipe(Section):
    """A whole training recipe."""

    name: Name = "run"
    seed: Annotated[int, Number, Field(ge=0, le=MAX_SEED)] = 0
    model: Model = Field(default_factory=AmoebaNetModel)  # DEFAULT_KIND
    pipeline: Pipeline = Field(default_factory=Pipeline)
    data: Data = Field(default_factory=Data)
    train: Train = Field(default_factory=lambda: Train(steps=100))
    optimizer: Optimizer = Field(default_factory=Optimizer)
    schedule: Schedule = Field(default_factory=Schedule)
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    eval: Eval = Field(default_factory=Eval)
    metrics: Metrics = Field(default_factory=Metrics)

    @model_validator(mode="after")
    def _data_fits_model(self) -> Recipe:
        source, model = self.data.source, self.model
        if isinstance(model, AmoebaNetModel) and source not in IMAGE_SOURCES:
            raise ValueError(f"data.source '{source}' holds text, and model.kind amoebanet classifies images: "
                             f"images come from {', '.join(IMAGE_SOURCES)}")
        if isinstance(model, TransformerModel) and source not in TEXT_SOURCES:
            raise ValueError(f"data.source '{source}' holds images, and model.kind transformer reads text: text "
                             f"comes from {', '.join(TEXT_SOURCES)}")
        # Found here, not by the ranks once they have started and read the data.
        if isinstance(model, AmoebaNetModel) and self.data.tokens_per_batch is not None:
            raise ValueError("data.tokens_per_batch sizes batches of text, and model.kind amoebanet classifies "
                             "images: leave it out and give data.batch_size")
        if self.optimizer.lr_per_256 and self.data.tokens_per_batch is not None:  # it scaled by an unused size
            raise ValueError("optimizer.lr_per_256 scales optimizer.lr by data.batch_size / 256, which "
                             "data.tokens_per_batch replaces: leave lr_per_256 out and give the learning rate itself")
        if isinstance(model, TransformerModel) and (self.data.vocab_size or 0) > model.vocab_size:
            raise ValueError(f"data.vocab_size ({self.data.vocab_size}) must be <= model.vocab_size "
                             f"({model.vocab_size}): the tokenizer's pieces are the model's vocabulary")
        if isinstance(model, TransformerModel) and model.arch == "encoder-decoder" and source in LM_ONLY_SOURCES:
            raise ValueError(f"data.source '{source}' is plain text for a language model (model.arch decoder-only); "
                             f"an encoder-decoder translates pairs: jsonl, tsv, parquet or hub")
        if (isinstance(model, TransformerModel) and model.arch == "decoder-only"
                and self.data.seq_len > model.max_len and "seq_len" not in self.data.model_fields_set):
            self.data.seq_len = model.max_len  # the default follows the model, and the run's recipe says so
        return self

    def peak_lr(self) -> float:
        """The peak learning rate; with `lr_per_256` it scales with the batch size, as the paper's AmoebaNet."""
        lr = self.optimizer.lr
        return lr * self.data.batch_size / 256 if self.optimizer.lr_per_256 else lr

    @model_validator(mode="after")
    def _held_out_to_evaluate(self) -> Recipe:
        # Generated data and pydoc's hold out only data.eval_fraction: the recipe alone says whether any is held out
        # (train said so once its ranks had read the data; validate passed it).
        data, every = self.data, self.eval.every
        if not every or data.source not in ("synthetic", "pydoc"):
            return self
        few = data.source == "synthetic" and round(data.synthetic_size * data.eval_fraction) == 0
        of = f" of data.synthetic_size {data.synthetic_size}" if few and data.eval_fraction else ""
        if data.eval_fraction == 0 or few:
            raise ValueError(nothing_held_out(every, f" (data.eval_fraction {data.eval_fraction:g}{of}); raise "
                                                     "data.eval_fraction"))
        return self

    @model_validator(mode="after")
    def _floor_under_peak(self) -> Recipe:
        sched, opt = self.schedule, self.optimizer
        if sched.min_lr and sched.name not in FLOORED:  # it would be read by nothing, without a word
            raise ValueError(f"schedule.min_lr ({sched.min_lr:g}) is the floor of the {' and '.join(FLOORED)} "
                             f"schedules, and schedule.name {sched.name} has none: set it to 0, or choose one of them")
        peak = self.peak_lr()
        if sched.min_lr > peak:  # cosine would climb to it, exponential start at it
            scaled = " x data.batch_size / 256" if opt.lr_per_256 else ""
            raise ValueError(f"schedule.min_lr ({sched.min_lr:g}) must be <= the peak learning rate ({peak:g}: "
                             f"optimizer.lr{scaled})")
        return self

    @model_validator(mode="after")
    def _microbatches_fit_batch(self, info: ValidationInfo) -> Recipe:
        pipe, batch = self.pipeline, self.data.batch_size
        if self.data.tokens_per_batch is not None or (info.context or {}).get(PLANNING):
            return self
        if problem := microbatch_problem(pipe.microbatches, batch, "pipeline.microbatches", "data.batch_size"):
            raise ValueError(problem)
        # Each replica trains on its share of the mini-batch, the smallest of which is batch // D examples.
        if microbatch_problem(pipe.microbatches, batch // pipe.data_parallel):
            count = pipe.data_parallel
            share = (f"each of the {count} replicas gets" if batch % count == 0 else
                     f"the smallest share of the {count} replicas is")
            raise ValueError(f"pipeline.microbatches x pipeline.data_parallel ({pipe.microbatches} x {count}) "
                             f"must be <= data.batch_size ({batch}): {share} {batch // count} of the mini-batch's "
                             f"examples, and each of its micro-batches needs one")
        if (info.context or {}).get(STAND_IN):
            return self
        family = families.of(str(self.model.kind))
        replicas = f" x pipeline.data_parallel ({pipe.microbatches} x {pipe.data_parallel})" \
            if pipe.data_parallel > 1 else f" ({pipe.microbatches})"
        if problem := microbatch_problem(pipe.microbatches * pipe.data_parallel, batch, "pipeline.microbatches",
                                         "data.batch_size", family.least_examples, family.least_why):
            raise ValueError(problem.replace(f" ({pipe.microbatches * pipe.data_parallel})", replicas, 1))
        return self


def nothing_held_out(every: int, why: str) -> str:
    """The refusal of eval.every where the data holds nothing out; `why` follows the words, with what to do."""
    return f"eval.every ({every}): the data holds nothing out to evaluate on{why}, or set eval.every: null"


def unread_settings(recipe: Recipe) -> list[str]:
    """A line for each optimizer or schedule key set from its default that the chosen one does not read."""
    # A note, not a refusal: a recipe carried over from another optimizer keeps its keys, and a resume may change
    # them (momentum is no state of adam's); but amoebanet-rmsprop trained with decay 0.9 whatever decay said.
    lines = []
    for where, section, reads in (("optimizer", recipe.optimizer, OPTIMIZER_READS),
                                  ("schedule", recipe.schedule, SCHEDULE_READS)):
        keys = sorted({key for read in reads.values() for key in read}, key=list(type(section).model_fields).index)
        for key in keys:
            value = getattr(section, key)
            if value == type(section).model_fields[key].default or key in reads.get(section.name, ()):
                continue
            readers = " or ".join(name for name, read in reads.items() if key in read)
            shown_value = list(value) if isinstance(value, tuple) else value
            paper = " (the paper's RMSProp: decay and momentum 0.9)" if section.name == "amoebanet-rmsprop" else ""
            lines.append(f"{where}.{key} ({shown_value}) is read only by {where}.name {readers}: {section.name}"
                         f"{paper} trains without it")
    model, seq_len = recipe.model, recipe.data.seq_len
    language = isinstance(model, TransformerModel) and model.arch == "decoder-only"
    if seq_len != Data.model_fields["seq_len"].default and not language:  # a pair is as long as it is
        reader = "a translation model reads whole pairs" if isinstance(model, TransformerModel) else "images have none"
        lines.append(f"data.seq_len ({seq_len}) is read only by a language model (model.arch decoder-only): {reader}")
    steps, warmup = recipe.train.steps, recipe.schedule.warmup_steps
    if steps is not None and recipe.train.epochs is None and warmup > steps:  # epochs: the data sets the steps
        lines.append(f"schedule.warmup_steps ({warmup}) is longer than the run (train.steps {steps}): the learning "
                     f"rate never reaches its peak, {steps / warmup:.2g} of it at the last step")
    return lines
