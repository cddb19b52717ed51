"""The plan's table on a terminal of any width: one line a configuration where it fits, else stacked, none cut."""

import re

import pytest
from rich.console import Console

from gpipe_cli.plan import show
from gpipe_cli.plan.search import Config, Outcome
from tests.widths import problems

GiB = 2**30
TITLE = "predictions (simulated from the per-layer seconds; not measured)"


def _items() -> list[tuple[Outcome, str | None]]:
    """The quick start's wide cells: eight stages' memory, an offloading remat mode, V=4, long reasons."""
    def outcome(config: Config, balance: list[int], step: float, bubble: float) -> Outcome:
        memory = [(37.8 - i) * GiB for i in range(config.partitions)]
        return Outcome(config, balance, memory, True, step, bubble, batch=512)

    return [(outcome(Config(4, 2, 32, "gpipe", 1, "never"), [5, 3, 3, 3], 0.2518, 0.205), None),
            (outcome(Config(8, 1, 64, "zero-bubble-v", 2, "never"), [2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2],
                     0.2549, 0.337), "1% slower: bubble 0.34 (winner 0.21)"),
            (outcome(Config(2, 4, 16, "interleaved", 4, "except_last", "activations"), [2, 2, 2, 2, 2, 2, 1, 1],
                     0.2714, 0.057), "7% slower: gradient all-reduce over 4 replicas"),
            (outcome(Config(1, 8, 1, "gpipe", 1, "except_last"), [14], 0.3545, 0.0),
             "29% slower: more compute in smaller micro-batches (64 examples)")]


def _printed(width: int) -> str:
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    show.print_plan(console, _items(), TITLE)
    return console.export_text()


@pytest.mark.parametrize("width", [60, 80, 100])
def test_on_a_narrow_terminal_every_value_is_whole(width):
    # At 80 columns the table read `zero-…`, `excep…`, `2,033…` and `(pred…`.
    text = _printed(width)
    plain = show.plain(_items(), TITLE)
    assert not problems(text, width, plain), problems(text, width, plain)
    words = set(text.split())
    for o, why in _items():
        c = o.config
        for value in (f"K={c.partitions}", f"D={c.replicas}", f"M={c.microbatches}", c.schedule, c.checkpoint,
                      ",".join(map(str, o.balance)), show.rate(o.samples_per_s), f"{o.bubble:.3f}"):
            assert value in words, (value, text)
        # Each figure of a stage's memory, and each word of why it loses, in its order within the row.
        for part in (show.per_stage(o.memory), why or ""):
            for word in re.split(r" (?!GiB)", part):
                assert word in text, (word, text)
    assert "offload activations" in " ".join(text.split())


def test_on_a_wide_terminal_each_configuration_is_one_line_of_named_columns():
    text = _printed(300)
    assert problems(text, 300) == []
    header = next(line for line in text.splitlines() if "samples/s (pred.)" in line)
    assert header.split()[:5] == ["K", "D", "M", "schedule", "remat"]
    rows = [line for line in text.splitlines() if "slower" in line or line.lstrip().startswith("*")]
    assert len(rows) == len(_items())
