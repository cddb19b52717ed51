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


def _worse_as_named(model, winner: Outcome, other: Outcome, why: str) -> bool:
    """Whether the figure `why` names is one where `other` is worse than `winner`."""
    c, w = other.config, winner.config
    if m := re.search(r"bubble ([\d.]+) \(winner ([\d.]+)\)", why):
        return float(m[1]) > float(m[2])
    if m := re.search(r"all-reduce over (\d+) replicas \(winner (\d+)\)", why):
        return int(m[1]) > int(m[2])
    if "recomputes" in why:  # and by a mode the winner does not share, where it names one
        named = re.search(r"recomputes more \((\w+)", why)
        return c.recomputation() > w.recomputation() and (named is None or named[1] != w.checkpoint)
    if "smaller micro-batches" in why:
        return c.replicas * c.microbatches > w.replicas * w.microbatches
    return True  # in seconds of that part, which it spends longer in by construction


@pytest.mark.parametrize("seed", range(4))
def test_a_runner_up_loses_by_a_figure_worse_than_the_winners(seed):
    # It read 'bubble 0.29 (winner 0.29)', and 'recomputes more (except_last)' beside a winner of except_last.
    import math

    from gpipe_cli.estimate import simulate
    from gpipe_cli.plan import search
    from tests.plan.test_search import FAST, synthetic

    for layers, batch, devices, link in ((6, 8, 2, FAST), (8, 4, 4, FAST), (8, 16, 4, simulate.Link(1e5, 1e-2))):
        model = synthetic(layers, seed, batch=batch, equal=seed % 2 == 0)
        result = search.search(model, search.Hardware(devices, math.inf, link, link))
        best = result.best
        assert best is not None
        for other in result.ranked[1:]:
            why = show.reason(model, best, other, math.inf)
            assert _worse_as_named(model, best, other, why), (best.config.label(), other.config.label(), why)


def test_the_winners_own_remat_mode_is_no_reason(monkeypatch):
    import math

    from gpipe_cli.plan import search
    from tests.plan.test_search import FAST, synthetic

    # except_last at M=1 recomputes nothing, at M=2 it does: the difference is the M, not the mode.
    model = synthetic(6, 0, batch=8)
    hw = search.Hardware(2, math.inf, FAST, FAST)
    best, other = (search.evaluate(model, hw, search.Config(1, 2, m, "gpipe", 1, "except_last")) for m in (1, 2))
    assert best.samples_per_s > other.samples_per_s
    why = show.reason(model, best, other, math.inf)
    assert "recomputes more (except_last)" not in why and "winner" in why and "M=2" in why, why


def test_a_bubble_no_larger_than_the_winners_is_no_reason(monkeypatch):
    import math

    from gpipe_cli.plan import search

    # Idle 1.0 s longer, computing 0.5 s longer: the bubble's seconds grew most, but not its share of the step.
    winner = Outcome(Config(8, 1, 2, "gpipe", 1, "never"), [1] * 8, [GiB] * 8, True, 10.0, 0.80, batch=16)
    other = Outcome(Config(8, 1, 4, "gpipe", 1, "never"), [1] * 8, [GiB] * 8, True, 11.5, 9.0 / 11.5, batch=16)
    parts = {id(winner): {"compute": 2.0, "bubble": 8.0, "messages": 0.0, "allreduce": 0.0},
             id(other): {"compute": 2.5, "bubble": 9.0, "messages": 0.0, "allreduce": 0.0}}
    monkeypatch.setattr(search, "parts", lambda model, outcome: parts[id(outcome)])
    model = search.Model(lambda size: None, None, 16.0, 16)
    why = show.reason(model, winner, other, math.inf)
    assert other.bubble < winner.bubble and "bubble" not in why, why
    assert why == "13% slower: more compute in smaller micro-batches (4 examples)", why


def test_in_a_log_each_configuration_is_one_line_however_wide(monkeypatch):
    # Past the log's 200 columns the table was stacked, a configuration over four lines that grep split.
    import io

    from gpipe_cli.console import output_console

    monkeypatch.setattr("sys.stdout", io.StringIO())
    console = output_console()
    show.print_plan(console, [(o, why and why + " and more words" * 10) for o, why in _items()], TITLE)
    rows = [line for line in console.file.getvalue().splitlines() if "slower" in line or line.lstrip().startswith("*")]
    assert len(rows) == len(_items()) and all(" and more words" * 10 in line for line in rows[1:]), rows
    assert console.width == max(output_console().width, 200)  # put back
