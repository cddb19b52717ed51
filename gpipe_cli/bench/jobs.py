"""Start benchmark ranks with the launcher and read back what rank 0 wrote."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpipe_cli.bench.job import Job
from gpipe_cli.launch.launcher import LaunchOptions, launch

WORKER = "gpipe_cli.bench.worker"


class JobFailed(RuntimeError):
    """A benchmark job whose ranks did not all finish; the failing rank has printed why."""

    def __init__(self, code: int, partial: dict[str, Any]) -> None:
        super().__init__(f"benchmark ranks exited with code {code}")
        self.code, self.partial = code, partial


def run(job: Job, folder: Path, name: str, threads: int) -> dict[str, Any]:
    """Run `job` on `job.stages` ranks; rank 0's figures (raises JobFailed with what was written)."""
    out = folder / f"{name}.out.json"
    job = replace(job, out=str(out))
    path = folder / f"{name}.job.json"
    job.write(path)
    code = launch(WORKER, [str(path)], job.stages, LaunchOptions(threads=threads))
    result = json.loads(out.read_text()) if out.exists() else {}
    if code != 0:
        raise JobFailed(code, result)
    return result
