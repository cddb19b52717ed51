"""The named models of the paper, and the name patterns of any size of them: data, loaded without torch."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpipe_cli.errors import shown

# The Transformer-L of the paper's memory table: d_model 2048, feed-forward 8192, 32 heads, 32k vocabulary.
_TRANSFORMER_L = dict(arch="decoder-only", d_model=2048, ff=8192, heads=32, vocab_size=32000)
# The paper's T(L, H, A) translation models: d_model 1024 and a shared 64k-token vocabulary.
_T_MODEL = dict(arch="encoder-decoder", d_model=1024, vocab_size=64000)


@dataclass(frozen=True)
class Preset:
    """A named model: its kind, the parameters it sets, and where it comes from."""

    name: str
    kind: str
    params: dict[str, Any]
    description: str


def _amoebanet(variant: str, layers: int, filters: int, **extra: Any) -> dict[str, Any]:
    return dict(variant=variant, layers=layers, filters=filters, **extra)


def _t_model(layers: int, ff: int, heads: int) -> dict[str, Any]:
    return dict(_T_MODEL, layers=layers, ff=ff, heads=heads)


_PRESETS: list[Preset] = [
    Preset("amoebanet-d-18-208", "amoebanet", _amoebanet("d", 18, 208), "GPipe Table 1, 82M parameters"),
    Preset("amoebanet-d-18-256", "amoebanet", _amoebanet("d", 18, 256), "GPipe speed table"),
    Preset("amoebanet-d-18-416", "amoebanet", _amoebanet("d", 18, 416), "GPipe Table 1, 318M parameters"),
    Preset("amoebanet-d-18-544", "amoebanet", _amoebanet("d", 18, 544), "GPipe Table 1, 542M parameters"),
    Preset("amoebanet-d-36-544", "amoebanet", _amoebanet("d", 36, 544), "GPipe Table 1, 1.05B parameters"),
    Preset("amoebanet-d-72-512", "amoebanet", _amoebanet("d", 72, 512), "GPipe Table 1, 1.8B parameters"),
    Preset("amoebanet-b-18-512", "amoebanet", _amoebanet("b", 18, 512, image_size=480),
           "GPipe's 557M-parameter ImageNet model at 480x480"),
    Preset("transformer-big", "transformer",
           dict(arch="encoder-decoder", layers=6, d_model=1024, ff=4096, heads=16, vocab_size=32000,
                tie_embeddings=True), "Transformer-Big of Vaswani et al., T(6, 4096, 16)"),
    Preset("t-6-8192-16", "transformer", _t_model(6, 8192, 16), "GPipe T(6, 8192, 16)"),
    Preset("t-12-16384-32", "transformer", _t_model(12, 16384, 32), "GPipe T(12, 16384, 32)"),
    Preset("t-24-8192-16", "transformer", _t_model(24, 8192, 16), "GPipe T(24, 8192, 16)"),
    Preset("t-32-16384-32", "transformer", _t_model(32, 16384, 32), "GPipe T(32, 16384, 32)"),
    Preset("t-64-16384-32", "transformer", _t_model(64, 16384, 32), "GPipe T(64, 16384, 32)"),
    Preset("t-128-16384-32", "transformer", _t_model(128, 16384, 32), "GPipe T(128, 16384, 32)"),
    Preset("transformer-l-3", "transformer", dict(_TRANSFORMER_L, layers=3),
           "GPipe memory table Transformer-L, 282.2M parameters"),
    Preset("transformer-l-13", "transformer", dict(_TRANSFORMER_L, layers=13),
           "GPipe memory table Transformer-L, 785.8M parameters"),
    Preset("transformer-l-103", "transformer", dict(_TRANSFORMER_L, layers=103),
           "GPipe memory table Transformer-L, 5.3B parameters"),
]

# Names outside the list follow the same patterns: any size of the three families.
_PATTERNS: list[tuple[re.Pattern[str], Callable[[re.Match[str]], tuple[str, dict[str, Any]]]]] = [
    (re.compile(r"amoebanet-([db])-(\d+)-(\d+)"),
     lambda m: ("amoebanet", _amoebanet(m.group(1), int(m.group(2)), int(m.group(3))))),
    (re.compile(r"t-(\d+)-(\d+)-(\d+)"),
     lambda m: ("transformer", _t_model(int(m.group(1)), int(m.group(2)), int(m.group(3))))),
    (re.compile(r"transformer-l-(\d+)"),
     lambda m: ("transformer", dict(_TRANSFORMER_L, layers=int(m.group(1))))),
]
_PATTERN_HELP = ("amoebanet-{d|b}-L-D, t-L-H-A or transformer-l-L (L layers, D filters, H feed-forward width, "
                 "A heads)")


def presets() -> dict[str, Preset]:
    """The named presets from the paper, by name."""
    return {p.name: Preset(p.name, p.kind, dict(p.params), p.description) for p in _PRESETS}


def is_preset_name(name: str) -> bool:
    """Whether `name` is a preset or follows one of the presets' patterns."""
    return any(p.name == name for p in _PRESETS) or any(pattern.fullmatch(name) for pattern, _ in _PATTERNS)


def names_help() -> str:
    """Every preset name accepted, in words: the patterns, and the presets no pattern covers."""
    # Listing every preset would not fit one line; all but a few are instances of the patterns.
    others = [p.name for p in _PRESETS if not any(pattern.fullmatch(p.name) for pattern, _ in _PATTERNS)]
    return f"{', '.join(others)} or a name of the form {_PATTERN_HELP}"


def preset(name: str) -> tuple[str, dict[str, Any]]:
    """The kind and parameters of preset `name`; ValueError naming the accepted names if there is none."""
    known = presets()
    if name in known:
        return known[name].kind, known[name].params
    for pattern, make in _PATTERNS:
        match = pattern.fullmatch(name)
        if match:
            return make(match)
    raise ValueError(f"unknown model preset {shown(name)}; use {names_help()}")
