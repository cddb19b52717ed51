"""Text examples: parallel sentences for translation and token streams for language modelling."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from gpipe_cli.data.loader import Examples
from gpipe_cli.data.pydoc import pydoc_documents
from gpipe_cli.data.sources import existing_path, held_count, held_none, hold_out, open_splits, pick_splits, split_files
from gpipe_cli.data.synthetic import lm_documents, translation_pairs
from gpipe_cli.data.tokenizer import BOS, EOS, PAD, Tokenizer, lines_left_out, load_or_train
from gpipe_cli.errors import DataError, shown
from gpipe_cli.recipe.schema import SOURCE_FILES, Data

TextTask = Literal["translation", "lm"]
# What one record of a source is, as the run names it: data.eval_fraction holds out whole records.
RECORD_UNITS = {"text": "line", "jsonl": "line", "tsv": "line", "hub": "row", "parquet": "row", "pydoc": "paragraph"}
Record = Any  # a (source, target) pair of strings for translation, a string for lm


class Ragged:
    """Many int sequences in one flat array (millions of sentences without millions of objects)."""

    def __init__(self, seqs: Sequence[Sequence[int]]) -> None:
        self.lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        self.offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        self.flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32,
                                count=int(self.offsets[-1]))

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.flat[self.offsets[i]:self.offsets[i + 1]]


class TranslationExamples(Examples):
    """(src, tgt_in) -> tgt_out with tgt_in = [bos] + tokens and tgt_out = tokens + [eos]."""

    def __init__(self, src: Ragged, tgt: Ragged, refs: list[str] | None) -> None:
        self.src, self.tgt, self.refs = src, tgt, refs
        # Padded cost of an example: its longer side (the decoder side carries bos/eos).
        self.lengths = np.maximum(src.lengths, tgt.lengths + 1)

    @classmethod
    def build(cls, pairs: Sequence[tuple[str, str]], tok: Tokenizer, max_len: int, *,
              train: bool) -> TranslationExamples:
        """The examples of `pairs`: training drops pairs longer than max_len, eval truncates them."""
        src = tok.encode_batch([p[0] for p in pairs])
        tgt = tok.encode_batch([p[1] for p in pairs])
        fits = [len(s) <= max_len and len(t) + 1 <= max_len for s, t in zip(src, tgt, strict=True)]
        kept = [(s[:max_len], t[:max_len - 1], ref) for (_, ref), s, t, fit in zip(pairs, src, tgt, fits, strict=True)
                if s and t and (fit or not train)]
        out = cls(Ragged([k[0] for k in kept]), Ragged([k[1] for k in kept]), None if train else [k[2] for k in kept])
        which = f"{len(pairs):,} {'training' if train else 'held-out'} pairs"
        notes = []
        if empty := sum(1 for s, t in zip(src, tgt, strict=True) if not (s and t)):
            notes.append(f"{empty:,} of {which} have an empty side: left out")
        if long := sum(1 for s, t, fit in zip(src, tgt, fits, strict=True) if s and t and not fit):
            notes.append(f"{long:,} of {which} are longer than model.max_len ({max_len} tokens): "
                         + ("left out" if train else "cut short"))
        out.left_out = "; ".join(notes) or None
        return out

    def __len__(self) -> int:
        return len(self.src)

    def collate(self, ids: np.ndarray, group: np.ndarray, *, epoch: int | None, need_inputs: bool,
                need_targets: bool) -> tuple[Any, torch.Tensor | None]:
        # Pad to the longest of the global batch, so every shard of a step has the same shape.
        s_len = max(1, int(self.src.lengths[group].max()))
        t_len = int(self.tgt.lengths[group].max()) + 1
        n = len(ids)
        src = np.full((n, s_len), PAD, dtype=np.int64)
        tgt_in = np.full((n, t_len), PAD, dtype=np.int64)
        tgt_out = np.full((n, t_len), PAD, dtype=np.int64)
        for k, i in enumerate(ids.tolist()):
            s, t = self.src[i], self.tgt[i]
            if need_inputs:
                src[k, :len(s)] = s
                tgt_in[k, 0] = BOS
                tgt_in[k, 1:1 + len(t)] = t
            if need_targets:
                tgt_out[k, :len(t)] = t
                tgt_out[k, len(t)] = EOS
        inputs = (torch.from_numpy(src), torch.from_numpy(tgt_in)) if need_inputs else None
        return inputs, torch.from_numpy(tgt_out) if need_targets else None

    def target_tokens(self, ids: np.ndarray) -> int | None:
        return int((self.tgt.lengths[ids] + 1).sum())

    def references(self, ids: np.ndarray) -> list[str] | None:
        return None if self.refs is None else [self.refs[i] for i in ids.tolist()]


class LMExamples(Examples):
    """Documents joined by eos into one stream, cut into windows of seq_len predictions."""

    def __init__(self, stream: np.ndarray, seq_len: int) -> None:
        self.stream = stream
        self.seq_len = seq_len
        # Window i is stream[i*L : i*L + L + 1]: L inputs and their L next tokens (the last may be shorter).
        self.starts = np.arange(0, max(len(stream) - 1, 0), seq_len, dtype=np.int64)
        self.window = np.minimum(self.starts + seq_len + 1, len(stream)) - self.starts - 1
        self.lengths = self.window

    @classmethod
    def build(cls, docs: Sequence[str], tok: Tokenizer, seq_len: int) -> LMExamples:
        """Encode documents and chunk the stream."""
        ids = tok.encode_batch(list(docs))
        stream = Ragged([[*d, EOS] for d in ids if d]).flat.astype(np.int64)
        return cls(stream, seq_len)

    def __len__(self) -> int:
        return len(self.starts)

    def collate(self, ids: np.ndarray, group: np.ndarray, *, epoch: int | None, need_inputs: bool,
                need_targets: bool) -> tuple[Any, torch.Tensor | None]:
        t_len = int(self.window[group].max())
        inp = np.full((len(ids), t_len), PAD, dtype=np.int64)
        out = np.full((len(ids), t_len), PAD, dtype=np.int64)
        for k, i in enumerate(ids.tolist()):
            lo, n = int(self.starts[i]), int(self.window[i])
            inp[k, :n] = self.stream[lo:lo + n]
            out[k, :n] = self.stream[lo + 1:lo + n + 1]
        inputs = torch.from_numpy(inp) if need_inputs else None
        return inputs, (torch.from_numpy(out) if need_targets else None)

    def target_tokens(self, ids: np.ndarray) -> int | None:
        return int(self.window[ids].sum())


def unigram_perplexity(train: LMExamples, held_out: LMExamples, vocab_size: int,
                       ids: np.ndarray | None = None) -> float:
    """Perplexity of the held-out targets (of windows `ids`, or all) under the training stream's add-one smoothed
    unigram distribution."""
    counts = np.bincount(train.stream, minlength=vocab_size).astype(np.float64)
    log_p = np.log(counts + 1.0) - np.log(counts.sum() + len(counts))
    # Every token after the first, as the model is scored: a baseline that knows token frequencies, no context.
    windows = [] if ids is None else zip(held_out.starts[ids], held_out.window[ids])
    targets = held_out.stream[1:] if ids is None else np.concatenate(
        [np.zeros(0, np.int64), *(held_out.stream[s + 1:s + n + 1] for s, n in windows)])
    return float(np.exp(-log_p[targets].mean())) if len(targets) else float("nan")


def _record(obj: Mapping[str, Any], task: TextTask, data: Data, where: str) -> Record:
    """One record of a JSON object or dataset row."""
    keys = ", ".join(map(str, obj.keys()))
    if task == "lm":
        if data.text_field not in obj:
            raise DataError(f"{where}: no field '{data.text_field}' (fields: {keys}); set data.text_field")
        text = obj[data.text_field]
        if not isinstance(text, str | None):
            raise DataError(f"{where}: field '{data.text_field}' is not a string")
        return _unicode(text or "", where)
    s, t = data.source_field, data.target_field
    if s not in obj or t not in obj:
        nested = obj.get("translation")
        if not isinstance(nested, Mapping):
            absent = " and ".join(f"'{name}'" for name in (s, t) if name not in obj)
            raise DataError(f"{where}: no field{'s' if ' and ' in absent else ''} {absent} (fields: {keys}); set "
                            "data.source_field and data.target_field")
        if s not in nested or t not in nested:
            raise DataError(f"{where}: the translation has languages {', '.join(map(str, nested))}; set "
                            "data.source_field and data.target_field to two of them")
        obj = nested
    src, tgt = obj[s], obj[t]
    if not isinstance(src, str | None) or not isinstance(tgt, str | None):
        raise DataError(f"{where}: fields '{s}' and '{t}' must be strings")
    return (_unicode(src or "", where), _unicode(tgt or "", where))


def _unicode(text: str, where: str) -> str:
    """`text`, refused where it is no Unicode text (a JSON escape of half a surrogate pair, which UTF-8 cannot hold)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: invalid Unicode (a lone surrogate \\u{ord(text[e.start]):04x}); data is UTF-8 "
                        "text") from None
    return text


