"""Flags shared by the commands that build the measured model from `--model` or a recipe: bench, profile-memory."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from gpipe_cli.errors import UserError
from gpipe_cli.limits import MAX_SEED, one_of, outside, refuse
from gpipe_cli.models import families
from gpipe_cli.models.presets import is_preset_name, preset
from gpipe_cli.pipeline import schedules
from gpipe_cli.pipeline.config import OFFLOAD_MODES, REMAT_MODES, microbatch_problem
from gpipe_cli.recipe.aliases import (
    ALIASES,
    SIZE_FLAGS,
    balance_problem,
    balance_text,
    flag,
    given_as,
    replaced,
    set_balance_problem,
    set_key,
    settings,
)
from gpipe_cli.recipe.load import RecipeError, kind_note, typed_values, unknown_key

# The command line loads this module for its help and checks these flags before torch loads: the schedules'
# registry and the pipeline configuration import nothing heavy.
SCHEDULES = schedules.names()
SEED_HELP = "Seed of the weights and of the synthetic batch."


@dataclass
class ModelFlags:
    """The flags bench and profile-memory share: the model, the pipeline keys both read, and the model's sizes."""

    model: str = "transformer"
    microbatches: int = 8
    batch_size: int | None = None      # None: 4 examples per micro-batch (profile-memory --budget: the paper's batch)
    schedule: str = "gpipe"
    checkpoint: str = "except_last"
    offload: str = "none"              # "activations": stored activations wait in host memory (pipeline.offload)
    balance: str | None = None         # "3,5": layers per stage; None: the command's own cut
    set: list[str] = field(default_factory=list)
    # What the command makes otherwise than the recipe says: printed first, and no flag.
    notes: list[str] = field(default_factory=list, metadata={"flag": False})
    # Alias -> its flag or the `--set KEY` that gave it (only those typed), so that a refusal names what was typed:
    # no flag, and no part of what the options ask for (a flag and its --set give equal options).
    typed_as: dict[str, str] = field(default_factory=dict, compare=False, metadata={"flag": False})
    seed: int = 0
    json: Path | None = None
    layers: int | None = None
    filters: int | None = None
    d_model: int | None = None
    ff: int | None = None
    heads: int | None = None
    vocab_size: int | None = None
    image_size: int | None = None
    seq_len: int | None = None
    num_classes: int | None = None

    def named(self, name: str) -> str:
        """How the user gave alias `name`: the `--set KEY` where one gave it, else its flag."""
        return self.typed_as.get(name, flag(name))

    def given(self, name: str, value: object) -> str:
        """Alias `name` with `value`, as typed: `--set pipeline.partitions=200` or `--partitions 200`."""
        return f"{self.named(name)}{'=' if self.named(name).startswith('--set') else ' '}{value}"

    def cut_named(self, k: str | None = None) -> str:
        """What a refused cut came from, as the user gave it: K (`k`: as given otherwise) and any balance."""
        return (k or self.named("partitions")) + (f"/{self.named('balance')}" if self.balance is not None else "")

    def balance_named(self) -> str:
        """What a balance whose sum is refused came from: the balance, and K where K was typed too."""
        return self.cut_named() if "partitions" in self.typed_as else self.named("balance")

    def examples_problem(self, kind: str, microbatches: int, batch: int) -> str | None:
        """Why `microbatches` of `batch` leave a micro-batch fewer examples than family `kind` trains on, or None."""
        family = families.of(kind)
        return microbatch_problem(microbatches, batch, self.named("microbatches"), self.named("batch_size"),
                                  family.least_examples, family.least_why)

    def sizes(self) -> dict[str, int | None]:
        """The size flags, by name."""
        return {name: getattr(self, name) for name in SIZE_FLAGS}


def choice_problems(options: ModelFlags) -> list[str | None]:
    """The refusals of a --schedule, --checkpoint or --offload that names none of its choices, a --seed, a size."""
    return [one_of("--schedule", options.schedule, SCHEDULES), one_of("--checkpoint", options.checkpoint, REMAT_MODES),
            one_of("--offload", options.offload, OFFLOAD_MODES),
            outside("--seed", options.seed, 0, MAX_SEED),  # as a recipe's seed
            size_problem(options.model, options.sizes(), options.set)]


