"""A file written by `gpipe export`, and what each kind of model does with one input: translate, continue, classify."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn

from gpipe_cli.data.augment import FloatRange, ImageTransform, pil_to_tensor
from gpipe_cli.data.image_kind import FORMATS, image_format
from gpipe_cli.data.sources import first_line
from gpipe_cli.data.tokenizer import UNK, Tokenizer
from gpipe_cli.errors import UserError, shown, shown_path
from gpipe_cli.files import check_path
from gpipe_cli.models.transformer.decode import Forward, continue_text, encoding_once, translate, translation_limit
from gpipe_cli.models.weights import (
    NO_TOKENIZER,
    NO_TOKENIZER_FIX,
    Exported,
    NewerFormat,
    WeightsOnly,
    class_names,
    cut_short,
    not_finite,
    parse,
)
from gpipe_cli.predict import export_command, export_file
from gpipe_cli.runs import TOKENIZER_FILE

Answer = Callable[[str], Iterator[str]]  # one input -> the pieces of its line of output, as each is known
_CLASSIFIES = f"an image model classifies image files ({FORMATS}, ...)"
SHOWN_UNKNOWN = 8  # characters named in the line; the rest counted



def load_export(path: str) -> Exported:
    """The export at `path`: its model description, weights and tokenizer; one line refuses anything else."""
    from safetensors import SafetensorError, safe_open

    file = export_file(path)
    try:
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata()
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safetensors handle)
    except (SafetensorError, OSError, RuntimeError) as exc:
        # A copy or download that stopped early: "not a safetensors file" sent the user looking for another file.
        short = cut_short(file)
        if short is not None:
            raise UserError(f"{shown_path(str(file))} {short}; copy it again whole, or "
                            f"write it again with: {export_command(file)}") from None
        raise UserError(f"{shown_path(str(file))} is not a safetensors file ({first_line(exc)}); write one with: "
                        f"{export_command(file)}") from None
    try:
        exported = parse(tensors, metadata)
    except WeightsOnly as exc:  # gpipe export wrote it: advising that command again would go round in a circle
        raise UserError(f"{shown_path(path)} cannot be run: {exc}") from None
    except NewerFormat as exc:
        raise UserError(f"{shown_path(path)} cannot be read: {exc}; upgrade gpipe-cli to use it") from None
    except ValueError as exc:
        raise UserError(f"{shown_path(path)} is not a gpipe export: {exc}; write one with: "
                        f"{export_command(file)}") from None
    bad = not_finite(exported.state)
    if bad is not None:  # every answer would follow from NaN: a class of "nan%", an empty translation
        # float16 holds at most 65,504: a larger weight exported in it became infinite.
        hint = "; export the run again with --dtype bfloat16 or float32" if exported.dtype == "float16" else ""
        raise UserError(f"{shown_path(path)} cannot be run: its weights are not all finite ({bad}){hint}")
    return exported


class NoAnswer(Exception):
    """An input answered with nothing past what it was: why, said on stderr once its line is written."""


def translator(exported: Exported, model: nn.Module) -> Answer:
    """Greedy translation of a sentence, as the training's BLEU evaluation decodes."""
    tok, max_len = _tokenizer(exported), int(exported.spec.config["max_len"])

    def answer(text: str) -> Iterator[str]:
        ids = tok.encode(not_an_image(text, "translation"))
        _say_if_unknown(tok, ids, text)
        if len(ids) > max_len:  # cut as evaluation cuts a long source, and said: the translation ends early
            print(f"[gpipe] a sentence of {len(ids):,} tokens: its first {max_len} are translated (the model reads "
                  f"at most model.max_len = {max_len})", file=sys.stderr, flush=True)
            ids = ids[:max_len]
        if not ids and text.strip():  # zero-width or control characters alone: the model would read nothing
            raise NoAnswer("nothing to translate: the model's tokenizer drops every character of it")
        if ids:
            out = translate(_finite(encoding_once(model), text), torch.tensor([ids]),
                            translation_limit(len(ids), max_len), tok.vocab_size)
            yield tok.decode(out[0])

    return answer


def generator(exported: Exported, model: nn.Module, max_tokens: int) -> Answer:
    """The prompt, then up to `max_tokens` greedy tokens, each piece of text as soon as it is known."""
    tok, max_len = _tokenizer(exported), int(exported.spec.config["max_len"])

    def answer(text: str) -> Iterator[str]:
        ids = tok.encode(not_an_image(text, "language"))
        _say_if_unknown(tok, ids, text)
        # The prompt as typed, not as the tokenizer gives it back (spaces folded, unknown characters as ⁇); the
        # new text is what decoding grows by past it (the new tokens alone would lose the space before the first).
        yield text
        if not text.strip():  # a blank line of stdin: a blank answer keeps the answers beside their lines
            return
        read, new, shown_new, prompt = tok.decode(ids), "", "", len(ids)
        for token in continue_text(_finite(model, text), ids, max_tokens, max_len, tok.vocab_size):
            ids.append(token)
            whole = tok.decode(ids)
            new = whole[len(read):] if whole.startswith(read) else shown_new
            # A character's bytes may come over several tokens: its start waits for the rest.
            if new.startswith(shown_new) and len(new) > len(shown_new) and not new.endswith("\ufffd"):
                yield new[len(shown_new):]
                shown_new = new
        if new != shown_new and new.startswith(shown_new):  # the answer ended inside a character
            yield new[len(shown_new):]
        if len(ids) == prompt:  # the prompt came back alone, which reads as if nothing had run
            raise NoAnswer("the model ended the document right after the prompt, adding nothing (it may need more "
                           "training)")

    return answer


