"""What `gpipe bench` will measure, said before it measures anything."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console

from gpipe_cli import memory_model as mm
from gpipe_cli import sizing
from gpipe_cli.bench.options import (
    RANK_BYTES,
    SWEEP_MICROBATCHES,
    BenchOptions,
    overhead_rounds,
    parse_balance,
    run_name,
)
from gpipe_cli.errors import UserError
from gpipe_cli.estimate import kept
from gpipe_cli.estimate.model_flags import balance_entries
from gpipe_cli.estimate.subject import FAMILIES, Subject, model_overrides, naming_the_sized, resolve, to_measure
from gpipe_cli.launch import forked
from gpipe_cli.models import families
from gpipe_cli.pipeline import partition
from gpipe_cli.progress import SAY_BELOW_S, phase_line
from gpipe_cli.units import flop_rate, human_bytes, human_count, human_seconds

NO_STATE = "plain-sgd"  # bench steps without an optimizer: weights and gradients, as an optimizer without state


def sizable(options: BenchOptions) -> bool:
    """Whether the model is left to this machine: a family name, no size flag, `--set` only of size-neutral settings."""
    if options.model not in FAMILIES or any(v is not None for v in options.sizes().values()):
        return False
    if options.set:
        resolve(options.model, None, options.set)  # a bad key or value is one line, whichever way it is sized
    return sizing.keeps_size(options.model, model_overrides(options.set))


def runs(options: BenchOptions, layers: int) -> list[tuple[int, int]]:
    """The (K, M) configurations the command measures, K=1 first."""
    if options.simulate:
        return [(1, options.microbatches)]
    if options.sweep:
        from gpipe_cli.bench.setup import sweep_partitions

        ks = sweep_partitions(options, layers)
        return [(1, max(SWEEP_MICROBATCHES))] + [(k, m) for k in ks for m in SWEEP_MICROBATCHES]
    if options.measures_once:
        return [(1, options.microbatches)]
    return [(1, options.microbatches), (options.partitions, options.microbatches)]


def phase_seconds(cand: sizing.Candidate, machine: sizing.Machine, options: BenchOptions) -> dict[int, float]:
    """Seconds each job should take on `machine` with model `cand`, by its K (K=1 also times layers, host overhead)."""
    passes = sizing.passes(options.checkpoint)
    configs = runs(options, cand.pipeline_layers)
    forking = forked.available()  # every launch then forks from the one server that `run` starts
    seconds = {k: sizing.launch_seconds(k, machine, first=i == 0, forking=forking)
               for i, k in enumerate(sorted({k for k, _ in configs}))}
    steps = options.steps + options.warmup
    for k, m in configs:
        work = sizing.step_seconds(cand, machine, options.batch, m, passes)
        if k == 1:
            again = steps + 1 if options.runs_torch and options.measures_once else 0  # see --compare below
            seconds[k] += (steps + again) * work + 10 * work / m  # the per-layer costs, timed on one micro-batch
            continue
        # The ranks that compute at once: one per GPU, or as many as the cores host at --threads each.
        units = machine.units if machine.kind == "cuda" else machine.units // max(options.threads, 1)
        parallel = max(min(k, units), 1)
        # A stage's share with its bubble, but never faster than the cores can run all of the work.
        step = max(work * (m + k - 1) / (m * k), work / parallel)
        messages = 2 * m * 1e-3 * max(1.0, k / parallel)  # one send per micro-batch and direction
        # --compare: torch's counterpart takes as many steps again, and one more that learns its order of work.
        seconds[k] += (2 * steps + 1 if options.runs_torch else steps) * (step + messages)
    if options.measures_host_overhead:
        # The engine and the plain loop, each its warm-up and measured steps, on the whole model at K=1.
        count, each = overhead_rounds(options.steps)
        work = sizing.step_seconds(cand, machine, options.batch, options.microbatches, passes)
        seconds[1] += 2 * (options.warmup + count * each) * work
    return seconds


def need_bytes(cand: sizing.Candidate, machine: sizing.Machine, options: BenchOptions) -> float:
    """Memory the command needs at once, by the memory model: its fullest run (see `memory`)."""
    return _need(memory(Subject(cand.kind, cand.params, options.model), options, machine))


def _need(mem: Memory) -> float:
    return max(need for *_, need in mem.needs)


def judge(options: BenchOptions, machine: sizing.Machine, priced: dict[str, Memory] | None = None,
          say: Callable[[str], None] = lambda line: None) -> Callable[[sizing.Candidate], sizing.Verdict]:
    """The sizing verdict of a candidate for this command on this machine (each memory priced kept in `priced`)."""
    def verdict(cand: sizing.Candidate) -> sizing.Verdict:
        def need() -> float:
            subject = Subject(cand.kind, cand.params, options.model)
            try:
                found = memory(subject, options, machine, say)
            except partition.PartitionError:  # too few layers for the chunks: refused once chosen (check_cut)
                return math.inf
            if priced is not None:
                priced[_key(subject)] = found
            return _need(found)
        return sizing.Verdict(need, machine.memory_bytes * sizing.MEMORY_SHARE,
                              sum(phase_seconds(cand, machine, options).values()), sizing.TIME_BUDGET_S)
    return verdict


def _key(subject: Subject) -> str:
    return json.dumps([subject.kind, subject.params], sort_keys=True, default=repr)


@dataclass(frozen=True)
class Preview:
    """The subject chosen and the estimates the plan shows."""

    subject: Subject
    note: str
    seconds: float
    memory: Memory
    sized: bool = False  # chosen by sizing to this machine (else exactly what the flags asked)
    phases: dict[int, float] = field(default_factory=dict)  # each job's estimated seconds, by K (see phase_seconds)


def choose_subject(options: BenchOptions, machine: sizing.Machine,
                   say: Callable[[str], None] = lambda line: None) -> Preview:
    """The model to measure (sized to the machine when no model flag was given, else exactly what was asked) and its
    memory; refused in one line where its cut or its memory cannot be."""
    sized = sizable(options)
    stages = options.stages if options.simulate else max(k for k, _ in runs(options, 10**6))
    priced: dict[str, Memory] = {}
    subject, note, v = to_measure(options.model, options.sizes(), options.set, judge(options, machine, priced, say),
                                  stages, sized, options.virtual_at(stages), say)
    try:
        check_cut(options, subject)
    except partition.PartitionError as exc:
        raise UserError(naming_the_sized(str(exc), subject) if sized else str(exc)) from None
    mem = priced.get(_key(subject)) or memory(subject, options, machine, say)
    check_fits(subject, mem, options, machine, sized)
    cand = sizing.candidate(subject.kind, subject.params)
    return Preview(subject, note, v.seconds, mem, sized, phase_seconds(cand, machine, options))


def check_cut(options: BenchOptions, subject: Subject) -> None:
    """Refuse K (and --balance) that the model's layers cannot take, before anything is measured (PartitionError)."""
    layers = len(subject.build().layers)
    chunks = options.stages * options.virtual_stages
    # K, V and the balance as the user gave them: a flag or a --set.
    k_named = "--devices" if options.simulate and options.devices is not None else options.named("partitions")
    v_named = options.named("virtual_stages")
    try:
        partition.check_chunks(layers, options.stages, options.virtual_stages, (k_named, v_named))
        explicit = parse_balance(options.balance, chunks, f"{k_named} x {v_named}")
    except partition.PartitionError as exc:
        if isinstance(exc, partition.TooManyChunks):
            raise
        chunked = f"/{v_named} ({chunks} chunks)" if options.virtual_stages > 1 else ""
        raise partition.PartitionError(f"{options.cut_named(k_named + chunked)}: {exc}") from None
    if explicit is not None:  # one entry a chunk, as parsed: only its sum can be at fault, not K
        try:
            partition.check_balance(explicit, layers, chunks)
        except partition.PartitionError as exc:
            raise partition.PartitionError(f"{options.balance_named()}: {exc}") from None


