import pytest

from gpipe_cli.errors import UserError
from gpipe_cli.estimate.subject import FAMILIES, resolve
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