def is_v(schedule: Any) -> bool:
    """Whether `schedule` names a V-shaped schedule, which runs two chunks per stage."""
    return schedule in SCHEDULES and schedules.get(schedule).placement == "v"


# Only where the flags decide it: a recipe may hold the V's chunks, and a --set item names its key itself.
def chunks_problem(flags: Mapping[str, Any], recipe: str | None) -> str | None:
    """The refusal of a --virtual-stages above 1 with a schedule that runs one chunk per stage."""
    virtual, schedule = flags.get("virtual_stages"), flags.get("schedule")
    if virtual is None or virtual <= 1 or (schedule is None and recipe is not None) \
            or (schedule in schedules.names() and schedules.get(schedule).chunked):
        return None  # below 1: refused by the schema; without --schedule a recipe's may be chunked
    return (f"--virtual-stages {virtual}: {schedule or 'gpipe'} runs one chunk per stage; give --schedule "
            f"interleaved, or zero-bubble-v or v-half with --virtual-stages 2")


def v_problem(recipe: str | None, flags: Mapping[str, Any], sets: Sequence[str]) -> str | None:
    """The refusal of a V schedule typed as --schedule without --virtual-stages 2, naming the flags."""
    schedule, virtual = flags.get("schedule"), flags.get("virtual_stages")
    if not is_v(schedule) or virtual == 2:
        return None
    if virtual is None and (recipe is not None or "pipeline.virtual_stages" in typed_values(sets)):
        return None
    return f"--schedule {schedule} runs 2 chunks per stage in a V: give --virtual-stages 2 (got {virtual or 1})"


def balance_entries(balance: str | None) -> int | None:
    """How many stages a --balance list cuts (None: no list, e.g. a cut by a mode such as auto)."""
    if balance is None or not re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", balance):
        return None
    return len(balance.split(","))


def entries_problem(balance: str | None, partitions: int, virtual: int, default: bool = False) -> str | None:
    """The refusal of a --balance list whose entries are not K x V, naming the flags that set both (`default`: K was
    not typed, nor given by a recipe)."""
    entries = balance_entries(balance)
    if entries is None or partitions < 1 or virtual < 1 or entries == partitions * virtual:
        return None  # a K or V below 1 is refused by the schema
    k = f"--partitions ({partitions}, its default)" if default else f"--partitions {partitions}"
    if virtual == 1:
        return (f"--balance {balance} has {entries} entries but {k} has {partitions} stages: give one layer count "
                "per stage")
    return (f"--balance {balance} has {entries} entries but {k} x --virtual-stages {virtual} "
            f"is {partitions * virtual} chunks: give one layer count per chunk")


def _flag_value(name: str, recipe: str | None, flags: Mapping[str, Any], sets: Sequence[str], default: Any) -> Any:
    """An aliased key's value where the flags alone decide it (None: a recipe or a --set item may)."""
    if flags.get(name) is not None:
        return flags[name]
    if recipe is None and ALIASES[name] not in typed_values(sets):
        return default
    return None


# Size flag -> model parameter (the sequence length is the Transformer's max_len: its example length).
SIZE_PARAMS = {name: ALIASES[name].removeprefix("model.") for name in SIZE_FLAGS}


def size_limits(kind: str) -> dict[str, tuple[int, int]]:
    """(least, most) of each integer model parameter of `kind`, as the recipe schema allows."""
    from gpipe_cli.recipe.schema import MODEL_SECTIONS, bounds

    return {name: (int(found["ge"]), int(found["le"])) for name, info in MODEL_SECTIONS[kind].model_fields.items()
            if info.annotation is int and {"ge", "le"} <= (found := bounds(info)).keys()}


def size_problem(model: str, sizes: Mapping[str, int | None], sets: Sequence[str]) -> str | None:
    """A size flag of a family's or a preset's model beyond the schema's limits, said before torch loads."""
    # A recipe is resolved with the models, as is a --set, which wins over the flag of its key.
    if model not in families.FAMILIES and not is_preset_name(model):
        return None
    kind = model if model in families.FAMILIES else preset(model)[0]
    limits, typed = size_limits(kind), {set_key(item).removeprefix("model.") for item in sets}
    for name, value in sizes.items():
        param = SIZE_PARAMS[name]
        if value is not None and param not in typed:
            problem = foreign_size(name, kind) or (outside(flag(name), value, *limits[param]) if param in limits
                                                    else None)
            if problem:
                return problem
    return None


