"""Short flags that are aliases of recipe keys: `--partitions 4` is exactly `--set pipeline.partitions=4`."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from gpipe_cli.errors import shown
from gpipe_cli.limits import MAX_SIZE, choices
from gpipe_cli.recipe.load import RecipeError, apply_override, load_recipe, parse_override, typed_values, validate
from gpipe_cli.recipe.schema import DEFAULT_KIND, MODEL_SECTIONS, Data, Pipeline, Recipe
from gpipe_cli.recipe.yamlio import parse_value

# Flag (its parameter name) -> recipe key.
ALIASES: dict[str, str] = {
    "partitions": "pipeline.partitions", "microbatches": "pipeline.microbatches", "batch_size": "data.batch_size",
    "schedule": "pipeline.schedule", "virtual_stages": "pipeline.virtual_stages",
    "checkpoint": "pipeline.checkpoint", "offload": "pipeline.offload", "balance": "pipeline.balance",
    "layers": "model.layers", "filters": "model.filters", "d_model": "model.d_model", "ff": "model.ff",
    "heads": "model.heads", "vocab_size": "model.vocab_size", "image_size": "model.image_size",
    "seq_len": "model.max_len", "num_classes": "model.num_classes",
}
# bench and profile-memory run one pipeline: the schema's "(over all replicas)" says nothing there.
ONE_PIPELINE_BATCH = "Examples per mini-batch (N), split into the M micro-batches."
SET_HELP = "Override a recipe key: KEY=VALUE, the value read as YAML (repeatable)."
# The model's sizes: the model is resized by them, the rest of its section comes from the recipe or preset.
SIZE_FLAGS = tuple(name for name, key in ALIASES.items() if key.startswith("model."))
_SECTIONS: dict[str, tuple[type[BaseModel], ...]] = {
    "pipeline": (Pipeline,), "data": (Data,), "model": tuple(MODEL_SECTIONS.values())}
_LIST = re.compile(r"^\s*[-+]?\d+(\s*,\s*[-+]?\d+)*\s*$")  # signed: an entry below 1 is told as 0 is


def flag(name: str) -> str:
    """How a parameter name is typed, e.g. `--batch-size`."""
    return "--" + name.replace("_", "-")


def description(key: str) -> str:
    """The schema's description of a dotted recipe key (a model key: of the first model kind that has it)."""
    section, _, name = key.partition(".")
    for model in _SECTIONS[section]:
        info = model.model_fields.get(name)
        if info is not None and info.description:
            return f"{info.description}."
    raise KeyError(key)  # every alias has a description: a test holds the schema to it


def kind(name: str) -> type:
    """The type a flag takes: int for a count or size, else text (read as YAML, as `--set` reads it)."""
    section, _, key = ALIASES[name].partition(".")
    info = next(model.model_fields[key] for model in _SECTIONS[section] if key in model.model_fields)
    return int if info.annotation is int else str


def set_key(item: str) -> str:
    """The dotted key a `--set KEY=VALUE` item names."""
    return item.partition("=")[0].strip()


def given_as(name: str, flags: Mapping[str, Any], sets: Sequence[str]) -> str | None:
    """How the user gave alias `name`'s key: its flag (`--balance`), its `--set`, or None (not typed)."""
    if flags.get(name) is not None:
        return flag(name)
    return f"--set {ALIASES[name]}" if any(set_key(item) == ALIASES[name] for item in sets) else None


def balance_text(value: Any, cuts: tuple[str, ...], named: str = "pipeline.balance") -> str | None:
    """`pipeline.balance` as a command's `--balance` text: `5,5` for a list, None for `cuts` (its own cut)."""
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if value in cuts:
        return None
    raise RecipeError(f"{named}: {_cuts_by(cuts)} (got {value})")


def balance_problem(text: str | None, cuts: tuple[str, ...]) -> str | None:
    """Why `--balance text` is none of a command's `cuts` nor a list of layers per stage (None: it is one)."""
    if text is None or text in cuts or _LIST.match(text):
        return None
    return f"--balance: {_cuts_by(cuts)} (got {shown(text)})"


def set_balance_problem(sets: Sequence[str], cuts: tuple[str, ...]) -> str | None:
    """Why the last `--set pipeline.balance=...` is a word none of a command's `cuts` (None: the schema checks it)."""
    texts = [item.partition("=")[2].strip() for item in sets if set_key(item) == ALIASES["balance"]]
    try:
        value = parse_value(texts[-1], "") if texts else None
    except RecipeError:
        return None
    if not isinstance(value, str) or value in cuts:
        return None
    # The recipe's words (`params`, `memory`) are valid keys but not this command's cuts: list only its own.
    mended = f"; did you mean --set 'pipeline.balance=[{value}]'?" if _LIST.match(value) else ""
    return f"--set pipeline.balance: {_cuts_by(cuts)} (got {shown(value)}){mended}"


def _cuts_by(cuts: tuple[str, ...]) -> str:
    return f"this command cuts by {choices(cuts, 'a list of layer counts per stage')}"


