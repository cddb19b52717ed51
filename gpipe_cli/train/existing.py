"""Checks of an existing run directory made before any rank starts, and the settings a resume runs with."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpipe_cli.errors import DataError, UserError, cut, path_line, shell_path, shown, shown_path
from gpipe_cli.files import (
    atomic_write_bytes,
    check_file_name,
    check_not_empty,
    check_output,
    check_output_kind,
    check_path,
    remove_folders,
    same_file,
)
from gpipe_cli.launch.preflight import NODE_FLAGS
from gpipe_cli.recipe.load import default_recipe_text, load_recipe, parse_yaml, recipe_yaml
from gpipe_cli.recipe.schema import Recipe
from gpipe_cli.recipe.yamlio import RecipeError, parse_document, read_recipe_file
from gpipe_cli.runs import (
    CHECKPOINTS,
    CLASSES_FILE,
    EXPORTED,
    METRICS,
    PREFIX,
    RECIPE,
    SUPERSEDED,
    TOKENIZER_FILE,
    candidates,
    checkpoint_folders,
    holds_run,
    is_checkpoint,
    is_run,
    kept_by_a_run,
    last_step,
    newest_run_in,
    run_dir_of,
)
from gpipe_cli.train.claim import being_written, writer_of

# Model keys that leave the parameters as they are (regularisation, the loss, the initialisation, a
# preset's name whose values are compared key by key): a resume may change them. Every other model key
# shapes the parameters or what they compute.
FREE_MODEL_KEYS = frozenset({"preset", "dropout", "label_smoothing", "logit_clip", "scaled_init"})
# Optimizers that keep a momentum buffer per parameter only when optimizer.momentum is not 0.
_MOMENTUM_BUFFER = frozenset({"sgd", "rmsprop"})
_ABSENT = object()
PATH_CHARS = 200  # paths are named whole, as recipe paths are; a value is cut sooner
LATEST = "latest"  # a bare --resume
RUN_FOLDER = "give the folder gpipe train wrote, or one of its checkpoints"


@dataclass(frozen=True)
class Change:
    """A recipe key whose value differs from the run's recipe.yaml."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {_value(self.old)} -> {_value(self.new)}"