def foreign_size(name: str, kind: str) -> str | None:
    """The line refusing size flag `name` where models of `kind` have no such size, else None."""
    from gpipe_cli.recipe.schema import MODEL_SECTIONS

    sizes = [p for p in MODEL_SECTIONS[kind].model_fields if p in SIZE_PARAMS.values()]
    flags = [flag(n) for p in sizes for n, param in SIZE_PARAMS.items() if param == p]  # what the user types
    return None if SIZE_PARAMS[name] in sizes else f"{flag(name)} does not apply to {kind} models (their size " \
        f"flags: {', '.join(flags)})"


def model_of(recipe: str | None, model: str | None, done: str) -> str:
    """The model measured: the recipe's, or `--model` (None: a transformer); `done` is what the command does to it."""
    if model is not None and not model.strip():  # it measured the default model, as if the flag were not there
        raise UserError(f"--model: an empty name names no model; give a family ({', '.join(families.FAMILIES)}), a "
                        "preset or a recipe file, or leave the flag out for a transformer")
    if recipe is not None and model is not None:
        raise UserError(f"give a recipe or --model, not both (the recipe's model section is {done})")
    return recipe or model or "transformer"


# Recipe keys a command reads through a flag of its own, not the recipe (profile-memory's --optimizer).
OWN_FLAGS = {"optimizer.name": "optimizer"}


def unread_problem(sets: Sequence[str], command: str, own: Collection[str] = ()) -> str | None:
    """The refusal of a `--set` key of a section these commands do not read (`own`: their fields, which a flag sets)."""
    for item in sets:
        key = set_key(item)
        section, dot, _ = key.partition(".")
        if dot and section != "model" and key not in ALIASES.values():
            # A misspelling, as train says it; unless what it suggests is unread here too (`train.lr`: optimizer.lr).
            *pipeline, last = (k.removeprefix("pipeline.") for k in ALIASES.values() if k.startswith("pipeline."))
            reads = (f"of a recipe it reads the model section, data.batch_size and the pipeline's "
                     f"{', '.join(pipeline)} and {last}")
            unknown = unknown_key(key)
            if unknown is not None and (_read_here(unknown, own) or "did you mean" not in unknown):
                read = [k.partition(".")[2] for k in ALIASES.values() if k.startswith(f"{section}.")]
                if read:
                    return f"--set {unknown}; {command} reads of {section}: {', '.join(read)}"
                # `--set a.b`: no near key, nor a section it reads; it was "unknown key" and no more.
                return f"--set {unknown}" + ("" if "did you mean" in unknown else f"; {reads}")
            if OWN_FLAGS.get(key) in own:
                value, instead = item.partition("=")[2].strip(), flag(OWN_FLAGS[key])
                return f"--set {key}: {command} takes it as {instead}" + (f", e.g. {instead} {value}" if value else "")
            return f"--set {key}: {command} does not read it; {reads}"
    return None


def _read_here(unknown: str, own: Collection[str]) -> bool:
    """Whether a key that an unknown key's line suggests is one these commands read."""
    suggested = re.findall(r"[a-z_]+(?:\.[a-z_]+)+", unknown.partition("did you mean")[2])
    return any(k.startswith("model.") or k in ALIASES.values() or OWN_FLAGS.get(k) in own for k in suggested)


def _section(recipe: str | None, name: str) -> Any:
    """A section of the recipe file as written, or of the built-in one for None ({} where it has none)."""
    from gpipe_cli.recipe.load import default_recipe_text, parse_yaml, recipe_label
    from gpipe_cli.recipe.yamlio import read_recipe_file

    text = default_recipe_text() if recipe is None else read_recipe_file(Path(recipe))
    return parse_yaml(text, recipe_label(recipe)).get(name) or {}


