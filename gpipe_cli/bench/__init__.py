"""`gpipe bench`: training throughput at K stages and M micro-batches against K=1, baselines, traces, predictions."""

from typing import Any

from gpipe_cli.bench.options import FLAGS, BenchOptions

__all__ = ['FLAGS', 'BenchOptions', "run"]


def __getattr__(name: str) -> Any:
    # `run` pulls in torch and the engine; the CLI's help only needs the options.
    if name == "run":
        from gpipe_cli.bench.runner import run

        return run
    raise AttributeError(name)