def classifier(exported: Exported, model: nn.Module, top: int) -> Answer:
    """The image file's `top` most likely classes with their probabilities."""
    config = exported.spec.config
    classes = int(config["num_classes"])
    if not 1 <= top <= classes:
        raise UserError(f"--top: must be >= 1 and <= {classes}, the model's classes (got {top})")
    transform = ImageTransform(int(config["image_size"]), augment=False)  # the evaluation transform
    names = class_names(exported.metadata)

    def named(i: int) -> str:
        return names[i] if i < len(names) else f"class {i}"

    def answer(path: str) -> Iterator[str]:
        if not path.strip():  # a blank line of stdin (an INPUT is checked first): a blank answer, as text models give
            return
        with torch.no_grad():
            output = model(transform(read_image(path))[None])
        logits = _checked(output if isinstance(output, torch.Tensor) else output[0], path)  # not the auxiliary head
        probs, ids = logits.float().softmax(-1)[0].topk(top)
        yield f"{path}\t" + ", ".join(f"{named(i)} ({p:.1%})" for p, i in zip(probs.tolist(), ids.tolist(),
                                                                               strict=True))

    return answer


def read_image(path: str) -> torch.Tensor:
    """The image file at `path` as float [3, h, w] in [0, 1]."""
    from PIL import Image, UnidentifiedImageError

    check_image_path(path)
    try:
        with Image.open(path) as image:
            return pil_to_tensor(image)
    except FloatRange as exc:
        raise UserError(f"{shown_path(path)} cannot be classified: {exc}") from None
    # PIL refuses an image of more pixels than it allows with an error of its own (not an OSError).
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as exc:
        raise UserError(f"{shown_path(path)} is not an image PIL can read ({first_line(exc)}); {_CLASSIFIES}") from None


def check_image_path(path: str) -> None:
    """Refuse an input of an image model that names no file."""
    check_path(path, "INPUT")
    if not os.path.isfile(path):
        what = "a directory" if os.path.isdir(path) else "no such file"
        raise UserError(f"{shown_path(path)}: {what}; {_CLASSIFIES}")


def not_an_image(text: str, kind: str) -> str:
    """The input, refused when it names an image file (a text model reads sentences, not files)."""
    # By its bytes, not its name: a photo saved as notes.txt is one, a text file named x.png is a sentence.
    if os.path.isfile(text) and image_format(text) is not None:
        raise UserError(f"{shown(text)} is an image file, but this is a {kind} model: give it sentences, "
                        "as arguments or one per line on stdin")
    return text  # UTF-8: each INPUT and line of stdin is checked before it gets here


def _finite(forward: Forward, text: str) -> Forward:
    """`forward`, refusing outputs that are not finite (greedy decoding would pick a token all the same)."""
    def checked(inputs: object) -> torch.Tensor:
        logits = forward(inputs)
        _checked(logits[:, -1], text)  # the last position: the one decoding reads
        return logits
    return checked


def _checked(logits: torch.Tensor, given: str) -> torch.Tensor:
    """`logits`, when finite; else one line: finite weights can still overflow float32 on some input."""
    if not bool(torch.isfinite(logits).all()):
        raise UserError(f"the model's outputs for {shown(given)} are not finite (NaN or infinite), though its "
                        "weights are: it has no answer to give")
    return logits


def _say_if_unknown(tok: Tokenizer, ids: list[int], text: str) -> None:
    """A line on stderr when the tokenizer knows none, or only some, of the input's characters."""
    if tok.knows_none(ids):
        print(f"[gpipe] the model's tokenizer knows none of the characters of {shown(text)}: the model reads it as "
              "unknown pieces only, so its answer cannot follow from it", file=sys.stderr, flush=True)
    elif (unknown := tok.unknown_characters(text) if UNK in ids else []):
        # "Three Hundred Twelve" to a model trained on lower case was answered "dix-neuf" without a word.
        more = f" and {len(unknown) - SHOWN_UNKNOWN} more" if len(unknown) > SHOWN_UNKNOWN else ""
        named = ", ".join(map(repr, unknown[:SHOWN_UNKNOWN])) + more
        print(f"[gpipe] the model's tokenizer knows no piece for {named} of {shown(text)}: the model reads "
              f"{'it' if len(unknown) == 1 else 'them'} as unknown, so its answer may not follow from the input",
              file=sys.stderr, flush=True)


def _tokenizer(exported: Exported) -> Tokenizer:
    """The tokenizer stored in the export."""
    if exported.tokenizer is None:
        why = exported.metadata.get(NO_TOKENIZER)  # gpipe export records why it left the tokenizer out
        said = f"at export, {why}" if why else f"at export, its run's {TOKENIZER_FILE} or data.tokenizer did not load"
        again = exported.metadata.get(NO_TOKENIZER_FIX, "export the run again once its tokenizer file loads")
        raise UserError(f"the export holds no tokenizer, so gpipe predict cannot run it ({said}); {again}")
    try:
        return Tokenizer(exported.tokenizer)
    except UserError:
        raise
    except Exception as exc:  # sentencepiece raises RuntimeError for bytes that are no model
        raise UserError(f"the export's tokenizer is not a sentencepiece model ({first_line(exc)})") from None
