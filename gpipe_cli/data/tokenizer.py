"""A shared source/target sentencepiece vocabulary with the models' ids: pad 0, unk 1, bos 2, eos 3."""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from gpipe_cli.data.sources import first_line
from gpipe_cli.errors import DataError
from gpipe_cli.files import atomic_write_bytes, space_left, writing
from gpipe_cli.runs import TOKENIZER_FILE

PAD, UNK, BOS, EOS = 0, 1, 2, 3
# sentencepiece samples this many sentences for training: enough for a 32k vocabulary, bounded memory.
_TRAIN_SENTENCES = 2_000_000
# The pieces sentencepiece adds to the characters: the special ids the trainer is given (none of them -1).
_SPECIAL = ("pad", "unk", "bos", "eos")
# sentencepiece's refusal of a vocabulary below its characters + special pieces, which it counts together.
_TOO_FEW = re.compile(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)\.")
# The longest line sentencepiece trains on, in UTF-8 bytes (whole paragraphs, not only sentences): it skips longer.
MAX_LINE_BYTES = 1 << 16


class Tokenizer:
    """Text <-> token ids; `path` is the stored model file (None when it lives only in memory)."""

    def __init__(self, proto: bytes, path: Path | None = None) -> None:
        import sentencepiece as spm

        self.path = path
        self._proto = proto
        where = f"'{path}'" if path else "the tokenizer"
        if not proto:  # sentencepiece takes an empty model and gives every special id as -1
            raise DataError(f"{where} is empty (0 bytes), not a sentencepiece model")
        self._sp = spm.SentencePieceProcessor(model_proto=proto)
        ids = (self._sp.pad_id(), self._sp.unk_id(), self._sp.bos_id(), self._sp.eos_id())
        if ids != (PAD, UNK, BOS, EOS):
            raise DataError(f"{where} has pad/unk/bos/eos ids {ids} but the models need (0, 1, 2, 3); "
                            "train it with --pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3 "
                            "or leave data.tokenizer unset")

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load a sentencepiece model file."""
        p = Path(path).expanduser()
        if p.is_dir():
            raise DataError(f"tokenizer file '{p}' is a directory; give the sentencepiece model file (.model) in it")
        if not p.is_file():
            raise DataError(f"tokenizer file '{p}' does not exist")
        try:
            proto = p.read_bytes()
        except OSError as e:  # not "not a sentencepiece model": the file may be fine
            raise DataError(f"cannot read tokenizer file '{p}' ({e.strerror or e})") from None
        try:
            return cls(proto, p)
        except DataError:
            raise
        except Exception as e:  # sentencepiece raises RuntimeError/OSError for non-model files
            # Its words for bytes that do not parse name its own source line: `INTERNAL: src/...cc(109) [...]`.
            why = "its bytes do not parse: damaged, cut short, or another kind of file" \
                if "ParseFromArray" in str(e) else first_line(e)
            raise DataError(f"'{p}' is not a sentencepiece model ({why})") from None

    @property
    def model_bytes(self) -> bytes:
        """The sentencepiece model file's bytes."""
        return self._proto

    @property
    def vocab_size(self) -> int:
        """The real number of pieces (can be below the requested size for small corpora)."""
        return int(self._sp.get_piece_size())

    def encode(self, text: str) -> list[int]:
        """Token ids of one string, without bos/eos."""
        return list(self._sp.encode(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many strings (multi-threaded inside sentencepiece)."""
        if not texts:
            return []
        return [list(x) for x in self._sp.encode(list(texts), num_threads=min(16, os.cpu_count() or 1))]

    def decode(self, ids: Iterable[int] | Any) -> str:
        """Text of `ids` (a list or 1-d tensor): stops at eos, skips pad and bos."""
        ids = itertools.takewhile(lambda i: i != EOS, map(int, ids.tolist() if hasattr(ids, "tolist") else ids))
        return str(self._sp.decode([i for i in ids if i not in (PAD, BOS)]))

    def knows_none(self, ids: Sequence[int]) -> bool:
        """Whether `ids` are unknown pieces, with no other piece than spaces between them."""
        return UNK in ids and all(i == UNK or self._sp.id_to_piece(i) == "\u2581" for i in ids)

    def unknown_characters(self, text: str) -> list[str]:
        """The characters of `text` that no piece holds, each once, in order."""
        return [c for c in dict.fromkeys(text) if not c.isspace() and UNK in self._sp.encode(c)]

    def pieces(self, text: str) -> list[str]:
        """The subword pieces of `text`."""
        return list(self._sp.encode(text, out_type=str))

    def save(self, path: Path) -> Path:
        """Write the model file atomically (other ranks may be reading the folder)."""
        with writing(path, "", f"; {space_left(path.parent)}"):  # a full disk: one line, as for a checkpoint
            atomic_write_bytes(path, self._proto)
        self.path = path
        return path

    def __getstate__(self) -> dict[str, Any]:
        return {"proto": self._proto, "path": self.path}  # the model once: the processor rebuilds from it

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["proto"], state["path"])  # type: ignore[misc]


def train_tokenizer(texts: Iterable[str], vocab_size: int, key: str = "model.vocab_size",
                    model_vocab_size: int | None = None) -> Tokenizer:
    """Train a BPE model on `texts` (BPE: unigram degenerates to characters on small repetitive corpora)."""
    import sentencepiece as spm

    model = io.BytesIO()
    counts = [0, 0]  # lines given, and of them those sentencepiece skips as too long

    def sentences() -> Iterator[str]:
        for text in texts:
            if text and text.strip():
                counts[0] += 1
                counts[1] += _too_long(text)
                yield text
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_writer=model, vocab_size=vocab_size, model_type="bpe",
            hard_vocab_limit=False,  # small corpora get a smaller vocabulary instead of an error
            pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS, character_coverage=0.9999,
            input_sentence_size=_TRAIN_SENTENCES, shuffle_input_sentence=True,
            max_sentence_length=MAX_LINE_BYTES,
            num_threads=min(16, os.cpu_count() or 1), minloglevel=2)
    except Exception as e:
        too_few = _TOO_FEW.search(str(e))
        if too_few:  # its own words name a --character_coverage option that gpipe does not have
            raise DataError(_too_small(vocab_size, int(too_few[1]), key, model_vocab_size)) from None
        if counts[0] and counts[1] == counts[0]:  # sentencepiece says only that it has no sentences
            raise DataError(f"every line of the training text is longer than {MAX_LINE_BYTES // 1024} KiB, and the "
                            f"tokenizer leaves lines over {MAX_LINE_BYTES // 1024} KiB out of its training: split "
                            "the text into shorter lines, e.g. one paragraph a line") from None
        raise DataError(f"cannot train a {vocab_size}-piece tokenizer on the training text "
                        f"({first_line(e)})") from None
    if not model.getvalue():
        raise DataError("cannot train a tokenizer: the training text is empty")
    return Tokenizer(model.getvalue())


def lines_left_out(texts: Iterable[str]) -> str | None:
    """What a tokenizer trained on `texts` passes over (lines over MAX_LINE_BYTES), in words; None if nothing."""
    lines = [text for text in texts if text and text.strip()]
    if not (long := sum(map(_too_long, lines))):
        return None
    return (f"{long:,} of {len(lines):,} lines of the training text are over {MAX_LINE_BYTES // 1024} KiB: the "
            f"tokenizer's training left them out")


def _too_long(text: str) -> bool:
    """Whether sentencepiece skips `text` as longer than MAX_LINE_BYTES."""
    # A character is 1 to 4 bytes: only a line in between is encoded to count them.
    return len(text) > MAX_LINE_BYTES or (4 * len(text) > MAX_LINE_BYTES
                                          and len(text.encode("utf-8", "surrogatepass")) > MAX_LINE_BYTES)


def _too_small(vocab_size: int, needed: int, key: str, model_vocab_size: int | None) -> str:
    """The line for a vocabulary that cannot hold the text's characters (those of 99.99% of it) and special pieces."""
    both = key != "model.vocab_size" and model_vocab_size is not None and needed > model_vocab_size
    return (f"{key} ({vocab_size}) is smaller than the {needed - len(_SPECIAL)} distinct characters of the training "
            f"text plus the tokenizer's {len(_SPECIAL)} special pieces ({', '.join(_SPECIAL)}): give "
            # data.vocab_size may not exceed model.vocab_size: both must grow
            f"{'it and model.vocab_size ' if both else ''}at least {needed}")


def load_or_train(*, path: str | None, run_dir: Path | None, texts: Callable[[], Iterable[str]],
                  vocab_size: int, model_vocab_size: int, key: str = "model.vocab_size") -> Tokenizer:
    """data.tokenizer if given, else run_dir/tokenizer.model if present, else train one (of size `key`) and store it."""
    if vocab_size > model_vocab_size:
        raise DataError(f"data.vocab_size ({vocab_size}) exceeds model.vocab_size ({model_vocab_size})")
    if path:
        tok = Tokenizer.load(path)
        if run_dir is not None and not (kept := Path(run_dir) / TOKENIZER_FILE).is_file():
            # The run keeps a copy of the tokenizer it started with: a resume checks the file still holds it.
            with _locked(kept.parent / f".{kept.stem}.lock"):
                if not kept.is_file():
                    with writing(kept, "", f"; {space_left(kept.parent)}"):
                        atomic_write_bytes(kept, tok.model_bytes)
    elif run_dir is None:
        tok = train_tokenizer(texts(), vocab_size, key, model_vocab_size)
    elif (stored := Path(run_dir) / TOKENIZER_FILE).is_file():  # resuming, or another rank already trained it
        tok = Tokenizer.load(stored)
    else:
        # One rank trains while the others wait on the (hidden) lock, then all read the same file.
        with _locked(stored.parent / f".{stored.stem}.lock"):
            if stored.is_file():
                tok = Tokenizer.load(stored)
            else:
                tok = train_tokenizer(texts(), vocab_size, key, model_vocab_size)
                tok.save(stored)
    if tok.vocab_size > model_vocab_size:
        raise DataError(f"the tokenizer has {tok.vocab_size} pieces but model.vocab_size is "
                        f"{model_vocab_size}; raise model.vocab_size or use a smaller tokenizer")
    return tok


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """An exclusive file lock where the platform has one (a no-op elsewhere)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: ranks may both train, the atomic rename keeps the file whole
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            # Leave no lock file in the run directory. Safe: whoever locks next checks under its lock
            # whether the tokenizer exists, and the tokenizer itself is written atomically.
            lock.unlink(missing_ok=True)
            fcntl.flock(f, fcntl.LOCK_UN)