def _strings(values: Sequence[Any], column: str, where: str) -> list[str]:
    """A dataset column's values as text ("" for none), refused in one line where one is not text."""
    bad = next((i for i, v in enumerate(values) if not isinstance(v, str | None)), None)
    if bad is not None:
        raise DataError(f"{where}: row {bad + 1}: column '{column}' holds {type(values[bad]).__name__} values, not "
                        "text")
    return [v or "" for v in values]


def _lines(f: Path) -> Iterator[tuple[int, str]]:
    """(line number, line without newline) of each non-blank line, with one clear error for non-text files."""
    try:
        # utf-8-sig: a byte order mark, as some Windows editors begin a file, is no part of the first line (a header)
        with open(f, encoding="utf-8-sig") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    yield n, line.rstrip("\n").rstrip("\r")
    except UnicodeDecodeError:
        raise DataError(_not_utf8(f)) from None


def _not_utf8(f: Path) -> str:
    """Where file `f` stops being UTF-8 text, in one line (a reading error places the byte in a chunk only)."""
    raw = f.read_bytes()
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):  # a UTF-16 byte order mark: Windows editors save "Unicode" so
        return (f"'{f}' is not UTF-8 text (it starts with a UTF-16 byte order mark: save it as UTF-8); data files "
                "are UTF-8")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        return f"'{f}':{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); data files are UTF-8 text"
    return f"'{f}' is not UTF-8 text"


