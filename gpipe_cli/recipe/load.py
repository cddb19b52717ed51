"""Read a YAML recipe, apply `--set` overrides and presets, and validate it into a typed Recipe."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import types
import typing
from collections.abc import Collection, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from gpipe_cli.errors import as_typed, cut, near, not_utf8, shown, shown_path
from gpipe_cli.limits import words
from gpipe_cli.models.presets import preset
from gpipe_cli.recipe.schema import (
    DEFAULT_KIND,
    LOCAL_SOURCES,
    MODEL_SECTIONS,
    PLANNING,
    SOURCE_FILES,
    STAND_IN,
    Recipe,
    TransformerModel,
    bounds,
)
from gpipe_cli.recipe.yamlio import RecipeError, dump, parse_document, parse_value, read_recipe_file

__all__ = ["RecipeError", "apply_override", "default_recipe_text", "load_recipe", "parse_override",
           "recipe_label", "recipe_read", "recipe_yaml", "typed_values", "validate"]

def default_recipe_text() -> str:
    """The small recipe `gpipe train` runs when given none."""
    return resources.files("gpipe_cli.recipe").joinpath("quickstart.yaml").read_text()


def recipe_read(path: str | Path | None) -> tuple[str | Path | None, str]:
    """The file a command reads its recipe from (None: not a file) and what to call it: an output must not be it."""
    if path is not None:
        return path, "the recipe itself"
    built_in = resources.files("gpipe_cli.recipe").joinpath("quickstart.yaml")
    return (built_in if isinstance(built_in, Path) else None), "the built-in recipe"


def recipe_label(path: str | Path | None) -> str:
    """How errors name a recipe."""
    return "quickstart.yaml (built in)" if path is None else cut(str(path), 200)


# Every problem is a RecipeError of one line: the file, the key path, the bad value and what is allowed.
def load_recipe(path: str | Path | None, overrides: Sequence[str] = (), check_data: bool = True,
                planning: bool = False) -> Recipe:
    """Load, override and validate a recipe (None: the embedded quick-start recipe)."""
    # check_data=False skips the check that local data and tokenizer paths exist (to rebuild a model); `planning`:
    # the pipeline's M and D are the plan's to choose, so they need not fit data.batch_size.
    label = recipe_label(path)
    if path is not None and not str(path).strip():  # Path("") would read as the current directory
        raise RecipeError(f"the recipe path is {'only spaces' if str(path) else 'empty'}; give a YAML file, or leave "
                          "it out (train, validate and plan: the built-in quick-start recipe; bench and "
                          "profile-memory: their --model)")
    if isinstance(path, str) and path.endswith(os.sep) and os.path.isfile(path.rstrip(os.sep)):
        # Path() drops the slash, and the file was read; a trailing slash names a directory to every other tool.
        raise RecipeError(f"{path}: a file named as a directory (the trailing '{os.sep}'); give {path.rstrip(os.sep)}")
    for item in overrides:  # an unquoted `--set k=[3, 3]` leaves `3]` for the recipe: the cause is told, not that
        parse_override(item)
    raw = parse_yaml(default_recipe_text() if path is None else read_recipe_file(Path(path)), label, overrides)
    return validate(raw, label, check_data, Path(path).parent if path is not None else None, planning,
                    typed_values(overrides))


def typed_values(overrides: Sequence[str]) -> dict[str, str]:
    """The `--set` items' values as typed, by key: an error names the `--set` and shows what was typed (a mapping's
    keys too: `--set 'model={heads: 5}'` typed model.heads, not model.d_model)."""
    typed: dict[str, str] = {}
    for key, _, text in (item.partition("=") for item in overrides):
        typed[key.strip()] = text.strip()
        with contextlib.suppress(RecipeError):  # text that is no YAML is said as it is
            typed.update(_leaves(key.strip(), parse_value(text, "")))
    return typed


def _leaves(key: str, value: Any) -> dict[str, str]:
    """The keys a mapping value gives under `key`, with their values as YAML would write them."""
    if not isinstance(value, dict):
        return {}
    out: dict[str, str] = {}
    for name, item in value.items():
        if not isinstance(name, str):  # `{1: 2}`: refused for its key, which is what the line shows
            continue
        out[f"{key}.{name}"] = item if isinstance(item, str) else json.dumps(item, default=str)
        out.update(_leaves(f"{key}.{name}", item))
    return out


def recipe_yaml(recipe: Recipe) -> str:
    """The resolved recipe (every default filled in) as YAML."""
    return dump(recipe.model_dump(mode="json"))


def parse_yaml(text: str, label: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The recipe's YAML as a mapping, with the `--set KEY=VALUE` items of `overrides` applied."""
    data = parse_document(text, label)
    if data is None:
        raise RecipeError(f"{label}: the recipe is empty; give at least one section (model, data, train...), "
                          "every key left out takes its default")
    if not isinstance(data, dict):
        raise RecipeError(f"{label}: a recipe must be a mapping of sections (got {type(data).__name__})")
    # A section whose keys are all commented out reads as null: they take their defaults, as when it is left out.
    for section in [k for k, v in data.items() if v is None and (k == "model" or k in Recipe.model_fields and
                                                                 _subsection(Recipe, k, data) is not None)]:
        del data[section]
    for item in overrides:  # against the recipe as written, before any --set changes it
        _written_as_a_value(data, parse_override(item)[0], label)
    # Another model.kind first: it starts the section anew, which would drop a model key set before it.
    for item in sorted(overrides, key=lambda item: item.partition("=")[0].strip() != "model.kind"):
        apply_override(data, item)
    return data


