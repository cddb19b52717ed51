"""How a plan reaches the user: the table of the best, why each runner-up loses, the `--set` lines, the recipe file."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from gpipe_cli.console import figure_table, fit_table, print_rows, print_table
from gpipe_cli.files import atomic_write_bytes
from gpipe_cli.plan import search
from gpipe_cli.plan.search import Outcome
from gpipe_cli.recipe.load import validate as validate_recipe
from gpipe_cli.recipe.yamlio import rewrite
from gpipe_cli.units import counted, human_bytes


def reason(model: search.Model, winner: Outcome, other: Outcome, budget: float, fastest: float = 0.0) -> str:
    """Why `other` loses to `winner`, in a few words: a part of its step where it is worse than the winner."""
    # `fastest`: the top predicted samples/s, within search.TIED of which the least memory wins (0: the winner's).
    if not other.fits:
        stage = max(range(len(other.memory)), key=lambda s: other.memory[s])
        return f"stage {stage} needs {human_bytes(other.memory[stage])} > {human_bytes(budget)}"
    slower = 1.0 - other.samples_per_s / winner.samples_per_s if winner.samples_per_s else 0.0
    top = max(fastest, winner.samples_per_s)
    below = 1.0 - other.samples_per_s / top if top else 0.0
    if below < search.TIED:  # a tie, which memory decides
        if other.config.offload != "none" and winner.config.offload == "none":
            return "as fast (within 0.5%), offloads activations to host memory"
        return "as fast (within 0.5%), needs more memory" if other.peak > winner.peak else "as fast (within 0.5%)"
    if slower < search.TIED:  # close to a winner that needs less memory, beyond the tie with the fastest
        return f"{below * 100:.1f}% below the fastest: only those within 0.5% of it are as fast"
    mine, theirs = search.parts(model, other), search.parts(model, winner)
    pct = f"{slower * 100:.0f}% slower"
    # The parts it spends longer in, most first; each named only by a figure that is worse than the winner's.
    for part in sorted((p for p in mine if mine[p] > theirs[p]), key=lambda p: theirs[p] - mine[p]):
        why = _worse(model, winner, other, part)
        if why is not None:
            return f"{pct}: {why}"
    # Only idle longer, at a bubble no larger: the winner's steps are that much shorter.
    return f"{pct}: longer idle per step ({_ms(mine['bubble'])}, winner {_ms(theirs['bubble'])})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _worse(model: search.Model, winner: Outcome, other: Outcome, part: str) -> str | None:
    """How `other` is worse than `winner` in `part` of its step (None: no figure there is worse, e.g. its bubble)."""
    c, w = other.config, winner.config
    if part == "bubble":
        return f"bubble {other.bubble:.2f} (winner {winner.bubble:.2f})" if round(other.bubble, 2) > round(
            winner.bubble, 2) else None
    if part == "messages":
        return "more time in messages"
    if part == "allreduce":
        if c.replicas > w.replicas:
            return f"gradient all-reduce over {c.replicas} replicas (winner {w.replicas})"
        # As many replicas (or fewer): its stages hold more of the parameters to reduce.
        return f"longer gradient all-reduce ({_ms(other.allreduce)}, winner {_ms(winner.allreduce)})"
    if c.recomputation() > w.recomputation():
        if c.checkpoint != w.checkpoint:
            return f"recomputes more ({c.checkpoint}, winner {w.checkpoint})"
        # One mode, except_last: the winner's forwards each meet their backward at once (M=1, or 1F1B on one stage).
        return (f"recomputes forwards ({c.checkpoint} with {c.schedule} at M={c.microbatches}; the winner's, with "
                f"{w.schedule} at M={w.microbatches}, none)")
    size, win_size = model.batch // c.replicas // c.microbatches, model.batch // w.replicas // w.microbatches
    if size < win_size:
        return f"more compute in smaller micro-batches ({counted(size, 'example')})"
    return "more compute per step"


def per_stage(memory: Sequence[float]) -> str:
    """Bytes per stage, the unit written once when they share it: '9.1 9.3 7.4 GiB'."""
    texts = [human_bytes(m) for m in memory]
    units = {t.split()[-1] for t in texts}
    if len(units) == 1:
        return " ".join(t.split()[0] for t in texts) + " " + units.pop()
    return " · ".join(texts)


def rate(samples_per_s: float) -> str:
    """Samples per second with enough digits to tell slow plans apart."""
    return f"{samples_per_s:,.1f}" if samples_per_s >= 100 else f"{samples_per_s:.3g}"


def distinct(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The outcomes without repeats: those predicted alike (same speed, cut and memory) show once, the first."""
    first: dict[tuple[float, tuple[int, ...], tuple[int, ...]], Outcome] = {}
    for o in outcomes:
        first.setdefault((round(o.samples_per_s, 6), tuple(o.balance), tuple(round(m) for m in o.memory)), o)
    return list(first.values())


def rows(model: search.Model, result: search.Result, top: int, budget: float) -> list[tuple[Outcome, str | None]]:
    """The best `top` fitting configurations (the best of each K among them) and up to two faster that do not fit."""
    # Fastest first, each with why it loses (None: the winner).
    best = result.best
    assert best is not None
    ranked = distinct(result.ranked)
    # The best of every other K first, so that each way to split the devices is seen, then the next fastest.
    others = [next(o for o in ranked if o.config.partitions == k)
              for k in {o.config.partitions for o in ranked} - {best.config.partitions}]
    shown = [best] + sorted(others, key=lambda o: -o.samples_per_s)
    shown = shown[:top] + [o for o in ranked if o not in shown][:max(top - len(shown), 0)]
    faster = distinct([o for o in result.refused if o.samples_per_s > best.samples_per_s])[:2]
    fastest = max(o.samples_per_s for o in ranked)
    return [(o, None if o is best else reason(model, best, o, budget, fastest))
            for o in sorted(shown + faster, key=lambda o: -o.samples_per_s)]


