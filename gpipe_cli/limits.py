"""The bounds of every count a recipe or a flag holds, and the one way a value outside them is answered."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

from gpipe_cli.errors import UserError, shown

# Upper bounds that no real run reaches: they turn typos such as 1e20 into a clear error instead of an
# allocation that fails deep inside torch.
MAX_COUNT = 1_000_000_000  # steps, examples, intervals
MAX_SIZE = 1 << 20  # model widths, batch and sequence sizes
MAX_LAYERS = 10_000
# AmoebaNet's sizes: layers in three stacks of cells, filters D with stem reduction cells of D/4 filters.
AMOEBANET_STEPS = {"layers": 3, "filters": 4}
MAX_RANKS = 65_536  # K, D, devices
MAX_VIRTUAL = 64  # chunks per stage (interleaved)
MAX_REAL = 1e9  # learning rates, clipping thresholds, decay intervals
MAX_THREADS = 1024
# The shortest train.stall_timeout: ten of the heartbeat's one-second beats. At 1 s a healthy run's own beat
# came late, and the job ended "frozen" without its final checkpoint.
LEAST_STALL_S = 10.0
MAX_SEED = 2**32 - 1  # a recipe's seed and --seed alike
EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # what `gpipe export --dtype` stores
# A count as a flag takes it: digits, signed (a sign is then checked against the bounds); not Python's int(),
# which also reads `1_000` and other scripts' digits.
DIGITS = re.compile(r"[+-]?[0-9]+")


def words(low: str | None, high: str | None) -> str:
    """A range as every message words it: `>= 1 and <= 65536`, or one side alone."""
    return f"{low} and {high}" if low and high else low or high or ""


def outside(name: str, value: float, low: float, high: float | None = None) -> str | None:
    """`NAME: must be >= LOW and <= HIGH (got VALUE)` when `value` is outside the bounds, else None."""
    if low <= value and (high is None or value <= high):
        return None
    return f"{name}: must be {words(f'>= {low}', f'<= {high}' if high is not None else None)} (got {value})"


def finite(flag: str, value: float | None, unit: str = "", zero: bool = False) -> str | None:
    """A rate or latency flag's refusal unless it is a finite number above 0 (or at it, where `zero`)."""
    # An infinite link or rate prices messages or layers at no time, or at no speed: a result of nonsense.
    if value is None or (math.isfinite(value) and (value >= 0 if zero else value > 0)):
        return None
    got = int(value) if math.isfinite(value) and value.is_integer() else value  # the 0 typed reads 0, not 0.0
    return f"{flag}: must be a finite number {'>=' if zero else '>'} 0{unit} (got {got})"


def choices(allowed: Sequence[str], last: str | None = None) -> str:
    """`'a', 'b' or 'c'`: the allowed words as every choice message (the recipe's too) lists them."""
    items = [repr(item) for item in allowed] + ([last] if last else [])
    return f"{', '.join(items[:-1])} or {items[-1]}" if len(items) > 1 else items[0]


def one_of(name: str, value: str, allowed: Sequence[str]) -> str | None:
    """`NAME: must be 'a' or 'b' (got 'VALUE')` when `value` is not among `allowed`, else None."""
    return None if value in allowed else f"{name}: must be {choices(allowed)} (got {shown(value)})"


def refuse(problems: Iterable[str | None]) -> None:
    """Raise the first of `problems` (None: no problem) as the one line the user sees."""
    problem = next((p for p in problems if p), None)
    if problem:
        raise UserError(problem)
