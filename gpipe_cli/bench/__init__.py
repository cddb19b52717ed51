"""`gpipe bench`: training throughput at K stages and M micro-batches against K=1, baselines, traces, predictions."""

from gpipe_cli.bench.options import CUTS, FLAGS, BenchOptions, bench_options, validate

__all__ = ['CUTS', 'FLAGS', 'BenchOptions', 'bench_options', "run"]


def run(options: BenchOptions) -> int:
    """Run `gpipe bench`; its flags are checked before torch and the engine load, so a mistake is said at once."""
    validate(options)
    from gpipe_cli.bench.runner import run as measure  # torch and the engine: only for flags that are good

    return measure(options)
