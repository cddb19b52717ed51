import re
from pathlib import Path

import pytest

from gpipe_cli.recipe.load import (
    RecipeError,
    default_recipe_text,
    load_recipe,
    parse_override,
    parse_yaml,
    recipe_yaml,
    validate,
)
from gpipe_cli.train.plan import checked_plan

ROOT = Path(__file__).resolve().parents[2]
BASE = {"model": {"kind": "transformer", "layers": 2, "d_model": 32, "ff": 64, "heads": 4, "vocab_size": 100},
        "pipeline": {"partitions": 2, "microbatches": 4}, "data": {"batch_size": 8}, "train": {"steps": 2}}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_builtin_recipe_is_the_shipped_quickstart():
    assert default_recipe_text() == (ROOT / "recipes" / "quickstart.yaml").read_text()
    recipe = load_recipe(None)
    assert recipe.pipeline.partitions == 2 and recipe.data.source == "synthetic"


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates_and_plans(path):
    recipe = load_recipe(path)
    plan = checked_plan(recipe, str(path))
    assert len(plan.stages) == recipe.pipeline.partitions


@pytest.mark.parametrize("overrides,message", [
    (["pipeline.microbatches=0"], "recipe.yaml: --set pipeline.microbatches: must be >= 1 and <= 1048576 (got 0)"),
    # A value as typed: YAML reads `yes` as true and `null` as None.
    (["pipeline.offload=yes"], "--set pipeline.offload: must be 'none' or 'activations' (got yes)"),
    (["pipeline.microbatches=null"], "--set pipeline.microbatches: must be an integer >= 1 and <= 1048576 (got null)"),
    (["pipeline.schedule=zb"], "pipeline.schedule: must be 'gpipe', '1f1b', 'interleaved', 'zero-bubble', "
                               "'zero-bubble-v' or 'v-half' (got 'zb')"),
    (["pipeline.virtual_stages=2"],
     "pipeline.virtual_stages 2 needs pipeline.schedule: interleaved or zero-bubble-v or v-half (got gpipe)"),
    (["pipeline.schedule=zero-bubble", "pipeline.virtual_stages=2"],
     "pipeline.virtual_stages 2 needs pipeline.schedule: interleaved or zero-bubble-v or v-half "
     "(got zero-bubble)"),
    (["pipeline.schedule=zero-bubble-v"],
     "pipeline.schedule zero-bubble-v runs 2 chunks per stage in a V: set pipeline.virtual_stages: 2 (got 1)"),
    (["pipeline.virtual_stages=0"], "pipeline.virtual_stages: must be >= 1 and <= 64 (got 0)"),
    (["pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "pipeline.balance=[2, 2]"],
     "pipeline.balance has 2 entries but the pipeline has 4; give one layer count per chunk"),
    (["pipeline.checkpoint=sometimes"], "pipeline.checkpoint: must be 'always', 'except_last' or 'never'"),
    (["pipeline.offload=all"], "pipeline.offload: must be 'none' or 'activations' (got 'all')"),
    (["model.heads=abc"], "model.heads: must be an integer >= 1 and <= 1048576 (got 'abc')"),
    (["model.filters=8"], "model.filters: unknown key (a key of model.kind amoebanet); allowed keys here: kind, "
                          "preset, arch, layers"),
    (["pipeline.microbatch=4"], "pipeline.microbatch: unknown key (did you mean pipeline.microbatches?); allowed"),
    # A misspelt section is named as the --set under it, not blamed on the recipe.
    (["pipline.partitions=2"], "recipe.yaml: --set pipline: unknown key (did you mean pipeline?)"),
    (["Pipeline.partitions=2"], "recipe.yaml: --set Pipeline: unknown key (did you mean pipeline?)"),
    # Checks across keys and of a union's tag name the --set too; a type error gives the range as well.
    (["model.kind=gpt"], "recipe.yaml: --set model.kind: must be 'amoebanet' or 'transformer' (got 'gpt')"),
    (["optimizer.betas=[0.9]"], "recipe.yaml: --set optimizer.betas: must be a list of 2 numbers"),
    (["pipeline.microbatches=64"], "recipe.yaml: --set pipeline.microbatches (64) must be <= data.batch_size"),
    # A floor no schedule reads, or one above the peak (cosine climbed to it), was taken without a word.
    (["schedule.min_lr=0.5"], "recipe.yaml: --set schedule.min_lr (0.5) is the floor of the cosine and exponential "
                              "schedules, and schedule.name constant has none"),
    (["schedule.name=cosine", "schedule.min_lr=0.5"], "recipe.yaml: --set schedule.min_lr (0.5) must be <= the peak "
                                                       "learning rate (0.1: optimizer.lr)"),
    (["pipeline.partitions=2.5"], "recipe.yaml: --set pipeline.partitions: must be an integer >= 1 and <= 65536 "
                                  "(got 2.5)"),
    (["train.lr=0.1"], "train.lr: unknown key (did you mean optimizer.lr?); allowed keys here: steps"),
    (["train.checkpoint_every=5"], "train.checkpoint_every: unknown key (did you mean checkpoint.every?)"),
    # A key of its own section first: `schedule.warmup` was pointed at train.profile.warmup, the profiler's.
    (["schedule.warmup=5"], "schedule.warmup: unknown key (did you mean schedule.warmup_steps?)"),
    (["pipeline.virtual=2"], "pipeline.virtual: unknown key (did you mean pipeline.virtual_stages?)"),
    (["eval.every_steps=5"], "eval.every_steps: unknown key (did you mean eval.every?)"),
    # Under a section a --set gave whole: named by that --set, as a key it gave itself is.
    (["train.profile={steps: [0]}"], "recipe.yaml: --set train.profile.steps.0: must be >= 1 (got 0)"),
    # A key several sections hold: each of them (it said nothing where `lr` named optimizer.lr).
    (["steps=20"], "steps: unknown key (did you mean train.steps or train.profile.steps?)"),
    (["data.steps=20"], "data.steps: unknown key (did you mean train.steps or train.profile.steps?)"),
    (["colour=blue"], "colour: unknown key; allowed keys here: name, seed, model"),
    (["filters=8"], "--set filters: unknown key (did you mean model.filters, a key of model.kind amoebanet?)"),
    (["model.kind=resnet"], "model.kind: must be 'amoebanet' or 'transformer' (got 'resnet')"),
    (["pipeline.microbatches=16"], "pipeline.microbatches (16) must be <= data.batch_size (8)"),
    (["pipeline.balance=[1, 0]"], "pipeline.balance: every entry must be a number of layers from 1 to"),
    (["pipeline.balance=fast"], "pipeline.balance: must be 'auto', 'params', 'time', 'memory' or a list"),
    (["data.source=jsonl", "data.path=/no/such/file"], "data.path: no such file or directory: '/no/such/file'"),
    # Named by the --set that gave it: the recipe file never set it.
    (["data.source=jsonl", "data.path=/no/such/file"], "recipe.yaml: --set data.path: no such file or directory"),
    (["data.tokenizer=/no/such.model"], "recipe.yaml: --set data.tokenizer: no such sentencepiece model"),
    (["data.source=jsonl"], "data.path is required for data.source 'jsonl'"),
    (["model.d_model=30"], "model.d_model (30) must be divisible by model.heads (4)"),
    # A check across keys names the --set of the one given so, wherever it stands in the line.
    (["model.heads=5"], "recipe.yaml: model.d_model (32) must be divisible by --set model.heads (5)"),
    # A --set of a whole section names the key it gave, not the section's other keys (it named model.d_model).
    (["model={heads: 5}"], "recipe.yaml: model.d_model (32) must be divisible by --set model.heads (5)"),
    (["train.steps=null"], "give train.steps or train.epochs"),
    # A check of a section names the --set items it read after its line ("--set give train.steps ...").
    (["train={steps: null, epochs: null}"], "recipe.yaml: give train.steps or train.epochs; with both, training stops "
                                            "at whichever comes first (from --set train.epochs=null, --set "
                                            "train.steps=null)"),
    (["pipeline.data_parallel=16"],
     "must be <= data.batch_size (8): the smallest share of the 16 replicas is 0 of the "),
    (["pipeline.data_parallel=16"], "micro-batches needs one (from --set pipeline.data_parallel=16)"),
    # The schema's "train.epochs (or both ...)" read as a key and its value: "give train.steps or --set train.epochs".
    (["train.steps=null", "train.epochs=null"], "recipe.yaml: give train.steps or train.epochs; with both, training "
                                                "stops at whichever comes first"),
    (["name=has space"], "name: may contain only ASCII letters, digits"),
    (["train.profile={steps: [5, 9]}"], "train.profile.steps starts at step 5, after the run's last (train.steps 2): "
                                        "nothing would be traced"),
    (["data.source=imagefolder", "data.path=/"], "data.source 'imagefolder' holds images, and model.kind transformer "
                                                 "reads text: text comes from synthetic, jsonl, tsv, text, parquet, "
                                                 "pydoc, hub"),
    (["data.source=pydoc"], "data.source 'pydoc' is plain text for a language model (model.arch decoder-only); an "
                            "encoder-decoder translates pairs"),
    (["model={kind: amoebanet}", "data.source=text", "data.path=/"], "data.source 'text' holds text, and "
                                                                     "model.kind amoebanet classifies images"),
    # Both were found by the ranks after they had started, and validate had passed them.
    (["model={kind: amoebanet}", "data.source=synthetic", "data.tokens_per_batch=1000"],
     "--set data.tokens_per_batch sizes batches of text, and model.kind amoebanet classifies images: leave it out "
     "and give data.batch_size"),
    # The learning rate was scaled by data.batch_size, which a batch sized in tokens does not read.
    (["optimizer.lr_per_256=true", "data.tokens_per_batch=400"],
     "optimizer.lr_per_256 scales optimizer.lr by data.batch_size / 256, which data.tokens_per_batch replaces"),
    (["data.vocab_size=101"], "--set data.vocab_size (101) must be <= model.vocab_size (100): the tokenizer's pieces "
                              "are the model's vocabulary"),
    (["model.arch=decoder-only", "model.max_len=16", "data.seq_len=17"],
     "--set data.seq_len (17) must be <= model.max_len (16): a language model reads at most model.max_len tokens"),
    (["name=.."], "name: may contain only ASCII letters, digits, '.', '_' and '-', not dots alone (got '..')"),
    (["name=."], "not dots alone (got '.')"),
    # YAML 1.2's numbers: `1:30` is not YAML 1.1's 90, nor `1_000` 1000 (pydantic would read "1_000" as one).
    (["train.steps=1:30"], "--set train.steps: must be an integer >= 1 and <= 1000000000 (got '1:30')"),
    (["train.steps=1_000"], "--set train.steps: must be an integer >= 1 and <= 1000000000 (got '1_000')"),
    (["optimizer.lr=0b11"], "--set optimizer.lr: must be a number > 0.0 and <= 1000000000.0 (got '0b11')"),
    (["name=2024"], """--set name: must be a string (got 2024); YAML reads it as a number: put it in quotes: --set \
'name="2024"'"""),
])
def test_errors_name_the_key_the_value_and_what_is_allowed(tmp_path, overrides, message):
    import yaml

    path = write(tmp_path, yaml.safe_dump(BASE))
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_what_train_refused_only_once_its_ranks_had_started_is_refused_by_the_recipe(tmp_path, monkeypatch):
    # validate passed each of these; train said them after starting its ranks, the tokenizer's without its key.
    import yaml

    path = write(tmp_path, yaml.safe_dump(BASE))
    junk = tmp_path / "junk.model"
    junk.write_text("not a model\n")
    with pytest.raises(RecipeError, match=f"recipe.yaml: --set data.tokenizer: '{junk}' is not a sentencepiece model"):
        load_recipe(path, [f"data.tokenizer={junk}"])
    from gpipe_cli.data.synthetic import translation_pairs
    from gpipe_cli.data.tokenizer import train_tokenizer

    big = train_tokenizer([s for p in translation_pairs(300, 0, "train") for s in p], 300).save(tmp_path / "big.model")
    pieces = load_recipe(path, [f"data.tokenizer={big}", "model.vocab_size=300"]).model.vocab_size
    with pytest.raises(RecipeError, match=re.escape(f"--set data.tokenizer: the tokenizer has {pieces} pieces but "
                                                    "--set model.vocab_size is 200; raise model.vocab_size")):
        load_recipe(path, [f"data.tokenizer={big}", "model.vocab_size=200"])
    monkeypatch.setenv("HOME", str(tmp_path))  # `~` was not expanded: no such file
    (tmp_path / "pairs.tsv").write_text("a\tb\n")
    assert load_recipe(path, ["data.source=tsv", "data.path=~/pairs.tsv"]).data.path == str(tmp_path / "pairs.tsv")
    image = ["model={kind: amoebanet, layers: 3, filters: 8, image_size: 32, num_classes: 4}"]
    with pytest.raises(RecipeError, match="--set data.tokenizer: an image model reads no tokenizer; leave it out"):
        load_recipe(path, [*image, f"data.tokenizer={junk}"])
    with pytest.raises(RecipeError, match=re.escape("eval.every (5): the data holds nothing out to evaluate on "
                                                    "(data.eval_fraction 0); raise data.eval_fraction")):
        load_recipe(path, ["eval.every=5", "data.eval_fraction=0"])
    with pytest.raises(RecipeError, match=re.escape("(data.eval_fraction 0.0001 of data.synthetic_size 2048)")):
        load_recipe(path, ["eval.every=5", "data.eval_fraction=0.0001"])
    assert load_recipe(path, ["eval.every=5", "data.eval_fraction=0.001"]).eval.every == 5  # two examples held out


def test_a_data_folder_without_files_of_its_source_is_refused_before_any_rank_starts(tmp_path):
    # `--dry-run` passed it; the ranks then said "no .jsonl/.json files under 'empty'", after starting.
    import yaml

    path = write(tmp_path, yaml.safe_dump(BASE))
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "sub" / "notes.md").write_text("not data")
    with pytest.raises(RecipeError) as info:
        load_recipe(path, ["data.source=jsonl", f"data.path={tmp_path / 'empty'}"])
    assert str(info.value).endswith(f"--set data.path: no .jsonl or .json files under '{tmp_path / 'empty'}', which "
                                    "data.source jsonl reads; give a folder that holds some, or one such file")
    (tmp_path / "empty" / "sub" / "pairs.JSONL").write_text('{"src": "a", "tgt": "b"}\n')  # anywhere below, any case
    load_recipe(path, ["data.source=jsonl", f"data.path={tmp_path / 'empty'}"])


