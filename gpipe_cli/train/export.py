"""`gpipe export`: the consolidated model of a run's checkpoint as one self-describing safetensors file."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gpipe_cli.data.tokenizer import Tokenizer
from gpipe_cli.errors import DataError, UserError, shell_path
from gpipe_cli.files import atomic_path_of_a_writer, check_not_input, shown_path, writing
from gpipe_cli.models import weights
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.recipe.load import load_recipe, parse_yaml, validate
from gpipe_cli.recipe.schema import Recipe
from gpipe_cli.recipe.yamlio import RecipeError, read_recipe_file
from gpipe_cli.recipe_model import model_spec
from gpipe_cli.runs import (
    CHECKPOINTS,
    CLASSES_FILE,
    EXPORTED,
    METRICS,
    RECIPE,
    TOKENIZER_FILE,
    candidates,
    is_checkpoint,
    newest_step,
    run_dir_of,
)
from gpipe_cli.train import checkpoint
from gpipe_cli.train.existing import check_a_run, check_export_arguments, course_export, fork_of, renamed
from gpipe_cli.train.safe_dcp import SafeLoadPlanner, SafeReader

_MODEL = "model."
EXPORT_READS = ("name", "seed", "model", "data", "pipeline")  # what rebuilds the model and its tokenizer
PRUNED_TRIES = 5  # reads of a run whose training removed the checkpoint being read, before giving up


def export(location: str, output: str | None = None, dtype: str | None = None) -> Path:
    """Write the newest verified checkpoint's model, recipe, tie map and tokenizer to one safetensors file."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    check_export_arguments(location, output)
    if output is not None:  # the run directory of the checkpoint that will be read
        _check_not_the_runs(Path(output), run_dir_of(str(next(iter(candidates(Path(location))), location))))
    # A training that keeps few checkpoints may prune the one read meanwhile: the newest then is read instead.
    for attempt in range(PRUNED_TRIES):
        found = _newest(location)
        try:
            run_dir, tensors, metadata = _read(found, dtype)
            break
        except (OSError, RuntimeError, ValueError, CheckpointException, UserError):
            if found.path.exists() or attempt == PRUNED_TRIES - 1:
                raise
    target = Path(output) if output is not None else _default_place(found.path, run_dir)
    # A full disk, a read-only file system: one line, and nothing left behind.
    elsewhere = "" if output is not None else "; write it elsewhere with --output FILE"
    with writing(target, "--output" if output is not None else "", elsewhere), atomic_path_of_a_writer(target) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError as exc:
            raise _os_error(exc) from None
        _sort_header(tmp)
    named = is_checkpoint(Path(location))  # a checkpoint, not the run: its newest whole one
    newest = newest_step(run_dir) if named and output is None and target == run_dir / EXPORTED else None
    if newest is not None and newest > found.step:
        # The run's export now answers with older weights: predict says so each time; this says it as it happens.
        print(f"[gpipe] {shown_path(target)} now holds step {found.step}, not the run's newest checkpoint (step "
              f"{newest}): gpipe export {shell_path(run_dir)} writes that one", file=sys.stderr)
    return target


def _sort_header(path: Path) -> None:
    """Put a safetensors header's keys in order: safetensors writes the metadata in a hash map's order, by run."""
    # Two exports of one checkpoint were different bytes; the header is rewritten in place, at its own length.
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= size:  # the same JSON in another order: always, unless a writer's escapes differ
            f.seek(8)
            f.write(text.ljust(size))


def _newest(location: str) -> checkpoint.Found:
    """The newest verified checkpoint of `location`, refused ones said on stderr; UserError when there is none."""
    found, refused = checkpoint.newest_whole(Path(location), verify=True)
    if found is None:  # each refused one's reason, in the one line (they are read again: only on this way out)
        reasons = "; ".join(f"{p.name}: {checkpoint.inspect(p, verify=True)[1]}" for p in candidates(Path(location)))
        if not reasons:
            folder = Path(location) / CHECKPOINTS
            if folder.is_dir() and not os.access(folder, os.R_OK | os.X_OK):  # not "there are no checkpoints"
                raise UserError(f"{location}: cannot read {shown_path(folder)} (permission denied)")
            check_a_run(Path(location))
        others = "" if reasons else renamed(Path(location), "export")  # moved aside by hand: named, it is read
        raise UserError(f"{location}: no complete checkpoint to export ({reasons or 'there are no checkpoints'})"
                        f"{others}")
    for message in refused:
        print(f"[gpipe] {message}", file=sys.stderr)
    return found


