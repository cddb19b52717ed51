"""Odd input to `gpipe plan` is one line, exit code 2 and nothing written; a Ctrl-C is 130 and nothing written."""


import pytest

from gpipe_cli.cli import run
from gpipe_cli.recipe.load import default_recipe_text
from tests.plan.test_runner import TINY, refused_before_torch
from tests.train.recipes import write

QUICK = ["--devices", "2", "--tflops", "100", "--plain"]  # estimated seconds: nothing is measured


@pytest.mark.parametrize("args,line", [
    # --devices 10^20 counted every K up to it: the command never ended.
    (["--devices", "99999999999999999999"], "error: --devices: must be >= 1 and <= 65536 (got 99999999999999999999)"),
    (["--devices", "65537"], "error: --devices: must be >= 1 and <= 65536 (got 65537)"),
    # Infinite rates and links were taken: layers or messages priced at no time, a plan of nonsense.
    (["--devices", "2", "--tflops", "inf"], "error: --tflops: must be a finite number > 0 (got inf)"),
    (["--devices", "2", "--bandwidth", "inf"], "error: --bandwidth: must be a finite number > 0 GB/s (got inf)"),
    (["--devices", "2", "--latency-us", "inf"], "error: --latency-us: must be a finite number >= 0 (got inf)"),
    (["--devices", "2", "--node-bandwidth", "nan"],
     "error: --node-bandwidth: must be a finite number > 0 GB/s (got nan)"),
    (["--devices", "2", "--node-latency-us", "inf"],
     "error: --node-latency-us: must be a finite number >= 0 (got inf)"),
    # The value as typed: it said (got 0.0) and (got -1.0).
    (["--devices", "2", "--bandwidth", "0"], "error: --bandwidth: must be a finite number > 0 GB/s (got 0)"),
    (["--devices", "2", "--latency-us", "-1.5"], "error: --latency-us: must be a finite number >= 0 (got -1.5)"),
    # An empty --output read as '.', and the line named a file nobody gave.
    (["--devices", "2", "--output", ""], "error: --output: must name a .yaml or .yml file, e.g. planned.yaml "
                                         "(got '')"),
    (["--devices", "2", "--output", "out.txt"], "error: --output: must name a .yaml or .yml file, e.g. planned.yaml "
                                                "(got out.txt)"),
    (["--devices", "2", "--device-memory", "0.4"],
     "error: --device-memory: must be at least 1 byte, a size such as 8GiB, 16GB or 500MiB (got '0.4')"),
    # profile-memory's word for it was said to be profile-memory's, and --memory had no hint at all.
    (["--devices", "2", "--budget", "8GiB"], "error: No such option: --budget (gpipe profile-memory has it); did you "
                                             "mean --device-memory? (see 'gpipe plan --help')"),
    (["--devices", "2", "--memory", "8GiB"],
     "error: No such option: --memory; did you mean --device-memory? (see 'gpipe plan --help')"),
])
def test_flags_that_describe_no_plan_are_one_line_before_torch_loads(tmp_path, args, line):
    assert refused_before_torch(tmp_path, args, timeout=300) == line + "\n"


@pytest.mark.parametrize("spelling", ["same", "dotted", "link"])
def test_an_output_that_is_the_recipe_itself_is_refused_and_the_recipe_kept(tmp_path, capsys, monkeypatch, spelling):
    # The plan replaced the recipe it read, its comments with it, and said only "wrote".
    monkeypatch.chdir(tmp_path)
    recipe = write(tmp_path, TINY)
    before = recipe.read_bytes()
    given = recipe.name
    if spelling == "dotted":
        given = f"./{recipe.name}"
    elif spelling == "link":
        (tmp_path / "link.yaml").symlink_to(recipe.name)
        given = "link.yaml"
    code = run(["plan", given, *QUICK, "--output", recipe.name])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: --output '{recipe.name}' is the recipe itself"), err
    assert recipe.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({recipe.name, "link.yaml"} if spelling == "link"
                                                                else {recipe.name})