def _written_as_a_value(data: dict[str, Any], key: str, label: str) -> None:
    """Refuse, naming the recipe, a `--set` into a section that the recipe itself writes as a value (`train: 5`)."""
    # Every top-level key is a section; below, a value where a --set sees a section is the --set's mistake.
    section, dot, _ = key.partition(".")
    value = data.get(section)
    if dot and value is not None and not isinstance(value, dict):
        raise RecipeError(f"{label}: {section}: must be a mapping (got {cut(str(value))})")


def parse_override(item: str) -> tuple[str, Any]:
    """One `--set KEY=VALUE` as (dotted key, value); VALUE is read as YAML, e.g. `[3, 3]`, `1e-3`, `null`."""
    item = as_typed(item)
    where = not_utf8(item)
    if where is not None:
        raise RecipeError(f"--set {shown(item)}: not UTF-8 text ({where}); a recipe is UTF-8 text, in a file or on "
                          "the command line")
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError(f"--set expects KEY=VALUE with a dotted key, e.g. pipeline.microbatches=8 "
                          f"(got {shown(item)})")
    return key, parse_value(text, f"--set {cut(key)}", key)


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `--set KEY=VALUE` (VALUE parsed as YAML) to the raw recipe."""
    key, value = parse_override(item)
    model = raw.get("model")
    if key == "model.kind" and isinstance(model, dict) and _kind_of(model) not in (None, value):
        # Another kind makes the section anew, as `--set 'model={kind: ...}'` does: the keys of the kind it
        # replaces were each refused (`model.layers: must be a positive multiple of 3 (and 7 more problems)`).
        raw["model"] = {"kind": value}
        return
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:  # absent, or an optional section left off (`profile: null` in a resolved recipe)
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"--set {cut(key)}: {shown(part)} is a value, not a section")
        node = child
    node[parts[-1]] = _merged(node.get(parts[-1]), value)


def recipe_kind_note(path: str | Path | None, overrides: Sequence[str]) -> str | None:
    """`kind_note` of the recipe at `path` (None: the built-in one), once it has loaded."""
    if not any(parse_override(item)[0] == "model.kind" for item in overrides):
        return None
    data = parse_document(default_recipe_text() if path is None else read_recipe_file(Path(path)), recipe_label(path))
    return kind_note(data.get("model") if isinstance(data, dict) else None, overrides)


def kind_note(model: Any, overrides: Sequence[str]) -> str | None:
    """The note for a `--set model.kind` that starts the recipe's model section (`model`, as written) anew."""
    kinds = [value for key, value in map(parse_override, overrides) if key == "model.kind"]
    if not isinstance(model, dict) or not kinds or _kind_of(model) in (None, kinds[-1]):
        return None
    left = [str(key) for key in model if key != "kind"]
    if not left:
        return None
    return (f"--set model.kind={kinds[-1]} starts the model section anew: the recipe's model keys of kind "
            f"{_kind_of(model)} ({', '.join(left)}) are left out; {kinds[-1]}'s keys not set take their defaults")


