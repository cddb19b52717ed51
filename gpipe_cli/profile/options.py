"""What `gpipe profile-memory` is asked: one dataclass whose fields mirror the command's flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpipe_cli.bench.options import OFFLOAD_MODES, REMAT_MODES, SCHEDULES  # the same, and loaded without torch
from gpipe_cli.errors import UserError, cut, shown
from gpipe_cli.estimate.size_flags import SizeFlags
from gpipe_cli.files import check_output
from gpipe_cli.limits import MAX_RANKS, MAX_SIZE, outside, words
from gpipe_cli.pipeline import schedules
from gpipe_cli.units import parse_size

# Schedules whose chunks are placed in a V run two per device (V=2); the others are counted with one.
V_SHAPED = tuple(name for name in SCHEDULES if schedules.get(name).placement == "v")

# The largest K: the paper's largest pipeline (Transformer-L on 128 TPUs). Every stage of every row is
# priced, and measured rows driven, in this one process; far larger K only ran for minutes, silently.
MAX_PARTITIONS = 128

# The optimizers whose state can be counted: memory_model.OPTIMIZERS builds them, with torch; their names are
# here so that a misspelt --optimizer is refused before torch loads (a test keeps the two alike).
OPTIMIZER_NAMES = ("sgd", "adam", "adamw", "rmsprop", "plain-sgd", "rmsprop-no-momentum")


@dataclass
class ProfileOptions(SizeFlags):
    """The flags of `gpipe profile-memory` (see `FLAGS` for their help)."""

    model: str = "transformer"
    partitions: list[int] = field(default_factory=lambda: [2, 4, 8])
    microbatches: int = 8
    batch_size: int | None = None      # None: 4 per micro-batch; with --budget the paper's batch
    schedule: str = "gpipe"
    checkpoint: str = "except_last"
    offload: str = "none"              # pipeline.offload of pipeline-1 and pipeline-K
    balance: str | None = None         # "3,5" (one K only); None: by estimated FLOPs, as training does
    optimizer: str = "rmsprop"
    budget: str | None = None
    set: list[str] = field(default_factory=list)
    device: str = "auto"
    seed: int = 0
    json: Path | None = None



def _choices(values: tuple[str, ...]) -> str:
    """e.g. "a, b or c"."""
    return f"{', '.join(values[:-1])} or {values[-1]}" if len(values) > 1 else values[0]


# Flag name -> help text, for the CLI's typer options (one to one with the fields above).
FLAGS: dict[str, str] = {
    "model": "Preset, family (amoebanet, transformer: the paper's models, scaled down to this machine when no "
             "size flag or --set is given) or recipe file (.yaml). With --budget, the family searched: "
             "AmoebaNet-D (L, D) or Transformer-L.",
    "partitions": f"K values to profile (pipeline-K), comma-separated, each 1 to {MAX_PARTITIONS} (the paper's "
                  "largest), e.g. 2,4,8; naive-1 and pipeline-1 are always shown.",
    "microbatches": "M: micro-batches per mini-batch for pipeline-1 and pipeline-K.",
    "batch_size": "Examples per mini-batch [default: 4 x M; with --budget the paper's: 128 AmoebaNet, "
                  "32 Transformer].",
    "schedule": f"Schedule whose in-flight micro-batches are counted: {_choices(SCHEDULES)} (interleaved "
                f"with one chunk per device, as 1f1b; {_choices(V_SHAPED)} with two per device in a V).",
    "checkpoint": "Rematerialization of pipeline-1 and pipeline-K: always, except_last or never.",
    "offload": "pipeline.offload of pipeline-1 and pipeline-K: none, or activations (needs --checkpoint always or "
               "except_last).",
    "balance": "Layers per stage for a single K, e.g. 5,5 (per chunk under a V: 2K of them) [default: balanced by "
               "estimated FLOPs, as training].",
    "optimizer": "Optimizer whose state is counted: sgd (momentum), adam, adamw, rmsprop (the paper's, "
                 "momentum 0.9).",
    "budget": "Per-device memory, more than 0 bytes, e.g. 8GiB: find the largest model of the family that "
              "fits at each K (the paper's Table 1).",
    "layers": "Layers (not with --budget, which searches it).",
    "filters": "AmoebaNet filters D (not with --budget, which searches it).",
    "d_model": "Transformer model width.",
    "ff": "Transformer feed-forward width.",
    "heads": "Transformer attention heads.",
    "vocab_size": "Transformer vocabulary.",
    "image_size": "AmoebaNet image side in pixels.",
    "seq_len": "Transformer sequence length.",
    "num_classes": "AmoebaNet classes.",
    "set": "Any model parameter (repeatable).",
    "device": "Where to measure: auto (CUDA if present), cpu or cuda.",
    "seed": "Seed of the weights and of the synthetic batch.",
    "json": "Write every figure as JSON to FILE.",
}


def parse_partitions(text: str) -> list[int]:
    """`2,4,8` as a list of K values."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--partitions expects K values separated by commas, e.g. 2,4,8 (got '{cut(text)}')") from None
    return values


