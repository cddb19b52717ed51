"""Ctrl-C and SIGTERM: finish the current step, write a checkpoint, stop every rank cleanly.

The first SIGINT or SIGTERM asks for a stop; the ranks agree on it after each step (one tiny
all-reduce), so they all stop after the same step. A second Ctrl-C aborts at once.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

import torch
import torch.distributed as dist


class StopRequest:
    """Remembers the first stop signal this rank received."""

    def __init__(self, announce: bool) -> None:
        self.signum = 0
        self.announce = announce
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum:
            self.signum = signum
            if self.announce:
                print(f"\n[gpipe] {signal.Signals(signum).name}: stopping after this step and writing a checkpoint "
                      f"(Ctrl-C again to abort at once)", file=sys.stderr, flush=True)
        elif signum == signal.SIGINT:
            os._exit(128 + signum)

    def agreed(self, group: dist.ProcessGroup | None, distributed: bool) -> int:
        """The stop signal any rank received (0: none), the same on every rank."""
        if not distributed:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        self.signum = self.signum or int(flag.item())
        return int(flag.item())