# Each stage's memory is priced by walking every action of its schedule: 46 us per micro-batch and stage on a
# 2-core CPU machine (9 s for M=65,536 at K=1 and K=2).
WALK_S = 5e-5
# The walks this process has priced: the memory model keeps each one, so pricing another model (sizing's next
# candidate) walks nothing again.
_WALKED: set[tuple[str, str, str, int, int, int]] = set()


@dataclass(frozen=True)
class Memory:
    """What the memory model says each run of the command holds."""

    stages: dict[int, list[float]]       # K -> each stage's bytes, at the command's M (the plan's line)
    needs: list[tuple[int, int, float]]  # (K, M, bytes) of every run: what it needs of the memory `have` counts


def memory(subject: Subject, options: BenchOptions, machine: sizing.Machine,
           say: Callable[[str], None] = lambda line: None) -> Memory:
    """Each stage's memory (the memory model's) at K and K=1, and what every run of the command needs here at once."""
    # On a CPU all of its ranks with their runtimes; on GPUs the fullest one, its ranks dealt out in turn.
    spec = subject.build()
    figures = kept.figures(spec)  # shapes only
    # Each layer's seconds on a micro-batch, as sizing prices them: its FLOPs at the rate the family's layers reach
    # here, and the fixed cost of a call, which the run's cut by measured time sees and a cut by FLOPs did not (a
    # small AmoebaNet's stages were cut [1, 1, 18, 24] for the plan and [10, 11, 11, 12] by the run).
    size = sizing.ceil_div(options.batch, options.microbatches)
    rate, per_call = sizing.layer_rate(machine, subject.kind)
    # FLOPs per example as sizing described them, at 2 examples: per example they do not depend on the batch.
    costs = [c.flops * size / rate + per_call for c in kept.summary(spec, 2).layers]
    configs = runs(options, len(spec.layers))
    ks = {1, max(k for k, _ in configs)}
    stages: dict[tuple[int, int], list[float]] = {}
    walks = {*configs, *((k, options.microbatches) for k in ks)}
    fresh = {(options.schedule, options.checkpoint, options.offload, options.virtual_at(k), k, m)
             for k, m in walks} - _WALKED
    seconds = WALK_S * sum(virtual * k * m for *_, virtual, k, m in fresh)
    _WALKED.update(fresh)
    if seconds >= SAY_BELOW_S:  # a million micro-batches were minutes of silence
        say(phase_line(f"pricing each stage's memory, action by action of {options.microbatches:,} micro-batches",
                       seconds))
    host: dict[tuple[int, int], float] = {}  # what the stages offload, all together
    for k, m in walks:  # each stage's estimated bytes
        virtual = options.virtual_at(k)
        cut = explicit_cut(options, k, len(costs)) or partition.balance_by_cost(costs, k * virtual)
        found = mm.footprints(figures, cut, options.batch, m, options.schedule, options.checkpoint,
                              kept.bytes_per_parameter(NO_STATE), virtual, options.offload)
        stages[(k, m)], host[(k, m)] = [fp.total_bytes for fp in found], sum(fp.host_bytes for fp in found)
    units = max(machine.units, 1)
    # On a CPU what the stages offload stays in the same RAM.
    needs = [(k, m, max(sum(stages[(k, m)][g::units]) for g in range(min(k, units))) if machine.kind == "cuda"
              else sum(stages[(k, m)]) + host[(k, m)] + k * RANK_BYTES) for k, m in configs]
    return Memory({k: stages[(k, options.microbatches)] for k in ks}, needs)