def balance_help(cuts: tuple[str, ...]) -> str:
    """The `--balance` help of a command that cuts by `cuts` (the recipe's key allows more)."""
    return f"Layers per stage, e.g. 5,5, or how to cut: {' or '.join(cuts)}."


def replaced(flags: Mapping[str, Any], sets: Sequence[str]) -> list[str]:
    """A note for each alias flag given whose key a `--set` item names too: the item, which comes after it, wins."""
    last = {set_key(item): item.strip() for item in sets}
    return [f"--set {last[ALIASES[name]]} replaces {flag(name)} {value}" for name, value in flags.items()
            if value is not None and ALIASES[name] in last]


def as_sets(flags: Mapping[str, Any]) -> list[str]:
    """The `--set KEY=VALUE` items that the alias flags given (not None) stand for."""
    return [f"{ALIASES[name]}=" + _as_yaml(name, str(value)) for name, value in flags.items() if value is not None]


def _as_yaml(name: str, text: str) -> str:
    """A flag's text as the YAML of its `--set` item: `--balance 5,5` is [5, 5]; a word stays the word typed."""
    if name == "balance" and _LIST.match(text):
        return f"[{text}]"
    # YAML reads `--offload yes` as true and `--schedule null` as null: an error would show a value never typed.
    if kind(name) is str:
        try:
            value = parse_value(text, flag(name))
        except RecipeError as exc:  # said where the item is read, but for a word that opens a list (`--schedule
            # '[a'`): a flag takes words, so it is refused as any other word the flag does not take
            return json.dumps(text) if "is not valid YAML" in str(exc) else text
        if value is None or isinstance(value, bool):
            return json.dumps(text)
    return text


# The recipe is validated with the flags and `--set` items applied, as `train` reads it; a bad flag value is named
# by the flag. Without a recipe, `defaults` (by flag name) stand for it and the model's keys are left to the command.
def settings(path: str | None, flags: Mapping[str, Any], sets: Sequence[str],
             defaults: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What a recipe and `--set` say of the aliased keys, by flag name, and the `--set` items of the model section."""
    given_flags = as_sets({name: flags[name] for name in flags if name not in SIZE_FLAGS})
    items = [*given_flags, *sets]
    keys = [parse_override(item)[0] for item in items]
    model_sets = [item for item, key in zip(items, keys) if key.startswith("model.")]
    try:
        if path is not None:  # every flag before the --set items, which win where both name a key
            sized = [*given_flags, *as_sets({name: flags[name] for name in flags if name in SIZE_FLAGS}), *sets]
            recipe = load_recipe(path, sized, check_data=False)
            return {name: _value(recipe, key) for name, key in ALIASES.items() if name not in SIZE_FLAGS}, model_sets
        raw: dict[str, Any] = {"model": {"kind": DEFAULT_KIND}, "data": {"batch_size": MAX_SIZE}}
        for item in [*as_sets(defaults), *(item for item in items if item not in model_sets)]:
            apply_override(raw, item)
        recipe = validate(raw, "", check_data=False, typed=typed_values(items), stand_in=True)  # the model: --model's
    except RecipeError as exc:
        raise by_flag(exc, flags, None if path is not None else
                      {n: v for n, v in defaults.items() if ALIASES[n] not in keys}, sets) from None
    given = {name: _value(recipe, key) for name, key in ALIASES.items() if key in keys and name not in SIZE_FLAGS}
    return given, model_sets


def by_flag(error: RecipeError, flags: Mapping[str, Any], defaults: Mapping[str, Any] | None = None,
            sets: Sequence[str] = ()) -> RecipeError:
    """`error` with each aliased key named by its flag (a typed one, or one of `defaults` left untyped) and without the
    empty label of no recipe; a key that a `--set` item also names is that item's (it comes after the flag)."""
    message = str(error).removeprefix(": ")
    overridden = {set_key(item) for item in sets}
    typed = [name for name, value in flags.items() if value is not None and ALIASES[name] not in overridden]
    for name in typed:
        head, sep, rest = message.partition(f"{ALIASES[name]}:")
        if sep and (not head or head.endswith((": ", "--set "))):  # the key leads (after the recipe's name)
            return RecipeError(f"{flag(name)}:{rest}")
    if any(message.startswith(f"--set {ALIASES[name]} ") for name in typed):  # a check across keys a flag leads
        message = message.removeprefix("--set ")
    for name in typed:  # each key named by the flag that gave it: `--microbatches (6) ... --partitions (4)`
        message = message.replace(f"--set {ALIASES[name]} (", f"{flag(name)} (").replace(f"{ALIASES[name]} (",
                                                                                         f"{flag(name)} (")
        message = message.replace(f"--set {ALIASES[name]} ", f"{flag(name)} ")  # `--balance has 3 entries ...`
    for name, value in (defaults or {}).items():  # without a recipe the command's default stood for it
        message = message.replace(f"{ALIASES[name]} ({value})", f"{flag(name)} ({value}, its default)")
    return RecipeError(message)


def _value(recipe: Recipe, key: str) -> Any:
    section, _, name = key.partition(".")
    return getattr(getattr(recipe, section), name)