def _read(found: checkpoint.Found, dtype: str | None) -> tuple[Path, dict[str, torch.Tensor], dict[str, str]]:
    """The checkpoint's run directory, and its tensors and metadata as the export stores them."""
    # The checkpoint's own recipe: a resume since may have changed the run's (model.logit_clip, say), and one
    # copied out of its run has no run around it. Checkpoints of older versions keep none: the run's then.
    own = found.path / RECIPE
    kept_recipe = own.is_file()  # before the tensors: a training's pruning may take the folder while they are read
    reader = SafeReader(str(found.path))
    with checkpoint.single_process_quiet(False), checkpoint.root_log_quiet():  # a pruned folder: read again, quietly
        entries = reader.read_metadata().state_dict_metadata
        state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
                 for key, meta in entries.items()
                 if key.startswith(_MODEL) and isinstance(meta, TensorStorageMetadata)}
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    tensors = {key[len(_MODEL):]: value.contiguous() for key, value in state.items()}
    run_dir = run_dir_of(str(found.path))
    # A checkpoint copied out of its run: the folder above is not its run, whose tokenizer and classes it would take.
    inside = (run_dir / CHECKPOINTS).resolve() in found.path.resolve().parents
    tensors, metadata = _described(tensors, run_dir if inside else None, own if kept_recipe else run_dir / RECIPE,
                                   found.step, dtype, kept=kept_recipe)
    return run_dir, tensors, metadata


def _default_place(checkpoint_path: Path, run_dir: Path) -> Path:
    """The run's model.safetensors; for a checkpoint of a course a resume set aside, a file named after its folder."""
    # The run's own export is of the course it goes on with: an abandoned one's weights must not replace it unasked.
    return run_dir / EXPORTED if fork_of(checkpoint_path) is None else course_export(checkpoint_path.parent)


def _os_error(exc: Exception) -> Exception:
    """The OSError that a safetensors error words as text (its I/O errors end "(os error 28)"); else `exc`."""
    found = re.search(r"\(os error (\d+)\)", str(exc))
    return OSError(int(found[1]), os.strerror(int(found[1]))) if found else exc


def _check_not_the_runs(output: Path, run_dir: Path) -> None:
    """Refuse an --output that is a hard link to a file the run keeps (check_output refuses those by name)."""
    instead = f"name another file, e.g. {shown_path(run_dir / EXPORTED)}"
    kept = [run_dir / name for name in (RECIPE, METRICS, TOKENIZER_FILE)]
    check_not_input(output, "--output", [(path, f"the run's {path.name}") for path in kept], instead)


def _model_recipe(recipe_file: Path) -> Recipe:
    """The run's recipe as far as an export reads it: its model and data, whatever a later version refuses elsewhere."""
    try:
        return load_recipe(recipe_file, check_data=False)
    except RecipeError as exc:
        raw = parse_yaml(read_recipe_file(recipe_file), str(recipe_file))
        read = {key: raw[key] for key in EXPORT_READS if key in raw}
        try:  # a limit a later version set on a training key (train.stall_timeout) stops no export
            recipe = validate(read, str(recipe_file), check_data=False)
        except RecipeError:
            raise exc from None
        print(f"[gpipe] {exc}: the export reads only its model and data settings, which are valid", file=sys.stderr)
        return recipe


