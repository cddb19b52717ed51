"""What `gpipe profile-memory` is asked: one dataclass whose fields mirror the command's flags."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpipe_cli.errors import UserError, cut, shown
from gpipe_cli.estimate.model_flags import (
    SEED_HELP,
    ModelFlags,
    balance_entries,
    choice_problems,
    chunks_problem,
    model_of,
    shared_fields,
    v_problem,
)
from gpipe_cli.files import another_file, check_not_input, check_output, check_output_kind
from gpipe_cli.limits import DIGITS, MAX_RANKS, MAX_SIZE, one_of, outside, refuse, words
from gpipe_cli.pipeline.config import microbatch_problem
from gpipe_cli.recipe.aliases import ALIASES, SET_HELP, given_as
from gpipe_cli.recipe.load import recipe_label
from gpipe_cli.units import parse_size

# The largest K: the paper's largest pipeline (Transformer-L on 128 TPUs). Every stage of every row is
# priced, and measured rows driven, in this one process; far larger K only ran for minutes, silently.
MAX_PARTITIONS = 128
DEFAULT_PARTITIONS = (2, 4, 8)  # the paper's Table 1

# The optimizers whose state can be counted: memory_model.OPTIMIZERS builds them, with torch; their names are
# here so that a misspelt --optimizer is refused before torch loads (a test keeps the two alike).
# Name -> what it is, for the help: every name accepted is listed there.
OPTIMIZER_WORDS = {"sgd": "momentum 0.9", "adam": "", "adamw": "", "rmsprop": "the paper's, momentum 0.9",
                   "plain-sgd": "SGD without momentum: no state", "rmsprop-no-momentum": "RMSprop without momentum"}
OPTIMIZER_NAMES = tuple(OPTIMIZER_WORDS)


@dataclass
class ProfileOptions(ModelFlags):
    """What `gpipe profile-memory` counts: its own flags (see `FLAGS`) and the recipe keys it reads (`ALIASES`)."""

    partitions: list[int] = field(default_factory=lambda: list(DEFAULT_PARTITIONS))
    virtual_stages: int = 1  # chunks per stage: 2 under a V schedule, V >= 2 interleaved (K > 1 only)
    optimizer: str = "rmsprop"
    budget: str | None = None
    device: str = "auto"


# Flag name -> help text of profile-memory's own flags (the recipe's keys have the schema's).
CUTS = ("auto",)  # the cut profile-memory makes itself: by estimated FLOPs
FLAGS: dict[str, str] = {
    "model": "A preset (model.preset), a family (amoebanet, transformer: the paper's models, scaled down to this "
             "machine when no size flag or --set model.KEY is given) or a recipe file [default: transformer]. "
             "With --budget, the family searched: AmoebaNet-D (L, D) or Transformer-L.",
    "recipe": "Recipe YAML file: its model, pipeline and data.batch_size, K its pipeline.partitions "
              "[default: --model's model].",
    "partitions": f"K values to profile (pipeline-K), comma-separated, each 1 to {MAX_PARTITIONS} (the paper's "
                  "largest), e.g. 2,4,8; naive-1 and pipeline-1 are always shown [default: 2,4,8, or the recipe's "
                  "pipeline.partitions].",
    "optimizer": "Optimizer whose state is counted: " + ", ".join(f"{name} ({words})" if words else name
                                                                   for name, words in OPTIMIZER_WORDS.items())
                 + ".",
    "budget": "Per-device memory, more than 0 bytes, e.g. 8GiB: find the largest model of the family that "
              "fits at each K (the paper's Table 1).",
    "set": SET_HELP,
    "device": "Where to measure: auto (CUDA if present), cpu or cuda.",
    "seed": SEED_HELP,
    "json": "Write every figure as JSON to FILE.",
}


def profile_options(recipe: str | None, partitions: str | None, flags: Mapping[str, Any], sets: Sequence[str],
                    **own: Any) -> ProfileOptions:
    """The options a recipe (None: the command's own model), the alias flags, `--set` and the command's flags give."""
    # The recipe's keys are checked as `train` checks them, before torch loads.
    model = model_of(recipe, own.pop("model", None), "profiled")
    ks = parse_partitions(partitions) if partitions is not None else None
    if ks is not None:
        _check_partitions(ks)
    # A recipe holds one K, as does a --set of its key; without either, the default is several.
    set_k = given_as("partitions", {}, sets)
    listed = ks if ks is not None else None if recipe is not None or set_k else list(DEFAULT_PARTITIONS)
    typed_v = flags.get("virtual_stages")
    virtual = typed_v if typed_v is not None and typed_v >= 1 else 1  # a V below 1 is refused by the schema
    refuse([chunks_problem(flags, recipe),
            None if listed is None else one_cut_problem(flags.get("balance"), listed, virtual, default=ks is None)])
    if listed is not None and (len(listed) == 1 or virtual > 1):
        # The single K is the pipeline's K, so that a --balance is checked against it, with a recipe too; with
        # chunks, the largest K's rules are the recipe's (`validate` checks the others').
        flags = {**flags, "partitions": max(listed)}
    try:
        given = shared_fields(ProfileOptions, recipe, flags, sets, CUTS, "gpipe profile-memory")
    except UserError as exc:
        if ks is not None or listed is None or virtual <= 1:
            raise
        # The rules were checked at the default's largest K, as though it had been typed: name the default.
        default = f"each K of --partitions ({', '.join(map(str, listed))}, its default)"
        raise type(exc)(str(exc).replace(f"--partitions ({max(listed)})", default)) from None
    if recipe is not None and own.get("budget") is not None:  # the header then mixed the two without a word
        given["notes"].append("--budget searches the family's layers and width at the paper's other sizes, not the "
                              "recipe's model; the recipe gives the pipeline and the batch")
    k = given.pop("partitions", None)
    if listed is None and k is not None:  # the recipe's K, or a --set's, named as it was given
        _check_partitions([k], set_k or f"{recipe_label(recipe)}: {ALIASES['partitions']}")
    return ProfileOptions(model=model, partitions=listed or ([k] if k is not None else list(DEFAULT_PARTITIONS)),
                          **given, **own)


def _interleaved_problem(options: ProfileOptions) -> str | None:
    """The refusal of interleaved chunks at a K that does not divide M (the schedule's rule, as in a recipe)."""
    if options.virtual_stages <= 1 or options.schedule != "interleaved":
        return None
    bad = next((k for k in options.partitions if k > 1 and options.microbatches % k), None)
    return None if bad is None else (f"--microbatches {options.microbatches}: interleaved needs a multiple of each K "
                                     f"in --partitions (got K={bad})")


def one_cut_problem(balance: str | None, partitions: list[int], virtual: int, default: bool = False) -> str | None:
    """The refusal of a --balance list beside several K: a list of layers per stage is one K's cut."""
    entries = balance_entries(balance)
    if entries is None or len(partitions) == 1:
        return None
    hint = f"--partitions {entries // virtual}" if entries % virtual == 0 else "a single K in --partitions"
    listed = ",".join(map(str, partitions)) + (", the default" if default else "")
    return f"--balance {balance} cuts a single K: give {hint} (got {listed})"


def parse_partitions(text: str) -> list[int]:
    """`2,4,8` as a list of K values."""
    parts = text.split(",")
    if not any(part.strip() for part in parts):
        return []  # refused as listing no K
    empty = next((i for i, part in enumerate(parts, 1) if not part.strip()), None)
    if empty is not None:  # `2,,4`: a K left out as likely as a stray comma
        raise UserError(f"--partitions: entry {empty} is empty; give K values separated by commas, e.g. 2,4,8 "
                        f"(got '{cut(text)}')")
    bad = next((part for part in parts if not DIGITS.fullmatch(part.strip())), None)
    if bad is not None:
        raise UserError(f"--partitions: each K must be a whole number written in digits, separated by commas, "
                        f"e.g. 2,4,8 (got {shown(bad.strip())} in '{cut(text)}')")
    return [int(part) for part in parts]


def validate(options: ProfileOptions) -> None:
    """Refuse options that cannot describe a profile, or a --json that cannot be written, naming the flag."""
    # Before torch loads, so the one line comes at once.
    _check_partitions(options.partitions)
    refuse([
        outside("--microbatches", options.microbatches, 1, MAX_SIZE),
        microbatch_problem(options.microbatches, options.batch_size, "--microbatches", "--batch-size"),
        *choice_problems(options),
        one_of("--optimizer", options.optimizer, OPTIMIZER_NAMES),
        one_of("--device", options.device, ("auto", "cpu", "cuda")),
        one_cut_problem(options.balance, options.partitions, options.virtual_stages),
        v_problem(None, {"schedule": options.schedule, "virtual_stages": options.virtual_stages}, ()),
        _interleaved_problem(options),
        None if options.budget is None or (options.layers is None and options.filters is None)
        else "--budget searches the layers and filters: drop --layers/--filters",
        None if options.budget is None or options.balance is None
        else "--budget cuts each model it tries itself (by memory): drop --balance",
    ])
    if options.budget is not None and parse_size(options.budget, "--budget") <= 0:
        # Nothing fits no memory at all: a table of empty rows would only hide the typo.
        whole = "" if not any(c in "123456789" for c in options.budget) else ", and a size counts whole bytes"
        raise UserError(f"--budget: must be more than 0 bytes, e.g. 8GiB (got '{cut(options.budget)}'){whole}")
    check_output(options.json, "--json", "memory.json")
    if options.json is not None:  # a --model that names a file is the recipe read
        check_not_input(options.json, "--json", [(options.model, "the recipe itself")],
                        another_file(options.json, f"{options.json.stem}.memory.json"))
        check_output_kind(options.json, "--json")


def _check_partitions(partitions: list[int], named: str = "--partitions") -> None:
    """Refuse an empty --partitions and any K outside 1..MAX_PARTITIONS, naming the first such K."""
    if not partitions:
        raise UserError(f"{named}: must list K values {words('>= 1', f'<= {MAX_PARTITIONS}')}, e.g. 2,4,8 "
                        "(got none)")
    bad = next((k for k in partitions if not 1 <= k <= MAX_PARTITIONS), None)
    if bad is not None:
        values = "be" if named != "--partitions" else "list K values"
        raise UserError(f"{named}: must {values} {words('>= 1', f'<= {MAX_PARTITIONS}')} (the paper's "
                        f"largest pipeline; gpipe train takes up to {MAX_RANKS}) (got {shown(bad)})")