def test_a_language_models_default_window_follows_a_shorter_model_but_a_given_one_is_checked(tmp_path):
    import yaml

    path = write(tmp_path, yaml.safe_dump(BASE))
    lm = ["model.arch=decoder-only", "model.max_len=16"]
    assert load_recipe(path, lm).data.seq_len == 16  # the default follows the model (as the run's recipe keeps it)
    assert load_recipe(path, ["model.arch=decoder-only"]).data.seq_len == 128
    assert load_recipe(path, [*lm, "data.seq_len=16"]).data.seq_len == 16
    assert load_recipe(path, ["model.max_len=16", "data.seq_len=64"]).data.seq_len == 64  # a translation's own
    # bench, profile-memory and plan read no data: a recipe's window does not stop their shorter --seq-len
    assert load_recipe(path, [*lm, "data.seq_len=64"], check_data=False).model.max_len == 16
    with pytest.raises(RecipeError, match=r"data.seq_len \(64\) must be <= model.max_len \(16\)"):
        load_recipe(path, [*lm, "data.seq_len=64"])


def test_a_relative_data_path_beside_the_recipe_but_not_here_says_where_paths_are_read_from(tmp_path, monkeypatch):
    import yaml

    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "pairs.jsonl").write_text('{"source": "one", "target": "un"}\n')
    path = write(folder, yaml.safe_dump({**BASE, "data": {"source": "jsonl", "path": "pairs.jsonl"}}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError, match=r"data.path: no such file or directory: 'pairs.jsonl' \(a relative path "
                                          r"is read from the directory gpipe runs in; the recipe's folder holds "):
        load_recipe(path.relative_to(tmp_path))
    monkeypatch.chdir(folder)
    assert load_recipe(path.name).data.path == "pairs.jsonl"


def test_a_csv_file_and_a_pattern_are_refused_saying_what_is_read(tmp_path):
    # A .csv file given to tsv failed on its first line with a hint to name its columns, which it did (with
    # commas); a pattern was said to be no such file.
    import yaml

    (tmp_path / "pairs.csv").write_text("source,target\none,un\n")
    with pytest.raises(RecipeError, match=re.escape("pairs.csv' is a .csv file, which no source reads (a comma "
                                                    "inside a sentence would split it); save it tab-separated")):
        load_recipe(write(tmp_path, yaml.safe_dump(BASE)), ["data.source=tsv", f"data.path={tmp_path / 'pairs.csv'}"])
    with pytest.raises(RecipeError, match=r"no such file or directory: '.*/\*\.tsv'; patterns are not expanded: "
                                          r"give the folder that holds the files$"):
        load_recipe(write(tmp_path, yaml.safe_dump(BASE)), ["data.source=tsv", f"data.path={tmp_path / '*.tsv'}"])


def test_a_split_that_picks_no_file_is_refused_with_the_recipe_before_any_rank_starts(tmp_path):
    # `--dry-run` passed it; the launch started its ranks, which stopped 12 s in saying so.
    import yaml

    (tmp_path / "pairs.tsv").write_text("one\tun\ntwo\tdeux\n")
    with pytest.raises(RecipeError, match=r"recipe.yaml: data.eval_split picks files of a folder by name, and "
                                          r"data.path '.*pairs.tsv' is one file"):
        load_recipe(write(tmp_path, yaml.safe_dump(BASE)), ["data.source=tsv", f"data.path={tmp_path / 'pairs.tsv'}",
                                                            "data.eval_split=test"])
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "train.tsv").write_text("one\tun\n")
    with pytest.raises(RecipeError, match=r"no file under '.*corpus' has data.eval_split 'dev' in its name$"):
        load_recipe(write(tmp_path, yaml.safe_dump(BASE)), ["data.source=tsv", f"data.path={tmp_path / 'corpus'}",
                                                            "data.eval_split=dev"])