# `kept`: the checkpoint keeps `recipe_file`, so that its absence is the folder pruned while read, not an older version.
def _described(tensors: dict[str, torch.Tensor], run_dir: Path | None, recipe_file: Path, step: int,
               dtype: str | None, kept: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to store (tied ones once, cast to `dtype`) and the metadata that makes them usable alone."""
    source_bad = weights.not_finite(tensors)
    if source_bad is not None:  # written all the same, as the weights a user may want to look into
        print(f"[gpipe] the checkpoint's weights are not all finite ({source_bad}): gpipe predict refuses the "
              "export", file=sys.stderr)
    if dtype is not None:
        tensors = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in tensors.items()}
        if source_bad is None and (cast_bad := weights.not_finite(tensors)) is not None:
            raise UserError(f"--dtype {dtype}: the checkpoint's weights do not all fit its range ({cast_bad} "
                            f"once cast); give --dtype bfloat16 or float32")
    floating = [v.dtype for v in tensors.values() if v.is_floating_point()]
    stored = str(floating[0]).removeprefix("torch.") if floating else "float32"
    if not recipe_file.is_file():  # an older version's checkpoint moved away from its run: the weights alone
        if kept:  # pruned while read: the newest then is read instead
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(recipe_file))
        print(f"[gpipe] no {RECIPE} in {recipe_file.parent}: the export holds the weights only, which gpipe predict "
              "cannot use", file=sys.stderr)
        return tensors, {"step": str(step), "format": "pt", "layers": weights.LAYERS}
    recipe = _model_recipe(recipe_file)
    spec = model_spec(recipe)
    why = weights.misfit(spec, tensors)
    if why is not None:  # an edited recipe.yaml: an export that gpipe predict could never build
        raise UserError(f"{recipe_file} does not describe the checkpoint's model: {why}")
    tokenizer, missing, fix = None, None, None
    if spec.task != "image":
        source = Path(recipe.data.tokenizer) if recipe.data.tokenizer else \
            run_dir / TOKENIZER_FILE if run_dir is not None else None
        if source is not None:  # a tokenizer this process may not read is refused: once read, the export is whole
            try:
                open(source.expanduser(), "rb").close()
            except PermissionError as exc:
                raise UserError(f"cannot read the run's tokenizer {shown_path(source)} ({exc.strerror}); the export "
                                "holds it for gpipe predict") from None
            except OSError:  # missing: said below, and written all the same
                pass
        try:  # named whole: gpipe predict repeats the reason, perhaps in another folder
            if source is None:  # a checkpoint copied out of its run: exporting it again there cannot help
                fix = "export the checkpoint from its run's checkpoints/ folder, beside the run's tokenizer"
                raise DataError(f"{recipe_file.parent} lies outside its run, whose {TOKENIZER_FILE} it does not hold")
            tokenizer = Tokenizer.load(os.path.abspath(source.expanduser())).model_bytes  # found now, not by predict
        except DataError as exc:
            # Written all the same, as a weights-only export is: its weights and recipe still load in Python.
            missing = str(exc)
            print(f"[gpipe] {exc}: the export holds no tokenizer, so gpipe predict cannot run it (its weights "
                  "and recipe still load in Python)", file=sys.stderr)
    try:
        tensors, aliases = weights.store_once(tensors, spec.tied)
    except ValueError as exc:
        raise UserError(f"{recipe_file.parent}: {exc}") from None
    return tensors, weights.describe(spec, aliases, dtype=stored, step=step, recipe=recipe_file.read_text(),
                                     tokenizer=tokenizer, no_tokenizer=missing,
                                     no_tokenizer_fix=fix, classes=_classes(recipe, spec, run_dir))


def _classes(recipe: Recipe, spec: ModelSpec, run_dir: Path | None = None) -> list[str] | None:
    """An imagefolder's or parquet run's class names in label order, for gpipe predict (None: other data, or gone)."""
    if spec.task != "image":
        return None
    with contextlib.suppress(OSError, ValueError, TypeError):  # kept as it trained (older runs: read from the data)
        kept = json.loads((run_dir / CLASSES_FILE).read_text()) if run_dir is not None else None
        if isinstance(kept, list) and all(isinstance(name, str) for name in kept):
            return kept
    if recipe.data.source not in ("imagefolder", "parquet") or not recipe.data.path:
        return None
    from gpipe_cli.data.images import folder_classes, parquet_classes

    folder = Path(recipe.data.path).expanduser()
    if recipe.data.source == "parquet":
        names = parquet_classes(folder, recipe.data.label_field) if folder.exists() else []
    else:
        try:
            names = folder_classes(folder) if folder.is_dir() else []
        except DataError:  # a folder that reads as no image folder now: numbers, not names
            names = []
    if not names or len(names) > int(spec.config["num_classes"]):  # moved or changed since: numbers, not wrong names
        return None
    return names
