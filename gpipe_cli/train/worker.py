"""Entry point of every training rank: `python -m gpipe_cli.train.worker JOB.json` (started by the launcher).

The stop handler goes in before torch is imported: a Ctrl-C while a rank imports or sets up ends it
quietly (see `pipeline/stopping.py`), not with a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gpipe_cli.pipeline import stopping
from gpipe_cli.quick_exit import exit_now

STARTED = "training"  # beside the job file: created once a rank of this node has a step to finish


def main(argv: list[str] | None = None) -> None:
    """Read the job file named on the command line and run it."""
    path = Path((sys.argv[1:] if argv is None else argv)[0])
    try:
        stopping.until_started(announce=False)  # through the imports; the launcher tells a stop in set-up
        from gpipe_cli.train.job import Job
        from gpipe_cli.train.rank import run_job

        code = run_job(Job(**json.loads(path.read_text())), path.parent / STARTED, announce=False)
    except stopping.StoppedEarly as stop:
        code = 128 + stop.signum
    exit_now(code)


if __name__ == "__main__":
    main()