def test_a_single_file_of_another_sources_kind_is_refused_naming_that_source(tmp_path):
    # data.source text trained on a .jsonl file's raw JSON lines without a word.
    import yaml

    for name in ("pairs.jsonl", "pairs.json", "pairs.Parquet", "notes.txt", "notes", "more.md"):
        (tmp_path / name).write_text('{"text": "one two"}\n')
    (tmp_path / "folder.jsonl").mkdir()  # a folder's files are picked by suffix, and said when none is right
    (tmp_path / "folder.jsonl" / "notes.txt").write_text("one two\n")
    lm = {**BASE, "model": {**BASE["model"], "arch": "decoder-only"}}
    sets = ["data.source=text", f"data.path={tmp_path / 'pairs.jsonl'}"]
    with pytest.raises(RecipeError) as caught:
        load_recipe(write(tmp_path, yaml.safe_dump(lm)), sets)
    assert str(caught.value) == (f"{tmp_path / 'recipe.yaml'}: --set data.path: '{tmp_path / 'pairs.jsonl'}' is a "
                                 ".jsonl file, which data.source jsonl reads (data.source text reads .txt, .text or "
                                 ".raw files); use --set data.source=jsonl")
    path = write(tmp_path, yaml.safe_dump({**lm, "data": {"source": "text", "path": str(tmp_path / "pairs.json")}}))
    with pytest.raises(RecipeError, match=r"is a \.json file, which data.source jsonl reads .*; use data.source: "
                                          r"jsonl$"):
        load_recipe(path)
    refused = {("jsonl", "notes.txt"): "tsv or text", ("tsv", "pairs.Parquet"): "parquet",
               ("parquet", "pairs.jsonl"): "jsonl"}
    for (source, name), owners in refused.items():
        with pytest.raises(RecipeError, match=f"which data.source {owners} reads"):
            load_recipe(path, [f"data.source={source}", f"data.path={tmp_path / name}"])
    for source, name in [("text", "notes.txt"), ("tsv", "notes.txt"), ("jsonl", "pairs.json"), ("text", "notes"),
                         ("text", "more.md"), ("text", "folder.jsonl")]:
        assert load_recipe(path, [f"data.source={source}", f"data.path={tmp_path / name}"]).data.source == source