def read_jsonl(files: Sequence[Path], task: TextTask, data: Data) -> list[Record]:
    """Records of JSON-lines files (one object per line)."""
    out = []
    for f in files:
        for n, line in _lines(f):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{f}:{n}: not valid JSON ({e.msg}: column {e.colno})") from None
            if not isinstance(obj, dict):  # e.g. a .json file holding one array of them
                raise DataError(f"{f}:{n}: expected a JSON object, got {type(obj).__name__}; data.source jsonl reads "
                                "one object per line")
            out.append(_record(obj, task, data, f"{f}:{n}"))
    return out


def read_tsv(files: Sequence[Path], task: TextTask, data: Data) -> list[Record]:
    """Records of tab-separated files: source<TAB>target (translation) or text (lm); header optional."""
    out: list[Record] = []
    for f in files:
        cols: tuple[int, int] = (0, 1)
        named = False  # a header picked the columns: other columns are allowed, and ignored
        for k, (n, line) in enumerate(_lines(f)):
            cells = line.split("\t")
            if k == 0:  # a first line (blank ones left out) naming the configured fields picks the columns
                names = [c.strip() for c in cells]
                if task == "lm" and data.text_field in names:
                    cols, named = (names.index(data.text_field), 0), True
                    continue
                if task == "translation" and data.source_field in names and data.target_field in names:
                    cols, named = (names.index(data.source_field), names.index(data.target_field)), True
                    continue
            # Without a header, a stray tab would silently cut a sentence short: the count must be exact.
            if task == "lm":
                if not named and len(cells) > 1:
                    raise DataError(f"{f}:{n}: expected one column (the text), got {len(cells)} tab-separated; "
                                    f"a first line naming data.text_field ('{data.text_field}') picks a column")
                out.append(cells[cols[0]] if cols[0] < len(cells) else "")
            elif max(cols) >= len(cells) or (not named and len(cells) > 2):
                raise DataError(f"{f}:{n}: expected two tab-separated columns (source, target), got "
                                f"{len(cells)}" + ("" if named else f"; a first line naming data.source_field "
                                f"('{data.source_field}') and data.target_field ('{data.target_field}') picks two"))
            else:
                out.append((cells[cols[0]], cells[cols[1]]))
    return out


def read_text(files: Sequence[Path]) -> list[str]:
    """Non-empty lines of plain text files (each line a document: a paragraph or a sentence)."""
    return [line for f in files for _, line in _lines(f)]


def from_dataset(ds: Any, task: TextTask, data: Data, where: str) -> list[Record]:
    """Records of a `datasets` Dataset, read column-wise."""
    cols = ds.column_names
    if len(ds) == 0:
        return []
    if task == "lm":
        if data.text_field not in cols:
            raise DataError(f"{where} has no column '{data.text_field}' (columns: {', '.join(cols)}); "
                            "set data.text_field")
        return _strings(ds[data.text_field], data.text_field, where)
    if data.source_field in cols and data.target_field in cols:
        return list(zip(_strings(ds[data.source_field], data.source_field, where),
                        _strings(ds[data.target_field], data.target_field, where), strict=True))
    if "translation" in cols:
        rows = list(ds["translation"])
        _record(rows[0], task, data, where)  # one clear error if the languages are wrong
        return [_record(r, task, data, f"{where}: row {i}") for i, r in enumerate(rows, 1)]
    raise DataError(f"{where} has no columns '{data.source_field}' and '{data.target_field}' (columns: "
                    f"{', '.join(cols)}); set data.source_field and data.target_field")


