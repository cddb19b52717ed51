"""The model a benchmark or a memory profile runs: a preset, a family name or a recipe's model, resized."""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gpipe_cli import sizing
from gpipe_cli.contention import Load
from gpipe_cli.errors import UserError, cut, near, shown
from gpipe_cli.estimate import kept
from gpipe_cli.estimate.model_flags import SIZE_PARAMS, foreign_size, size_limits
from gpipe_cli.limits import outside, refuse, words
from gpipe_cli.models import families
from gpipe_cli.models.base import Batch, ModelSpec
from gpipe_cli.models.presets import is_preset_name, names_help, preset
from gpipe_cli.models.registry import allowed_params, build_model, resolve_preset
from gpipe_cli.pipeline.layer_profile import WARMUP_ROUNDS, profile_layers
from gpipe_cli.progress import SAY_BELOW_S, phase_line, said_if_slow
from gpipe_cli.recipe.aliases import flag
from gpipe_cli.recipe.load import parse_override

TIMING_S = 2.0  # the most a layer's timing may take at the quick rate (real layers may reach a quarter of it)
REPEATS = 3  # timed rounds per layer, of which the median counts
# Forward-equivalents a layer's timing runs per example: REPEATS timed and WARMUP_ROUNDS untimed rounds of two
# forwards without a graph, one with, and a backward (two), then one forward for its memory.
TIMING_ROUNDS = 5 * (REPEATS + WARMUP_ROUNDS) + 1

# A family name stands for its model of the paper's speed table (Table 2).
FAMILIES = {kind: family.paper_preset for kind, family in families.FAMILIES.items()}



@dataclass(frozen=True)
class Subject:
    """A model to measure: its kind and build parameters, and how the user named it."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    def build(self) -> ModelSpec:
        """The ModelSpec (layers are built lazily by the engine)."""
        try:
            return build_model(self.kind, **self.params)
        except ValueError as exc:
            raise UserError(f"--model {self.label}: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        """The subject as plain data (what a worker needs to rebuild it)."""
        return {"kind": self.kind, "params": dict(self.params), "label": self.label}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Subject:
        """The inverse of `to_json`."""
        return Subject(str(data["kind"]), dict(data["params"]), str(data.get("label", "")))


def _mode(model: str) -> int:
    """The file mode `--model` names as a path (0: none, or a name no path can have, e.g. too long)."""
    try:
        return os.stat(model).st_mode
    except (OSError, ValueError):
        return 0


def model_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` items as model parameters (a leading `model.` is optional)."""
    out = {}
    for item in items:
        key, value = parse_override(item)  # the recipe's `--set` parser: one syntax everywhere
        key = key.removeprefix("model.")
        if "." in key:
            raise UserError(f"--set expects KEY=VALUE naming a model parameter, e.g. model.dropout=0 "
                            f"(got {shown(item)})")
        if key in ("kind", "preset"):  # the recipe's keys for what this command's --model names
            raise UserError(f"--set {shown(item)}: the model is chosen by --model (a family or a preset, e.g. "
                            f"--model {value if key == 'kind' and value in FAMILIES else 'amoebanet'})")
        out[key] = value
    return out


def unknown_param(key: str, allowed: Sequence[str], where: str = "") -> str:
    """A `--set` model key no model of the kind has, in train's words: near spellings first, then what is allowed."""
    close = near(key, allowed)
    return (f"--set model.{key}: unknown key{f' (did you mean model.{close[0]}?)' if close else ''}; allowed keys "
            f"{where or 'here'}: {', '.join(allowed)}")


def check_limits(kind: str, params: Mapping[str, Any], named: Mapping[str, str], source: str) -> None:
    """Refuse a size beyond the recipe schema's limits; `named` maps a parameter to its flag, others are `source`'s."""
    # A recipe could not hold it either, and building billions of layers would take the machine's memory and time
    # before anything is said.
    for param, (low, high) in size_limits(kind).items():
        if param not in params:
            continue
        value, name = params[param], named.get(param, f"{source}: {param}")
        if isinstance(value, bool) or not isinstance(value, int):  # `--set model.layers=true`, or left empty
            raise UserError(f"{name}: must be an integer {words(f'>= {low}', f'<= {high}')} (got {shown(value)})")
        problem = outside(name, value, low, high)
        if problem:
            raise UserError(problem)


def resolve(model: str, sizes: Mapping[str, int | None] | None = None, overrides: Sequence[str] = ()) -> Subject:
    """The subject `--model`, the size flags (None: keep) and `--set` items describe."""
    if model.endswith((".yaml", ".yml")) or stat.S_ISREG(_mode(model)):  # a recipe file rather than a preset
        from gpipe_cli.recipe.load import load_recipe

        recipe = load_recipe(model, [item if "." in item.partition("=")[0] else f"model.{item}" for item in overrides])
        kind, params = str(recipe.model.kind), recipe.model.model_dump(exclude={"kind", "preset"})
    else:
        name = FAMILIES.get(model, model)
        if not is_preset_name(name):
            if stat.S_ISDIR(_mode(model)):  # as `gpipe plan DIR` says it: the user meant a recipe
                raise UserError(f"--model {cut(model)}: is a directory, not a recipe file")
            raise UserError(f"--model: unknown model preset {shown(model)}; use a family ({', '.join(FAMILIES)}), "
                            f"a recipe file (.yaml), {names_help()}")
        given = model_overrides(overrides)
        allowed = allowed_params(preset(name)[0])
        refuse([next((unknown_param(key, allowed) for key in given if key not in allowed), None)])
        kind, params = resolve_preset(name, **given)
    typed = [item.partition("=")[0].strip() for item in overrides]  # syntax: checked above
    named = {key.removeprefix("model."): f"--set {key}" for key in typed}  # named as the user typed them
    for name, value in (sizes or {}).items():
        if value is None or SIZE_PARAMS[name] in named:  # a flag comes before the --set items, which win
            continue
        param = SIZE_PARAMS[name]
        refuse([foreign_size(name, kind)])
        params[param], named[param] = value, flag(name)
    check_limits(kind, params, named, f"--model {cut(model)}")
    subject = Subject(kind, params, model)
    try:
        subject.build()  # validate now, with a one-line message
    except UserError as exc:
        raise UserError(by_setting(str(exc), f"--model {model}: ", named)) from None
    return subject