@pytest.mark.parametrize("text,message", [
    ("", "the recipe is empty"),
    ("# only a comment\n", "the recipe is empty"),
    ("- a\n- b\n", "a recipe must be a mapping of sections (got list)"),
    ("model: [unclosed\n", "not valid YAML at line"),
])
def test_bad_files(tmp_path, text, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        load_recipe(write(tmp_path, text))


def test_a_file_named_with_a_trailing_slash_is_refused(tmp_path):
    # `gpipe validate recipe.yaml/` read the file: the slash, which names a directory, was dropped without a word.
    path = tmp_path / "recipe.yaml"
    path.write_text(default_recipe_text())
    with pytest.raises(RecipeError, match=re.escape(f"{path}/: a file named as a directory (the trailing '/'); "
                                                    f"give {path}")):
        load_recipe(f"{path}/")
    assert load_recipe(str(path)).name == load_recipe(None).name


def test_missing_file():
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe("/no/such/recipe.yaml")


def test_the_built_in_recipes_name_where_it_is_not_a_file_points_to_it(tmp_path, monkeypatch):
    # `gpipe train quickstart` said only "no such recipe file".
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError, match=r"^quickstart: no such recipe file; leave the recipe out to train the "
                                          r"built-in quick start$"):
        load_recipe("quickstart")