def explicit_cut(options: BenchOptions, k: int, layers: int | None = None) -> list[int] | None:
    """The --balance list of the K-stage run, which the estimate then prices (None: the run cuts on its own, or
    the list is not of a model of `layers` layers, as for a candidate that sizing prices)."""
    chunks = k * options.virtual_at(k)
    given = k == options.stages and balance_entries(options.balance) == chunks
    cut = parse_balance(options.balance, chunks) if given else None
    return cut if cut is not None and sum(cut) == (layers or sum(cut)) else None


def check_fits(subject: Subject, mem: Memory, options: BenchOptions, machine: sizing.Machine, sized: bool) -> None:
    """Refuse, in one line and before anything starts, a command one of whose runs cannot fit the free memory."""
    k, m, need = max(mem.needs, key=lambda run: run[2])
    if need <= machine.memory_bytes:
        return
    cand = sizing.candidate(subject.kind, subject.params)
    run = f" in its K={k} run" + (f" at M={m}" if m != options.microbatches else "")
    raise UserError(_does_not_fit(options, cand, run, need, machine, sized))


def _does_not_fit(options: BenchOptions, cand: sizing.Candidate, run: str, need: float, machine: sizing.Machine,
                  sized: bool) -> str:
    """The one line that refuses a model too large for this machine: what it needs, what is free, what to do."""
    where = "each GPU" if machine.kind == "cuda" else "this machine"
    what = (f"{cand.describe()} ({human_count(cand.parameters)} parameters) needs about {human_bytes(need)}{run} "
            f"(est.), {human_bytes(machine.memory_bytes)} is free on {where}")
    if sized:  # the family's smallest member: only the batch and the ranks are left to shrink
        return (f"even the smallest model of --model {options.model} does not fit: {what}; lower --batch-size or "
                f"--partitions, or free memory")
    # Only a family (--model transformer, amoebanet) is sized to the machine; a recipe or a preset is taken as it is.
    sizable = ", or leave the size flags and --set out to let bench size it to this machine" \
        if options.model in FAMILIES else ""
    return (f"the model does not fit: {what}; shrink it ({families.of(cand.kind).shrink_flags}), "
            f"{'lower --batch-size' if sizable else 'or lower --batch-size'}{sizable}")