def validate(options: ProfileOptions) -> None:
    """Refuse options that cannot describe a profile, or a --json that cannot be written, with one line naming the
    flag (before torch loads)."""
    _check_partitions(options.partitions)
    checks = [
        (1 <= options.microbatches <= MAX_SIZE, outside("--microbatches", options.microbatches, 1, MAX_SIZE) or ""),
        (options.batch_size is None or options.batch_size >= options.microbatches,
         f"--batch-size ({options.batch_size}) must be >= --microbatches ({options.microbatches})"),
        (options.schedule in SCHEDULES, f"--schedule must be one of {', '.join(SCHEDULES)} (got {options.schedule})"),
        (options.checkpoint in REMAT_MODES,
         f"--checkpoint must be one of {', '.join(REMAT_MODES)} (got {options.checkpoint})"),
        (options.offload in OFFLOAD_MODES,
         f"--offload must be one of {', '.join(OFFLOAD_MODES)} (got {options.offload})"),
        (options.offload == "none" or options.checkpoint != "never",
         "--offload activations moves the inputs that rematerialization stores: it needs --checkpoint always or "
         "except_last"),
        (options.optimizer in OPTIMIZER_NAMES,
         f"--optimizer must be one of {', '.join(OPTIMIZER_NAMES)} (got {options.optimizer})"),
        (options.device in ("auto", "cpu", "cuda"), f"--device must be auto, cpu or cuda (got {options.device})"),
        (options.balance is None or len(options.partitions) == 1, "--balance needs a single K in --partitions"),
        (options.budget is None or (options.layers is None and options.filters is None),
         "--budget searches the layers and filters: drop --layers/--filters"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    if options.budget is not None and parse_size(options.budget, "--budget") <= 0:
        # Nothing fits no memory at all: a table of empty rows would only hide the typo.
        raise UserError(f"--budget must be more than 0 bytes, e.g. 8GiB (got '{cut(options.budget)}')")
    check_output(options.json, "--json", "memory.json")


def _check_partitions(partitions: list[int]) -> None:
    """Refuse an empty --partitions and any K outside 1..MAX_PARTITIONS, naming the first such K."""
    if not partitions:
        raise UserError(f"--partitions: must list K values {words('>= 1', f'<= {MAX_PARTITIONS}')}, e.g. 2,4,8 "
                        "(got none)")
    bad = next((k for k in partitions if not 1 <= k <= MAX_PARTITIONS), None)
    if bad is not None:
        raise UserError(f"--partitions: must list K values {words('>= 1', f'<= {MAX_PARTITIONS}')} (the paper's "
                        f"largest pipeline; gpipe train takes up to {MAX_RANKS}) (got {shown(bad)})")
