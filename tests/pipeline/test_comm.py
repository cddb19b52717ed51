import pytest
import torch

from gpipe_cli.pipeline.comm import Inbound, Outbound, Transport
from gpipe_cli.pipeline.fabric import BACKWARD, FORWARD, Link
from gpipe_cli.pipeline.wire import CommError, TensorMeta, decode, encode, meta_of, pack, unpack
from tests.pipeline import loopback


def metas(tensors, differentiable=False):
    return [meta_of(t, differentiable) for t in tensors]


def test_header_roundtrip_with_absent_and_integer_tensors():
    x = torch.zeros(3, 5, 7)
    mask = torch.ones(3, 5, dtype=torch.bool)
    header = decode(encode(4, 8, 120, metas([x, None, mask], differentiable=True), bare=False, ahead=96))
    assert (header.microbatch, header.chunks, header.offset, header.bare, header.ahead) == (4, 8, 120, False, 96)
    assert header.tensors == (TensorMeta(torch.float32, (3, 5, 7), True), None,
                              TensorMeta(torch.bool, (3, 5), False))


def test_gradients_are_not_marked_differentiable():
    header = decode(encode(0, 1, 0, metas([torch.zeros(2)]), bare=True))
    assert header.bare and header.tensors[0].requires_grad is False


def test_scalar_and_bfloat16():
    header = decode(encode(0, 1, 0, metas([torch.zeros((), dtype=torch.bfloat16)]), bare=True))
    assert header.tensors[0] == TensorMeta(torch.bfloat16, (), False)


def test_corrupt_header_is_detected():
    with pytest.raises(CommError, match="out of step"):
        decode(torch.zeros(64, dtype=torch.int64))


def test_too_many_tensors_for_the_header():
    with pytest.raises(CommError, match="too many"):
        encode(0, 1, 0, metas([torch.zeros(1, 2, 3, 4, 5, 6)] * 8))


def test_every_dtype_travels_as_aligned_bytes_in_one_buffer_padded_to_what_was_posted_ahead():
    tensors = [torch.arange(7, dtype=torch.int16), None, torch.tensor([True, False, True]),
               torch.randn(3, 2, dtype=torch.bfloat16), torch.randn(5, dtype=torch.float64)]
    header = decode(encode(0, 1, 0, metas(tensors)))
    buffer = pack(tensors, header.payload + 100, torch.device("cpu"))
    assert buffer.numel() == header.payload + 100 and header.payload % 1 == 0
    out = unpack(buffer, header)
    assert out[1] is None
    for sent, got in zip(tensors, out):
        if sent is not None:
            assert got.dtype == sent.dtype and torch.equal(got, sent)
            assert got.data_ptr() % 8 == 0


class _Work:
    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


class _Fabric:
    """Sends that complete when told (`done`); records which works a wait was for."""

    data_device = torch.device("cpu")

    def __init__(self) -> None:
        self.done, self.waited = False, []

    def send_header(self, link, header):
        return _Work(self.done)

    def send(self, link, payload):
        return _Work(self.done)

    def wait(self, work, data, timeout):
        self.waited.append(work)


def test_a_flush_waits_for_every_send_not_yet_complete_even_behind_a_completed_one():
    fabric = _Fabric()
    out = Outbound(Transport(torch.device("cpu"), fabric), Link(0, 1, FORWARD))
    out.send(0, 2, 0, [torch.ones(4)])  # still on its way
    fabric.done = True
    out.send(1, 2, 0, [torch.ones(4)])  # left at once
    fabric.waited.clear()
    out.flush()
    assert any(not w.done for w in fabric.waited), "the first message's buffer was let go before it left"