def _kind_of(model: dict[str, Any]) -> Any:
    """The kind a model section names: its own, else its preset's (None: neither, or an unknown preset)."""
    if model.get("kind") is not None or model.get("preset") is None:
        return model.get("kind")
    try:
        return preset(str(model["preset"]))[0]
    except ValueError:
        return None


def _merged(old: Any, new: Any) -> Any:
    """`new` over `old`: a mapping over a section sets the keys it names and keeps the others (as a dotted key
    would), unless it makes the section anew (another `kind`, or a `preset`); any other value replaces."""
    if not isinstance(old, dict) or not isinstance(new, dict) or new.get("kind", old.get("kind")) != old.get("kind") \
            or new.get("preset") is not None:
        return new
    return {**old, **{key: _merged(old.get(key), value) for key, value in new.items()}}


def _preset_section(model: dict[str, Any], label: str, typed: Collection[str]) -> dict[str, Any]:
    """The model section with its preset's parameters filled in under the keys the recipe gives (`typed`: --set)."""
    explicit = {k: v for k, v in model.items() if k not in ("kind", "preset")}
    try:
        kind, params = preset(str(model["preset"]))
    except ValueError as exc:
        raise RecipeError(f"{label}: {'--set ' if 'model.preset' in typed else ''}model.preset: {exc}") from None
    if model.get("kind") not in (None, kind):
        raise RecipeError(f"{label}: model.kind is {shown(model['kind'])} but preset {shown(model['preset'])} "
                          f"is a model of kind {shown(kind)}; leave model.kind out or set it to {shown(kind)}")
    known = {k: v for k, v in params.items() if k in MODEL_SECTIONS[kind].model_fields}
    return {"kind": kind, "preset": model["preset"], **known, **explicit}


