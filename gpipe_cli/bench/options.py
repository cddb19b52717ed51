"""What `gpipe bench` is asked to measure: one dataclass whose fields mirror the command's flags."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpipe_cli.bench.trace import paths as trace_paths
from gpipe_cli.errors import UserError, shown
from gpipe_cli.estimate.model_flags import SEED_HELP, ModelFlags, choice_problems, model_of, shared_fields
from gpipe_cli.files import another_file, check_not_input, check_output, check_output_kind, check_picture
from gpipe_cli.limits import MAX_COUNT, MAX_RANKS, MAX_SIZE, MAX_THREADS, finite, outside, refuse
from gpipe_cli.pipeline import schedules
from gpipe_cli.pipeline.config import microbatch_problem
from gpipe_cli.recipe.aliases import ALIASES, given_as
from gpipe_cli.units import human_bytes, meminfo_available


@dataclass
class BenchOptions(ModelFlags):
    """What `gpipe bench` measures: its own flags (see `FLAGS`) and the recipe keys it reads (see `ALIASES`)."""

    partitions: int = 2
    steps: int = 10
    warmup: int = 3
    virtual_stages: int = 1            # V: chunks per stage (interleaved)
    sweep: bool = False
    compare: bool = False
    trace: Path | None = None
    simulate: bool = False
    devices: int | None = None
    bandwidth: float = 12.0            # GB/s of the simulated link
    latency_us: float = 20.0           # per-message latency of the simulated link
    threads: int = 1
    oversubscribe: bool = False

    @property
    def batch(self) -> int:
        """The mini-batch size actually used."""
        return self.batch_size if self.batch_size is not None else 4 * max(self.microbatch_values())

    def microbatch_values(self) -> list[int]:
        """The M values this invocation measures."""
        return list(SWEEP_MICROBATCHES) if self.sweep else [self.microbatches]

    def virtual_at(self, stages: int) -> int:
        """V at K=`stages`: a K=1 run holds one chunk, except under a V-shaped schedule (two, in memory)."""
        return self.virtual_stages if stages > 1 or schedules.get(self.schedule).placement == "v" else 1

    @property
    def stages(self) -> int:
        """The K of the benchmark: measured on --partitions ranks, or predicted for --devices with --simulate."""
        return self.devices if self.simulate and self.devices is not None else self.partitions

    @property
    def measures_once(self) -> bool:
        """Whether the K run is the K=1 run (one rank, one chunk): then it is measured once, not twice."""
        return not self.simulate and not self.sweep and self.partitions == 1 and self.virtual_stages == 1

    @property
    def runs_torch(self) -> bool:
        """Whether --compare runs torch's counterpart of the schedule: v-half has none, said after ours is measured."""
        return self.compare and schedules.get(self.schedule).torch_counterpart is not None

    @property
    def measures_host_overhead(self) -> bool:
        """Whether the K=1 run also times the engine against a plain loop: only when benchmarking K=1 itself."""
        # At K > 1 it would add as many K=1 steps again to every run.
        return self.stages == 1 and not self.sweep

    def sweep_plot(self) -> Path | None:
        """Where --sweep draws its bars: the --json file with .png in place of its suffix (None: no --json)."""
        if not self.sweep or self.json is None or not self.json.name:  # "." or "/": refused as a directory
            return None
        return self.json.with_suffix(".png")

    def outputs(self) -> list[tuple[str, Path]]:
        """Every file this invocation writes, with the flag that names it."""
        named = [("--json", self.json), ("--json (its --sweep plot)", self.sweep_plot())]
        if self.trace is not None:
            named += [("--trace", path) for path in trace_paths(self.trace)]
        return [(flag, path) for flag, path in named if path is not None]


def run_name(partitions: int, virtual_stages: int) -> str:
    """How the K ranks' run is named: `K=1 V=2` where one rank holds a V's two chunks, apart from the K=1 baseline."""
    return f"K={partitions}" + (f" V={virtual_stages}" if partitions == 1 and virtual_stages > 1 else "")


