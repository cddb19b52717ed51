"""Layers built on the meta device: shapes only, without torch's compiler."""

import subprocess
import sys

import torch

from gpipe_cli.pipeline.layers import on_meta


def test_models_described_on_the_meta_device_leave_torchs_compiler_unimported():
    # nn.Embedding's initialisation on the meta device imported it (about 2 s of every export and plan).
    code = ("import sys\n"
            "from gpipe_cli.models.registry import build_model\n"
            "from gpipe_cli.pipeline.layers import build_layers\n"
            "for kind, kw in (('transformer', {}), ('amoebanet', dict(layers=6, filters=16, image_size=32, "
            "num_classes=10))):\n"
            "    spec = build_model(kind, **kw)\n"
            "    layers = build_layers(spec.factories(), range(len(spec.layers)), 0, 'meta')\n"
            "    assert all(p.is_meta for layer in layers for p in layer.parameters())\n"
            "print('torch._dynamo' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


def test_only_meta_tensors_are_left_unfilled():
    with on_meta():
        meta = torch.nn.init.normal_(torch.empty(4, 4))
        real = torch.nn.init.normal_(torch.zeros(64, device="cpu"), std=1.0)
        trunc = torch.nn.init.trunc_normal_(torch.zeros(64, device="cpu"))
    assert meta.is_meta and meta.shape == (4, 4)
    assert real.std() > 0.5 and trunc.abs().sum() > 0