def validate(raw: dict[str, Any], label: str, check_data: bool = True, folder: Path | None = None,
             planning: bool = False, typed: dict[str, str] | None = None, stand_in: bool = False) -> Recipe:
    """Validate a raw recipe mapping (read from `folder`, `typed`: --set values), raising one RecipeError line."""
    model = raw.get("model")
    if isinstance(model, dict) and model.get("preset"):
        raw = {**raw, "model": _preset_section(model, label, typed or {})}
    recipe = _validated(raw, label, planning, typed, stand_in)
    if not check_data:
        return recipe
    data, model = recipe.data, recipe.model

    def given(key: str) -> str:  # a key is named by the --set that gave it, as the schema's checks name it
        return f"--set {key}" if key in (typed or {}) else key

    # A window asked for is never cut without a word (the default follows the model); bench, profile-memory and
    # plan read no data, so only a recipe whose data is read is held to it.
    if isinstance(model, TransformerModel) and model.arch == "decoder-only" and data.seq_len > model.max_len:
        raise RecipeError(f"{label}: {given('data.seq_len')} ({data.seq_len}) must be <= model.max_len "
                          f"({model.max_len}): a language model reads at most model.max_len tokens at once")
    # os.path.exists: False (not an exception) for names too long for the file system
    if data.source in LOCAL_SOURCES and data.path and not os.path.exists(data.path):
        wild = any(c in Path(data.path).name for c in "*?[")  # a glob reaches us unexpanded from a recipe
        raise RecipeError(f"{label}: {given('data.path')}: no such file or directory: {shown_path(data.path)}"
                          + ("; patterns are not expanded: give the folder that holds the files" if wild
                             else _beside(data.path, folder)))
    if data.source in SOURCE_FILES and data.path and data.path.lower().endswith(".csv") and os.path.isfile(data.path):
        raise RecipeError(f"{label}: {given('data.path')}: {shown_path(data.path)} is a .csv file, which no source "
                          "reads (a comma inside a sentence would split it); save it tab-separated (.tsv, data.source "
                          "tsv), as JSON lines (jsonl) or as parquet")
    if data.source in SOURCE_FILES and data.path and (wrong := _other_sources_file(data.source, data.path)):
        typed_source = "data.source" in (typed or {})
        fix = " or ".join(f"--set data.source={other}" if typed_source else f"data.source: {other}" for other in wrong)
        raise RecipeError(f"{label}: {given('data.path')}: {shown_path(data.path)} is a {Path(data.path).suffix} file, "
                          f"which data.source {' or '.join(wrong)} reads (data.source {data.source} reads "
                          f"{_either(SOURCE_FILES[data.source])} files); use {fix}")
    if data.source in SOURCE_FILES and data.path and os.path.isdir(data.path) and \
            not _holds_any(Path(data.path), SOURCE_FILES[data.source]):  # the ranks found it so after starting
        raise RecipeError(f"{label}: {given('data.path')}: no {_either(SOURCE_FILES[data.source])} files under "
                          f"{shown_path(data.path)}, which data.source {data.source} reads; give a folder that holds "
                          "some, or one such file")
    if data.source in SOURCE_FILES and data.path and os.path.exists(data.path):  # splits by name: the ranks found
        from gpipe_cli.data.sources import split_files  # a split that picks nothing only after starting
        from gpipe_cli.errors import DataError

        try:
            split_files(Path(data.path), SOURCE_FILES[data.source], data)
        except DataError as exc:
            raise RecipeError(f"{label}: {exc}") from None
    if data.source == "imagefolder" and data.path and os.path.isdir(data.path):  # its ranks found it after starting
        from gpipe_cli.data.image_folder import scan
        from gpipe_cli.errors import DataError

        try:
            scan(Path(data.path), tuple(filter(None, (data.train_split, data.eval_split))))
        except DataError as exc:
            raise RecipeError(f"{label}: {given('data.path')}: {exc}") from None
    if data.tokenizer and not os.path.exists(data.tokenizer):
        raise RecipeError(f"{label}: {given('data.tokenizer')}: no such sentencepiece model: "
                          f"{shown_path(data.tokenizer)}{_beside(data.tokenizer, folder)}")
    if data.tokenizer and os.path.isdir(data.tokenizer):
        raise RecipeError(f"{label}: {given('data.tokenizer')}: {shown_path(data.tokenizer)} is a directory; give the "
                          "sentencepiece model file (.model) in it")
    if data.tokenizer and not isinstance(model, TransformerModel):  # it was read by nothing, without a word
        raise RecipeError(f"{label}: {given('data.tokenizer')}: an image model reads no tokenizer; leave it out")
    if data.tokenizer:  # a file that is no model was told only once the ranks had started, naming no key
        from gpipe_cli.data.tokenizer import Tokenizer
        from gpipe_cli.errors import DataError

        try:
            pieces = Tokenizer.load(data.tokenizer).vocab_size
        except DataError as exc:
            raise RecipeError(f"{label}: {given('data.tokenizer')}: {exc}") from None
        if isinstance(model, TransformerModel) and pieces > model.vocab_size:  # train said so once its ranks ran
            raise RecipeError(f"{label}: {given('data.tokenizer')}: the tokenizer has {pieces} pieces but "
                              f"{given('model.vocab_size')} is {model.vocab_size}; raise model.vocab_size or use a "
                              "smaller tokenizer")
    return recipe


def _holds_any(folder: Path, suffixes: Sequence[str]) -> bool:
    """Whether a file of one of `suffixes` (any case) is anywhere under `folder`; stops at the first."""
    try:
        return any(p.name.lower().endswith(tuple(suffixes)) and p.is_file() for p in folder.rglob("*"))
    except OSError:  # an unreadable folder: the loader says so in its words
        return True


def _other_sources_file(source: str, path: str) -> list[str]:
    """The other sources whose files a single file `path` is, by its suffix, where `source`'s is not ([] if any)."""
    # Each source reads any one file it is given: text would train on a .jsonl file's raw JSON without a word.
    suffix = Path(path).suffix.lower()
    if suffix in SOURCE_FILES[source] or not os.path.isfile(path):  # a folder's files are picked by suffix
        return []
    return [other for other, suffixes in SOURCE_FILES.items() if suffix in suffixes]


def _either(items: Sequence[str]) -> str:
    """`a, b or c`."""
    return f"{', '.join(items[:-1])} or {items[-1]}" if len(items) > 1 else items[0]


def _beside(path: str, folder: Path | None) -> str:
    """A hint for a relative path missing here that the recipe's folder holds (paths are read from here)."""
    if folder is None or os.path.isabs(path) or folder.resolve() == Path.cwd() or not (folder / path).exists():
        return ""
    return f" (a relative path is read from the directory gpipe runs in; the recipe's folder holds {folder / path})"