def overhead_rounds(steps: int) -> tuple[int, int]:
    """How the host-overhead comparison runs `steps` steps a side: (rounds, steps of each side per round)."""
    # Up to 10 rounds of at least 2 steps, so that a side's best step need not follow a switch.
    count = max(1, min(10, steps // 2))
    return count, -(-steps // count)


SWEEP_MICROBATCHES = (1, 4, 32)
SWEEP_PARTITIONS = (2, 4, 8)
RANK_BYTES = 400 << 20  # a rank's own memory before its stage: the interpreter, torch, its transport and buffers

CUTS = ("auto", "time")  # the cuts bench makes itself: auto and time are both by measured per-layer time
# Flag name -> help text of bench's own flags (the recipe's keys have the schema's).
FLAGS: dict[str, str] = {
    "model": "A preset (model.preset: transformer-l-13, amoebanet-d-18-256, ...), a family (transformer, "
             "amoebanet: the paper's speed-table model, scaled down to this machine and about a minute unless a size "
             "flag or --set model.KEY is given) or a recipe file [default: transformer].",
    "recipe": "Recipe YAML file: its model, pipeline and data.batch_size [default: --model's model, K=2, M=8].",
    "steps": "Measured steps (each figure is their median).",
    "warmup": "Steps run first and not measured.",
    "set": "Override a recipe key: KEY=VALUE, the value read as YAML (repeatable), e.g. --set model.arch=decoder-only.",
    "sweep": "The paper's Table 2: M in {1,4,32} x K in {2,4,8} (as far as this machine hosts), normalised to K=2, "
             "M=1, beside the paper's figures.",
    "compare": "Also run torch.distributed.pipelining's counterpart of --schedule on the same model, K, M, cut and "
               "recomputation: throughput, idle share and peak-memory ratios.",
    # Suffixes quoted: the help's tidying takes a space before a dot for a stray one, and drops it.
    "trace": "One step's timeline as a Chrome trace to FILE (Perfetto) and a Gantt chart (needs matplotlib) to "
             "FILE with '.png' in place of its suffix; for a FILE ending in '.png' the trace goes to FILE with "
             "'.json' in place of '.png'.",
    "simulate": "Predict throughput for --devices from measured per-layer costs and the link instead of measuring "
                "K ranks.",
    "devices": "K to predict for [default: --partitions].",
    "bandwidth": "Simulated link bandwidth in GB/s.",
    "latency_us": "Simulated per-message latency in microseconds.",
    "threads": "Intra-op threads per rank (1 keeps timings comparable).",
    "oversubscribe": "With --sweep, also K values that exceed the cores or GPUs (their timings mean little).",
    "seed": SEED_HELP,
    "json": "Write every figure as JSON to FILE (with --sweep, the plot too, to FILE with '.png' in place of its "
            "suffix).",
}


def bench_options(recipe: str | None, flags: Mapping[str, Any], sets: Sequence[str], **own: Any) -> BenchOptions:
    """The options a recipe (None: bench's own model and pipeline), the alias flags, `--set` and bench's flags give."""
    # The recipe's keys are checked as `train` checks them, before torch loads.
    typed = [given for name in ("partitions", "microbatches", "balance") if (given := given_as(name, flags, sets))]
    if own.get("sweep") and typed:
        raise UserError(f"--sweep measures its own K and M (the paper's Table 2): leave out {', '.join(typed)}")
    named = given_as("partitions", flags, sets)
    # --simulate --devices K predicts for K stages: the recipe's keys are checked at that K, not at bench's default
    # (without a recipe, a --balance's entries against it are checked with the model's layers, naming --devices).
    devices = own.get("devices") if own.get("simulate") and named is None else None
    if devices is not None:  # else the recipe's check named it pipeline.partitions
        refuse([outside("--devices", devices, 1, MAX_RANKS)])
    k = devices if flags.get("balance") is None else None
    # A recipe's own K gives way to it as a --set would (bench's defaults never override a recipe).
    forced = [f"{ALIASES['partitions']}={devices}"] if devices is not None and recipe is not None else []
    try:
        fields = shared_fields(BenchOptions, recipe, flags, [*forced, *sets], CUTS, "gpipe bench",
                               **({"partitions": k} if k is not None else {}))
    except UserError as exc:
        if own.get("simulate") and own.get("devices") not in (None, flags.get("partitions")) and named:
            raise UserError(_predicted_k(own["devices"], named)) from None  # first: the other problem follows it
        said = str(exc).replace(f"--set {ALIASES['partitions']} ({devices})", f"--devices ({devices})")
        if forced:
            said = said.replace("(partitions x virtual_stages)", "(--devices x virtual_stages)")
        raise type(exc)(said.replace(f"--partitions ({k}, its default)", f"--devices ({k})")) from None
    options = BenchOptions(model=model_of(recipe, own.pop("model", None), "measured"), **fields, **own)
    if options.simulate and options.devices not in (None, options.partitions) and named:
        # --devices is the K predicted: a --partitions beside it that differs would be dropped without a word.
        raise UserError(_predicted_k(options.devices, named))
    return options


def _predicted_k(devices: int, named: str) -> str:
    """The refusal of --partitions (as `named`) beside a --simulate --devices that differs from it."""
    return f"--simulate predicts for --devices {devices} stages: leave out {named}, or --devices to predict for it"


def validate(options: BenchOptions) -> None:
    """Refuse options that cannot describe a benchmark, with one line naming the flag."""
    refuse([
        outside("--partitions", options.partitions, 1, MAX_RANKS),
        outside("--microbatches", options.microbatches, 1, MAX_SIZE),
        outside("--steps", options.steps, 1, MAX_COUNT),
        outside("--warmup", options.warmup, 0, MAX_COUNT),
        outside("--threads", options.threads, 1, MAX_THREADS),
        *choice_problems(options),
        finite("--bandwidth", options.bandwidth, " GB/s"),
        finite("--latency-us", options.latency_us, zero=True),
        None if options.devices is None else outside("--devices", options.devices, 1, MAX_RANKS),
        None if options.devices is None or options.simulate else "--devices needs --simulate",
        "--sweep and --simulate cannot be combined" if options.sweep and options.simulate else None,
        "--sweep and --compare cannot be combined" if options.sweep and options.compare else None,
        "--simulate and --compare cannot be combined: --compare measures torch's schedules on K ranks"
        if options.simulate and options.compare else None,
        # torch's stages talk through a process group, which one rank alone does not start.
        "--compare runs torch's schedules across ranks: it needs --partitions 2 or more"
        if options.compare and options.partitions == 1 and not options.simulate else None,
        "--oversubscribe goes with --sweep (the K values it adds are the sweep's)"
        if options.oversubscribe and not options.sweep else None,
        "--virtual-stages > 1 cannot be combined with --sweep" if options.virtual_stages != 1 and options.sweep
        else None,
        "--trace records the K ranks' measured step: it cannot be combined with --sweep or --simulate"
        if options.trace is not None and (options.sweep or options.simulate) else None,
    ])
    seen: dict[str, str] = {}
    for flag, path in options.outputs():  # before anything is measured: a file that cannot be written, or twice
        # A file named after the one the flag names: an example inside the folder would not help.
        if path not in (options.json, options.trace) and os.path.isdir(path):
            raise UserError(f"{flag} would also write {shown(str(path))}, which is a folder; name another "
                            f"{flag.partition(' ')[0]} file")
        check_output(path, flag, "trace.json" if flag == "--trace" else "bench.json")
        # A --model that names a file is the recipe read (a name such as `transformer` is a preset).
        check_not_input(path, flag, [(options.model, "the recipe itself")],
                        another_file(path, f"{path.stem}.{'trace' if flag == '--trace' else 'bench'}.json"))
        where = os.path.abspath(path)
        if where in seen:  # the second write would replace the first
            raise UserError(f"{flag} would write {shown(str(path))}, which {seen[where]} writes too; name "
                            f"different files")
        seen[where] = flag
        if path.suffix.lower() == ".png" and path != options.trace:  # a chart beside a file the user named
            check_picture(path, f"{flag} would also write", f"name another {flag.partition(' ')[0]} file")
    # A name of another kind, once no two outputs collide: a sweep's plot is named after --json, in PNG.
    check_output_kind(options.json, "--json")
    check_output_kind(options.trace, "--trace", allowed=(".json", ".jsonl", ".png"))  # x.png: x.json beside
    available = meminfo_available()  # a bench starts every stage on this machine
    if available is not None and not options.simulate and options.partitions * RANK_BYTES > available:
        raise UserError(f"{options.given('partitions', options.partitions)}: a bench starts one rank per stage on "
                        f"this machine, each needing about {human_bytes(RANK_BYTES)} before its model; "
                        f"{human_bytes(available)} available here holds at most {max(available // RANK_BYTES, 1)}")
    from gpipe_cli.pipeline.schedule import check as check_schedule  # torch: only once the flags above are good

    try:
        for m in options.microbatch_values():
            check_schedule(options.schedule, options.stages, m, options.virtual_stages)
    except ValueError as exc:
        raise UserError(f"--schedule/--virtual-stages: {exc}") from None
    batch = options.batch
    if microbatch_problem(m := max(options.microbatch_values()), batch):
        raise UserError(f"{options.given('batch_size', batch)} is smaller than M={m}: every micro-batch needs an "
                        "example")
    if options.compare and batch % options.microbatches:
        raise UserError(f"--compare needs {options.named('batch_size')} divisible by {options.named('microbatches')} "
                        f"({batch} % {options.microbatches} != 0): torch.distributed.pipelining receives into fixed "
                        "buffers sized by the first micro-batch")


def parse_balance(text: str | None, partitions: int,
                  named: str = "--partitions x --virtual-stages") -> list[int] | None:
    """`--balance 3,5` as a list (validated against the model later); `partitions` counts chunks (K x V)."""
    if text is None or not text.strip():
        return None
    try:
        balance = [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--balance expects layer counts separated by commas, e.g. 5,5 (got '{text}')") from None
    if len(balance) != partitions:
        raise UserError(f"--balance {text} has {len(balance)} entries but the pipeline has {partitions} ({named})")
    return balance