@pytest.mark.parametrize("typed", ["recipes/run.yml", "recipes/run", "run", "recipes/rn.yaml"])
def test_a_missing_recipe_names_the_one_meant(tmp_path, monkeypatch, typed):
    """`gpipe train recipes/quickstart.yml` was told only that no such file exists."""
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "run.yaml").write_text(default_recipe_text())
    (tmp_path / "recipes" / "other.yaml").write_text(default_recipe_text())
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError, match=re.escape(f"{typed}: no such recipe file; did you mean recipes/run.yaml?")):
        load_recipe(typed)
    with pytest.raises(RecipeError, match="no such recipe file$"):
        load_recipe("recipes/unlike.yaml")


@pytest.mark.parametrize("typed, item", [("train.steps=3", "train.steps=3"),
                                         ("pipeline.balance=[3, 3]", "'pipeline.balance=[3, 3]'")])
def test_a_missing_recipe_typed_as_key_value_is_answered_with_its_set(tmp_path, monkeypatch, typed, item):
    """`gpipe train train.steps=3` was told only that no such recipe file exists."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as caught:
        load_recipe(typed)
    assert str(caught.value) == f"{typed}: no such recipe file; to override a recipe key give --set {item}"


@pytest.mark.parametrize("item", ["foo", "=3", "a..b=1", ".a=1"])
def test_malformed_set(item):
    with pytest.raises(RecipeError, match="--set expects KEY=VALUE"):
        load_recipe(None, [item])


@pytest.mark.parametrize("item,line", [
    # They were type errors of the text: `--set optimizer: must be a mapping (got '{lr: 0.01')`.
    ("optimizer={lr: 0.01", "--set optimizer: '{lr: 0.01' is not valid YAML (an unclosed '{'); did you mean "
                            "--set 'optimizer={lr: 0.01}'?"),
    ("pipeline.balance=[3,3", "--set pipeline.balance: '[3,3' is not valid YAML (an unclosed '['); did you mean "
                              "--set 'pipeline.balance=[3,3]'?"),
    ("data.name=[a, {b: 1", "--set data.name: '[a, {b: 1' is not valid YAML (an unclosed '[' and '{'); did you "
                            "mean --set 'data.name=[a, {b: 1}]'?"),
    ("optimizer.lr=\"abc", "--set optimizer.lr: '\"abc' is not valid YAML (an unclosed '\"'); did you mean "
                           "--set 'optimizer.lr=\"abc\"'?"),
    # `--set pipeline.balance=[3, 3]` unquoted: the shell passed `[3,` as the item.
    ("pipeline.balance=[3,", "--set pipeline.balance: '[3,' is not valid YAML (an unclosed '['); the shell splits "
                             "an item at its spaces unless it is quoted whole: --set 'pipeline.balance=[3, ...]'"),
    ("pipeline.balance=[3,,3]", "--set pipeline.balance: '[3,,3]' is not valid YAML (at column 4: expected the "
                                "node content, but found ',')"),
])
def test_a_set_value_that_opens_a_list_mapping_or_quote_but_is_no_yaml_says_so(item, line):
    with pytest.raises(RecipeError) as caught:
        load_recipe(None, [item])
    assert str(caught.value) == line


def test_an_unquoted_list_whose_tail_the_shell_made_the_recipe_is_told_as_the_set_it_was():
    # `gpipe train --set pipeline.balance=[3, 3]`: the recipe argument is `3]`, which is no file.
    with pytest.raises(RecipeError) as caught:
        load_recipe("3]", ["pipeline.balance=[3,"])
    assert str(caught.value).startswith("--set pipeline.balance: '[3,' is not valid YAML (an unclosed '['); the shell")


def test_a_set_value_that_is_no_yaml_but_opens_nothing_stays_text():
    assert load_recipe(None, ["data.name=a: b: c"]).data.name == "a: b: c"  # no YAML (a second ": ")


@pytest.mark.parametrize("item,line", [
    ("pipeline.balance=3,3", "quickstart.yaml (built in): --set pipeline.balance: must be 'auto', 'params', "
                             "'time', 'memory' or a list of layer counts per stage (got '3,3'); did you mean --set "
                             "'pipeline.balance=[3,3]'?"),
    ("optimizer.betas=0.9,0.99", "quickstart.yaml (built in): --set optimizer.betas: must be a list (got "
                                 "'0.9,0.99'); did you mean --set 'optimizer.betas=[0.9,0.99]'?"),
    # A key that takes no list is not offered one.
    ("name=a,b", "quickstart.yaml (built in): --set name: may contain only ASCII letters, digits, '.', '_' and '-', "
                 "not dots alone (got 'a,b')"),
])
def test_a_list_typed_without_brackets_for_a_key_that_takes_one_is_shown_with_them(item, line):
    with pytest.raises(RecipeError) as caught:
        load_recipe(None, [item])
    assert str(caught.value) == line


def test_set_parses_yaml_values_and_creates_sections():
    recipe = load_recipe(None, ["pipeline.balance=[3, 3]", "train.grad_clip=1.5", "checkpoint.every=7"])
    assert recipe.pipeline.balance == [3, 3] and recipe.train.grad_clip == 1.5 and recipe.checkpoint.every == 7


def test_preset_fills_sizes_and_explicit_keys_win():
    recipe = validate({"model": {"preset": "amoebanet-d-18-256", "num_classes": 10, "image_size": 32},
                       "train": {"steps": 1}}, "r.yaml")
    assert recipe.model.kind == "amoebanet" and recipe.model.layers == 18 and recipe.model.filters == 256
    assert recipe.model.num_classes == 10


def test_preset_errors():
    with pytest.raises(RecipeError, match="model.preset: unknown model preset 'nope'"):
        validate({"model": {"preset": "nope"}, "train": {"steps": 1}}, "r.yaml")
    with pytest.raises(RecipeError, match="'transformer-big' is a model of kind 'transformer'; leave model.kind"):
        validate({"model": {"kind": "amoebanet", "preset": "transformer-big"}, "train": {"steps": 1}}, "r.yaml")


def test_more_partitions_than_layers_is_refused_by_the_plan():
    recipe = load_recipe(None, ["pipeline.partitions=9"])
    with pytest.raises(Exception, match="pipeline.partitions: cannot cut 6 pipeline layers into 9 partitions"):
        checked_plan(recipe, "r.yaml")


def test_bench_and_profile_read_set_with_the_recipe_parser():
    from gpipe_cli.estimate.subject import resolve

    subject = resolve("t-6-8192-16", {"layers": 2, "d_model": 32, "ff": 64, "heads": 4},
                      ["dropout=1e-1", "model.label_smoothing=0"])
    assert subject.params["dropout"] == 0.1 and subject.params["label_smoothing"] == 0
    with pytest.raises(RecipeError, match="an alias refers to itself"):
        resolve("t-6-8192-16", overrides=["dropout=&a [*a]"])
    with pytest.raises(RecipeError, match="--set expects KEY=VALUE"):
        resolve("t-6-8192-16", overrides=["dropout"])


def test_yaml_1_2_floats_and_merge_keys():
    raw = parse_yaml("optimizer: {lr: 1e-3, weight_decay: 5E-5}\nlength: &len {steps: 3}\n", "r.yaml")
    assert raw["optimizer"] == {"lr": 1e-3, "weight_decay": 5e-5}
    merged = parse_yaml("x: &b {steps: 3}\ntrain: {<<: *b, log_every: 2}\n", "r.yaml")
    assert merged["train"] == {"steps": 3, "log_every": 2}  # a merge key is not a duplicate


def test_a_balance_entry_is_a_count_written_as_any_whole_number():
    recipe = load_recipe(None, ["model.layers=2", "pipeline.balance=[3.0, 1e0, 2]", "pipeline.partitions=3"],
                         check_data=False)
    assert recipe.pipeline.balance == [3, 1, 2] and all(type(n) is int for n in recipe.pipeline.balance)
    with pytest.raises(RecipeError, match=r"every entry must be a number of layers .* \(got 2.5 in \[3, 2.5\]\)"):
        load_recipe(None, ["pipeline.balance=[3, 2.5]"], check_data=False)


def test_set_fills_an_optional_section_a_resolved_recipe_leaves_null(tmp_path):
    resolved = write(tmp_path, recipe_yaml(load_recipe(None)))  # as a run's recipe.yaml: `profile: null`
    assert "profile: null" in resolved.read_text() and "wandb: null" in resolved.read_text()
    recipe = load_recipe(resolved, ["train.profile.steps=[1, 2]", "metrics.wandb.project=p"])
    assert recipe.train.profile is not None and recipe.train.profile.steps == (1, 2)
    assert recipe.metrics.wandb is not None and recipe.metrics.wandb.project == "p"
    with pytest.raises(RecipeError, match="'steps' is a value, not a section"):
        load_recipe(resolved, ["train.steps.max=3"])


def test_a_preset_model_is_checked_against_its_data_as_the_preset_resolves(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"source": "one", "target": "un"}\n')
    text = ["data.source=jsonl", f"data.path={pairs}"]
    assert load_recipe(None, ["model={preset: transformer-big}", *text]).model.kind == "transformer"
    with pytest.raises(RecipeError, match="data.source 'jsonl' holds text, and model.kind amoebanet"):
        load_recipe(None, ["model={preset: amoebanet-d-18-256}", *text])


def test_a_mapping_set_into_a_section_keeps_its_other_keys_unless_it_makes_it_anew():
    # `--set 'optimizer={lr: 0.01}'` trained with SGD: the section's other keys went back to their defaults.
    dotted = load_recipe(None, ["optimizer.lr=0.01", "pipeline.partitions=3"])
    assert load_recipe(None, ["optimizer={lr: 0.01}", "pipeline={partitions: 3}"]) == dotted
    assert dotted.optimizer.name == "adam" and dotted.pipeline.microbatches == 4
    assert load_recipe(None, ["model={layers: 3}"]).model == load_recipe(None, ["model.layers=3"]).model
    whole = load_recipe(None, ["model={kind: amoebanet}", "data.source=synthetic"]).model
    assert whole.kind == "amoebanet" and "d_model" not in whole.model_dump()  # another kind: the section anew
    # As a dotted key too: it was `model.layers: must be a positive multiple of 3 (got 2) (and 7 more problems)`.
    assert load_recipe(None, ["model.kind=amoebanet", "data.source=synthetic"]).model == whole
    assert load_recipe(None, ["model.kind=amoebanet", "model.layers=3"]).model.layers == 3  # later keys: the new one's
    assert load_recipe(None, ["model.kind=transformer"]).model == load_recipe(None).model  # its own kind: kept
    assert load_recipe(None, ["model={preset: transformer-big}", "model.kind=transformer"]).model.d_model == 1024
    # A model key set before it is the new kind's too, not dropped without a word.
    assert load_recipe(None, ["model.layers=3", "model.kind=amoebanet"]).model.layers == 3


def test_naming_the_kind_of_a_model_section_without_one_keeps_its_keys(tmp_path):
    # `model: {layers: 4, d_model: 64}` is refused as needing model.kind; the --set that says so rebuilt it anew.
    path = tmp_path / "kindless.yaml"
    path.write_text("model:\n  layers: 4\n  d_model: 64\n  heads: 4\n")
    model = load_recipe(path, ["model.kind=transformer"], check_data=False).model
    assert (model.kind, model.layers, model.d_model) == ("transformer", 4, 64)
    with pytest.raises(RecipeError, match="unknown model preset 'no-such'"):  # still refused, not rebuilt away
        load_recipe(None, ["model={preset: no-such}", "model.kind=amoebanet"])


def test_a_set_into_a_section_the_recipe_writes_as_a_value_names_the_recipe(tmp_path):
    # It blamed the --set (`'train' is a value, not a section`), which was right; the recipe was not.
    path = tmp_path / "sect.yaml"
    path.write_text("train: 5\n")
    with pytest.raises(RecipeError, match=r"sect\.yaml: train: must be a mapping \(got 5\)$"):
        load_recipe(path, ["train.steps=2"])
    with pytest.raises(RecipeError, match=r"^--set train\.steps: 'train' is a value, not a section$"):
        load_recipe(None, ["train=5", "train.steps=2"])  # the --set before it made it one


@pytest.mark.parametrize("text, value", [("010", 10), ("+7", 7), ("0o10", 8), ("0x10", 16), ("1e3", 1000.0),
                                         ("2.5e-1", 0.25), (".5", 0.5), ("1:30", "1:30"), ("1_000", "1_000"),
                                         ("0b11", "0b11"), ("yes", True)])
def test_numbers_read_as_yaml_1_2_reads_them_not_as_yaml_1_1(text, value):
    # YAML 1.1 read `010` as 8 and `1:30` as 90: a recipe's figure silently other than the one typed.
    read = parse_yaml(f"x: {text}\n", "recipe.yaml")["x"]
    assert read == value and type(read) is type(value)


@pytest.mark.parametrize("key, value, says", [("layers", 4, "3"), ("filters", 6, "4")])
def test_an_amoebanet_size_of_no_whole_cells_reads_as_bench_says_it(tmp_path, key, value, says):
    # A recipe said "model: AmoebaNet layers must ..." where bench says "--layers: must ...".
    path = tmp_path / "recipe.yaml"
    path.write_text("model: {kind: amoebanet}\ntrain: {steps: 1}\n")
    with pytest.raises(RecipeError) as caught:
        load_recipe(str(path), [f"model.{key}={value}"])
    assert str(caught.value) == f"{path}: --set model.{key}: must be a positive multiple of {says} (got {value})"


def test_both_keys_of_a_check_given_by_set_are_named_so(tmp_path):
    # "--set pipeline.microbatches (4) must be <= data.batch_size (2)": the 2 came from a --set too, not the recipe.
    path = tmp_path / "r.yaml"
    path.write_text("model: {kind: transformer}\ndata: {batch_size: 32}\n")
    with pytest.raises(RecipeError) as raised:
        load_recipe(str(path), ["pipeline.microbatches=4", "data.batch_size=2"], check_data=False)
    assert "--set pipeline.microbatches (4) must be <= --set data.batch_size (2)" in str(raised.value), raised.value


def test_a_set_of_another_model_kind_says_which_of_the_recipes_model_keys_it_leaves_out(tmp_path, capsys):
    # `--set model.kind=amoebanet` on a Transformer's recipe dropped its layers, widths and dropout without a word
    # (bench then measured the paper's AmoebaNet for half an hour).
    from gpipe_cli.cli import run
    from gpipe_cli.recipe.load import recipe_kind_note

    path = tmp_path / "r.yaml"
    path.write_text("model: {kind: transformer, layers: 2, d_model: 64}\n")
    said = recipe_kind_note(str(path), ["model.kind=amoebanet", "model.layers=3"])
    assert said == ("--set model.kind=amoebanet starts the model section anew: the recipe's model keys of kind "
                    "transformer (layers, d_model) are left out; amoebanet's keys not set take their defaults")
    assert recipe_kind_note(str(path), ["model.kind=transformer"]) is None  # the same kind keeps the section
    assert recipe_kind_note(str(path), ["model.layers=3"]) is None
    assert run(["validate", str(path), "--set", "model.kind=amoebanet", "--set", "model.layers=3",
                "--set", "model.filters=8"]) == 0
    assert capsys.readouterr().out.startswith(f"note: {said}\n")
    # bench and profile-memory say it first among their notes.
    from gpipe_cli.bench.options import CUTS, BenchOptions
    from gpipe_cli.estimate.model_flags import shared_fields

    given = shared_fields(BenchOptions, str(path), {}, ["model.kind=amoebanet", "model.layers=3"], CUTS, "gpipe bench")
    assert given["notes"][0] == said


def test_a_section_whose_keys_are_all_commented_out_takes_its_defaults(tmp_path):
    # `pipeline:` over commented-out keys reads as null, and was refused: "pipeline: must be a mapping (got null)".
    path = tmp_path / "recipe.yaml"
    path.write_text("name: commented\npipeline:\n  # partitions: 2\ntrain:\n  steps: 3\nmodel:\n")
    recipe = load_recipe(str(path), check_data=False)
    assert recipe.pipeline.partitions == 1 and recipe.train.steps == 3 and recipe.model.kind
    path.write_text("name:\n")  # a value, not a section: still refused
    with pytest.raises(RecipeError, match="name: must be a string"):
        load_recipe(str(path), check_data=False)


@pytest.mark.parametrize("overrides", [
    ["schedule.name=cosine", "optimizer.lr=0.01", "schedule.min_lr=0.01"],  # a floor at the peak: a constant rate
    ["train.steps=5", "train.profile.steps=[5,5]"],  # the last step traced alone
    ["data.synthetic_size=10", "data.eval_fraction=0.06", "eval.every=1"],  # 0.6 of an example rounds to one
    ["pipeline.schedule=interleaved", "pipeline.partitions=2", "pipeline.virtual_stages=3",
     "pipeline.microbatches=4"],  # a multiple of K, whatever V
])
def test_limits_taken_at_their_edge_are_allowed(tmp_path, overrides):
    import yaml

    load_recipe(write(tmp_path, yaml.safe_dump(BASE)), overrides, check_data=False)


@pytest.mark.parametrize("overrides,message", [
    (["data.synthetic_size=10", "data.eval_fraction=0.04", "eval.every=1"], "data.eval_fraction 0.04 of "
                                                                           "data.synthetic_size 10"),
    (["pipeline.schedule=interleaved", "pipeline.partitions=3", "pipeline.virtual_stages=2",
      "pipeline.microbatches=4"], "pipeline.microbatches (4) must be a multiple of --set pipeline.partitions (3)"),
])
def test_limits_just_past_their_edge_are_refused(tmp_path, overrides, message):
    import yaml

    with pytest.raises(RecipeError, match=re.escape(message)):
        load_recipe(write(tmp_path, yaml.safe_dump(BASE)), overrides, check_data=False)


def test_a_fraction_held_out_rounds_to_the_nearest_example():
    from gpipe_cli.data.sources import hold_out

    assert [len(hold_out(15, 0.1)[1]), len(hold_out(14, 0.1)[1])] == [2, 1]


def test_a_set_typed_in_utf_8_is_read_so_under_a_c_locale():
    # Under LC_ALL=C Python hands "zéro" over as the escaped bytes c3 a9, which --set refused: "not UTF-8 text".
    assert parse_override("data.name=z\udcc3\udca9ro") == ("data.name", "zéro") == parse_override("data.name=zéro")
    with pytest.raises(RecipeError, match=r"not UTF-8 text \(byte 0xff at character 7\)"):
        parse_override("name=z\udcffro")


def test_the_number_checks_take_one_positional_argument_as_every_pydantic_calls_them():
    # pydantic before 2.8 passes its validation info as a second positional argument: `kind` got it, and
    # `--set optimizer.lr=abc` ended in a TypeError instead of its one line.
    import inspect

    from gpipe_cli.recipe import schema

    for check in (schema._real, schema._number):
        positional = [p for p in inspect.signature(check).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert len(positional) == 1, check.__name__
