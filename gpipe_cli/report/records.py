"""What `gpipe report` reads of a run directory: its recipe and the usable records of its metrics.jsonl."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpipe_cli.errors import UserError
from gpipe_cli.recipe.yamlio import parse_document, read_recipe_file
from gpipe_cli.records import EVAL_NUMBERS, PARTS, TRAIN_NUMBERS


@dataclass
class Records:
    """The train and eval records of a metrics.jsonl, and the lines that could not be used."""

    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    damaged: list[int] = field(default_factory=list)  # the numbers of the malformed lines, from 1

    def damage(self) -> str:
        """'3 malformed lines, the first on line 7' (empty when every line was read)."""
        count = len(self.damaged)
        if count <= 1:
            return f"1 malformed line (line {self.damaged[0]})" if count else ""
        return f"{count} malformed lines, the first on line {self.damaged[0]}"


def _number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _numbers(values: Any) -> bool:
    return isinstance(values, list) and all(_number(v) for v in values)


def _usable(record: dict[str, Any]) -> bool:
    """Whether a train or eval record holds every figure the report reads, each of the right type."""
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return False
    if record["kind"] == "eval":
        return all(_number(record.get(key)) for key in EVAL_NUMBERS)
    time_s = record.get("time_s")
    return (all(key in record for key in ("samples_per_s", "step_time_s"))
            and all(_number(record.get(key)) for key in TRAIN_NUMBERS)
            and isinstance(time_s, dict) and all(_numbers(time_s.get(part)) for part in PARTS)
            and bool(time_s["compute"])
            and (record.get("mem_peak_bytes") is None or _numbers(record["mem_peak_bytes"])))


def read_records(path: Path) -> Records:
    """The usable train and eval records of a metrics.jsonl; the numbers of the lines that are not."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    lines = data.split(b"\n")
    out = Records()
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested past what Python parses
            if number < len(lines):  # the last line, unended, is still being written (or was cut by a crash)
                out.damaged.append(number)
            continue
        if not isinstance(record, dict):
            out.damaged.append(number)
        elif record.get("kind") in ("train", "eval"):  # other kinds, should there ever be any, are not read
            if _usable(record):
                (out.train if record["kind"] == "train" else out.evals).append(record)
            else:
                out.damaged.append(number)
    return out


def read_recipe(path: Path) -> dict[str, Any]:
    """A run's recipe.yaml as a mapping (empty when there is none); UserError when it cannot be read."""
    if not path.is_file():
        return {}
    loaded = parse_document(read_recipe_file(path), str(path))
    return loaded if isinstance(loaded, dict) else {}