def _validated(raw: dict[str, Any], label: str, planning: bool = False, typed: dict[str, str] | None = None,
               stand_in: bool = False) -> Recipe:
    try:
        return Recipe.model_validate(raw, context={PLANNING: planning, STAND_IN: stand_in})
    except ValidationError as exc:
        errors = _unknown_first(exc.errors())
        key = ".".join(str(p) for p in _path(errors[0]["loc"]))
        # An unknown section is named by the --set items under it too (`--set pipline.partitions=2`).
        typed = typed or {}
        under = [v for k, v in typed.items() if k.startswith(key + ".")]
        text = typed.get(key, under[0] if under and errors[0]["type"] == "extra_forbidden" else None)
        message = _describe(dict(errors[0]), raw, text)
        more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
        # A --set of a whole section (`model={heads: 5}`) gave the keys it holds, not the others the line names.
        leaves = {k for k in typed if not any(other.startswith(k + ".") for other in typed)}
        named = (text is not None and (_leading(message) == key or message.startswith(key + ":"))) or \
            led_by(message, leaves)
        # A check across keys names the --set of a later key it reads, `... --set model.heads (5)`, but not one of
        # a product, whose figures stand after its last factor (a leading key is named in front, below).
        said = re.sub(r"(?<! x )\b([a-z_]+(?:\.[a-z_]+)+) \(",
                      lambda m: f"--set {m[1]} (" if m[1] in leaves and not (named and m.start() == 0) else m[0],
                      message)
        if not named:  # any other --set the line names, after it
            given = [f"--set {k}={typed[k]}" for k in sorted(leaves)
                     if re.search(rf"(?<![\w.]){re.escape(k)}\b", message) and f"--set {k} " not in said]
            said += f" (from {', '.join(given)})" if given else ""
        message = said
        raise RecipeError(f"{label}: {'--set ' if named else ''}{message}{more}{_bracketed(key, text, raw)}") from None


def _bracketed(key: str, text: str | None, raw: dict[str, Any]) -> str:
    """`; did you mean --set 'KEY=[3,3]'?` for a --set value typed as a list without brackets, where KEY takes one."""
    if text is None or "," not in text or not isinstance(parse_value(text, ""), str) \
            or not _takes_list(key.split("."), raw):
        return ""
    return f"; did you mean --set {shlex.quote(f'{key}=[{text}]')}?"


def _takes_list(loc: Sequence[str], raw: dict[str, Any]) -> bool:
    """Whether the key at `loc` takes a list, alone or as one of its forms (pipeline.balance: a word or a list)."""
    section = _section_model(loc, raw)
    info = section.model_fields.get(loc[-1]) if section is not None else None
    if info is None:
        return False
    annotation = info.annotation
    forms = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    return any(typing.get_origin(form) in (list, tuple) for form in forms)


def _unknown_first(errors: list[Any]) -> list[Any]:
    """The errors, an unknown key first where its section also misses a key: the misspelling is the cause."""
    missing = {tuple(_path(e["loc"])[:-1]) for e in errors if e["type"] == "missing"}
    return sorted(errors, key=lambda e: not (e["type"] == "extra_forbidden" and tuple(_path(e["loc"])[:-1]) in missing))


def _leading(message: str) -> str | None:
    """The dotted key a line starts with (`model.heads must ...`), if any."""
    leading = re.match(r"[a-z_]+(\.\w+)*", message)
    return leading[0] if leading else None


def led_by(message: str, keys: Collection[str]) -> bool:
    """Whether an error starts with one of `keys`: a check across keys then names the --set of its first key."""
    # `pipeline.balance has 1 entries but ...`, `pipeline.partitions: cannot cut 6 pipeline layers into 100 partitions`
    leading = _leading(message)
    # A key under a section that a --set gave whole (`--set 'train.profile={steps: [0]}'`) is that --set's too.
    return leading is not None and "." in leading and any(leading == key or leading.startswith(key + ".")
                                                          for key in keys)


def _section_model(loc: Sequence[str | int], raw: dict[str, Any]) -> type[BaseModel] | None:
    """The schema class of the section that holds the key at `loc`."""
    model: type[BaseModel] | None = Recipe
    for part in loc[:-1]:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model = _subsection(model, part, raw)
    return model