def recipe_size_problem(recipe: str | None, flags: Mapping[str, Any], sets: Sequence[str],
                        built_in: bool = False) -> str | None:
    """A size flag the recipe's model family has no such size for, worded as without a recipe (`built_in`: a recipe
    of None is the built-in one, as plan reads it; else there is none)."""
    # It was the schema's "--filters: unknown key (a key of model.kind amoebanet); allowed keys here: ...".
    typed = [name for name in SIZE_FLAGS if flags.get(name) is not None]
    if (recipe is None and not built_in) or not typed:
        return None
    from gpipe_cli.recipe.load import parse_override
    from gpipe_cli.recipe.schema import MODEL_SECTIONS

    model = _section(recipe, "model")
    kind = model.get("kind") if isinstance(model, dict) else None
    named = model.get("preset") if isinstance(model, dict) else None
    for item in sets:
        if set_key(item) == "model.kind":
            kind = parse_override(item)[1]
        elif set_key(item) == "model.preset":
            named = parse_override(item)[1]
    if kind is None and isinstance(named, str) and is_preset_name(named):  # the paper's recipes name a preset alone
        kind = preset(named)[0]
    if not isinstance(kind, str) or kind not in MODEL_SECTIONS:  # the schema says what is wrong with it
        return None
    return next((problem for name in typed if (problem := foreign_size(name, kind))), None)


def _replicas_note(recipe: str | None, command: str) -> list[str]:
    """A note that the recipe's data-parallel replicas are not measured (its figures were taken as the recipe's)."""
    if recipe is None:
        return []
    pipeline = _section(recipe, "pipeline")
    replicas = pipeline.get("data_parallel", 1) if isinstance(pipeline, dict) else 1
    if not isinstance(replicas, int) or replicas <= 1:
        return []
    return [f"the recipe's pipeline.data_parallel ({replicas}) is not read: {command} measures one pipeline, on the "
            "whole data.batch_size"]


# The recipe's keys are checked as `train` checks them, before torch loads; `cuts`: the command's own `--balance`
# cuts; `defaults` add to the fields' own where there is no recipe.
def shared_fields(options: type[ModelFlags], recipe: str | None, flags: Mapping[str, Any], sets: Sequence[str],
                  cuts: tuple[str, ...], command: str, **defaults: Any) -> dict[str, Any]:
    """The fields a recipe (None: the command's own model), the alias flags and `--set` give."""
    refuse([unread_problem(sets, command, {f.name for f in fields(options)}), recipe_size_problem(recipe, flags, sets)])
    own = {f.name: f.default for f in fields(options) if f.name in ALIASES and f.default not in (None, MISSING)}
    # Named by the flags, before the schema names the keys they stand for.
    k, v = (_flag_value(name, recipe, flags, sets, {**own, **defaults}.get(name, 1))
            for name in ("partitions", "virtual_stages"))
    if problem := set_balance_problem(sets, cuts):
        raise RecipeError(problem)  # as the recipe's own keys are refused
    refuse([balance_problem(flags.get("balance"), cuts), chunks_problem(flags, recipe), v_problem(recipe, flags, sets),
            None if k is None or v is None else entries_problem(
                flags.get("balance"), k, v, recipe is None and given_as("partitions", flags, sets) is None)])
    given, model_sets = settings(recipe, flags, sets, {**own, **defaults})
    notes = replaced(flags, sets) + _replicas_note(recipe, command)
    if recipe is not None and (dropped := kind_note(_section(recipe, "model"), sets)):
        notes.insert(0, dropped)
    if "balance" in given:
        named = given_as("balance", flags, sets)
        if named is None and isinstance(given["balance"], str) and given["balance"] not in cuts:
            # The recipe's own cut, which train makes: a mode typed here is refused, one written there is said.
            notes.append(f"the recipe's pipeline.balance ({given['balance']}) is a cut {command} does not make; "
                         f"it makes its own, as --balance {cuts[0]}")
            given["balance"] = None
        else:
            given["balance"] = balance_text(given["balance"], cuts, named or ALIASES["balance"])
    typed_as = {name: how for name in ALIASES if (how := given_as(name, flags, sets))}
    return {**given, **{name: flags.get(name) for name in SIZE_FLAGS}, "set": model_sets, "notes": notes,
            "typed_as": typed_as}