def choose_run_dir(recipe: Recipe, output_dir: str | None, root: str = "outputs", make: bool = False) -> Path:
    """The directory this run will write to: not made yet, or with `make` made here, so that no other run takes it."""
    if output_dir:
        return Path(output_dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path, suffix = Path(root) / recipe.name / stamp, 0
    while True:  # two runs started in the same second: the second gets "-1"
        if make:
            with contextlib.suppress(FileExistsError):
                path.mkdir(parents=True)
                return path
        elif not path.exists():
            return path
        suffix += 1
        path = Path(root) / recipe.name / f"{stamp}-{suffix}"


def save_recipe(recipe: Recipe, run_dir: Path) -> None:
    """Store the resolved recipe (every default filled in, its files' paths absolute) with the run."""
    atomic_write_bytes(run_dir / RECIPE, recipe_bytes(recipe))


def recipe_bytes(recipe: Recipe) -> bytes:
    """The resolved recipe as the run keeps it, in its recipe.yaml and in each checkpoint (its course's settings)."""
    return recipe_yaml(anchored(recipe)).encode()


def settings_of(location: str) -> Path:
    """The recipe.yaml a resume from `location` continues with: the run's, or that of a checkpoint before its newest."""
    # A resume back to an earlier checkpoint goes back to its course, whose settings a later resume may have changed
    # in the run's recipe.yaml (a ten times larger learning rate). Checkpoints of older versions keep none.
    earlier = earlier_checkpoint(location)
    return earlier / RECIPE if earlier is not None and (earlier / RECIPE).is_file() else run_dir_of(location) / RECIPE


# A relative path is read from the directory gpipe runs in: the run's recipe names its files from anywhere, so
# that a resume from another directory (a requeued job, a `cd`) reads the same files.
def anchored(recipe: Recipe) -> Recipe:
    """`recipe` with its data files' relative paths made absolute from here."""
    data = recipe.data
    paths = {key: os.path.abspath(value) for key in ("path", "tokenizer")
             if isinstance(value := getattr(data, key), str) and value and not os.path.isabs(value)}
    return recipe.model_copy(update={"data": data.model_copy(update=paths)}) if paths else recipe


def check_not_runs(folder: Path, named: str = "") -> None:
    """Refuse a folder that holds runs rather than being one, naming its newest run (`named`: the flag, if any)."""
    inside = newest_run_in(folder)
    if inside is not None:  # outputs/ given for outputs/NAME/STAMP: said otherwise to hold no run at all
        raise UserError(f"{named}{cut(str(folder), PATH_CHARS)}: not a run directory but a folder of runs; give "
                        f"one, such as the newest: {cut(str(inside), PATH_CHARS)}")


def check_a_run(folder: Path, named: str = "") -> None:
    """Refuse a folder that is no run directory, saying what it lacks (`named`: the flag, if any)."""
    if holds_run(folder):
        return
    check_not_runs(folder, named)
    missing = [*(name for name in (RECIPE, METRICS) if not (folder / name).is_file()), CHECKPOINTS]
    lacks = f"no {', '.join(missing[:-1])} or {missing[-1]}" if len(missing) > 1 else f"no {CHECKPOINTS}"
    if (folder / METRICS).is_file():
        lacks += f", and its {METRICS} is empty"
    raise UserError(f"{named}{cut(str(folder), PATH_CHARS)}: not a run directory ({lacks}); give a folder gpipe train "
                    "wrote, or one of its checkpoint folders")


def remove_set_up(run_dir: Path, before: Collection[str] | None = None, parents: Sequence[Path] = ()) -> None:
    """Remove the set-up a run that never started added to `run_dir` (it held `before`; None: made for it)."""
    # Made for it (`before` None), the directory goes too, and then `parents`, the folders made above it, while empty.
    # Left behind, its recipe and empty records read as a run: `gpipe report outputs/x/*` refused to report. In a
    # folder the user made, what it held already is theirs, or an earlier launch's, and stays.
    with contextlib.suppress(OSError):
        try:
            names = set(os.listdir(run_dir)).difference(before or ())
        except FileNotFoundError:  # rank 0, stopped while it built its stage, took it out: those above it go too
            remove_folders(list(parents) if before is None else [])
            return
        if holds_run(run_dir) or not names <= {RECIPE, METRICS, TOKENIZER_FILE, CLASSES_FILE, CHECKPOINTS}:
            return
        # checkpoints/ first: where it is not empty (a checkpoint being written), nothing else has gone either.
        for name in sorted(names, key=lambda name: name != CHECKPOINTS):
            (os.rmdir if name == CHECKPOINTS else os.unlink)(run_dir / name)
        if before is None:  # the first that holds anything else stays, and so do those above it
            remove_folders([run_dir, *parents])


def check_export_arguments(location: str, output: str | None) -> None:
    """Refuse, before torch loads, an export's missing run or an --output it cannot write."""
    if output is not None:  # found now, not after the checkpoint has been read
        check_not_empty(output, "--output", give=f"name one, e.g. {EXPORTED}, or leave the flag out")
        check_file_name(output, "--output")
        check_output(Path(output), "--output", EXPORTED)
        # A recipe or records named by mistake were replaced by the weights.
        check_output_kind(Path(output), "--output", "safetensors", ".safetensors", (".safetensors",))
    check_path(location, "RUN", "run", RUN_FOLDER)
    if not os.path.exists(location):
        raise UserError(f"no such run directory or checkpoint: {shown_path(location)}")
    if not os.path.isdir(location):
        raise UserError(f"{shown_path(location)} is a file; give a run directory or one of its checkpoint folders")
    if output is None and (outside := loose(location)) is not None:  # its run's folder would be the one above
        raise UserError(f"{outside}; name the file to write with --output FILE.safetensors")
    other = Path(os.path.realpath(output)).parent if output is not None else None
    if output is not None and Path(output).name == EXPORTED and other is not None and holds_run(other) \
            and other != Path(os.path.realpath(run_dir_of(os.path.abspath(location)))):
        # gpipe predict of that run would take these weights for its own, of a step it never trained.
        raise UserError(f"--output {shown_path(output)} is the export another run keeps for gpipe predict; name "
                        "another file, or leave --output out to write the run's own")


def check_not_in_a_run(output_dir: str | None) -> None:
    """Refuse an --output-dir inside another run's checkpoints/ (its pruning would delete this run with them)."""
    if output_dir and (kept := kept_by_a_run(Path(output_dir))) is not None:
        raise UserError(f"--output-dir {cut(output_dir, PATH_CHARS)} {kept[1]}; give a folder outside it")


def check_new_run_dir(output_dir: Path, ours: bool = False) -> None:
    """Refuse to start a new run in a directory that holds another (`ours`: this job holds, or claims, its lock)."""
    if not output_dir.is_dir():
        return
    check_layout(output_dir, "--output-dir", "move it, or give another --output-dir")
    # Under this launch's own claim the holder is this process (or node 0 of this job, for another node); else
    # another gpipe train holds it, and a launch (a dry run learns it here) would be refused, run there or not.
    if not ours:
        check_no_writer(output_dir, "--output-dir", "wait until it ends, or give another --output-dir")
    if not holds_run(output_dir):
        # The run writes its own; a user's file of that name, in a folder given as the output, was replaced. A run
        # that stopped in its set-up has left its records' file or checkpoints/ beside it, and takes a new run.
        started = any((output_dir / name).exists() for name in (METRICS, CHECKPOINTS))
        kept = next((name for name in (RECIPE, TOKENIZER_FILE, CLASSES_FILE)
                     if (output_dir / name).exists() and not started), None)
        if kept is not None:
            raise UserError(f"--output-dir {cut(str(output_dir), PATH_CHARS)} holds a {kept} but no run (no records "
                            f"or checkpoints), and a new run writes its own {kept} there; give a new or empty "
                            f"folder, or move the file")
        return
    step = last_step(output_dir)
    held = f"already holds a run (its last step is {step})" if step is not None else "already holds a run"
    if not candidates(output_dir):  # records, but nothing a resume continues from: it would be refused
        raise UserError(f"--output-dir {cut(str(output_dir), PATH_CHARS)} {held} but no checkpoint; "
                        f"{start_again(output_dir)}, or give another --output-dir for a new run")
    raise UserError(f"--output-dir {cut(str(output_dir), PATH_CHARS)} {held}; use --resume to continue it, or another "
                    f"--output-dir for a new run")


def check_layout(run_dir: Path, flag: str, instead: str) -> None:
    """Refuse a run directory where a name the run writes is taken by the other kind: a file named checkpoints."""
    # Found here, not by a rank's traceback once the ranks have started and trained the tokenizer.
    for name, kept in ((CHECKPOINTS, "a folder of checkpoints"), (METRICS, "its records' file"),
                       (RECIPE, "its recipe file"), (TOKENIZER_FILE, "its tokenizer file")):
        path = run_dir / name
        if os.path.lexists(path) and os.path.isdir(path) != (name == CHECKPOINTS):
            raise UserError(f"{flag} {cut(str(run_dir), PATH_CHARS)}: its {name} is "
                            f"{'not a folder' if name == CHECKPOINTS else 'a folder'}, where the run keeps {kept}; "
                            f"{instead}")


def start_again(run_dir: Path) -> str:
    """How to start a run that saved no checkpoint again, in its own directory (its records are replaced)."""
    return f"start it again from step 0 with: gpipe train --resume --output-dir {shell_path(run_dir)}" \
        + _on_nodes(None)


def recipe_changes(recipe: Recipe, where: Path) -> list[Change] | None:
    """Every key whose value differs from a run's recipe.yaml, or the one `where` names (None: none is readable)."""
    path = where / RECIPE if where.is_dir() else where
    if not path.is_file():
        return None
    try:
        saved = parse_document(read_recipe_file(path), str(path))
    except UserError:
        return None
    if not isinstance(saved, dict):
        return None
    # The same defaults on both sides, so a key the run's version left out is not a change; a recipe of
    # another version that no longer validates is compared as it reads.
    with contextlib.suppress(ValueError):
        saved = anchored(Recipe.model_validate(saved)).model_dump(mode="json")
    return sorted(differences(saved, anchored(recipe).model_dump(mode="json"), ""), key=lambda c: c.key)


def held_changes(recipe: Recipe, location: str) -> list[Change] | None:
    """Every key differing from the recipe.yaml of the checkpoint a resume from `location` loads (None: it has none)."""
    # What the checkpoint holds is its own recipe's: the run's may have been edited, or lost, since.
    found = candidates(Path(location))
    return recipe_changes(recipe, found[0]) if found and (found[0] / RECIPE).is_file() else None


def check_tokenizer_kept(recipe: Recipe, location: str) -> None:
    """Refuse a data.tokenizer file that no longer holds the tokenizer the run started with (replaced since)."""
    from gpipe_cli.data.tokenizer import Tokenizer
    kept = run_dir_of(location) / TOKENIZER_FILE
    if not recipe.data.tokenizer or not kept.is_file():
        return
    try:
        same = Tokenizer.load(recipe.data.tokenizer).model_bytes == Tokenizer.load(kept).model_bytes
    except DataError:  # a file that is no tokenizer: the recipe's check says so
        return
    if not same:
        raise UserError(f"--resume {cut(location, PATH_CHARS)}: data.tokenizer {shown_path(recipe.data.tokenizer)} is "
                        f"not the tokenizer the run started with (its copy: {kept}), whose ids its checkpoints' "
                        "embeddings learned; put that file back, or start a new run in another --output-dir")


def check_checkpoint_keys(recipe: Recipe, changes: list[Change], location: str) -> None:
    """Refuse changes to what the checkpoints hold: the model's parameters and the optimizer's state."""
    refused = [c for c in changes if _shapes_checkpoint(c)]
    refused += [c for c in changes if c.key == "optimizer.momentum" and _momentum_buffer_changes(recipe, c)]
    ids = [c for c in changes if c.key in _TOKENIZER_KEYS]
    if ids and not refused and recipe.model.kind == "transformer":
        # Another tokenizer's ids would train, and be read, as the ones the embeddings learned.
        listed, one = ", ".join(map(str, ids)), len(ids) == 1
        raise UserError(f"--resume {cut(location, PATH_CHARS)}: {listed} {'changes' if one else 'change'} the "
                        "tokenizer, whose ids its checkpoints' embeddings learned (the run keeps its own); resume "
                        f"with the run's {'value' if one else 'values'}, or start a new run in another --output-dir")
    if not refused:
        return
    # Another model family differs in most model keys, whose list, cut to a line, hid the one that decides.
    refused = [c for c in refused if c.key == "model.kind"] or refused
    listed, one = ", ".join(map(str, refused)), len(refused) == 1
    raise UserError(f"--resume {cut(location, PATH_CHARS)}: {listed} {'changes' if one else 'change'} what its "
                    f"checkpoints hold (the model's parameters and the optimizer's state); resume with the run's "
                    f"{'value' if one else 'values'}, or start a new run in another --output-dir")


def past_end(location: str, checkpoint: str, step: int, end: str, key: str = "train.steps") -> str:
    """The refusal of a resume whose checkpoint is past the run's end (`end`, set by `key`)."""
    return (f"--resume {cut(location, PATH_CHARS)}: checkpoint {checkpoint} is at step {step}, past {end}; "
            f"resuming would write earlier steps over it; raise {key} to train past step {step}")


def complete_line(run_dir: Path, step: int, end: str, key: str = "train.steps", earlier: Path | None = None) -> str:
    """The line that says a resumed run has nothing left to do (its end, `end`, set by `key`; `earlier`: a checkpoint
    before the run's newest, which the resume named)."""
    if earlier is not None:  # the run itself is further on: "complete at step 4" named a run at step 6
        fork = fork_of(earlier)  # one of a course set aside goes back to where that course left the run
        return (f"checkpoint {cut(str(earlier), PATH_CHARS)} is at step {step} ({end}), the end already; nothing to "
                f"do (raise {key} to train on from it: the run's steps after {step if fork is None else fork} are "
                "then set aside)")
    return (f"the run in {cut(path_line(run_dir), PATH_CHARS)} is already complete at step {step} ({end}); nothing "
            f"to do (raise {key} to train past step {step})")


def course_export(course: Path) -> Path:
    """Where `gpipe export` of a course a resume set aside writes: in its run, named after the course's folder."""
    name = Path(EXPORTED)
    return run_dir_of(str(course)) / f"{name.stem}-{course.name}{name.suffix}"


def fork_of(path: Path) -> int | None:
    """The step a checkpoint set aside by an earlier resume branches from (None for one in checkpoints/)."""
    found = re.fullmatch(rf"{SUPERSEDED}.*-at-step-(\d+)(-\d+)?", path.parent.name)
    return int(found.group(1)) if found else None


def earlier_checkpoint(location: str) -> Path | None:
    """The checkpoint `location` names when it is not its run's newest (None: the run's newest, or the run itself)."""
    path = Path(location)
    if not (path.name.startswith(PREFIX) or any(part.startswith(SUPERSEDED) for part in path.parts)):
        return None
    named, newest = candidates(path), candidates(run_dir_of(location))
    return named[0] if named and not (newest and same_file(newest[0], named[0])) else None


def settings_unkept(location: str) -> str:
    """What a resume's line adds where an earlier checkpoint of an older version keeps no settings ('' otherwise)."""
    earlier = earlier_checkpoint(location)
    if earlier is None or (earlier / RECIPE).is_file():
        return ""
    return (f"; checkpoint {earlier.name}, of an older gpipe-cli, keeps no settings of its own: these are the run's "
            "newest, which a later resume may have changed")


def check_resumable(location: str) -> int:
    """Refuse, before any rank starts, a resume from a place with no whole checkpoint; return the newest one's step."""
    # Checksums are left to the ranks, which read every byte anyway and skip a checkpoint that fails them.
    from gpipe_cli.train import checkpoint  # torch: only once the first line is out

    found, _ = checkpoint.newest_whole(Path(location))
    if found is not None:
        return found.step
    raise no_usable(location, [f"{p.name}: {checkpoint.inspect(p)[1]}" for p in candidates(Path(location))])


def renamed(location: Path, verb: str) -> str:
    """What a run holds of checkpoints renamed from `step-*`, which only their own name picks ('' if none)."""
    folder, inside = checkpoint_folders(location)
    names = sorted(p.name for p in inside if is_checkpoint(p) and not p.name.startswith(PREFIX))
    if not names:
        return ""
    listed = ", ".join(shown(name) for name in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"; {shown_path(folder)} holds {listed}, not named {PREFIX}*: {verb} one by its path"


def no_usable(location: str, refused: list[str]) -> UserError:
    """The refusal of a resume from `location`, whose checkpoints were each refused as `refused` says."""
    reasons = "; ".join(refused) if refused else "there are no checkpoints there"
    if not refused and (others := renamed(Path(location), "resume")):
        return UserError(f"--resume {cut(location, PATH_CHARS)}: no usable checkpoint ({reasons}){others}")
    again = f"; {start_again(Path(location))}" if not refused and holds_run(Path(location)) else ""
    aside = any(part.startswith(SUPERSEDED) for part in Path(location).parts)  # a course set aside: the run goes on
    if refused and not Path(location).name.startswith(PREFIX) and not aside:  # every checkpoint: no way on but anew
        run = run_dir_of(location)
        again = (f"; to train it again from step 0 there, move its {CHECKPOINTS}/ aside, then "
                 f"{start_again(run).removeprefix('start it again from step 0 with: ')}")
    return UserError(f"--resume {cut(location, PATH_CHARS)}: no usable checkpoint ({reasons}){again}")


def resume_end(recipe: Recipe, location: str) -> int | None:
    """Refuse a resume past train.steps; the step if the run is complete there (None: to train, or the ranks decide)."""
    from gpipe_cli.train import checkpoint  # torch: only once the first line is out
    from gpipe_cli.train.safe_dcp import saved_keys

    steps = recipe.train.steps
    if steps is None:
        return None
    for path in candidates(Path(location)):
        found, _ = checkpoint.inspect(path)
        if found is None:
            continue
        if found.step < steps:  # older ones are earlier still: training goes on as usual
            return None
        if checkpoint.inspect(path, verify=True)[1] is not None or saved_keys(path) is None:
            continue  # the ranks would not load it either: they fall back past damaged ones
        if found.step > steps:
            raise UserError(past_end(location, path.name, found.step, f"train.steps {steps}"))
        held = found.manifest.get("data", {}).get("held_out") if isinstance(found.manifest.get("data"), dict) else None
        newest = earlier_checkpoint(location) is None  # an earlier one at the end: its course went on past it
        if recipe.train.epochs is not None or (newest and final_eval_missing(run_dir_of(location), found.step,
                                                                             recipe, held)):
            return None  # an epochs' end: the ranks read the data; a final evaluation to make: the ranks make it
        return found.step
    return None


def evaluation_missing(run_dir: Path, step: int) -> tuple[bool, bool]:
    """(whether the run's records lack an evaluation of `step` and go no further, whether they hold any evaluation)."""
    # Records past the step: a checkpoint before the run's newest, whose course went on, not an evaluation lost.
    from gpipe_cli.records import read_records

    metrics = run_dir / METRICS
    train, evals, _ = read_records(metrics) if metrics.is_file() else ([], [], "")
    lacks = not any(r["step"] > step for r in train) and not any(r["step"] == step for r in evals)
    return lacks, bool(evals)


def final_eval_missing(run_dir: Path, step: int, recipe: Recipe, held: Any = None) -> bool:
    """Whether a run at its end `step` evaluates and lacks that step's record: a stop cut its final evaluation short
    (`held`: the held-out examples its checkpoint counted, None where it counted none)."""
    try:
        lacks, evaluated = evaluation_missing(run_dir, step)
    except UserError:  # unreadable: the ranks, which read it too, say so
        return True
    # A run holding nothing out has no eval record at all: only one that evaluates, or has, lacks one (a checkpoint
    # of an older version counts no held-out examples: one evaluated at its end alone is taken as complete).
    evaluates = bool(held) if isinstance(held, int) else bool(recipe.eval.every or evaluated)
    return evaluates and lacks


def differences(old: Any, new: Any, prefix: str) -> Iterator[Change]:
    """Changed leaves of two nested mappings, by dotted key (a section set on one side only is one change)."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*old, *(k for k in new if k not in old)]:
            yield from differences(old.get(key, _ABSENT), new.get(key, _ABSENT), f"{prefix}{key}.")
    elif old != new:
        yield Change(prefix[:-1], old, new)


_TOKENIZER_KEYS = ("data.tokenizer", "data.vocab_size")


def _shapes_checkpoint(change: Change) -> bool:
    """Whether a changed key changes what a checkpoint holds (not K, D or the cut: it is keyed by global names)."""
    section, _, key = change.key.partition(".")
    if section == "model":
        return key.partition(".")[0] not in FREE_MODEL_KEYS
    return change.key == "optimizer.name"


def _momentum_buffer_changes(recipe: Recipe, change: Change) -> bool:
    """Whether optimizer.momentum moves between 0 and not 0 for an optimizer keeping a momentum buffer only then."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (change.old, change.new))
    return recipe.optimizer.name in _MOMENTUM_BUFFER and numbers and bool(change.old) != bool(change.new)


def _value(value: Any) -> str:
    """A recipe value as YAML writes it inline."""
    if value is _ABSENT:
        return "(not set)"
    if value is None or isinstance(value, bool):
        return shown(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_value, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return cut(str(value))


def check_resume_path(resume: str | None) -> None:
    """Refuse a --resume location that does not exist (a bare --resume is looked up later)."""
    if resume != LATEST:
        check_path(resume, "--resume", "run", f"{RUN_FOLDER}, or no value for the newest run")
    if resume not in (None, LATEST) and not os.path.exists(resume):
        raise UserError(f"--resume: no such run directory or checkpoint: {shown_path(resume)}")
    if resume not in (None, LATEST) and not os.path.isdir(resume):
        raise UserError(f"--resume: {shown_path(resume)} is a file; give a run directory or one of its checkpoint "
                        "folders")
    if resume not in (None, LATEST) and (outside := loose(resume)) is not None:
        raise UserError(f"--resume: {outside}, and a resume writes its run in the folder above that; put it in a run "
                        f"folder's {CHECKPOINTS}/ with its {RECIPE} beside them, and resume that folder")


def loose(location: str) -> str | None:
    """What a checkpoint lying in no run's checkpoints/ (nor a course set aside there) is, in words (else None)."""
    path = Path(os.path.abspath(location))
    if not is_checkpoint(path):
        return None
    parent = path.parent
    if parent.name == CHECKPOINTS or (parent.name.startswith(SUPERSEDED) and parent.parent.name == CHECKPOINTS):
        return None
    return f"{shown_path(location)} is a checkpoint outside a run's {CHECKPOINTS}/ (it lies in {shown(parent.name)})"


def check_resume_output(resume: str | None, output_dir: str | None) -> None:
    """Refuse an --output-dir beside a --resume that names a run elsewhere: a resume writes where its run is."""
    if resume in (None, LATEST) or not output_dir:  # a bare --resume continues (or starts) the run in --output-dir
        return
    run = run_dir_of(resume)
    if same_file(run, output_dir):
        return
    # The resume's own path is left out: typed just before, it would make three paths of one line.
    which = "its run" if run == Path(resume) else f"the run in {cut(str(run), PATH_CHARS)}"
    raise UserError(f"--output-dir {cut(output_dir, PATH_CHARS)}: --resume continues {which} where it is; drop "
                    "--output-dir, or give it with a bare --resume to continue the run there")


def starts_anew(resume: str | None, output_dir: str | None) -> bool:
    """Whether this launch starts a new run: no --resume, or a bare one into an --output-dir that holds no run yet."""
    return not resume or (resume == LATEST and bool(output_dir) and not holds_run(Path(str(output_dir))))


def check_recipe_kept(recipe: str | None, output_dir: str | None, resume: str | None) -> None:
    """Refuse a new run whose --output-dir's recipe.yaml is the recipe given: the run writes its resolved one there."""
    # A resume rewrites the run's own recipe.yaml as it goes on, which is what that file is for; a bare --resume
    # into a folder without a run starts one, and the recipe.yaml there is the user's.
    if recipe and output_dir and starts_anew(resume, output_dir) and same_file(recipe, Path(output_dir) / RECIPE):
        raise UserError(f"--output-dir {cut(output_dir, PATH_CHARS)}: its {RECIPE} is the recipe given, which the "
                        f"run would replace with the resolved recipe (comments gone); keep the recipe elsewhere, or "
                        "give another --output-dir")


def train_recipe(recipe: str | None, overrides: Sequence[str], resume: str | None, output_dir: str | None,
                 root: str) -> tuple[Recipe, str | None]:
    """The recipe this command trains, and the file it was read from (None: the built-in one)."""
    _check_not_a_run(recipe)
    if resume is None or recipe is not None:
        return load_recipe(recipe, overrides), recipe
    run = _run_to_continue(resume, output_dir, overrides, root)
    if run is None:  # no run there yet, as a requeued job's first launch finds it
        return load_recipe(None, overrides), None
    path = settings_of(resume) if resume != LATEST else run / RECIPE
    if not path.is_file():
        where = cut(str(run), PATH_CHARS)
        check_a_run(run, "--resume ")
        raise UserError(f"--resume {where}: the run has no {RECIPE} to continue with; give the recipe it was started "
                        f"with: gpipe train RECIPE --resume {where}")
    try:
        return load_recipe(str(path), overrides), str(path)
    except RecipeError as exc:  # a value an earlier version allowed (a limit added since): the way past it
        if "--set" in str(exc):
            raise
        named = re.search(r": ([a-z_]+(?:\.[a-z_0-9]+)+): ", str(exc))
        key = named[1] if named else "KEY"
        raise RecipeError(f"{exc}; the run's {RECIPE} holds it: --set {key}=VALUE on the --resume replaces it") \
            from None


def _check_not_a_run(recipe: str | None) -> None:
    """Refuse a run directory given as the recipe, saying how to continue it or to start again with its recipe."""
    # `gpipe train outputs/NAME/STAMP` means that run; the recipe reader would say only that it is a directory.
    if recipe is None or not os.path.isdir(recipe) or not is_run(Path(recipe)):
        return
    ways = [f"--resume {shell_path(recipe)} to continue it"] if candidates(Path(recipe)) else []
    if os.path.isfile(os.path.join(recipe, RECIPE)):
        ways.append(f"{shell_path(os.path.join(recipe, RECIPE))} to start again with its recipe")
    raise UserError(f"{cut(recipe, PATH_CHARS)}: is a run directory, not a recipe file; give "
                    f"{', or '.join(ways) or 'the recipe it was started with'}")


def resume_location(resume: str, output_dir: str | None, name: str, root: str) -> str:
    """Where --resume continues from: an explicit path, --output-dir, or the newest run named `name`."""
    if resume != LATEST:  # checked to exist before the recipe was read
        return resume
    if output_dir:
        return output_dir
    check_a_run_to_resume(resume, output_dir, name, root)
    from gpipe_cli.train.checkpoint import newest_whole  # torch: only once the first checks are done

    for run in _runs_named(name, root):
        if newest_whole(run)[0] is not None:
            check_layout(run, "--resume", "move it aside to continue the run")
            return str(run)
    raise _no_run_of(name, root)


def check_a_run_to_resume(resume: str | None, output_dir: str | None, name: str, root: str, ours: bool = False) -> None:
    """Refuse, before torch loads, a resume of a run another gpipe train writes, or of one without a checkpoint."""
    # `ours`: this job's claimant (rank 0, or node 0's launcher) may hold it already, as in `check_new_run_dir`.
    if resume == LATEST and not output_dir and not any(candidates(run) for run in _runs_named(name, root)):
        raise _no_run_of(name, root)
    # A --dry-run never claims the run: this is where it learns that a launch would be refused.
    if resume == LATEST and output_dir:
        if not ours:
            check_no_writer(Path(output_dir), "--output-dir", "wait until it ends, or give another --output-dir")
        check_layout(Path(output_dir), "--output-dir", "move it, or give another --output-dir")
    if resume in (None, LATEST):
        return
    if not ours:
        check_no_writer(run_dir_of(resume), "--resume", "wait until it ends")
    check_layout(run_dir_of(resume), "--resume", "move it aside to continue the run")
    if not candidates(Path(resume)):  # before the first line says what starts
        raise no_usable(resume, [])


def check_no_writer(run_dir: Path, flag: str, instead: str) -> None:
    """Refuse `run_dir` while another gpipe train writes it, worded as the claim refuses it (`instead`: what to do)."""
    if (writer := writer_of(run_dir)) is not None:
        raise being_written(run_dir, flag, writer, instead)


def _runs_named(name: str, root: str) -> list[Path]:
    """The run directories of `name` under `root`, newest first."""
    return sorted((p for p in Path(root, name).glob("*") if p.is_dir()), reverse=True)


def _no_run_of(name: str, root: str) -> UserError:
    # A bare --resume in another folder than the run's looks under that folder's outputs/: say which.
    here = "" if Path(root).is_absolute() else f" in {os.getcwd()}"
    return UserError(f"--resume: no run of '{name}' with a complete checkpoint under {Path(root, name)}/{here}")


def _run_to_continue(resume: str, output_dir: str | None, overrides: Sequence[str], root: str) -> Path | None:
    """The run directory a resume without a recipe continues (None: --output-dir holds no run yet)."""
    if resume == LATEST and output_dir:
        return Path(output_dir) if holds_run(Path(output_dir)) else None
    # A bare --resume looks for the newest run of the built-in recipe's name (or a `--set name=` given).
    name = "" if resume != LATEST else _name(overrides)
    return run_dir_of(resume_location(resume, output_dir, name, root))


def _name(overrides: Sequence[str]) -> str:
    """Only the run name of the built-in recipe with `overrides` applied: the rest apply to the run's recipe.yaml."""
    raw = parse_yaml(default_recipe_text(), "quickstart.yaml (built in)", overrides)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise UserError(f"--set name: must be a run name (got {shown(name)})")
    return name


# `continued`: no recipe was given, so every change is one of `overrides`; else `recipe` (None: the built-in one)
# replaces the run's, and `changes` lists every difference from it (None: the run has no readable recipe.yaml).
def resume_line(run_dir: Path, step: int | None, changes: list[Change] | None, recipe: str | None,
                continued: bool, overrides: Sequence[str], base: Path | None = None) -> str:
    """The one line that says which run a resume continues, from which step, and with which settings (`base`: the
    recipe.yaml they are compared with, the run's unless an earlier checkpoint's)."""
    where = f"resuming {path_line(run_dir)}" + (f" at step {step}" if step is not None else "")
    listed = ", ".join(map(str, changes or []))
    base = base or run_dir / RECIPE
    ours = base == run_dir / RECIPE
    if continued:
        course = "" if ours else f" with the settings of checkpoint {base.parent.name} ({path_line(base)}),"
        if listed:
            return f"{where}{course} with {listed} (--set)"
        return f"{where} with the {'run' if ours else 'checkpoint'}'s own settings ({path_line(base)})"
    given = recipe if recipe is not None else "the built-in quick-start recipe"
    if overrides:
        given += " and --set"
    owner = "the run" if ours else f"checkpoint {base.parent.name}"
    if changes is None:
        return f"{where} with {given} ({owner} has no readable {RECIPE} to compare it with)"
    if not listed:
        return f"{where} with {given}, the same settings as {owner}'s"
    return f"{where} with {given}, which {'differ' if overrides else 'differs'} from {owner}'s {RECIPE}: {listed}"


def continue_command(run_dir: Path, flags: str | None = None) -> str:
    """The command that continues a stopped run as it was started, ready to copy (`flags`: see `_on_nodes`)."""
    return f"gpipe train --resume {shell_path(run_dir)}" + _on_nodes(flags)


def way_on(run_dir: Path) -> str:
    """How a run that ended early goes on: from its newest checkpoint, or from step 0 without one."""
    return f"continue with {continue_command(run_dir)}" if candidates(run_dir) else start_again(run_dir)


def _on_nodes(flags: str | None) -> str:
    """The launch flags of this node of several (None: as its launcher handed them to this rank), after a space."""
    flags = os.environ.get(NODE_FLAGS, "") if flags is None else flags
    return f" {flags}" if flags else ""
