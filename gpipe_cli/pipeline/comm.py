"""Point-to-point messages between stages: one protocol for every backend."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpipe_cli.pipeline import heartbeat
from gpipe_cli.pipeline.fabric import STREAM_NAMES, Fabric, Link, Work
from gpipe_cli.pipeline.wire import HEADER_LEN, CommError, Header, decode, encode, layout, meta_of, pack, unpack

__all__ = ["CommError", "Header", "Inbound", "Outbound", "Transport"]


TIMEOUT_S = 600.0  # a receive or collective waits this long at most, under the heartbeat's judgement


@dataclass
class Transport:
    """This rank's device and fabric (None alone), and how long a host may wait for one message."""

    device: torch.device
    fabric: Fabric | None = None
    timeout: float = TIMEOUT_S
    control: Any = None  # the gloo group host-side code shares values through (None: the default group)
    staging: bool = False  # several ranks share one GPU: payloads go through host memory

    @property
    def data_device(self) -> torch.device:
        """Where payloads travel from."""
        return self.fabric.data_device if self.fabric is not None else self.device

    def wait(self, work: Work, data: bool, what: str) -> None:
        """Wait for one operation; a stuck one is named by the heartbeat as `what`."""
        assert self.fabric is not None
        try:
            if data and self.data_device.type == "cuda":
                self.fabric.wait(work, True, self.timeout)
                event = torch.cuda.Event()
                event.record()
                heartbeat.waits.device(event, what)
            else:
                with heartbeat.waits.host(what):
                    self.fabric.wait(work, data, self.timeout)
        except RuntimeError as exc:
            raise CommError(f"{what} failed: {exc}") from exc


class _End:
    """One end of a link, with the payload sizes of its last step of each kind, by which receives are posted ahead."""

    def __init__(self, transport: Transport, link: Link, chunks: int = 1) -> None:
        assert transport.fabric is not None  # a link joins two ranks
        self.transport, self.fabric, self.link = transport, transport.fabric, link
        self.name = STREAM_NAMES[link.stream]
        self.chunks = chunks  # a message's number is its micro-batch times this, plus its receiving chunk
        self._last: dict[bool, list[int]] = {True: [], False: []}
        self._sizes: list[int] = []  # this step's, so far
        self._training: bool | None = None

    def begin_step(self, training: bool = True) -> None:
        """Mark a step boundary (both ends of the link call it, in step)."""
        if self._training is not None:
            self._last[self._training] = self._sizes
        self._sizes, self._training = [], training

    def which(self, number: int) -> str:
        """A message's micro-batch as a user counts them (from 1), and its chunk where a stage runs several."""
        microbatch, chunk = divmod(number, self.chunks)
        return f"micro-batch {microbatch + 1}" + (f" (chunk {chunk})" if self.chunks > 1 else "")

    def _ahead_bytes(self) -> int:
        """The bytes posted ahead for the next message of this step."""
        last = self._last[bool(self._training)]
        return last[len(self._sizes)] if len(self._sizes) < len(last) else 0


class Outbound(_End):
    """Messages from this rank over one link, in schedule order."""

    def __init__(self, transport: Transport, link: Link, chunks: int = 1) -> None:
        super().__init__(transport, link, chunks)
        self._pending: deque[tuple[list[Work], int]] = deque()

    def send(self, microbatch: int, chunks: int, offset: int, tensors: Sequence[torch.Tensor | None],
             bare: bool = False, differentiable: bool = False) -> None:
        """Post a message; returns at once, the operations holding the buffers until they complete."""
        transport, fabric, link = self.transport, self.fabric, self.link
        metas = [meta_of(t, differentiable) for t in tensors]
        size = layout(metas)[1]
        # Part 1: exactly `ahead` bytes (message i's size in the previous step) into the receive posted ahead,
        # padded if smaller; part 2: the rest, received once the header says so.
        ahead = self._ahead_bytes()
        self._sizes.append(size)
        works = [fabric.send_header(link, encode(microbatch, chunks, offset, metas, bare, ahead))]
        if size or ahead:
            buffer = pack(tensors, max(size, ahead), transport.data_device)
            if transport.staging:  # gloo reads host memory: the copies out of the GPU must be done
                torch.cuda.current_stream().synchronize()
            if ahead:
                works.append(fabric.send(link, buffer[:ahead]))
            if size > ahead:
                works.append(fabric.send(link, buffer[ahead:size]))
        self._pending.append((works, microbatch))
        # Completed sends release their buffers now; nothing here waits for a receiver.
        while self._pending and all(w.is_completed() for w in self._pending[0][0]):
            self._pending.popleft()

    def flush(self) -> None:
        """Wait until every posted message has left (on a GPU: the compute stream waits)."""
        while self._pending:
            works, microbatch = self._pending.popleft()
            what = f"sending {self.name} of {self.which(microbatch)} to rank {self.link.dst}"
            for i, work in enumerate(works):
                self.transport.wait(work, data=i > 0, what=what)