FIGURES = ("balance", "samples/s (pred.)", "bubble (pred.)", "peak memory per stage (pred.)", "why it loses")
# Stacked, for a terminal too narrow for the table: the configuration in one column, a part a line (the winner's
# marked in it), and headers without "(pred.)", which the title says of every figure.
STACKED = ("configuration", "balance", "samples/s", "bubble", "peak memory per stage", "why it loses")
WORDS = ("", "configuration", "schedule", "remat", "balance", "peak memory per stage (pred.)",
         "peak memory per stage", "why it loses")
# The column that says whose a row is, repeated by each table the stacked one splits into to fit; those whose cells
# wrap between words.
KEYS = ("configuration",)
PROSE = ("peak memory per stage", "why it loses")


def table(items: Sequence[tuple[Outcome, str | None]], title: str, stacked: bool = False) -> Table:
    """The configurations as a rich table of predicted figures (`stacked`: each configuration in one column)."""
    names = STACKED if stacked else ("", "K", "D", "M", "schedule", "remat", *FIGURES)
    t = figure_table(title, names, WORDS, box=box.SIMPLE_HEAD, title_justify="left")
    for o, why in items:
        c = o.config
        mark = "*" if why is None else ""
        schedule = c.schedule + (f" V={c.virtual}" if c.virtual > 1 else "")
        moved = f"offload {c.offload}" if c.offload != "none" else ""
        shape = [mark, str(c.partitions), str(c.replicas), str(c.microbatches), schedule,
                 f"{c.checkpoint} {moved}".strip()]
        if stacked:
            shape = ["\n".join(filter(None, (f"{mark} K={c.partitions} D={c.replicas} M={c.microbatches}".lstrip(),
                                              schedule, c.checkpoint, moved)))]
        t.add_row(*shape, ",".join(map(str, o.balance)), rate(o.samples_per_s), f"{o.bubble:.3f}",
                  per_stage(o.memory), why or "", end_section=stacked)
    return t


UNBOUNDED = 100_000  # columns a log's table may take: as many as its rows need


def print_plan(console: Console, items: Sequence[tuple[Outcome, str | None]], title: str) -> None:
    """The configurations at the console's width: a line each where they fit, else stacked, no figure cut."""
    whole = table(items, title)
    if console.soft_wrap:  # a log's (`output_console`): a configuration a line, however wide, for grep to find whole
        before = console.width  # print's own width is bounded by the console's
        console.width = max(before, console.measure(whole, options=console.options.update(max_width=UNBOUNDED)).maximum)
        try:
            print_rows(console, whole)
        finally:
            console.width = before
    elif fit_table(whole, console.width) == [whole]:
        console.print(whole)
    else:
        print_table(console, table(items, title, stacked=True), KEYS, PROSE)


def plain(items: Sequence[tuple[Outcome, str | None]], title: str) -> str:
    """The configurations as plain lines."""
    return "\n".join([title, *(f"{'*' if why is None else ' '} {o.config.label()} balance "
                               f"{','.join(map(str, o.balance))} | predicted {rate(o.samples_per_s)} samples/s, "
                               f"bubble {o.bubble:.3f}, peak memory {per_stage(o.memory)}"
                               f"{'' if why is None else f' | {why}'}" for o, why in items)])


def pipeline_section(outcome: Outcome, backend: str) -> dict[str, Any]:
    """The recipe's pipeline section that runs `outcome` as predicted."""
    c = outcome.config
    moved = {"offload": c.offload} if c.offload != "none" else {}  # the section is replaced whole: none by default
    return {"partitions": c.partitions, "microbatches": c.microbatches, "schedule": c.schedule,
            "virtual_stages": c.virtual, "checkpoint": c.checkpoint, **moved, "balance": list(outcome.balance),
            "data_parallel": c.replicas, "backend": backend}


def set_lines(section: dict[str, Any]) -> list[str]:
    """`--set pipeline.KEY=VALUE` for every key of the section, quoted for a shell."""
    def text(value: Any) -> str:
        return "[" + ",".join(map(str, value)) + "]" if isinstance(value, list) else str(value)
    return [f"--set {shlex.quote(f'pipeline.{key}={text(value)}')}" for key, value in section.items()]


HEADER = "# written by gpipe plan"


def header_line(devices: int, budget: float, outcome: Outcome) -> str:
    """The comment a planned recipe starts with: what it was planned for, and the prediction."""
    return (f"{HEADER} for {counted(devices, 'device')} of {human_bytes(budget)}: {outcome.config.label()}, "
            f"predicted {rate(outcome.samples_per_s)} samples/s\n")


def write_recipe(text: str, raw: dict[str, Any], section: dict[str, Any], path: Path, label: str,
                 header: str) -> None:
    """Write `raw` with its pipeline section replaced, validated, whole or not at all, over the user's `text`."""
    # `raw` is read from `text` with the --set overrides; the user's comments and key order stay.
    if "pipeline" in raw:
        out = {**raw, "pipeline": section}
    else:  # the usual order: the pipeline section right after the model
        items = list(raw.items())
        at = list(raw).index("model") + 1 if "model" in raw else len(items)
        out = dict([*items[:at], ("pipeline", section), *items[at:]])
    validate_recipe(out, f"{label} with the planned pipeline", check_data=False)
    if text.startswith(HEADER):  # planned again: the new plan's line replaces the old one's
        text = text.partition("\n")[2]
    atomic_write_bytes(path, (header + rewrite(text, out, label)).encode())
