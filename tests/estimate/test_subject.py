import re

import pytest

from gpipe_cli.cli import run as gpipe
from gpipe_cli.errors import UserError, one_line
from gpipe_cli.estimate.subject import FAMILIES, resolve
from gpipe_cli.models.presets import presets
from tests.bench import tiny


def test_family_names_are_the_papers_benchmark_models():
    assert resolve("amoebanet").params["filters"] == 256 and resolve("amoebanet").params["layers"] == 18
    transformer = resolve("transformer")
    assert (transformer.params["layers"], transformer.params["d_model"], transformer.params["ff"]) == (48, 2048, 8192)
    assert set(FAMILIES) == {"amoebanet", "transformer"}


def test_size_flags_and_set_override_the_preset():
    subject = resolve("transformer", tiny.sizes(tiny.TRANSFORMER), tiny.TRANSFORMER["set"])
    assert subject.params["d_model"] == 32 and subject.params["max_len"] == 8
    assert subject.params["arch"] == "decoder-only"
    assert len(subject.build().layers) == 6


def test_a_set_item_comes_after_the_size_flag_of_its_parameter():
    # The flag's value was taken and the --set's dropped unread, even `--set model.d_model=abc`.
    sizes = tiny.sizes(tiny.TRANSFORMER)
    assert resolve("transformer", sizes, [*tiny.TRANSFORMER["set"], "model.d_model=16"]).params["d_model"] == 16
    with pytest.raises(UserError, match=r"^--set model.d_model: must be an integer"):
        resolve("transformer", sizes, [*tiny.TRANSFORMER["set"], "model.d_model=abc"])
    recipe = "gpipe_cli/recipe/quickstart.yaml"
    assert resolve(recipe, {"d_model": 64}, ["model.d_model=16"]).params["d_model"] == 16


def test_a_size_flag_of_another_family_is_refused():
    with pytest.raises(UserError, match="--filters does not apply to transformer"):
        resolve("transformer", {"filters": 16})


@pytest.mark.parametrize("model,message", [("nonsense-model", "unknown model preset"),
                                           ("amoebanet-d-5-256", "multiple of 3")])
def test_bad_models_are_one_line_user_errors(model, message):
    with pytest.raises(UserError, match=message):
        resolve(model)


def test_bad_set_item_is_refused():
    with pytest.raises(UserError, match="--set expects KEY=VALUE"):
        resolve("transformer", {}, ["dropout"])


def test_a_recipe_file_gives_its_model(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  kind: transformer\n  arch: decoder-only\n  layers: 2\n  d_model: 32\n  ff: 64\n"
                      "  heads: 2\n  vocab_size: 64\n  max_len: 8\ndata:\n  batch_size: 8\ntrain:\n  steps: 1\n")
    subject = resolve(str(recipe), {"layers": 3}, ["dropout=0"])
    assert subject.kind == "transformer" and subject.params["layers"] == 3 and subject.params["dropout"] == 0
    assert len(subject.build().layers) == 5


# What a preset name may be, written out independently of the registry's own patterns.
_FORMS = re.compile(r"amoebanet-[db]-\d+-\d+|t-\d+-\d+-\d+|transformer-l-\d+")


@pytest.mark.parametrize("model", ["foo", "x" * 5000])
def test_an_unknown_model_names_everything_allowed_in_one_uncut_line(model):
    with pytest.raises(UserError) as info:
        resolve(model)
    message = str(info.value)
    assert one_line(message) == message and message.startswith("--model: unknown model preset '")
    for allowed in ("a family (amoebanet, transformer)", "a recipe file (.yaml)",
                    "amoebanet-{d|b}-L-D, t-L-H-A or transformer-l-L", "A heads)"):
        assert allowed in message
    # Every preset is named or is an instance of a form the line names.
    for name in presets():
        assert name in message or _FORMS.fullmatch(name), name


@pytest.mark.parametrize("typed", ["recipes", "recipes/"])
def test_a_directory_is_said_to_be_no_recipe_file(tmp_path, monkeypatch, typed):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    with pytest.raises(UserError, match=f"^--model {typed}: is a directory, not a recipe file$"):
        resolve(typed)


def test_a_directory_named_like_a_family_does_not_hide_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "transformer").mkdir()
    assert resolve("transformer").params["layers"] == 48


