"""The engine: this rank's stage, driven through a schedule, one synchronous mini-batch at a time."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpipe_cli.pipeline import grads, memory, microbatch, partition, stats
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline.batchnorm import deferred_batchnorms
from gpipe_cli.pipeline.comm import BACKWARD, FORWARD, RESULT, Inbound, Outbound
from gpipe_cli.pipeline.executor import Channels, Executor, Message
from gpipe_cli.pipeline.schedule import Kind
from gpipe_cli.pipeline.stage import Stage, as_tensors
from gpipe_cli.pipeline.tied import tie_parameters
from gpipe_cli.pipeline.topology import Topology

Units = Callable[[torch.Tensor], "torch.Tensor | int | float"]
Metrics = dict[str, Callable[[Any, torch.Tensor], "torch.Tensor | float"]]  # name -> sum over examples
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepResult:
    """What one training step returns on every rank."""

    loss: float | None            # the mini-batch's mean loss (last stages and rank 0)
    grad_norm: float              # global gradient norm before clipping
    skipped: bool                 # a non-finite loss or gradient on some stage: the update was not applied
    stats: stats.StepStats | None  # every stage's figures, on rank 0


@dataclass
class EvalResult:
    """What an evaluation pass returns on every rank (outputs only on rank 0, when asked)."""

    loss: float
    units: float
    metrics: dict[str, float] = field(default_factory=dict)
    outputs: Any | None = None


class Pipeline:
    """This rank's stage of a GPipe pipeline: one call of `train_step` trains one mini-batch."""

    def __init__(self, layers: Sequence[nn.Module], topology: Topology, balance: Sequence[int],
                 loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None, *,
                 units: Units | None = None, schedule: str = "gpipe", checkpoint: str = "except_last",
                 tied: Sequence[Sequence[str]] = (), precision: str = "fp32", virtual_stages: int = 1) -> None:
        self.topology, self.layout = topology, topology.layout
        self.balance, self.virtual = list(balance), virtual_stages
        stages = self.layout.stages
        if len(self.balance) != stages * virtual_stages:
            raise ValueError(f"balance {self.balance} has {len(self.balance)} entries, the job has {stages} stages "
                             f"x {virtual_stages} virtual stages")
        sched.check(schedule, stages, stages, virtual_stages)  # M is checked when a step's list is built
        self.ranges = partition.stage_ranges(self.balance)  # one per chunk
        self.layer_indices = partition.stage_layers(self.balance, stages, self.layout.stage)
        if len(layers) != len(self.layer_indices):
            raise ValueError(f"stage {self.layout.stage} needs {len(self.layer_indices)} layers, got {len(layers)}")
        if checkpoint not in sched.REMAT_MODES:
            raise ValueError(f"unknown checkpoint mode '{checkpoint}': allowed are {', '.join(sched.REMAT_MODES)}")
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision '{precision}': allowed are {', '.join(PRECISIONS)}")
        self.schedule_name, self.checkpoint = schedule, checkpoint
        self.device = topology.device
        self.module = nn.Sequential(OrderedDict((str(i), layer) for i, layer in zip(self.layer_indices, layers)))
        self.module.to(self.device)
        self.units = units
        self.staging = topology.transport.staging
        self.shared = tie_parameters(self.module, topology, self.ranges, tied)
        self._norm_exclude = {id(c.parameter) for c in self.shared if not c.counts_in_norm}
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.batchnorms = deferred_batchnorms(self.module)
        meter = memory.ActivationMeter([*self.module.parameters(), *self.module.buffers()])
        last_chunk = len(self.ranges) - 1
        # One Stage per chunk, over the same layer objects as `self.module` (which names them globally).
        self.stages = {
            c: Stage(nn.Sequential(OrderedDict((str(i), self.module.get_submodule(str(i))) for i in self.ranges[c])),
                     self.device, loss if c == last_chunk else None, meter, PRECISIONS[precision])
            for c in range(self.layout.stage, len(self.ranges), stages)}
        self.stage = self.stages[last_chunk if self.layout.is_last else self.layout.stage]  # holds the loss if any
        self.loss_scale = grads.LossScale(precision == "fp16")
        self.timeline = stats.Timeline(self.layout.stage, self.device)
        self._plans: dict[int, sched.Schedule] = {}
        self._open_channels()

    # ----------------------------------------------------------------- set-up

    def _open_channels(self) -> None:
        layout, transport = self.layout, self.topology.transport
        # With V > 1 the chunks form a ring: the last stage's chunks feed the first stage's next ones.
        ring = self.virtual > 1
        prev = layout.rank_of((layout.stage - 1) % layout.stages) if ring or not layout.is_first else None
        nxt = layout.rank_of((layout.stage + 1) % layout.stages) if ring or not layout.is_last else None
        self.fwd_in = Inbound(transport, prev, FORWARD, "activations") if prev is not None else None
        self.bwd_out = Outbound(transport, prev, BACKWARD) if prev is not None else None
        self.fwd_out = Outbound(transport, nxt, FORWARD) if nxt is not None else None
        self.bwd_in = Inbound(transport, nxt, BACKWARD, "gradients") if nxt is not None else None
        result_src = layout.rank_of(layout.stages - 1, 0)
        self.result_in = (Inbound(transport, result_src, RESULT, "outputs")
                          if self.topology.distributed and layout.rank == 0 and result_src != 0 else None)
        self.result_out = (Outbound(transport, 0, RESULT)
                           if layout.is_last and layout.replica == 0 and layout.rank != 0 else None)

    def _begin_step(self) -> None:
        # Every channel's two ends mark step boundaries together: it is how they agree on buffer sizes.
        for channel in (self.fwd_in, self.bwd_in, self.fwd_out, self.bwd_out, self.result_in, self.result_out):
            if channel is not None:
                channel.begin_step()

    def _plan(self, chunks: int) -> sched.Schedule:
        if chunks not in self._plans:
            self._plans[chunks] = sched.build(self.schedule_name, self.layout.stage, self.layout.stages, chunks,
                                              self.checkpoint, self.virtual)
        return self._plans[chunks]

    def _executor(self, chunks: int, training: bool, **state: Any) -> Executor:
        channels = Channels(self.fwd_in, self.fwd_out, self.bwd_in, self.bwd_out)
        return Executor(self.stages, channels, len(self.ranges), chunks, training, **state)

    # ----------------------------------------------------------------- helpers

    def _to_device(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        return tuple(self._to_device(b) for b in batch)

    def _feed(self, inputs: Any, chunks: int, example_offset: int = 0) -> list[Message]:
        """The first stage's micro-batches as messages: tensors, bareness and global example offset."""
        offsets = microbatch.offsets(microbatch.sizes(microbatch.batch_size(inputs), chunks), example_offset)
        return [(*as_tensors(mb), off) for mb, off in zip(microbatch.scatter(self._to_device(inputs), chunks), offsets)]

    def _sum_over_last_stages(self, values: list[float]) -> list[float]:
        group = self.topology.last_stages_group
        if group is None:
            return values
        t = torch.tensor(values, dtype=torch.float64,
                         device="cpu" if self.staging or self.device.type == "cpu" else self.device)
        dist.all_reduce(t, group=group)
        return t.tolist()

    def _count_units(self, target: torch.Tensor) -> float:
        return float(self.units(target)) if self.units is not None else float(target.shape[0])

    def parameters(self) -> list[nn.Parameter]:
        """This stage's trainable parameters, each once (for the optimizer)."""
        return self.params

    def zero_grad(self) -> None:
        """Drop the gradients of this stage."""
        for p in self.params:
            p.grad = None

    # ----------------------------------------------------------------- training

    def train_step(self, inputs: Any = None, targets: torch.Tensor | None = None, *, microbatches: int,
                   step: int, example_offset: int = 0, max_grad_norm: float | None = None,
                   trace: bool = False, update: Callable[[], None] | None = None) -> StepResult:
        """Forward and backward one mini-batch as M micro-batches; leave the summed gradients in place.

        The first stage gives `inputs`, the last stage `targets` (a single stage gives both).
        `example_offset` is the global index of this replica's first example (split-invariant dropout).
        `update` (the optimizer step) runs, timed, once the gradients are ready, unless some stage's loss
        or gradient is not finite.
        """
        layout, chunks = self.layout, microbatches
        actions = self._plan(chunks)
        self.module.train()
        for stage in self.stages.values():
            stage.step = step
        self.stage.meter.reset_peak()
        memory.reset_cuda_peak(self.device)
        self.timeline.start()

        feed: list[Message] = []
        if layout.is_first:
            if inputs is None:
                raise ValueError("the first stage needs the inputs of the mini-batch")
            feed = self._feed(inputs, chunks, example_offset)
        targets_mb: list[torch.Tensor] = []
        weights: list[float] = []
        examples = units_total = 0.0
        if layout.is_last:
            if targets is None:
                raise ValueError("the last stage needs the targets of the mini-batch")
            targets_mb = microbatch.scatter(targets, chunks)
            units = [self._count_units(t) for t in targets_mb]
            examples, units_total = float(targets.shape[0]), sum(units)
            global_units = self._sum_over_last_stages([units_total])[0]
            if global_units <= 0:
                raise ValueError("the mini-batch has no units to train on (every target is padding)")
            weights = [u / global_units * self.loss_scale.value for u in units]
            targets_mb = [self._to_device(t) for t in targets_mb]

        self._begin_step()
        if self.fwd_in is not None:
            self.fwd_in.expect(sum(a.kind == Kind.RECV_FWD for a in actions))
        if self.bwd_in is not None:
            self.bwd_in.expect(sum(a.kind == Kind.RECV_BWD for a in actions))

        run = self._executor(chunks, True, timeline=self.timeline, feed=feed, targets=targets_mb, weights=weights)
        run.run(actions)
        losses = run.losses
        with self.timeline.span(stats.COMM):
            for channel in (self.fwd_out, self.bwd_out):
                if channel is not None:
                    channel.flush()
        in_flight = sum(stage.in_flight for stage in self.stages.values())
        if in_flight:
            raise RuntimeError(f"the {self.schedule_name} schedule left {in_flight} micro-batches of "
                               f"stage {layout.stage} without a backward")

        loss = float(torch.stack(losses).sum()) / self.loss_scale.value if losses else None
        norm, finite = self._finish_gradients(max_grad_norm, loss is None or math.isfinite(loss))
        self.loss_scale.update(finite)
        if finite and update is not None:
            with self.timeline.span(stats.OPTIMIZER):
                update()
        step_time = self.timeline.now()
        events = self.timeline.events()
        wait, comm, optimizer = self.timeline.parts(events)
        mine = stats.StageStats(layout.stage, layout.replica, step_time, self.timeline.busy(events),
                                self.stage.meter.peak, memory.peak_rss_bytes(), memory.cuda_peak_bytes(self.device),
                                wait, comm, optimizer, -1 if finite else self._first_nonfinite_layer())
        gathered = stats.gather(mine, loss or 0.0, int(examples), units_total, norm,
                                sched.theoretical_bubble(layout.stages, chunks, self.schedule_name, self.virtual),
                                self.topology.transport.control,
                                events if trace else None)
        if gathered is not None and loss is None:
            loss = gathered.loss
        return StepResult(loss=loss, grad_norm=norm, skipped=not finite, stats=gathered)

    def _finish_gradients(self, max_grad_norm: float | None, loss_finite: bool) -> tuple[float, bool]:
        """Sum over replicas and shared copies, unscale, take the global norm and clip.

        Returns the norm and whether every loss and gradient of every stage and replica is finite.
        """
        with self.timeline.span(stats.COMM):
            bad = grads.all_reduce_replicas(self.params, self.topology.replica_group, self.staging,
                                            0.0 if loss_finite else 1.0)
            grads.sum_shared(self.shared, self.staging)
        if self.loss_scale.enabled:
            grads.scale_(self.params, 1.0 / self.loss_scale.value)
        # The norm's collective waits for the slowest stage to finish its backward: that is the bubble.
        with self.timeline.span(stats.WAIT):
            norm, bad = grads.global_norm(self.params, self._norm_exclude, self.topology.pipeline_group,
                                          self.staging, self.device, bad)
        finite = math.isfinite(norm) and bad == 0
        if finite and max_grad_norm is not None and norm > max_grad_norm:
            grads.scale_(self.params, max_grad_norm / (norm + 1e-6))
        with self.timeline.span(stats.COMM):
            grads.commit_batchnorms(self.batchnorms, self.topology.replica_group, self.staging)
        return norm, finite

    def _first_nonfinite_layer(self) -> int:
        """The global index of this stage's first layer, in backward order, with a non-finite gradient."""
        name = grads.first_nonfinite(reversed(list(self.module.named_parameters())))
        return int(name.split(".", 1)[0]) if name is not None else -1

    # ----------------------------------------------------------------- evaluation

    def evaluate(self, inputs: Any = None, targets: torch.Tensor | None = None, *, microbatches: int,
                 metrics: Metrics | None = None, return_outputs: bool = False) -> EvalResult:
        """A no-grad forward of one batch; loss and metric sums over all replicas, outputs on rank 0.

        A batch smaller than `microbatches` runs with one example per micro-batch; an empty batch (a
        data-parallel shard with nothing left) passes an empty message down the pipeline.
        """
        layout = self.layout
        was_training = self.module.training
        self.module.eval()
        self._begin_step()
        try:
            chunks, received = self._eval_chunks(inputs, microbatches)
            feed = self._feed(inputs, chunks) if layout.is_first and chunks else []
            targets_mb = microbatch.scatter(targets, chunks) if layout.is_last and chunks and targets is not None \
                else []
            loss_sum = units_sum = 0.0
            sums = dict.fromkeys(metrics or {}, 0.0)
            outputs: list[Any] = []

            def on_output(mb: int, out: Any) -> None:
                nonlocal loss_sum, units_sum
                if targets_mb:
                    target = self._to_device(targets_mb[mb])
                    n = self._count_units(targets_mb[mb])
                    assert self.stage.loss is not None
                    loss_sum += float(self.stage.loss(out, target)) * n
                    units_sum += n
                    for key, metric in (metrics or {}).items():
                        sums[key] += float(metric(out, target))
                if return_outputs:
                    outputs.append(out.detach() if isinstance(out, torch.Tensor) else out)

            if chunks == 0 and not layout.is_last:  # an empty shard: tell the next stage, chunk stage + 1
                assert self.fwd_out is not None
                self.fwd_out.send(layout.stage + 1, 0, 0, [])
            if chunks:
                self._executor(chunks, False, feed=feed, on_output=on_output, received=received).run(
                    sched.forward_only(layout.stage, layout.stages, chunks, self.virtual))
            if self.fwd_out is not None:
                self.fwd_out.flush()
            return self._eval_result(loss_sum, units_sum, sums, outputs, return_outputs)
        finally:
            self.module.train(was_training)

    def _eval_chunks(self, inputs: Any, microbatches: int) -> tuple[int, dict[int, Message]]:
        """How many micro-batches this evaluation runs; other stages learn it from their first message.

        Returns M and the messages already taken, keyed as the executor keys them.
        """
        layout = self.layout
        taken: dict[int, Message] = {}
        if layout.is_first:
            chunks = min(microbatches, microbatch.batch_size(inputs))
        else:
            assert self.fwd_in is not None
            self.fwd_in.expect(1)
            first = layout.stage  # the key of chunk `stage`, micro-batch 0
            header, tensors = self.fwd_in.take(first)
            chunks, taken = header.chunks, {first: (tensors, header.bare, header.offset)}
        if chunks and self.fwd_in is not None:
            actions = sched.forward_only(layout.stage, layout.stages, chunks, self.virtual)
            self.fwd_in.expect(sum(a.kind == Kind.RECV_FWD for a in actions) - len(taken))
        return chunks, taken

    def _eval_result(self, loss_sum: float, units_sum: float, sums: dict[str, float], outputs: list[Any],
                     return_outputs: bool) -> EvalResult:
        layout = self.layout
        keys = sorted(sums)
        if layout.is_last:
            totals = self._sum_over_last_stages([loss_sum, units_sum, *(sums[k] for k in keys)])
            loss_sum, units_sum = totals[0], totals[1]
            sums = dict(zip(keys, totals[2:]))
        result = EvalResult(loss=loss_sum / units_sum if units_sum else float("nan"), units=units_sum,
                            metrics=sums)
        gathered = microbatch.gather(outputs) if return_outputs and outputs else None
        if self.topology.distributed:
            box = [result]
            dist.broadcast_object_list(box, src=layout.rank_of(layout.stages - 1, 0),
                                       group=self.topology.transport.control)
            result = box[0]
            if return_outputs and self.result_out is not None and gathered is not None:
                tensors, bare = as_tensors(gathered)
                self.result_out.send(0, 1, 0, [None if t is None else t.cpu() for t in tensors], bare)
                self.result_out.flush()
            if return_outputs and self.result_in is not None:
                self.result_in.expect(1)
                header, tensors = self.result_in.take(0)
                gathered = tensors[0] if header.bare else tuple(tensors)
        if return_outputs and layout.rank == 0:
            result.outputs = gathered
        return result

    # ----------------------------------------------------------------- state

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers, keyed by global layer index ("<layer>.<name>")."""
        return self.module.state_dict(keep_vars=False)

    def close(self) -> None:
        """Stop the receiving threads."""
        for channel in (self.fwd_in, self.bwd_in, self.result_in):
            if channel is not None:
                channel.close()
