"""Greedy decoding of a translation model with its encoder run once per source: the whole model's tokens."""

import torch
from torch import nn

from gpipe_cli.models.registry import build_model
from gpipe_cli.models.transformer.decode import encoding_once, encodings_reused, translate
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


def test_encodings_reused_computes_each_sources_encoding_once_and_changes_no_token():
    # The pipeline's decoding receives each micro-batch's source states anew at every step, as other tensors.
    torch.manual_seed(0)
    spec = build_model("transformer", arch="encoder-decoder", layers=2, d_model=32, ff=64, heads=4, vocab_size=50,
                       max_len=40, dropout=0.1)
    model = nn.Sequential(*spec.build_all()).eval()
    sources = [torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (2, 5))]
    whole = [translate(model, source, 30) for source in sources]
    runs = []
    next(m for m in model if isinstance(m, EncoderLayer)).ffn.register_forward_hook(lambda *_: runs.append(1))
    with encodings_reused(model):
        assert [translate(lambda inputs: model((inputs[0].clone(), inputs[1])), source, 30)
                for source in sources] == whole
    assert len(runs) == len(sources)  # once per source, not once per token
    runs.clear()
    translate(model, sources[0], 30)
    assert len(runs) > 1  # the block has ended: every step encodes again
    runs.clear()
    with torch.enable_grad(), encodings_reused(model):  # training never reuses: gradients flow through each pass
        model((sources[0], sources[0]))
        model((sources[0], sources[0]))
    assert len(runs) == 2


def test_a_translation_may_run_to_twice_its_source_and_eight_more_within_the_model():
    from gpipe_cli.models.transformer.decode import translation_limit

    assert (translation_limit(10, 512), translation_limit(600, 512)) == (28, 511)
