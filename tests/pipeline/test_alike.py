"""Alike layers are priced once on the meta device, and the figures are those of pricing every layer."""

from __future__ import annotations

import functools

import pytest

import gpipe_cli.models.describe as describe_module
import gpipe_cli.pipeline.layer_profile as layer_profile
from gpipe_cli.memory_model import probe
from gpipe_cli.pipeline.alike import alike_key
from gpipe_cli.recipe.load import load_recipe
from gpipe_cli.recipe_model import model_spec

MODELS = {
    "translation, tied": (None, ["model.layers=5"]),
    "translation, untied": (None, ["model.layers=4", "model.tie_embeddings=false"]),
    "language model": ("recipes/lm-pydoc.yaml", ["model.layers=6"]),
    "amoebanet": ("recipes/amoebanet-small.yaml", []),
}


def spec_of(name: str):
    path, sets = MODELS[name]
    return model_spec(load_recipe(path, sets))


@pytest.mark.parametrize("name", MODELS)
def test_the_memory_figures_equal_those_of_pricing_every_layer(monkeypatch, name):
    spec = spec_of(name)
    once = [probe(spec, examples, 0, "meta") for examples in (2, 4)]
    monkeypatch.setattr(layer_profile, "alike_key", lambda *args, **kwargs: None)
    assert once == [probe(spec, examples, 0, "meta") for examples in (2, 4)]


@pytest.mark.parametrize("name", MODELS)
def test_the_flops_and_shapes_equal_those_of_counting_every_layer(monkeypatch, name):
    spec = spec_of(name)
    once = describe_module.describe(spec, 2)
    monkeypatch.setattr(describe_module, "alike_key", lambda *args, **kwargs: None)
    assert once == describe_module.describe(spec, 2)


def test_a_deep_model_builds_each_kind_of_layer_once_on_the_meta_device(monkeypatch):
    # `gpipe validate --set model.layers=10000` was priced layer by layer: about 35 minutes.
    spec = spec_of("language model")
    deep = model_spec(load_recipe("recipes/lm-pydoc.yaml", ["model.layers=400"]))
    built: list[int] = []
    real = layer_profile.build_layers
    monkeypatch.setattr(layer_profile, "build_layers",
                        lambda factories, indices, *args: built.extend(indices) or real(factories, indices, *args))
    _, rows = probe(deep, 2, 0, "meta")
    assert len(rows) == 402 and len(built) < 10, built
    assert rows[1:-1] == [rows[1]] * 400  # every decoder layer alike
    assert probe(spec, 2, 0, "meta")[1][1] == rows[1]  # as in a shallow model


def test_only_a_call_of_comparable_arguments_has_a_key():
    assert alike_key(lambda: None, []) is None
    assert alike_key(functools.partial(dict, a={1}), []) is None  # unhashable: not compared
    assert alike_key(functools.partial(dict, a=[1]), []) == alike_key(functools.partial(dict, a=[1]), [])
    assert alike_key(functools.partial(dict, a=(1, 2)), []) == alike_key(functools.partial(dict, a=(1, 2)), [])
    assert alike_key(functools.partial(dict, a=1), []) != alike_key(functools.partial(dict, a=2), [])
