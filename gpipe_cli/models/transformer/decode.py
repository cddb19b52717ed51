"""Greedy decoding: one token per step, for a translation model or a language model run in one process."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from gpipe_cli.models.losses import PAD_ID
from gpipe_cli.models.transformer.layers import Embedding, EncoderLayer

# The tokenizer's ids, as FIRST_WORD_ID in network.py assumes them: pad 0, unk 1, bos 2, eos 3.
BOS_ID, EOS_ID = 2, 3

Forward = Callable[[Any], torch.Tensor]  # model inputs -> logits [N, T, vocab]


def translation_limit(source_length: int, max_len: int) -> int:
    """The most tokens to decode for a source of `source_length` tokens."""
    # Translations of number words run up to about twice the source; never past the model's positions.
    return min(max_len - 1, 2 * source_length + 8)


def greedy_step(logits: torch.Tensor, prefix: torch.Tensor, finished: torch.Tensor,
                vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`prefix` with each row's most likely next token appended (padding once a row has ended), and the rows ended."""
    last = logits[:, -1, :vocab].clone()  # vocab: the tokenizer's pieces (the model's may be more)
    # Never an answer: pad, unk and bos (ids 0 to 2) decode to nothing or "⁇", yet use up a token each. A slice, so
    # that no index tensor is copied to the device at each token.
    last[:, PAD_ID:BOS_ID + 1] = -torch.inf
    token = last.argmax(-1).cpu()
    token[finished] = PAD_ID
    return torch.cat([prefix, token[:, None]], dim=1), finished | (token == EOS_ID)


@torch.no_grad()
def translate(forward: Forward, source: torch.Tensor, max_len: int, vocab: int | None = None) -> list[list[int]]:
    """Greedy translations of `source` [N, S] (padded with 0): the token ids after bos, up to eos or `max_len`."""
    prefix = torch.full((source.shape[0], 1), BOS_ID, dtype=torch.long)
    finished = torch.zeros(source.shape[0], dtype=torch.bool)
    while bool((~finished).any()) and prefix.shape[1] <= max_len:
        prefix, finished = greedy_step(forward((source, prefix.to(source.device))), prefix, finished, vocab)
    return [row[1:].tolist() for row in prefix]


def encoding_once(model: nn.Module) -> Forward:
    """A translation model's forward for decoding, keeping a source's encoder states while the target prefix grows."""
    embed, *layers = model.children()
    assert isinstance(embed, Embedding)
    encoders = [layer for layer in layers if isinstance(layer, EncoderLayer)]
    decoders = layers[len(encoders):]
    kept: dict[str, Any] = {}

    def forward(inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        source, prefix = inputs
        if kept.get("source") is not source:  # each step otherwise reran the encoder on the same source
            encoded = embed.stream(source)
            for encoder in encoders:
                encoded = encoder(encoded)
            kept.update(source=source, states=encoded)
        states: Any = (*kept["states"], *embed.stream(prefix))  # the softmax makes them logits
        for layer in decoders:
            states = layer(states)
        return states
    return forward


# The pipeline's decoding passes each micro-batch's source through the encoder layers at every step, the states
# arriving as new tensors (messages): a layer compares what it receives with what it has encoded. In evaluation an
# encoder layer is a function of its input, so the kept output is the very one it would compute.
@contextlib.contextmanager
def encodings_reused(model: nn.Module) -> Iterator[None]:
    """In the block, each encoder layer in `model` returns its kept output for an input it has encoded (no grad)."""
    layers = [m for m in model.modules() if isinstance(m, EncoderLayer)]

    def reusing(forward: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]) -> Callable[..., Any]:
        kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # input, its key mask, output
        found = [0]  # where to look first

        def forward_once(states: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            x, keep, *rest = states
            if torch.is_grad_enabled():
                return forward(states)
            # Micro-batches come in the same order at every step: the one after the last found is looked at first.
            for seen, mask, out in kept[found[0]:] + kept[:found[0]]:
                found[0] = (found[0] + 1) % len(kept)
                if seen.shape == x.shape and torch.equal(seen, x) and torch.equal(mask, keep):
                    return (out, keep, *rest)
            result = forward(states)
            kept.append((x, keep, result[0]))  # one batch's micro-batches: the block ends with its decoding
            return result
        return forward_once

    for layer in layers:
        layer.forward = reusing(layer.forward)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def continue_text(forward: Forward, prompt: list[int], max_tokens: int, window: int,
                  vocab: int | None = None) -> Iterator[int]:
    """Up to `max_tokens` greedy next tokens after `prompt`, each as soon as it is known (stopping before eos), each
    from the last `window` tokens."""
    tokens = torch.tensor([(prompt or [EOS_ID])[-window:]], dtype=torch.long)  # empty: a new document starts
    finished = torch.zeros(1, dtype=torch.bool)
    for _ in range(max_tokens):
        with torch.no_grad():
            tokens, finished = greedy_step(forward(tokens), tokens, finished, vocab)
        tokens = tokens[:, -window:]  # what the next step reads: a long answer keeps no more
        if bool(finished.all()):
            return
        yield int(tokens[0, -1])