_Posted = tuple[Work, torch.Tensor]  # a payload receive posted on a link, and its buffer


class Inbound(_End):
    """Messages arriving over one link, their receives posted ahead of use."""

    window = 4  # header receives posted ahead at most

    def __init__(self, transport: Transport, link: Link, chunks: int = 1) -> None:
        super().__init__(transport, link, chunks)
        self._unposted = 0  # headers expected but not posted yet
        self._expected = 0  # messages expected and not taken yet
        self._headers: deque[tuple[Work, torch.Tensor]] = deque()
        self._ahead: _Posted | None = None

    def begin_step(self, training: bool = True) -> None:
        """Mark a step boundary (both ends of the link call it, in step)."""
        if self._expected or self._ahead is not None:
            raise CommError(f"{self._expected} {self.name} message(s) from rank {self.link.src} were expected and "
                            f"never taken")
        super().begin_step(training)

    def expect(self, count: int) -> None:
        """Receive the next `count` messages."""
        self._expected += count
        self._unposted += count
        self._post()

    def _post(self) -> None:
        fabric = self.fabric
        while self._unposted and len(self._headers) < self.window:
            header = torch.empty(HEADER_LEN, dtype=torch.int64)
            self._headers.append((fabric.recv_header(self.link, header), header))
            self._unposted -= 1
        ahead = self._ahead_bytes()
        if self._expected and self._ahead is None and ahead:
            buffer = self._buffer(ahead)
            self._ahead = fabric.recv(self.link, buffer), buffer

    def _buffer(self, size: int) -> torch.Tensor:
        # Host buffers of ranks sharing a GPU are pinned, so the copy to the device does not block.
        return torch.empty(size, dtype=torch.uint8, device=self.transport.data_device,
                           pin_memory=self.transport.staging)

    def take(self, microbatch: int) -> tuple[Header, list[torch.Tensor | None]]:
        """The next message (which must be for `microbatch`): its header and its tensors on the device."""
        transport = self.transport
        what = f"receiving {self.name} of {self.which(microbatch)} from rank {self.link.src}"
        if not self._headers:
            raise CommError(f"no {self.name} message for {self.which(microbatch)} was expected")
        work, raw = self._headers.popleft()
        transport.wait(work, data=False, what=what)
        header = decode(raw)
        ahead = self._ahead_bytes()
        self._sizes.append(header.payload)
        self._expected -= 1
        if header.ahead != ahead:
            raise CommError(f"{what}: the sender split it for {header.ahead} bytes posted ahead, this rank posted "
                            f"{ahead}: the two ends of the link are out of step")
        if header.microbatch != microbatch:
            raise CommError(f"expected {self.name} of {self.which(microbatch)}, got "
                            f"{self.which(header.microbatch)}: the stages run different schedules")
        # The payload is read from the receive posted ahead, or from a buffer whose tail is part 2.
        first, self._ahead, rest = self._ahead, None, None
        if header.payload <= header.ahead:
            payload = first[1][:header.payload] if first is not None else self._buffer(0)
        else:
            payload = self._buffer(header.payload)
            rest = self.fabric.recv(self.link, payload[header.ahead:])
        self._post()  # the next message's part 1 goes after this one's part 2, as the sender posts them
        if first is not None:
            transport.wait(first[0], data=True, what=what)
            if rest is not None:
                payload[:header.ahead].copy_(first[1], non_blocking=True)
        if rest is not None:
            transport.wait(rest, data=True, what=what)
        return header, [None if t is None or meta is None else
                        t.to(transport.device, non_blocking=True).requires_grad_(meta.requires_grad)
                        for meta, t in zip(header.tensors, unpack(payload, header))]
