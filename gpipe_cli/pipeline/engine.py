"""The engine: this rank's stage, driven through a schedule, one synchronous mini-batch at a time."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpipe_cli.pipeline import device as dev
from gpipe_cli.pipeline import grads, memory, microbatch, partition, stats
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline import step as step_
from gpipe_cli.pipeline import topology as topo_
from gpipe_cli.pipeline.batchnorm import deferred_batchnorms
from gpipe_cli.pipeline.comm import Inbound, Outbound
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.executor import Channels, Executor, Message, feed_messages
from gpipe_cli.pipeline.fabric import BACKWARD, FORWARD, RESULT, Link
from gpipe_cli.pipeline.offload import Offloader, offloaded
from gpipe_cli.pipeline.schedule import Kind
from gpipe_cli.pipeline.stage import Stage, as_tensors, from_tensors
from gpipe_cli.pipeline.tied import tie_parameters
from gpipe_cli.pipeline.topology import Topology

Units = Callable[[torch.Tensor], "torch.Tensor | int | float"]
Metrics = dict[str, Callable[[Any, torch.Tensor], "torch.Tensor | float"]]  # name -> sum over examples
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class EvalResult:
    """What an evaluation pass returns on every rank (outputs only on rank 0, when asked)."""

    loss: float
    units: float
    metrics: dict[str, float] = field(default_factory=dict)
    outputs: Any | None = None


class Pipeline:
    """This rank's stage of a GPipe pipeline: one call of `train_step` trains one mini-batch."""

    def __init__(self, layers: Sequence[nn.Module], topology: Topology, config: PipelineConfig,
                 loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None, *,
                 units: Units | None = None, tied: Sequence[Sequence[str]] = (), precision: str = "fp32") -> None:
        self.topology, self.layout, self.config = topology, topology.layout, config
        if (config.stages, config.replicas) != (self.layout.stages, self.layout.replicas):
            raise ValueError(f"the pipeline has {config.stages} stages x {config.replicas} replicas, the job "
                             f"{self.layout.stages} x {self.layout.replicas}")
        if not config.balance:
            raise ValueError("the pipeline is not cut: its balance is empty")
        self.balance = list(config.balance)
        # The configuration places the chunks; the topology's layout states it for every later reader.
        self.layout = topology.layout = dataclasses.replace(self.layout, virtual=config.virtual,
                                                            placement=config.placement)
        self.ranges = partition.stage_ranges(self.balance)  # one per chunk
        self.layer_indices = partition.stage_layers(self.balance, self.layout.stages, self.layout.stage,
                                                    config.placement)
        if len(layers) != len(self.layer_indices):
            raise ValueError(f"stage {self.layout.stage} needs {len(self.layer_indices)} layers, got {len(layers)}")
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision '{precision}': allowed are {', '.join(PRECISIONS)}")
        self.device = topology.device
        self.module = nn.Sequential(OrderedDict((str(i), layer) for i, layer in zip(self.layer_indices, layers)))
        self.module.to(self.device)
        self.units = units
        self.tied = tuple(tuple(group) for group in tied)  # global names, as a checkpoint of any cut holds them
        self.shared = tie_parameters(self.module, topology, self.ranges, tied)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        # Per trainable parameter: its global layer (to name a non-finite gradient) and whether it counts in
        # the global norm (a tied copy counts on its first holder only).
        self._layer_of = [int(name.split(".", 1)[0]) for name, p in self.module.named_parameters() if p.requires_grad]
        excluded = {id(c.parameter) for c in self.shared if not c.counts_in_norm}
        self._in_norm = [id(p) not in excluded for p in self.params]
        self._per_param: dict[tuple[int, ...], torch.Tensor | None] = {}
        self._zero = torch.zeros((), dtype=torch.float64, device=self.device)  # never written to
        self.batchnorms = deferred_batchnorms(self.module)
        meter = memory.ActivationMeter([*self.module.parameters(), *self.module.buffers()])
        last_chunk = len(self.ranges) - 1
        offloader = Offloader(self.device, meter)
        # One Stage per chunk, over the same layer objects as `self.module` (which names them globally).
        self.stages = {
            c: Stage(nn.Sequential(OrderedDict((str(i), self.module.get_submodule(str(i))) for i in self.ranges[c])),
                     self.device, loss if c == last_chunk else None, meter, PRECISIONS[precision],
                     offloader if config.offload != "none" else None, offloaded(config.offload, c))
            for c in self.layout.chunks}
        self.stage = self.stages[last_chunk if self.layout.is_last else min(self.stages)]  # holds the loss if any
        self.loss_scale = grads.LossScale(precision == "fp16", self.device)
        self.timeline = stats.Timeline(self.layout.stage, self.device)
        self._plans: dict[int, sched.ActionList] = {}
        self._open_channels()

    def _open_channels(self) -> None:
        layout, transport, fabric = self.layout, self.topology.transport, self.topology.fabric
        if fabric is not None:
            fabric.open(topo_.links(layout), [])
        me, last = layout.rank, len(self.ranges) - 1
        # One channel per link, shared by every chunk whose neighbour runs on that rank; a neighbour on
        # this rank (the turn of a V) takes its messages in memory.
        links: dict[Link, Inbound | Outbound] = {}

        def channel(kind: type[Inbound] | type[Outbound], link: Link) -> Any:
            return links.setdefault(link, kind(transport, link, len(self.ranges)))

        self.fwd_in: dict[int, Inbound] = {}
        self.bwd_out: dict[int, Outbound] = {}
        self.fwd_out: dict[int, Outbound] = {}
        self.bwd_in: dict[int, Inbound] = {}
        for c in self.stages:
            prev = layout.rank_of(layout.owner(c - 1)) if c > 0 else me
            nxt = layout.rank_of(layout.owner(c + 1)) if c < last else me
            if prev != me:
                self.fwd_in[c] = channel(Inbound, Link(prev, me, FORWARD))
                self.bwd_out[c] = channel(Outbound, Link(me, prev, BACKWARD))
            if nxt != me:
                self.fwd_out[c] = channel(Outbound, Link(me, nxt, FORWARD))
                self.bwd_in[c] = channel(Inbound, Link(nxt, me, BACKWARD))
        self._channels = list(links.values())
        self._links = Channels(self.fwd_in, self.fwd_out, self.bwd_in, self.bwd_out)
        result_src = layout.rank_of(layout.last_stage, 0)
        self.result_in = (Inbound(transport, Link(result_src, 0, RESULT))
                          if self.topology.distributed and me == 0 and result_src != 0 else None)
        self.result_out = (Outbound(transport, Link(me, 0, RESULT))
                           if layout.is_last and layout.replica == 0 and me != 0 else None)

    def _begin_step(self, training: bool) -> None:
        # Every link's two ends mark step boundaries together: it is how they agree on what is posted ahead.
        for channel in (*self._channels, self.result_in, self.result_out):
            if channel is not None:
                channel.begin_step(training)

    def _expect(self, actions: sched.ActionList, taken: int = 0) -> None:
        """Tell each inbound channel how many messages this pass takes from it (`taken` already from the first)."""
        counts = Counter(id((self.fwd_in if a.kind == Kind.RECV_FWD else self.bwd_in)[a.chunk])
                         for a in actions if a.kind in (Kind.RECV_FWD, Kind.RECV_BWD))
        first = self.fwd_in.get(min(self.stages))
        for inbound in self._channels:
            if isinstance(inbound, Inbound) and id(inbound) in counts:
                inbound.expect(counts[id(inbound)] - (taken if inbound is first else 0))

    def _flush(self) -> None:
        for channel in self._channels:
            if isinstance(channel, Outbound):
                channel.flush()

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        """Host values summed over every rank (each replica's last stage brings its own; others zeros)."""
        fabric = self.topology.fabric
        if fabric is None or self.layout.replicas == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        fabric.host_sum(t)
        return t.tolist()

    def _loss_weights(self, units: list[float], total: float) -> list[float | torch.Tensor]:
        """Each micro-batch's share of the mini-batch's units over every replica, times the fp16 loss scale."""
        fabric, replicas = self.topology.fabric, self.layout.replica_ranks()
        shares: list[float | torch.Tensor]
        if fabric is None or len(replicas) < 2:
            # No units anywhere: NaN shares skip the step, and its result says why (as with replicas).
            shares = [u / total if total > 0 else math.nan for u in units]
            return [self.loss_scale.value * s for s in shares] if self.loss_scale.enabled else shares
        # Summed on the device by the replicas' last stages alone: no rank's host waits for another's at the step's
        # start. Divided in float64, as the host divides (stage.weighted rounds them as it would a number).
        summed = torch.full((), total, dtype=torch.float64, device=self.device)
        fabric.all_reduce(summed, replicas)
        weights = dev.to_device(torch.tensor(units, dtype=torch.float64), self.device).div_(summed)
        if self.loss_scale.enabled:
            weights = weights.float() * self.loss_scale.value  # as the scale times a number
        return list(weights.unbind())

    def _count_units(self, target: torch.Tensor) -> float:
        return float(self.units(target)) if self.units is not None else float(target.shape[0])

    def parameters(self) -> list[nn.Parameter]:
        """This stage's trainable parameters, each once (for the optimizer)."""
        return self.params

    def zero_grad(self) -> None:
        """Drop the gradients of this stage."""
        for p in self.params:
            p.grad = None

    def train_step(self, inputs: Any = None, targets: torch.Tensor | None = None, **options: Any) -> step_.StepResult:
        """`launch_step`, then read its figures at once (for callers that want them now)."""
        return self.launch_step(inputs, targets, **options).result()

    # The first stage gives `inputs`, the last `targets`; `example_offset` is the global index of this replica's
    # first example (split-invariant dropout); `optimizer` steps unless some stage's loss or gradient is not
    # finite; `measure_memory` counts every stored activation, at a Python call per saved tensor.
    def launch_step(self, inputs: Any = None, targets: torch.Tensor | None = None, *, step: int,
                    microbatches: int | None = None, example_offset: int = 0, max_grad_norm: float | None = None,
                    trace: bool = False, optimizer: torch.optim.Optimizer | None = None,
                    measure_memory: bool = True) -> step_.PendingStep:
        """Forward and backward M micro-batches of one mini-batch, then update; the host never waits for the device."""
        layout, config, chunks = self.layout, self.config, microbatches or self.config.microbatches
        if chunks not in self._plans:
            self._plans[chunks] = sched.build(config.schedule, layout.stage, layout.stages, chunks, config.checkpoint,
                                              config.virtual)
        actions = self._plans[chunks]
        if not self.module.training:  # evaluation restores the mode it found: no need to visit every module
            self.module.train()
        for stage in self.stages.values():
            stage.step = step
        meter = self.stage.meter
        meter.enabled = measure_memory
        meter.reset_peak()
        memory.reset_cuda_peak(self.device)
        self.timeline.start()

        feed: list[Message] = []
        if layout.is_first:
            if inputs is None:
                raise ValueError("the first stage needs the inputs of the mini-batch")
            feed = feed_messages(inputs, chunks, self.device, example_offset)
        targets_mb: list[torch.Tensor] = []
        weights: list[float | torch.Tensor] = []
        examples = units_total = 0.0
        if layout.is_last:
            if targets is None:
                raise ValueError("the last stage needs the targets of the mini-batch")
            targets_mb = microbatch.scatter(targets, chunks)
            units = [self._count_units(t) for t in targets_mb]
            examples, units_total = float(targets.shape[0]), sum(units)
            weights = self._loss_weights(units, units_total)
            targets_mb = microbatch.scatter(dev.to_device(targets, self.device), chunks)  # one copy, M views

        self._begin_step(True)
        self._expect(actions)

        run = Executor(self.stages, self._links, len(self.ranges), chunks, True, timeline=self.timeline, feed=feed,
                       targets=targets_mb, weights=weights)
        run.run(actions)
        with self.timeline.span(stats.COMM):
            self._flush()
        in_flight = sum(stage.in_flight for stage in self.stages.values())
        if in_flight:
            raise RuntimeError(f"the {config.schedule} schedule left {in_flight} micro-batches of "
                               f"stage {layout.stage} without a backward")

        loss = torch.stack(run.losses).sum().to(torch.float64) if run.losses else self._zero
        if self.loss_scale.enabled:
            loss = loss / self.loss_scale.value
        norm, bad, found, positions = self._finish_gradients(max_grad_norm, loss)
        finite = (bad == 0) & norm.isfinite() if optimizer is not None or self.loss_scale.enabled else None
        if finite is not None and self.loss_scale.enabled:
            self.loss_scale.update(bad + (~finite).to(bad.dtype))
        figures = step_.figures(loss, norm, bad, self.loss_scale.value, found)  # the scale after this step's update
        copy = dev.HostCopy(figures)  # queued now; read after the step's last marker, with one wait
        if optimizer is not None and finite is not None and step_.fused(optimizer):
            with self.timeline.span(stats.OPTIMIZER):
                optimizer.found_inf = (~finite).to(torch.float32)  # type: ignore[attr-defined]
                optimizer.grad_scale = None  # type: ignore[attr-defined]
                optimizer.step()
                del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]
        elif optimizer is not None and step_.finite(copy.read().tolist()):  # the one wait: it decides the update
            with self.timeline.span(stats.OPTIMIZER):
                optimizer.step()
        times = self.timeline.finish()
        peaks = stats.StageStats(layout.stage, layout.replica, 0.0, 0.0, meter.peak if measure_memory else -1,
                                 memory.peak_rss_bytes(), memory.cuda_peak_bytes(self.device),
                                 offloaded_peak=meter.host_peak if measure_memory else -1)
        return step_.PendingStep(
            layout, self.topology.fabric, times, copy, examples, units_total, peaks,
            sched.theoretical_bubble(layout.stages, chunks, config.schedule, config.virtual), trace,
            functools.partial(self.last_bad_layer, positions), self.loss_scale.enabled)

    # Returns the global norm, the non-finite loss count over all ranks, and this stage's per-parameter gradient
    # norms with their parameters' positions.
    def _finish_gradients(self, max_grad_norm: float | None, loss: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
        """Sum over replicas and shared copies, unscale, take the global norm and clip; all on the device."""
        layout, fabric, zero = self.layout, self.topology.fabric, self._zero
        with self.timeline.span(stats.COMM):
            flag = (~loss.isfinite()).to(torch.float64) if layout.is_last else zero
            bad = grads.all_reduce_replicas(self.params, fabric, layout.replica_ranks(), flag)
        if self.shared:  # timed on the holders alone: the shortest holder's time there is the transfer
            with self.timeline.span(stats.SHARED):
                grads.sum_shared(self.shared, fabric)
        if self.loss_scale.enabled:
            grads.scale_(self.params, self.loss_scale.value.reciprocal())
        found, positions = grads.norms(self.params)
        squares = zero
        if found is not None:
            counted = self._counted(positions)
            squares = found.dot(found) if counted is None else found.square().mul(counted).sum()
        # The norm's collective waits for the slowest stage to finish its backward: that is the bubble.
        with self.timeline.span(stats.WAIT):
            norm, bad = grads.global_norm(squares, bad, fabric, layout.pipeline_ranks())
        if max_grad_norm is not None:
            grads.clip_(self.params, norm, max_grad_norm)
        with self.timeline.span(stats.COMM):
            grads.commit_batchnorms(self.batchnorms, fabric, layout.replica_ranks(), (bad == 0) & norm.isfinite())
        return norm, bad, found, positions

    def _counted(self, positions: tuple[int, ...]) -> torch.Tensor | None:
        """Which of the parameters at `positions` count in the global norm (None: all of them)."""
        # Made once per set of parameters with a gradient (the same every step), so no step copies it.
        if positions not in self._per_param:
            mask = [float(self._in_norm[i]) for i in positions]
            self._per_param[positions] = (None if all(mask) else
                                          torch.tensor(mask, dtype=torch.float64, device=self.device))
        return self._per_param[positions]

    def last_bad_layer(self, positions: tuple[int, ...], norms: Sequence[float]) -> int:
        """The global index of the highest layer (the first in backward order) whose gradient is not finite."""
        bad = [self._layer_of[i] for i, value in zip(positions, norms) if not math.isfinite(value)]
        return max(bad, default=-1)

    def evaluate(self, inputs: Any = None, targets: torch.Tensor | None = None, *, microbatches: int | None = None,
                 metrics: Metrics | None = None, return_outputs: bool = False) -> EvalResult:
        """A no-grad forward of one batch; loss and metric sums over all replicas, outputs on rank 0."""
        layout = self.layout
        was_training = self.module.training
        self.module.eval()
        self._begin_step(False)
        try:
            received: dict[int, Message] = {}  # messages already taken (keyed as the executor's)
            if layout.is_first:
                chunks = min(microbatches or self.config.microbatches, microbatch.batch_size(inputs))
            else:  # the other stages learn it from their first message
                first = min(self.stages)  # this rank's first chunk; its micro-batch 0 has key `first`
                self.fwd_in[first].expect(1)
                header, tensors = self.fwd_in[first].take(first)
                chunks, received = header.chunks, {first: (tensors, header.bare, header.offset)}
            actions = sched.forward_only(layout.stage, layout.stages, chunks, self.config.virtual,
                                         layout.placement) if chunks else []
            self._expect(actions, len(received))
            feed = feed_messages(inputs, chunks, self.device) if layout.is_first and chunks else []
            targets_mb = microbatch.scatter(targets, chunks) if layout.is_last and chunks and targets is not None \
                else []
            sums: dict[str, Any] = dict.fromkeys(["loss", *sorted(metrics or {})], 0.0)  # the same order on every rank
            units_sum = 0.0
            outputs: list[Any] = []

            def on_output(mb: int, out: Any) -> None:
                nonlocal units_sum
                if targets_mb:
                    target = dev.to_device(targets_mb[mb], self.device)
                    n = self._count_units(targets_mb[mb])
                    assert self.stage.loss is not None
                    sums["loss"] = sums["loss"] + self.stage.loss(out, target).double() * n
                    units_sum += n
                    for key, metric in (metrics or {}).items():
                        sums[key] = sums[key] + metric(out, target)
                if return_outputs:
                    outputs.append(out.detach() if isinstance(out, torch.Tensor) else out)

            first = min(self.stages)
            # An empty shard: tell the next chunk's stage, if that chunk is the first it runs (chunks below K
            # are each stage's first, in either placement), for it learns M from that message.
            if chunks == 0 and first in self.fwd_out and first + 1 < layout.stages:
                self.fwd_out[first].send(first + 1, 0, 0, [])
            if chunks:
                Executor(self.stages, self._links, len(self.ranges), chunks, False, feed=feed, on_output=on_output,
                         received=received).run(actions)
            self._flush()
            # One read of the device's sums for the whole batch, then their totals over every rank.
            host = [0.0] * len(sums)
            if layout.is_last:
                host = dev.HostCopy(torch.stack([torch.as_tensor(s, device=self.device).to(torch.float64)
                                                 for s in sums.values()])).read().tolist()
            units_sum, *totals = self._sum_over_ranks([units_sum, *host])
            metric_sums = dict(zip(sums, totals))
            loss_sum = metric_sums.pop("loss")
            result = EvalResult(loss=loss_sum / units_sum if units_sum else float("nan"), units=units_sum,
                                metrics=metric_sums)
            gathered = microbatch.gather(outputs) if return_outputs and outputs else None
            fabric = self.topology.fabric
            if fabric is not None:
                result = fabric.share(result, layout.rank_of(layout.last_stage, 0))
                if return_outputs and self.result_out is not None and gathered is not None:
                    self.result_out.send(0, 1, 0, *as_tensors(gathered))
                    self.result_out.flush()
                if return_outputs and self.result_in is not None:
                    self.result_in.expect(1)
                    header, tensors = self.result_in.take(0)
                    gathered = from_tensors(tensors, header.bare)
            if return_outputs and layout.rank == 0:
                result.outputs = gathered
            return result
        finally:
            self.module.train(was_training)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers, keyed by global layer index ("<layer>.<name>")."""
        return self.module.state_dict(keep_vars=False)

    def close(self) -> None:
        """Nothing to stop: receiving needs no thread of its own."""
