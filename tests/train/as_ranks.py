"""`gpipe train` run as under torchrun, each rank forked from the suite's preloaded server: no torch import per rank."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpipe_cli.launch import forked
from tests.multiproc import run_ranks


@dataclass
class Ranks:
    """How `gpipe train` ended on each rank, and what they all printed (a launcher passes on every rank's output)."""

    codes: list[int | None]
    stdout: str
    stderr: str

    @property
    def code(self) -> int | None:
        """The job's exit code as the launcher gives it: the first rank's that is not 0, else 0."""
        return next((c for c in self.codes if c != 0), 0)

    @property
    def output(self) -> str:
        """Everything the ranks printed, stdout then stderr."""
        return self.stdout + self.stderr


def _train(args: list[str], env: dict[str, str], errors: str, before: Callable[[], None] | None) -> int:
    os.environ.update(env)
    if before is not None:
        before()
    # stdout goes to the rank's log (tests.multiproc); stderr apart, as the tests read them. The same file object
    # on fd 2: a second one would close the fd when either is collected.
    sys.stderr.flush()
    os.dup2(os.open(os.path.join(errors, f"{os.environ['RANK']}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    from gpipe_cli.cli import run

    try:
        return run(["train", *args, "--plain"])
    except SystemExit as end:
        return end.code if isinstance(end.code, int) else 1


# `before`: a module-level function each rank calls first (a test's stand-in for part of the product).
def gpipe_train(world: int, *args: str, env: dict[str, str] | None = None, timeout: float = 300.0,
                before: Callable[[], None] | None = None) -> Ranks:
    """`gpipe train *args --plain` on `world` ranks (the recipe's K x D) started as torchrun would; wait for all."""
    with tempfile.TemporaryDirectory() as errors:
        outcomes = run_ranks(_train, world, list(args), env or {}, errors, before, timeout=timeout)
        codes = [o.result if o.exitcode == 0 else o.exitcode for o in outcomes]
        err = "".join(p.read_text() for r in range(world) if (p := Path(errors, f"{r}.err")).exists())
        return Ranks(codes, "".join(o.output for o in outcomes), err)


def ranks_of(launcher: int) -> dict[int, int]:
    """rank -> pid of the ranks a launcher started (forked by its fork server, each named "gpipe rank N")."""
    table = forked.processes()
    near = {launcher} | {pid for pid, (parent, _) in table.items() if parent == launcher}
    found = {}
    for pid, (parent, _) in table.items():
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip() if parent in near else ""
        except OSError:
            continue
        if name.startswith("gpipe rank "):
            found[int(name.split()[-1])] = pid
    return found