def test_a_message_arrives_in_the_dtype_it_was_sent_in():
    # bf16 activations (autocast) and their gradients cross as bf16: upcast on arrival, a stage would store
    # twice the bytes for its boundary inputs and send fp32 gradients back.
    world = loopback.World(2, "cpu")
    link = Link(0, 1, FORWARD)
    sender = Outbound(Transport(world.device, loopback.LoopbackFabric(world, 0)), link)
    receiver = Inbound(Transport(world.device, loopback.LoopbackFabric(world, 1)), link)
    for end in (sender, receiver):
        end.begin_step(True)
    sent = [torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(2, dtype=torch.float16),
            torch.arange(5, dtype=torch.int64)]
    receiver.expect(1)
    sender.send(7, 1, 0, sent, differentiable=True)
    header, got = receiver.take(7)
    for s, g in zip(sent, got):
        assert g.dtype == s.dtype and torch.equal(g.detach(), s)
        assert g.requires_grad == s.is_floating_point()


def test_the_nccl_fabric_gives_every_communicator_the_runs_timeout_and_waits_for_data_on_the_stream(monkeypatch):
    # No CI machine has two GPUs: torch.distributed stood in for, this is what the NCCL branch asks of it.
    import datetime

    from gpipe_cli.pipeline import fabric as fabrics

    opened: list[tuple[list[int] | None, dict]] = []

    class Posted:
        def __init__(self, *post: object) -> None:
            self.post, self.waits = post, []

        def wait(self, *timeout: object) -> None:
            self.waits.append(timeout)

    monkeypatch.setattr(fabrics.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(fabrics.dist, "new_group", lambda ranks=None, **kw: opened.append((ranks, kw)) or len(opened))
    monkeypatch.setattr(fabrics.dist, "isend", lambda t, dst, group=None, tag=0: Posted("send", t.device, dst, group))
    monkeypatch.setattr(fabrics.dist, "irecv", lambda t, src, group=None, tag=0: Posted("recv", t.device, src, group))
    bound = datetime.timedelta(seconds=42)
    gpu = torch.device("meta")  # stands in for the rank's GPU: memory the host cannot read
    fabric = fabrics.TorchFabric(gpu, nccl=True, control="control", timeout=bound)
    ahead, back = fabrics.Link(0, 1, fabrics.FORWARD), fabrics.Link(1, 0, fabrics.BACKWARD)
    fabric.open([ahead, back], [(0, 1), (0,)])
    # Left out, NCCL's default held links 10 minutes and the host-and-device groups 30.
    assert opened == [([0, 1], {"backend": "nccl", "timeout": bound}), ([0, 1], {"backend": "nccl", "timeout": bound}),
                      ([0, 1], {"timeout": bound})]
    assert fabric.data_device == gpu
    with pytest.raises(CommError, match="cpu tensor reached the data plane"):
        fabric.send(ahead, torch.zeros(4, dtype=torch.uint8))
    sent = fabric.send(ahead, torch.zeros(4, dtype=torch.uint8, device=gpu))
    received = fabric.recv(back, torch.empty(4, dtype=torch.uint8, device=gpu))
    assert sent.post == ("send", gpu, 1, 1) and received.post == ("recv", gpu, 1, 2)
    fabric.wait(sent, True, 5.0)  # the compute stream waits; the host does not, so no host timeout
    header = fabric.send_header(ahead, torch.zeros(8, dtype=torch.int64))
    fabric.wait(header, False, 5.0)
    assert sent.waits == [()] and header.waits == [(datetime.timedelta(seconds=5),)]
    assert header.post == ("send", torch.device("cpu"), 1, "control")
    gloo = fabrics.TorchFabric(torch.device("cpu"), nccl=False, control=None, timeout=bound)
    gloo.open([ahead], [])
    assert opened[-1] == ([0, 1], {"backend": "gloo", "timeout": bound}) and gloo.data_device == torch.device("cpu")


def test_a_messages_micro_batch_is_said_as_users_count_them():
    # A stall said "gradients of micro-batch 6" at M=4: its number on the channel (micro-batch x chunks + chunk).
    transport = Transport(torch.device("cpu"), fabric=object())  # type: ignore[arg-type]
    assert Inbound(transport, Link(0, 1, FORWARD), chunks=2).which(7) == "micro-batch 4 (chunk 1)"
    assert Outbound(transport, Link(1, 0, BACKWARD)).which(0) == "micro-batch 1"
