"""Ctrl-C and SIGTERM: finish the current step, write a checkpoint, stop every rank cleanly."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

import torch
import torch.distributed as dist

from gpipe_cli.pipeline import stopping


class StopRequest:
    """Remembers the first stop signal this rank received."""

    def __init__(self, announce: bool) -> None:
        self.signum = 0
        self.announce = announce
        self.parent = os.getppid()  # a rank's parent ending sends it SIGINT (torch's workers ask for it)

    def arm(self) -> None:
        """Take over Ctrl-C and SIGTERM from the set-up's handler (after the first step: before it, nothing to save)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        stopping.started()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        stopping.note(signum)
        if not self.signum:
            self.signum = signum
            if self.announce and signum == signal.SIGINT:  # a person pressed Ctrl-C: answer at once
                what = "the launcher ended (SIGINT)" if os.getppid() != self.parent else "SIGINT"
                again = "" if os.getppid() != self.parent else " (Ctrl-C again to abort at once)"
                stopping.say_stop(f"{what}: stopping after this step{again}")
        elif signum == signal.SIGINT:
            if self.announce:
                print("[gpipe] SIGINT again: aborted at once; a checkpoint it cut short is removed on resume",
                      file=sys.stderr, flush=True)
            os._exit(128 + signum)

    def agreed(self, group: dist.ProcessGroup | None, distributed: bool) -> int:
        """The stop signal any rank received (0: none), the same on every rank."""
        agreed = self.signum
        if distributed:
            flag = torch.tensor([self.signum], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            agreed = int(flag.item())
            self.signum = self.signum or agreed
        if agreed and self.announce:
            why = "the output was closed (SIGPIPE)" if agreed == signal.SIGPIPE else signal.Signals(agreed).name
            print(f"[gpipe] {why}: writing a checkpoint, then stopping", file=sys.stderr, flush=True)
        return agreed