def show(preview: Preview, options: BenchOptions, machine: sizing.Machine, console: Console) -> None:
    """Print the plan: model, parameters, per-stage memory, ranks per core or GPU, and the time it should take."""
    from gpipe_cli.bench.setup import oversubscription

    spec = preview.subject.build()
    cand = sizing.candidate(preview.subject.kind, preview.subject.params)
    if preview.note:
        console.print(f"[bold]{preview.note}[/]")
    name = (cand.describe(full=True) if preview.subject.kind in families.FAMILIES
            and "layers" in preview.subject.params else spec.name)
    console.print(f"[bold]plan[/] · {name}: {human_count(cand.parameters)} parameters, "
                  f"{len(spec.layers)} pipeline layers, {cand.flops * 3 / 1e9:.3g} GFLOP per example and step")
    configs = runs(options, len(spec.layers))
    ks = sorted({k for k, _ in configs})
    steps = f"{options.warmup} warm-up + {options.steps} measured steps"
    # A sweep's K=1 run only times each layer (its figures are normalised to K=2, M=1, as the paper's).
    what = "per-layer costs at K=1, then " if options.sweep else "per-layer costs, then "
    listed = [f"K={k}" for k in ks if k > 1 or not options.sweep]
    if ks == [1] and len(configs) == 2:  # one rank holding a V's two chunks, measured beside K=1
        listed.append(run_name(1, options.virtual_stages))
    ms = "1,4,32" if options.sweep else str(options.microbatches)
    host = ", the engine against a plain loop at K=1" if options.measures_host_overhead else ""
    host += f", torch.distributed.pipelining's at K={max(ks)}" if options.runs_torch else ""
    console.print(f"  runs: {what}{', '.join(listed)}{host} · M={ms} · batch {options.batch} · "
                  f"{options.schedule} · checkpoint {options.checkpoint} · {steps}")
    k, whole = max(ks), human_bytes(preview.memory.stages[1][0])
    if k > 1:
        # Priced at an estimated cut where the run makes its own: the cut it makes is known only once it has timed.
        how = "est." if explicit_cut(options, k, len(spec.layers)) else "est. at a cut by estimated time"
        console.print(f"  memory at K={k} ({how}): " + " · ".join(human_bytes(b) for b in preview.memory.stages[k])
                      + f"; K=1 holds {whole}")
    else:
        console.print(f"  memory at K=1 (est.): {whole}")
    for ranks in ks[1:] or ks:
        over, hardware = oversubscription(ranks, options.threads)
        per = f"{ranks * options.threads / max(machine.units, 1):.0f} per {'GPU' if machine.kind == 'cuda' else 'core'}"
        warning = (f" ([bold yellow]warning:[/] oversubscribed, {per}: the speed figures will mean little)"
                   if over else "")
        plural = "s" if ranks > 1 else ""
        console.print(f"  ranks: K={ranks} runs {ranks} rank{plural} x {options.threads} thread(s) on "
                      f"{hardware}{warning}")
    # On a CPU the rate is the model's own heaviest early layer's, timed just now; elsewhere a matrix product's
    # scaled by the share such layers reach (a guess). The machine's rate is the one that share scales up to.
    rate = machine.flops_per_s * sizing.layer_efficiency(machine.kind, preview.subject.kind)
    how = "timed now" if machine.kind == "cpu" else "estimated"
    console.print(f"  estimate: about {human_seconds(preview.seconds)} "
                  f"(this machine: its layers at {flop_rate(rate)} per rank, {how}; "
                  f"{human_bytes(machine.memory_bytes)} free)")
