"""What `gpipe plan` is asked: one dataclass whose fields mirror the command's flags, checked before torch loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpipe_cli.errors import UserError
from gpipe_cli.files import check_file_name
from gpipe_cli.limits import MAX_COUNT, MAX_RANKS, finite, one_of, outside, refuse
from gpipe_cli.recipe.aliases import SET_HELP
from gpipe_cli.units import parse_size

TIMINGS = ("auto", "measure", "estimate")
ASSUMED_BANDWIDTH, ASSUMED_LATENCY_US = 12.0, 20.0  # within a node, when not measured: PCIe 4 x16 in practice


@dataclass
class PlanOptions:
    """The flags of `gpipe plan` (see `FLAGS` for their help)."""

    recipe: str | None = None
    set: list[str] = field(default_factory=list)
    devices: int = 1
    device_memory: str | None = None   # None: what each rank has on this machine
    nodes: int = 1
    top: int = 5
    output: Path | None = None
    bandwidth: float | None = None     # GB/s between devices of one node (None: measured here, or ASSUMED)
    latency_us: float | None = None
    node_bandwidth: float = 12.5       # GB/s between nodes
    node_latency_us: float = 5.0
    timing: str = "auto"
    tflops: float | None = None        # assumed effective TFLOP/s per device (estimated seconds)
    plain: bool = False

    def memory_bytes(self) -> int | None:
        """--device-memory in bytes (None: this machine's)."""
        return None if self.device_memory is None else parse_size(self.device_memory, "--device-memory")


# Flag name -> help text, for the CLI's typer options (one to one with the fields above).
FLAGS: dict[str, str] = {
    "devices": "N: devices to plan for (K stages x D replicas = N), 1 to 65536.",
    "device_memory": "Memory of each device, e.g. 80GiB (a number without a unit is bytes) [default: what each of "
                     "N ranks has on this machine].",
    "nodes": "Nodes the N devices are spread over (N / nodes each); a pipeline crossing nodes uses the node link.",
    "top": "How many configurations that fit to print (faster ones that do not fit are listed above them, with why).",
    "output": "Write the winning plan as a recipe here (the input recipe with its pipeline section replaced, its "
              "comments and key order kept).",
    "set": SET_HELP,
    "bandwidth": "Link between devices of one node, GB/s [default: measured between the CPU ranks here unless "
                 f"--tflops or --timing estimate, else {ASSUMED_BANDWIDTH:g} (PCIe 4 x16 in practice)]; giving it or "
                 "--latency-us assumes both.",
    "latency_us": "Per-message latency between devices of one node, microseconds [default: measured here, "
                  f"else {ASSUMED_LATENCY_US:g}]; giving it or --bandwidth assumes both.",
    "node_bandwidth": "Assumed link between nodes, GB/s (12.5: 100 Gb/s InfiniBand or Ethernet).",
    "node_latency_us": "Assumed per-message latency between nodes, microseconds.",
    "timing": "Per-layer seconds: measure (on this machine's device), estimate (FLOPs at this machine's measured "
              "rate) or auto (measure unless the model is too large or slow to time here).",
    "tflops": "Assumed effective TFLOP/s of each planned device: per-layer seconds from FLOPs at this rate "
              "(for devices that are not here; implies --timing estimate).",
    "plain": "Plain lines instead of a table.",
}


def output_path(text: str | None) -> Path | None:
    """--output as a path (None: not given); an empty name is refused, where Path would read it as '.'."""
    if text is None:
        return None
    if not text.strip():
        raise UserError(f"--output: must name a .yaml or .yml file, e.g. planned.yaml (got {text!r})")
    check_file_name(text, "--output")
    return Path(text)


def validate(options: PlanOptions) -> None:
    """Refuse flags that cannot describe a plan, with one line naming the flag."""
    refuse([
        # A planned K or D past the recipe's own limit could never be written or trained; counts beyond it
        # would also only make the search count divisors for minutes.
        outside("--devices", options.devices, 1, MAX_RANKS),
        outside("--nodes", options.nodes, 1, MAX_RANKS),
        # Checked only past `--nodes >= 1`, which comes first: N % 0 has no answer.
        None if options.nodes < 1 or (options.nodes <= options.devices and options.devices % options.nodes == 0)
        else f"--nodes {options.nodes} must divide --devices {options.devices} (the same devices on every node)",
        outside("--top", options.top, 1, MAX_COUNT),
        finite("--bandwidth", options.bandwidth, " GB/s"),
        finite("--latency-us", options.latency_us, zero=True),
        finite("--node-bandwidth", options.node_bandwidth, " GB/s"),
        finite("--node-latency-us", options.node_latency_us, zero=True),
        one_of("--timing", options.timing, TIMINGS),
        finite("--tflops", options.tflops),
        "--tflops estimates per-layer seconds: it cannot be combined with --timing measure"
        if options.tflops is not None and options.timing == "measure" else None,
        f"--output: must name a .yaml or .yml file, e.g. planned.yaml (got {options.output})"
        if options.output is not None and options.output.suffix.lower() not in (".yaml", ".yml") else None,
    ])
    memory = options.memory_bytes()
    if memory is not None and memory <= 0:
        raise UserError(f"--device-memory: must be at least 1 byte, a size such as 8GiB, 16GB or 500MiB "
                        f"(got '{options.device_memory}')")