def test_planning_the_built_in_recipe_never_overwrites_its_copy_in_recipes(tmp_path, capsys, monkeypatch):
    # Without a recipe the built-in one is planned; `--output recipes/quickstart.yaml` replaced the shipped copy.
    monkeypatch.chdir(tmp_path)
    copy = tmp_path / "quickstart.yaml"
    copy.write_text(default_recipe_text())
    assert run(["plan", *QUICK, "--output", copy.name]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --output 'quickstart.yaml' is the built-in recipe being planned"), err
    assert copy.read_text() == default_recipe_text() and [p.name for p in tmp_path.iterdir()] == [copy.name]


@pytest.mark.parametrize("held", ["services:\n  web:\n    image: nginx\n", "notes: [\n", "- a\n- b\n", "\x89PNG"])
def test_an_existing_output_that_holds_no_recipe_is_kept(tmp_path, capsys, monkeypatch, held):
    # `--output compose.yaml` replaced a compose file with the plan, and said only "wrote".
    monkeypatch.chdir(tmp_path)
    recipe, kept = write(tmp_path, TINY), tmp_path / "compose.yaml"
    kept.write_text(held)
    assert run(["plan", str(recipe), *QUICK, "--output", kept.name]) == 2
    err = capsys.readouterr().err
    assert err == ("error: --output 'compose.yaml' is a file that holds no recipe, which --output would replace; name "
                   "another file, e.g. 'compose.planned.yaml', or remove that file first\n")
    assert kept.read_text() == held
    other = write(tmp_path, TINY, "other-recipe.yaml")  # another recipe, or an empty file, is what a plan may replace
    for name, text in (("other.yaml", other.read_text()), ("empty.yaml", "")):
        (tmp_path / name).write_text(text)
        assert run(["plan", str(recipe), *QUICK, "--output", name]) == 0, capsys.readouterr().err
        assert "pipeline:" in (tmp_path / name).read_text()


@pytest.mark.parametrize("where", ["gpipe_cli.recipe_model.model_spec", "gpipe_cli.plan.search.search"])
def test_a_ctrl_c_a_library_swallowed_still_stops_the_plan(tmp_path, capsys, monkeypatch, handlers, where):
    """torch's import swallows a KeyboardInterrupt: only the remembered signal is left to act on."""
    # With nothing measured, no later check saw it: the plan printed, wrote --output and exited 0.
    import importlib

    from gpipe_cli import interrupts

    module_name, name = where.rsplit(".", 1)
    module = importlib.import_module(module_name)
    original = getattr(module, name)

    def swallowed(*args, **kwargs):
        monkeypatch.setattr(interrupts, "_interrupted", True)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, swallowed)
    recipe = write(tmp_path, TINY)
    output = tmp_path / "planned.yaml"
    assert run(["plan", str(recipe), *QUICK, "--output", str(output)]) == 130
    err = capsys.readouterr().err
    assert err == "gpipe plan: interrupted; nothing was written\n"
    assert not output.exists() and list(tmp_path.iterdir()) == [recipe]


@pytest.mark.parametrize("name", ["out.yaml", "out.yml", "out.YAML", "out.Yml"])
def test_an_output_suffix_is_taken_in_any_case(name):
    from pathlib import Path

    from gpipe_cli.plan.options import PlanOptions, validate

    validate(PlanOptions(devices=2, output=Path(name)))  # out.YAML was refused while out.yml was taken


def test_a_batch_smaller_than_the_recipes_m_is_planned_with_an_m_that_fits_it(capsys):
    # The built-in recipe's M=4 was held against --batch-size 1 and refused, though M is what plan picks.
    assert run(["plan", *QUICK, "--batch-size", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "is not compared: each replica's 1 example cannot make M=4 micro-batches" in out
    assert "--set data.batch_size=1" in out and "--set pipeline.microbatches=1 " in out


def test_only_plan_reads_a_recipe_whose_m_does_not_fit_its_batch():
    from gpipe_cli.recipe.load import RecipeError, load_recipe

    assert load_recipe(None, ["data.batch_size=1"], check_data=False, planning=True).pipeline.microbatches == 4
    with pytest.raises(RecipeError, match=r"pipeline.microbatches \(4\) must be <= --set data.batch_size \(1\)"):
        load_recipe(None, ["data.batch_size=1"], check_data=False)