def read_records(data: Data, task: TextTask, *, seed: int, words: int,
                 cache_dir: Path | None) -> tuple[list[Record], list[Record] | None]:
    """(train records, eval records or None) of any text source."""
    n_eval = int(round(data.synthetic_size * data.eval_fraction))
    if data.source == "synthetic":
        if task == "translation":
            return (translation_pairs(data.synthetic_size, seed, "train"),
                    translation_pairs(n_eval, seed, "eval"))
        return (lm_documents(data.synthetic_size, seed, "train", words),
                lm_documents(n_eval, seed, "eval", words))
    if data.source == "pydoc":
        return pydoc_documents(), None  # text_splits holds out data.eval_fraction of the paragraphs
    if data.source in ("hub", "parquet"):
        splits, where = open_splits(data, cache_dir, "jsonl/tsv/parquet")
        train_ds, eval_ds = pick_splits(splits, data, where)
        return (from_dataset(train_ds, task, data, where),
                None if eval_ds is None else from_dataset(eval_ds, task, data, where))
    exts = SOURCE_FILES[data.source]
    path = existing_path(data.path, f"data.source '{data.source}'")
    train_f, eval_f = split_files(path, exts, data)
    read = {"jsonl": lambda files: read_jsonl(files, task, data), "tsv": lambda files: read_tsv(files, task, data),
            "text": read_text}[data.source]
    return read(train_f), (read(eval_f) if eval_f else None)


def text_splits(data: Data, task: TextTask, *, seed: int, vocab_size: int, max_len: int, run_dir: Path | None,
                cache_dir: Path | None = None) -> tuple[Examples, Examples | None, Tokenizer]:
    """(train, held-out, tokenizer) for a text task."""
    seq_len = min(data.seq_len, max_len)
    # Synthetic documents of ~3/4 seq_len words give about one window each (~1.3 tokens a word).
    train_recs, eval_recs = read_records(data, task, seed=seed, words=max(8, seq_len * 3 // 4),
                                         cache_dir=cache_dir)
    where = f"the '{data.train_split}' split" if data.source != "synthetic" else "the synthetic data"
    where += f" of data.source '{data.source}'" + (f" ({shown(data.path, 200)})" if data.path else "")
    why_none = share = None
    by_content = eval_recs is None  # held out below, by a hash of each record
    if eval_recs is None:
        unit = RECORD_UNITS.get(data.source, "record")
        why_none = held_none(len(train_recs), data.eval_fraction, unit, shown(data.path, 200) if data.path else where)
        keys = ["\t".join(r) if isinstance(r, tuple) else r for r in train_recs]
        rows, held = hold_out(len(train_recs), data.eval_fraction, keys)
        if why_none is None and data.eval_fraction > 0 and not len(held):  # copies of one line stay together
            why_none = (f"data.eval_fraction ({data.eval_fraction:g}) holds out whole {unit}s with their copies, and "
                        f"every {unit} of {shown(data.path, 200) if data.path else where} is the same, which training "
                        f"keeps; give it other {unit}s")
        train_recs, eval_recs = [train_recs[i] for i in rows], [train_recs[i] for i in held]
        asked = held_count(len(keys), data.eval_fraction)
        if len(held) and not asked / 2 <= len(held) <= asked * 2:  # many copies of few lines: say the share moved
            share = (f"{len(held):,} of the {len(keys):,} {unit}s, where data.eval_fraction {data.eval_fraction:g} "
                     f"asks {asked:,}: the copies of a {unit} stay on one side")
    if not any((r[0].strip() and r[1].strip()) if task == "translation" else r.strip() for r in train_recs):
        raise DataError(f"{where} has no text")
    def corpus() -> Iterator[str]:
        return (text for r in train_recs for text in (r if task == "translation" else (r,)))

    tok = load_or_train(path=data.tokenizer, run_dir=run_dir, vocab_size=data.vocab_size or vocab_size,
                        model_vocab_size=vocab_size, key="data.vocab_size" if data.vocab_size else "model.vocab_size",
                        texts=corpus)  # read only when a tokenizer is trained
    train: Examples
    if task == "translation":
        train = TranslationExamples.build(train_recs, tok, max_len, train=True)
        if len(train) == 0:
            raise DataError(f"every training pair is empty or longer than model.max_len ({max_len}) tokens")
        evl: Examples | None = TranslationExamples.build(eval_recs, tok, max_len, train=False) if eval_recs else None
    else:
        train = LMExamples.build(train_recs, tok, seq_len)
        if len(train) == 0:
            raise DataError(f"{where} has too little text for one sequence")
        evl = LMExamples.build(eval_recs, tok, seq_len) if eval_recs else None
    train.held_none = why_none
    if evl is not None:
        evl.origin, evl.by_content = share, by_content
    if not data.tokenizer:  # trained on this text, here or by the run's first launch: every rank says alike
        train.left_out = "; ".join(filter(None, (train.left_out, lines_left_out(corpus())))) or None
    return train, evl, tok

