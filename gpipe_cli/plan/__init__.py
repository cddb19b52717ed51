"""`gpipe plan`: the fastest K, D, M, schedule, remat mode and balance for N devices, predicted."""

from typing import Any

from gpipe_cli.plan.options import FLAGS, PlanOptions

__all__ = ["FLAGS", "PlanOptions", "run"]


def __getattr__(name: str) -> Any:
    # `run` pulls in torch and the engine; the CLI's help only needs the options.
    if name == "run":
        from gpipe_cli.plan.runner import run

        return run
    raise AttributeError(name)
