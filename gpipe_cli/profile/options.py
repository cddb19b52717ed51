"""What `gpipe profile-memory` is asked: one dataclass whose fields mirror the command's flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpipe_cli.errors import UserError
from gpipe_cli.estimate.size_flags import SizeFlags
from gpipe_cli.pipeline.schedule import REMAT_MODES, SCHEDULES


@dataclass
class ProfileOptions(SizeFlags):
    """The flags of `gpipe profile-memory` (see `FLAGS` for their help)."""

    model: str = "transformer"
    partitions: list[int] = field(default_factory=lambda: [2, 4, 8])
    microbatches: int = 8
    batch_size: int | None = None      # None: 4 per micro-batch; with --budget the paper's batch
    schedule: str = "gpipe"
    checkpoint: str = "except_last"
    balance: str | None = None         # "3,5" (one K only); None: by estimated FLOPs, as training does
    optimizer: str = "rmsprop"
    budget: str | None = None
    set: list[str] = field(default_factory=list)
    device: str = "auto"
    seed: int = 0
    json: Path | None = None



# Flag name -> help text, for the CLI's typer options (one to one with the fields above).
FLAGS: dict[str, str] = {
    "model": "Preset, family (amoebanet, transformer: the paper's models, scaled down to this machine when no "
             "size flag or --set is given) or recipe file (.yaml). With --budget, the family searched: "
             "AmoebaNet-D (L, D) or Transformer-L.",
    "partitions": "K values to profile (pipeline-K), comma-separated, e.g. 2,4,8; naive-1 and pipeline-1 are "
                  "always shown.",
    "microbatches": "M: micro-batches per mini-batch for pipeline-1 and pipeline-K.",
    "batch_size": "Examples per mini-batch [default: 4 x M; with --budget the paper's: 128 AmoebaNet, "
                  "32 Transformer].",
    "schedule": "Schedule whose in-flight micro-batches are counted: gpipe, 1f1b or zero-bubble.",
    "checkpoint": "Rematerialization of pipeline-1 and pipeline-K: always, except_last or never.",
    "balance": "Layers per stage for a single K, e.g. 5,5 [default: balanced by estimated FLOPs, as training].",
    "optimizer": "Optimizer whose state is counted: sgd (momentum), adam, adamw, rmsprop (the paper's, "
                 "momentum 0.9).",
    "budget": "Per-device memory, e.g. 8GiB: find the largest model of the family that fits at each K "
              "(the paper's Table 1).",
    "layers": "Model size override: layers (not with --budget, which searches it).",
    "filters": "Model size override: AmoebaNet filters D (not with --budget, which searches it).",
    "d_model": "Model size override: Transformer model width.",
    "ff": "Model size override: Transformer feed-forward width.",
    "heads": "Model size override: Transformer attention heads.",
    "vocab_size": "Model size override: Transformer vocabulary.",
    "image_size": "Model size override: AmoebaNet image side in pixels.",
    "seq_len": "Model size override: Transformer sequence length.",
    "num_classes": "Model size override: AmoebaNet classes.",
    "set": "Model parameter override KEY=VALUE (repeatable).",
    "device": "Where to measure: auto (CUDA if present), cpu or cuda.",
    "seed": "Seed of the weights and of the synthetic batch.",
    "json": "Write every figure as JSON to FILE.",
}


def parse_partitions(text: str) -> list[int]:
    """`2,4,8` as a list of K values."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--partitions expects K values separated by commas, e.g. 2,4,8 (got '{text}')") from None
    return values


def validate(options: ProfileOptions) -> None:
    """Refuse options that cannot describe a profile, with one line naming the flag."""
    from gpipe_cli.profile.account import OPTIMIZERS  # imports torch: only when a profile really runs

    checks = [
        (bool(options.partitions) and all(k >= 1 for k in options.partitions),
         f"--partitions must list K values >= 1 (got {options.partitions})"),
        (options.microbatches >= 1, f"--microbatches must be >= 1 (got {options.microbatches})"),
        (options.batch_size is None or options.batch_size >= options.microbatches,
         f"--batch-size ({options.batch_size}) must be >= --microbatches ({options.microbatches})"),
        (options.schedule in SCHEDULES, f"--schedule must be one of {', '.join(SCHEDULES)} (got {options.schedule})"),
        (options.checkpoint in REMAT_MODES,
         f"--checkpoint must be one of {', '.join(REMAT_MODES)} (got {options.checkpoint})"),
        (options.optimizer in OPTIMIZERS,
         f"--optimizer must be one of {', '.join(OPTIMIZERS)} (got {options.optimizer})"),
        (options.device in ("auto", "cpu", "cuda"), f"--device must be auto, cpu or cuda (got {options.device})"),
        (options.balance is None or len(options.partitions) == 1, "--balance needs a single K in --partitions"),
        (options.budget is None or (options.layers is None and options.filters is None),
         "--budget searches the layers and filters: drop --layers/--filters"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
