"""The registry: kinds, presets, overrides and clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from models_testkit import build_preset

from gpipe_cli.errors import one_line
from gpipe_cli.models import families
from gpipe_cli.models.presets import is_preset_name, presets
from gpipe_cli.models.registry import BUILDERS, allowed_params, build_model, resolve_preset

REQUIRED_PRESETS = ["amoebanet-d-18-256", "amoebanet-d-18-208", "amoebanet-b-18-512", "transformer-big",
                    "t-6-8192-16", "transformer-l-3", "transformer-l-13", "transformer-l-103"]


def test_required_presets_are_listed_and_resolve() -> None:
    listed = presets()
    for name in REQUIRED_PRESETS:
        assert name in listed
        kind, params = resolve_preset(name)
        assert kind == listed[name].kind and params == listed[name].params


def test_every_preset_builds() -> None:
    for name, preset in presets().items():
        spec = build_preset(name)
        assert spec.layers and spec.config["kind"] == preset.kind


def test_overrides_replace_individual_keys() -> None:
    kind, params = resolve_preset("amoebanet-d-18-256", num_classes=10, image_size=32)
    assert kind == "amoebanet"
    assert params == dict(variant="d", layers=18, filters=256, num_classes=10, image_size=32)
    spec = build_preset("transformer-l-3", vocab_size=1000)
    assert spec.config["vocab_size"] == 1000 and spec.config["d_model"] == 2048


def test_pattern_names_resolve() -> None:
    assert resolve_preset("amoebanet-b-6-64") == ("amoebanet", dict(variant="b", layers=6, filters=64))
    kind, params = resolve_preset("t-2-128-4")
    assert kind == "transformer" and (params["layers"], params["ff"], params["heads"]) == (2, 128, 4)
    assert resolve_preset("transformer-l-7")[1]["layers"] == 7


def test_defaults_build() -> None:
    assert build_model("amoebanet").name == "amoebanet-d-18-256"
    assert build_model("transformer").task == "translation"
    assert "label_smoothing" in allowed_params("amoebanet")
    assert "logit_clip" in allowed_params("transformer")


@pytest.mark.parametrize(("call", "message"), [
    (lambda: build_model("resnet"), "unknown model kind 'resnet'"),
    (lambda: build_model("amoebanet", depth=3), "unknown parameter 'depth'"),
    (lambda: build_model("amoebanet", filter=3), r"unknown parameter 'filter' for model kind 'amoebanet' \(did you "
                                                 r"mean filters\?\); allowed: "),
    (lambda: resolve_preset("amoebanet-x"), "unknown model preset 'amoebanet-x'"),
    (lambda: build_preset("transformer-big", heads=0), "heads"),
    (lambda: resolve_preset("transformer-big", colour="red"), "unknown parameter 'colour'"),
    (lambda: build_preset("amoebanet-d-18-256", variant="z"), "variant"),
])
def test_bad_names_and_values_raise_value_error(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_an_unknown_preset_names_every_name_allowed_in_one_readable_line() -> None:
    with pytest.raises(ValueError) as info:
        resolve_preset("foo")
    message = str(info.value)
    assert one_line(message) == message and "more characters" not in message
    # The presets no form covers by name, then the forms: every preset is one or the other.
    assert "transformer-big or a name of the form amoebanet-{d|b}-L-D, t-L-H-A or transformer-l-L" in message
    for name in presets():
        assert is_preset_name(name)
    assert not is_preset_name("foo") and is_preset_name("t-2-64-2")


def test_every_family_states_its_facts_and_its_paper_model_and_members_build() -> None:
    assert set(families.FAMILIES) == set(BUILDERS)
    for kind, family in families.FAMILIES.items():
        assert resolve_preset(family.paper_preset)[0] == kind
        assert all(set(member) <= set(allowed_params(kind)) for member in family.smaller)
        assert family.probe_depths[0] < family.probe_depths[1] and family.depth_step >= 1


def test_the_families_facts_load_without_torch() -> None:
    # The first line of `gpipe train` names the model before torch loads.
    code = "import sys, gpipe_cli.models.families; assert 'torch' not in sys.modules"
    root = str(Path(families.__file__).parents[2])
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": root})