def _subsection(model: type[BaseModel], part: str, raw: dict[str, Any]) -> type[BaseModel] | None:
    """The schema class of `model`'s field `part` when it is a section (the model's by its kind), else None."""
    if model is Recipe and part == "model":
        kind = raw.get("model", {}).get("kind", DEFAULT_KIND) if isinstance(raw.get("model"), dict) else None
        return MODEL_SECTIONS.get(str(kind))
    annotation = model.model_fields[part].annotation
    # An optional section (`Profile | None`) is its model.
    members = [a for a in (typing.get_args(annotation) or (annotation,)) if a is not type(None)]
    first = members[0] if len(members) == 1 else None
    return first if isinstance(first, type) and issubclass(first, BaseModel) else None


def _keys(raw: dict[str, Any], model: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    """Every key the schema allows, dotted (the model section's for the recipe's kind)."""
    out = []
    for name in model.model_fields:
        sub = _subsection(model, name, raw)
        out += _keys(raw, sub, f"{prefix}{name}.") if sub is not None else [prefix + name]
    return out


def key_of_flag(option: str, close: bool = False) -> str | None:
    """The one recipe key an option typed as a flag names (`--steps`: train.steps; `close`: `--step` too), else None."""
    name = option.lstrip("-").partition("=")[0].replace("-", "_")
    every = {k for kind in MODEL_SECTIONS for k in _keys({"model": {"kind": kind}})}
    names = {k.rpartition(".")[2] for k in every}
    if close and name not in names:  # as near as an unknown key's (did you mean ...?)
        name = next(iter(near(name, names)), name)
    keys = {k for k in every if k.rpartition(".")[2] == name}
    nearest = [k for k in keys if k.count(".") == min(k.count(".") for k in keys)]  # train.steps, not its profile's
    return nearest[0] if len(nearest) == 1 else None


def unknown_key(key: str) -> str | None:
    """`KEY: unknown key (did you mean ...?)` where no recipe, of any model kind, has `key`; else None."""
    if any(key in _keys({"model": {"kind": kind}}) for kind in MODEL_SECTIONS):
        return None
    loc = key.split(".")
    return f"{key}: unknown key{_nearest(loc, _section_model(loc, {}), {})}"


def _nearest(loc: Sequence[str | int], section: type[BaseModel] | None, raw: dict[str, Any]) -> str:
    """` (did you mean KEY?)` for an unknown key: a near spelling here, or the key as another section holds it."""
    name, prefix = str(loc[-1]), "".join(f"{p}." for p in loc[:-1])
    fields = list(section.model_fields) if section else []
    # Or the start of a key here (`warmup` of warmup_steps), or a key here and more (`every_steps` of every).
    here = near(name, fields, prefix=True) or [k for k in fields if name.startswith(k + "_")][:1]
    # `train.lr` is optimizer.lr; `train.checkpoint_every` is checkpoint.every.
    elsewhere = [k for k in _keys(raw) if k.endswith("." + name) or k == name.replace("_", ".", 1)]
    if here or len(elsewhere) == 1:
        return f" (did you mean {prefix + here[0] if here else elsewhere[0]}?)"
    if 1 < len(elsewhere) <= 3:  # `steps`: train.steps, or train.profile.steps
        return f" (did you mean {', '.join(elsewhere[:-1])} or {elsewhere[-1]}?)"
    kinds = [kind for kind, model in MODEL_SECTIONS.items() if name in model.model_fields]
    if list(loc[:-1]) == ["model"] and kinds:  # model.filters in a Transformer recipe
        return f" (a key of model.kind {' or '.join(kinds)})"
    if not loc[:-1] and kinds:  # `--set positions=learned`, where the model section is of another kind
        return f" (did you mean model.{name}, a key of model.kind {' or '.join(kinds)}?)"
    return ""


def _path(loc: Sequence[str | int]) -> list[str | int]:
    # Unions and discriminated unions add their member names to the location; drop them.
    out: list[str | int] = []
    for part in loc:
        if isinstance(part, str) and (part in MODEL_SECTIONS and out == ["model"] or "[" in part or
                                      part.startswith(("function-", "tagged-union"))):
            continue
        out.append(part)
    return out


_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than": ("<", "lt"),
           "less_than_equal": ("<=", "le")}


