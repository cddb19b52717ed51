"""`gpipe bench`: training throughput at K stages and M micro-batches against K=1, baselines, traces, predictions."""

from gpipe_cli.bench.options import FLAGS, BenchOptions
from gpipe_cli.bench.runner import run

__all__ = ["FLAGS", "BenchOptions", "run"]
