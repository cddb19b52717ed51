"""Greedy decoding of a translation model with its encoder run once per source: the whole model's tokens."""

import torch
from torch import nn

from gpipe_cli.models.registry import build_model
from gpipe_cli.models.transformer.decode import encoding_once, translate
from gpipe_cli.models.transformer.layers import EncoderLayer


def test_the_encoder_runs_once_per_source_and_the_tokens_are_the_whole_models():
    torch.manual_seed(0)
    spec = build_model("transformer", arch="encoder-decoder", layers=2, d_model=32, ff=64, heads=4, vocab_size=50,
                       max_len=40, dropout=0.1)
    model = nn.Sequential(*spec.build_all()).eval()
    source = torch.randint(4, 50, (3, 7))
    source[1, 5:] = 0  # a padded row
    prefix = torch.randint(4, 50, (3, 6))
    cached = encoding_once(model)
    torch.testing.assert_close(cached((source, prefix)), model((source, prefix)), rtol=0, atol=0)
    runs = []
    next(m for m in model if isinstance(m, EncoderLayer)).register_forward_hook(lambda *_: runs.append(1))
    whole = translate(model, source, 30)
    steps = len(runs)
    runs.clear()
    assert translate(encoding_once(model), source, 30) == whole
    assert steps > 1 and len(runs) == 1