def test_an_unknown_parameter_of_set_names_set():
    # In train's words (it was "--set: unknown parameter 'colour' for model kind 'transformer'"), the key whole.
    with pytest.raises(UserError, match=r"^--set model.colour: unknown key; allowed keys here: arch, layers, "):
        resolve("transformer", {}, ["colour=red"])
    with pytest.raises(UserError, match=r"^--set model.d_modle: unknown key \(did you mean model.d_model\?\)"):
        resolve("transformer", {}, ["model.d_modle=64"])


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
@pytest.mark.parametrize("model,expected", [("foo", "error: --model: unknown model preset 'foo'; use a family"),
                                            ("recipes", "error: --model recipes: is a directory")])
def test_the_commands_refuse_a_bad_model_in_one_line(capsys, tmp_path, monkeypatch, command, model, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    assert gpipe([command, "--model", model]) == 2
    out = capsys.readouterr()
    assert out.err.splitlines() == [out.err.strip()] and out.err.startswith(expected), out
    assert "more characters" not in out.err and list(tmp_path.iterdir()) == [tmp_path / "recipes"]


@pytest.mark.parametrize("command", [["bench"], ["profile-memory"], ["plan", "--devices", "2"]])
def test_a_size_flag_a_recipes_model_has_not_is_worded_as_without_a_recipe(command, capsys):
    # With a recipe it was the schema's "--filters: unknown key (a key of model.kind amoebanet); allowed keys
    # here: kind, preset, arch, ..." (keys that are no sizes); without one, this line.
    assert gpipe([*command, "recipes/quickstart.yaml", "--filters", "16"]) == 2
    assert capsys.readouterr().err == ("error: --filters does not apply to transformer models (their size flags: "
                                       "--layers, --d-model, --ff, --heads, --vocab-size, --seq-len)\n")
    assert gpipe([*command, "recipes/quickstart.yaml", "--set", "model.kind=amoebanet", "--d-model", "16"]) == 2
    assert capsys.readouterr().err.startswith("error: --d-model does not apply to amoebanet models")
    # The paper's recipes name a preset and no model.kind: the schema's "unknown key" line again.
    assert gpipe([*command, "recipes/amoebanet-d-cifar10.yaml", "--d-model", "64"]) == 2
    assert capsys.readouterr().err.startswith("error: --d-model does not apply to amoebanet models")
    assert gpipe([*command, "recipes/amoebanet-d-cifar10.yaml", "--set", "model.preset=t-6-8192-16",
                  "--filters", "16"]) == 2
    assert capsys.readouterr().err.startswith("error: --filters does not apply to transformer models")


def test_a_slow_choice_of_the_model_to_measure_is_said_while_it_runs(monkeypatch):
    # Sizing traces each member tried on the meta device: the first AmoebaNet bench was 16 s of silence.
    import threading

    from gpipe_cli import sizing
    from gpipe_cli.estimate.subject import to_measure

    said: list[str] = []
    heard = threading.Event()

    def slow(cand: sizing.Candidate) -> sizing.Verdict:
        assert heard.wait(30)  # still choosing when the line is said
        return sizing.Verdict(1.0, 2.0, 1.0, 2.0)

    def say(line: str) -> None:
        said.append(line)
        heard.set()

    monkeypatch.setattr("gpipe_cli.estimate.subject.SLOW_CHOICE_S", 0.01)
    to_measure("transformer", {}, [], slow, 2, True, say=say)
    assert said == ["choosing a model this machine can measure (each size tried is traced once, then kept)..."]
    said.clear()
    monkeypatch.setattr("gpipe_cli.estimate.subject.SLOW_CHOICE_S", 5.0)
    to_measure("transformer", {}, [], lambda cand: sizing.Verdict(1.0, 2.0, 1.0, 2.0), 2, True, say=say)
    assert said == []  # quick: nothing


def test_the_pace_of_a_layer_counts_its_forward_and_backward_as_three_forwards(monkeypatch):
    from types import SimpleNamespace

    from gpipe_cli import sizing
    from gpipe_cli.estimate import kept, subject

    # A timed forward and backward is three forwards' FLOPs; counted as two, every model was paced a third slow.
    spec = resolve("transformer", tiny.sizes(tiny.TRANSFORMER), tiny.TRANSFORMER["set"]).build()
    timing = SimpleNamespace(forward=0.5, backward=1.0)  # seconds of the timed layer, however many examples
    monkeypatch.setattr(subject, "profile_layers", lambda factories, *args, **kwargs: [timing] * len(factories))
    here = sizing.Machine("cpu", 2, 8 * 2**30, 1e15, 0.0)  # fast enough that every example asked for is timed
    flops = max(layer.flops for layer in kept.summary(spec, 2).layers[:3])
    paced = subject.paced(here, spec, "transformer", 4, seed=0)
    efficiency = sizing.layer_efficiency("cpu", "transformer")
    assert paced.flops_per_s == pytest.approx(3 * flops * 4 / 1.5 / efficiency)