def _allowed_range(loc: Sequence[str | int], raw: dict[str, Any]) -> str | None:
    """The key's whole allowed range as words, e.g. `between 1 and 65536` (None: not one plain key)."""
    section = _section_model(loc, raw)
    name = loc[-1] if loc else None
    if section is None or not isinstance(name, str) or name not in section.model_fields:
        return None
    found = bounds(section.model_fields[name])
    low = f">= {found['ge']}" if "ge" in found else f"> {found['gt']}" if "gt" in found else None
    high = f"<= {found['le']}" if "le" in found else f"< {found['lt']}" if "lt" in found else None
    return words(low, high) or None


# Errors whose words need nothing of the schema: what the key must be (and the value given).
_PLAIN = {"missing": "is required", "string_too_short": "must not be empty",
          "finite_number": "must be a finite number {got}", "bool_number": "must be a number, not true or false {got}",
          "literal_error": "must be {expected} {got}",
          "string_pattern_mismatch": "may contain only ASCII letters, digits, '.', '_' and '-', not dots alone {got}",
          "string_too_long": "must be at most {max_length} characters long {got}"}
_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
          "list": "a list", "dict": "a mapping", "model": "a mapping", "tuple": "a list"}


def _describe(error: dict[str, Any], raw: dict[str, Any], typed: str | None = None) -> str:
    loc = _path(error["loc"])
    key = cut(".".join(str(p) for p in loc))
    kind, ctx, value = error["type"], error.get("ctx", {}), error.get("input")
    # A `--set` value as typed: YAML reads `yes` as true and `1e3` as 1000.0, which the user never wrote.
    if typed is not None and not typed.strip():
        got = "(got an empty value)"
    else:
        got = f"(got {shown(value) if typed is None or isinstance(parse_value(typed, ''), str) else cut(typed)})"
    if kind == "extra_forbidden":
        section = _section_model(loc, raw)
        allowed = ", ".join(section.model_fields) if section else "see the recipe reference"
        return f"{key}: unknown key{_nearest(loc, section, raw)}; allowed keys here: {allowed}"
    if kind == "missing" and len(loc) > 1 and isinstance(loc[-1], int):  # a list too short for its tuple
        section = _section_model(loc[:-1], raw)
        info = section.model_fields.get(str(loc[-2])) if section else None
        count = len(typing.get_args(info.annotation)) if info is not None else 0
        return f"{cut('.'.join(str(p) for p in loc[:-1]))}: must be a list of {count or 'more'} numbers {got}"
    if kind in _BOUNDS:
        op, bound = _BOUNDS[kind]
        allowed = _allowed_range(loc, raw) or f"{op} {ctx[bound]}"
        return f"{key}: must be {allowed} {got}"
    if kind in _PLAIN:
        return f"{key}: " + _PLAIN[kind].format(got=got, **ctx)
    if kind in ("too_long", "too_short") and isinstance(ctx.get("field_type"), str):
        return f"{key}: must be a list of {ctx.get('min_length', ctx.get('max_length'))} numbers {got}"
    if kind == "invalid_key":  # YAML reads `1:` as a number; pydantic's words: "Keys should be strings"
        return f"{key}: a key must be a name, not a number {got}"
    if kind == "union_tag_invalid":
        tags = [t.strip() for t in str(ctx.get("expected_tags", "")).split(",")]
        allowed = " or ".join([", ".join(tags[:-1]), tags[-1]] if len(tags) > 1 else tags)
        field = str(ctx.get("discriminator", "kind")).strip(chr(39))
        return f"{key}.{field}: must be {allowed} (got {shown(ctx.get('tag'))})"
    if kind == "union_tag_not_found":
        return f"{key}.kind: is required ({' or '.join(MODEL_SECTIONS)})"
    if kind == "value_error":
        return str(error["msg"]).removeprefix("Value error, ")
    if kind == "string_type" and isinstance(value, (int, float)) and not isinstance(value, bool):
        quoted = f": --set '{key}=\"{typed.strip()}\"'" if typed else ""
        return f"{key}: must be a string {got}; YAML reads it as a number: put it in quotes{quoted}"
    for name, kind_words in _KINDS.items():
        if kind.startswith(name + "_"):
            span = _allowed_range(loc, raw) if name in ("int", "float") else None
            return f"{key}: must be {kind_words}{' ' + span if span else ''} {got}"
    return f"{key}: {error['msg']} {got}"