def by_setting(message: str, label: str, named: Mapping[str, str]) -> str:
    """A builder's `label` + `PARAM must ...` as `--set model.PARAM: must ...` where the user typed PARAM."""
    text = message.removeprefix(label).removeprefix("AmoebaNet ")  # its builder names the family first
    for param, where in named.items():
        if text.startswith(f"{param} must "):
            return f"{where}: {text.removeprefix(param + ' ')}"
    # `d_model (32) must be divisible by heads (3)`: each part as the user set it, else as a recipe names it.
    parts = re.findall(r"\b([a-z_]+) \(", text)
    if text != message and parts and any(part in named for part in parts):
        return re.sub(r"\b([a-z_]+) \(", lambda m: f"{named.get(m[1], 'model.' + m[1])} (", text)
    return message


def naming_the_sized(message: str, subject: Subject) -> str:
    """A refused cut of a model sized to this machine, which the user never chose, naming that model."""
    return (f"{message} (of {families.of(subject.kind).title(subject.params, False)}, the model "
            f"sized to this machine; choose with --model/--layers)")


# Each member sizing tries is traced on the meta device, kept for the next launch: the first AmoebaNet bench was
# 16 s of silence on a 2-core CPU; with the figures kept, a choice takes about a second.
SLOW_CHOICE_S = 5.0


def to_measure(model: str, sizes: Mapping[str, int | None], settings: Sequence[str],
               judge: Callable[[sizing.Candidate], sizing.Verdict], stages: int,
               sized: bool, chunks: int = 1,
               say: Callable[[str], None] = lambda line: None) -> tuple[Subject, str, sizing.Verdict]:
    """The model a command measures (`sized`: to this machine by `judge`, deep enough for `stages` x `chunks`), its
    announcement and its verdict (`say`: where a slow choice is explained)."""
    if sized:
        with said_if_slow(say, "choosing a model this machine can measure (each size tried is traced once, then "
                               "kept)", SLOW_CHOICE_S):
            choice = sizing.choose(model, judge, stages, model_overrides(settings), chunks)
        return Subject(choice.kind, choice.params, model), choice.note, choice.verdict
    subject = resolve(model, sizes, settings)
    return subject, "", judge(sizing.candidate(subject.kind, subject.params))


def example_batch(spec: ModelSpec, examples: int, seed: int) -> tuple[Batch, Any]:
    """The same random (inputs, targets) on every rank that asks with the same seed (on the CPU)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return spec.example_batch(examples, "cpu")


def paced(machine: sizing.Machine, spec: ModelSpec, kind: str, examples: int, seed: int,
          say: Callable[[str], None] | None = None) -> sizing.Machine:
    """`machine` with the rate this model's layers reach here now: the heaviest of its first layers timed (`say`:
    where a timing long enough to wait on is announced)."""
    # The quick matrix-product rate fits in cache and misses a busy machine: real layers reach a fraction of it,
    # several times less on a shared CPU.
    layers = kept.summary(spec, 2).layers[:3]
    flops = [layer.flops for layer in layers]  # per example; the prefix stays cheap
    index = max(range(len(flops)), key=flops.__getitem__)
    # Timed on fewer examples where the quick rate puts it past TIMING_S: a layer that large reaches its rate on
    # them (the paper's Transformer-L took two silent minutes on 8 examples on a 2-core CPU).
    per_example = TIMING_ROUNDS * sum(flops[:index + 1]) / machine.flops_per_s
    if per_example > 0:
        examples = max(min(examples, int(TIMING_S / per_example)), families.of(kind).least_examples)
    if say is not None and per_example * examples >= SAY_BELOW_S:  # not a phase: its pace is what it measures
        say(phase_line(f"timing a '{layers[index].name}' layer on {examples} example{'s' * (examples > 1)} here",
                       per_example * examples))
    inputs, _ = example_batch(spec, examples, seed)
    load = Load()
    layer = profile_layers(spec.factories()[:index + 1], inputs, seed, "cpu", repeats=REPEATS)[index]  # medians
    seconds = layer.forward + layer.backward - 3 * machine.call_seconds  # less the fixed cost, charged apart
    if flops[index] <= 0 or seconds <= 0:
        return machine
    rate = 3 * flops[index] * examples / seconds
    # The machine's rate is this timing's now, and so is what others took from it.
    return dataclasses.replace(machine, flops_per_s=rate / sizing.layer_efficiency(machine.kind, kind),
                               load=load.finish())
