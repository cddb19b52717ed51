"""`gpipe train` as torchrun's ranks run it, forked from the suite's preloaded rank server: no launcher, no imports."""

from __future__ import annotations

from tests.multiproc import RankOutcome, run_ranks


def _command(args: list[str]) -> int:
    from gpipe_cli.cli import run

    return run(args)


def gpipe_ranks(args: list[str], world: int = 1, timeout: float = 600) -> tuple[int, str]:
    """Run `gpipe ARGS` on `world` ranks with torchrun's environment: the worst exit code and every rank's output."""
    outcomes: list[RankOutcome] = run_ranks(_command, world, args, timeout=timeout)
    codes = [o.result if o.exitcode == 0 else (o.exitcode or 1) for o in outcomes]
    return max(codes, key=lambda code: code != 0), "".join(o.output for o in outcomes)
