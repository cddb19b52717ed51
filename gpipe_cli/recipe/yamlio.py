"""The only place that reads and writes YAML: recipe files and `--set` values, with limits hostile input cannot pass."""

from __future__ import annotations

import codecs
import io
import itertools
import os
import re
import shlex
import stat
from pathlib import Path
from typing import Any

import yaml

from gpipe_cli.errors import UserError, cut, near, shown

MAX_RECIPE_BYTES = 1 << 20  # 1 MiB: a recipe is a page of settings
MAX_NODES = 100_000  # values after expanding every alias
MAX_DEPTH = 64  # nesting of sections and lists


class RecipeError(UserError):
    """A recipe that cannot be used; the message is one line."""


class _Loader(yaml.SafeLoader):
    """SafeLoader reading numbers as YAML 1.2 does: `010` is 10 and `1e-3` a float; `1_000` and `1:30` are text."""


# YAML 1.1's numbers (PyYAML's) read `010` as 8 and `1:30` as 90: a step count silently other than typed.
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
# add_implicit_resolver appends to lists shared with SafeLoader; give the subclass its own copies first.
_Loader.yaml_implicit_resolvers = {first: [(tag, rule) for tag, rule in rules if tag not in (_INT, _FLOAT)]
                                   for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_INT_TEXT = re.compile(r"^[-+]?[0-9]+$|^0o[0-7]+$|^0x[0-9a-fA-F]+$")
_FLOAT_TEXT = re.compile(r"^[-+]?(?:(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)$"
                         r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$")
_Loader.add_implicit_resolver(_INT, _INT_TEXT, list("-+0123456789"))
_Loader.add_implicit_resolver(_FLOAT, _FLOAT_TEXT, list("-+0123456789."))


def reads_as_number(text: str) -> bool:
    """Whether YAML, unquoted, reads `text` as a number."""
    return bool(_INT_TEXT.match(text) or _FLOAT_TEXT.match(text))


class _Huge(int):
    """A decimal integer of more digits than Python reads as text: its order of magnitude, shown by its length."""

    digits = 0

    def __repr__(self) -> str:
        return f"a number of {self.digits} digits"

    __str__ = __repr__


def _int(loader: _Loader, node: yaml.ScalarNode) -> int:
    """A YAML 1.2 integer: decimal (leading zeros too), 0o octal or 0x hexadecimal."""
    text = str(loader.construct_scalar(node))
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    try:
        return int(text)
    except ValueError:  # past Python's limit on digits: no setting takes such a number, and its range says so
        digits = len(text.lstrip("+-").lstrip("0"))
        huge = _Huge((-1 if text.startswith("-") else 1) * 10 ** (digits - 1))
        huge.digits = digits
        return huge


_Loader.add_constructor(_INT, _int)


def _near_recipe(path: Path) -> str | None:
    """A recipe beside `path` (or in its recipes/ folder) named close to it: .yml for .yaml, the suffix left out."""
    found: dict[str, str] = {}
    for folder in (path.parent, path.parent / "recipes"):
        try:
            with os.scandir(folder) as entries:  # a bounded look: a folder may hold very many files
                for entry in itertools.islice(entries, 2000):
                    if entry.name.endswith((".yaml", ".yml")) and entry.is_file():
                        named = str(folder / entry.name) if folder != Path(".") else entry.name
                        found.setdefault(entry.name.rpartition(".")[0], named)
        except OSError:
            continue
    stem = path.name.rpartition(".")[0] if path.name.endswith((".yaml", ".yml")) else path.name
    close = near(stem, found)
    return found[close[0]] if close else None


# A dotted recipe key and its value, as a `--set` item gives them: `train.steps=3`.
_SET_ITEM = re.compile(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*=")


def as_set(text: str) -> str | None:
    """`--set KEY=VALUE` (quoted for the shell) for an argument typed as KEY=VALUE, else None."""
    return f"--set {shlex.quote(text)}" if _SET_ITEM.match(text) else None


def read_recipe_file(path: Path) -> str:
    """The text of a recipe file: a regular file of at most MAX_RECIPE_BYTES, refused at once otherwise."""
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise RecipeError(f"{path}: is a directory, not a recipe file")
        if not stat.S_ISREG(info.st_mode):  # a FIFO or a device would block or never end
            raise RecipeError(f"{path}: is not a regular file (a recipe must be a YAML file)")
        if info.st_size > MAX_RECIPE_BYTES:
            raise RecipeError(f"{path}: the recipe is {info.st_size} bytes; at most {MAX_RECIPE_BYTES} are allowed")
        # O_NONBLOCK: should the path be swapped for a FIFO after the check, opening still cannot hang.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_RECIPE_BYTES + 1)
    except FileNotFoundError:  # a name of spaces, or with them around it, quoted: it read ": no such recipe file"
        named = str(path) if str(path).strip() == str(path) else shown(str(path))
        if (item := as_set(str(path))) is not None:  # `gpipe train train.steps=3`
            raise RecipeError(f"{named}: no such recipe file; to override a recipe key give {item}") from None
        near = _near_recipe(path)
        hint = f"; did you mean {near}?" if near else ""
        if not near and path.name.partition(".")[0] == "quickstart":  # the one built into the package
            hint = "; leave the recipe out to train the built-in quick start"
        raise RecipeError(f"{named}: no such recipe file{hint}") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read the recipe ({exc.strerror})") from None
    if len(data) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{path}: the recipe is over {MAX_RECIPE_BYTES} bytes, the most allowed")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):  # as some Windows editors save text
            raise RecipeError(f"{path}: not UTF-8 text but UTF-16 (it starts with a UTF-16 byte order mark); a "
                              "recipe is UTF-8 text: save it as UTF-8") from None
        line = data.count(b"\n", 0, exc.start) + 1
        raise RecipeError(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); a recipe is "
                          "UTF-8 text") from None


def parse_document(text: str, label: str) -> Any:
    """The YAML document in `text` as Python data, within the limits above (None for an empty one)."""
    loader = None
    try:
        loader = _Loader(text)  # refuses control characters (NUL, ESC...) while reading the text
        node = loader.get_single_node()
        if node is None:
            return None
        # Checked before it is built: PyYAML builds aliases as shared objects, so nested aliases (the "billion
        # laughs") parse cheaply but explode when validated or copied.
        _check(node, label)
        return loader.construct_document(node)
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        raise RecipeError(f"{label}: not valid YAML at line {line}, column {column}: control character "
                          f"U+{exc.character:04X} is not allowed") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid syntax"
        raise RecipeError(f"{label}: not valid YAML{where}: {cut(str(problem))}") from None
    except RecursionError:
        raise RecipeError(f"{label}: nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise RecipeError(f"{label}: unreadable value ({cut(str(exc))})") from None
    finally:
        if loader is not None:
            loader.dispose()


def parse_value(text: str, label: str, key: str | None = None) -> Any:
    """A `--set` value: YAML within the same limits; text that is not valid YAML stays a string, unless it opens a
    list, a mapping or a quoted string (`key`: the item's, to show it mended)."""
    if not text.strip():
        return None
    try:
        return parse_document(text, label)
    except RecipeError as exc:
        if "not valid YAML" not in str(exc):
            raise
        if not text.lstrip().startswith(_OPENERS):
            return text
        # `[3,3` was the string '[3,3', refused as no list: the mistake is its syntax, not its type.
        raise RecipeError(f"{label}: {shown(text.strip())} is not valid YAML ({_why(text, str(exc))})"
                          f"{_mended(text.strip(), key)}") from None


# What opens a YAML flow value, and what closes it: a value starting so is YAML, never plain text.
_CLOSERS = {"[": "]", "{": "}", '"': '"', "'": "'"}
_OPENERS = tuple(_CLOSERS)


def _left_open(text: str) -> list[str]:
    """The brackets and quotes `text` opens and leaves open, outermost first (YAML's flow syntax, roughly)."""
    stack: list[str] = []
    before, escaped = "", False
    for char in text:
        if stack and stack[-1] in "\"'":  # inside a quoted string only its quote (unescaped) counts
            escaped, closes = char == "\\" and stack[-1] == '"' and not escaped, char == stack[-1] and not escaped
            stack = stack[:-1] if closes else stack
        elif char in "[{" or (char in "\"'" and before in ("", "[", "{", ",", ":")):  # a quote inside a word is text
            stack.append(char)
        elif stack and char == _CLOSERS[stack[-1]]:
            stack.pop()
        before = char if not char.isspace() else before
    return stack


def _why(text: str, error: str) -> str:
    """Why a flow value is not valid YAML: what it leaves open, else YAML's own words (at a column of a line)."""
    if opened := _left_open(text):
        return f"an unclosed {' and '.join(repr(char) for char in opened)}"
    where = error.partition("not valid YAML")[2].strip()
    return where.replace("at line 1, column", "at column") if "\n" not in text else where


def _mended(text: str, key: str | None) -> str:
    """`; did you mean --set 'KEY=VALUE'?` with what `text` leaves open closed, where that makes it valid YAML."""
    opened = _left_open(text)
    if key is None or not opened:
        return ""
    closers = "".join(_CLOSERS[char] for char in reversed(opened))
    if text.endswith((",", ":", *_OPENERS)):  # `--set pipeline.balance=[3, 3]` unquoted: the shell passed `[3,`
        return (f"; the shell splits an item at its spaces unless it is quoted whole: "
                f"--set {shlex.quote(f'{key}={text} ...{closers}')}")
    closed = text + closers
    try:
        parse_document(closed, "")
    except RecipeError:
        return ""
    return f"; did you mean --set {shlex.quote(f'{key}={closed}')}?"


def dump(data: Any) -> str:
    """`data` as block-style YAML, in the given key order."""
    return yaml.safe_dump(data, sort_keys=False)


def rewrite(text: str, data: dict[str, Any], label: str) -> str:
    """`data` as YAML written over `text`, the document it was read from: its comments, key order and layout stay."""
    # A new key follows the key before it in `data`; only text PyYAML has read within the limits reaches ruamel.
    # ruamel.yaml loads in a tenth of a second: only a command that writes a recipe pays for it.
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap
    from ruamel.yaml.error import YAMLError as RoundTripError
    from ruamel.yaml.util import load_yaml_guess_indent

    try:
        _, indent, sequence_indent = load_yaml_guess_indent(text)
        writer = YAML(typ="rt")
        writer.width = 1 << 16  # lines are kept as the user wrapped them, never re-wrapped
        writer.preserve_quotes = True
        writer.indent(mapping=indent or 2, sequence=indent or 2, offset=sequence_indent or 0)
        document = writer.load(text)
        if not isinstance(document, CommentedMap):
            return dump(data)
        _sync(document, data)
        out = io.StringIO()
        writer.dump(document, out)
    except (RoundTripError, ValueError, TypeError, KeyError):  # one only PyYAML reads: written plainly
        return dump(data)
    written = out.getvalue()
    # Anchors and merge keys shared between sections, or a value YAML 1.1 (PyYAML) and 1.2 (ruamel) read
    # differently, could make an edit in place say something else: what is written must read back as `data`.
    return written if _same(parse_document(written, label), data) else dump(data)


def _sync(node: Any, data: dict[str, Any]) -> None:
    """Make the round-trip mapping `node` hold `data`, editing it in place so that its comments stay."""
    for key in [k for k in node if k not in data]:
        del node[key]
    previous = None
    for key, value in data.items():
        if key not in node:
            keys = list(node)
            node.insert(keys.index(previous) + 1 if previous in keys else len(keys), key, _fresh(value))
        elif isinstance(value, dict) and isinstance(node[key], dict):
            _sync(node[key], value)
        elif not _same(node[key], value):
            node[key] = _fresh(value)
        previous = key


def _fresh(value: Any) -> Any:
    """A new value as ruamel.yaml writes it in a recipe: mappings in blocks, lists of numbers and words in brackets."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    if isinstance(value, dict):
        return CommentedMap((key, _fresh(item)) for key, item in value.items())
    if isinstance(value, list):
        items = CommentedSeq(_fresh(item) for item in value)
        if not any(isinstance(item, (dict, list)) for item in value):
            items.fa.set_flow_style()  # `balance: [3, 3]`, as recipes write it
        return items
    return value


def _kind(value: Any) -> type:
    """The YAML type of a value, whichever library read it (True is no 1, and 1 no 1.0)."""
    from ruamel.yaml.scalarbool import ScalarBoolean

    if isinstance(value, (bool, ScalarBoolean)):
        return bool
    return next((kind for kind in (int, float, str, dict, list) if isinstance(value, kind)), type(value))


def _same(a: Any, b: Any) -> bool:
    """Whether two read documents hold the same data (mappings in any key order)."""
    if _kind(a) is not _kind(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _check(root: yaml.Node, label: str) -> None:
    """Refuse duplicate keys, cyclic aliases, too deep nesting and too many values once aliases expand."""
    sizes: dict[int, int] = {}
    visiting: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in visiting:
            raise RecipeError(f"{label}: line {node.start_mark.line + 1}: an alias refers to itself")
        if depth > MAX_DEPTH:
            raise RecipeError(f"{label}: line {node.start_mark.line + 1}: nested more than {MAX_DEPTH} levels deep")
        visiting.add(key)
        total, children = 1, []
        if isinstance(node, yaml.MappingNode):
            _no_duplicates(node, label)
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        for child in children:
            total += size(child, depth + 1)
            if total > MAX_NODES:
                break
        visiting.discard(key)
        if total > MAX_NODES:
            raise RecipeError(f"{label}: more than {MAX_NODES} values once its aliases are expanded "
                              f"(nested aliases?); a recipe is a page of settings")
        sizes[key] = total
        return total

    size(root, 0)


def _no_duplicates(node: yaml.MappingNode, label: str) -> None:
    seen: dict[str, int] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        line = key.start_mark.line + 1
        if key.value in seen:
            raise RecipeError(f"{label}: line {line}: duplicate key {shown(key.value)} "
                              f"(first given at line {seen[key.value]})")
        seen[key.value] = line
