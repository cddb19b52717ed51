"""Per-layer costs of one micro-batch as the balance and the simulator read them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline import microbatch, partition
from gpipe_cli.pipeline.layer_profile import profile_layers


@dataclass(frozen=True)
class LayerTiming:
    """One layer's seconds for one micro-batch, and the bytes it hands to the next layer."""

    name: str
    forward: float         # forward building the autograd graph (a micro-batch not rematerialised)
    forward_nograd: float  # the graph-less forward of a rematerialised micro-batch
    backward: float
    output_bytes: int
    recompute: float | None = None  # a rematerialised micro-batch's graph-building forward (None: `forward`)

    @property
    def recompute_seconds(self) -> float:
        """Seconds of the recompute (the forward's where it was not timed apart)."""
        return self.forward if self.recompute is None else self.recompute


@dataclass
class CostProfile:
    """Per-layer costs of a model at one micro-batch size, plus the loss."""

    microbatch_size: int
    input_bytes: int
    loss: float            # loss forward + backward seconds (charged to the last stage)
    layers: list[LayerTiming] = field(default_factory=list)

    def balance_costs(self, checkpoint: str) -> list[float]:
        """Per-layer seconds of one micro-batch under a remat mode: the weights `balance_by_cost` splits."""
        remat = checkpoint != "never"
        out = [t.forward_nograd + t.recompute_seconds + t.backward if remat else t.forward + t.backward
               for t in self.layers]
        out[-1] += self.loss
        return out

    def scaled(self, ratio: float | Sequence[float]) -> CostProfile:
        """Each layer's seconds multiplied by `ratio` (or its own of them), the loss by the last layer's."""
        ratios = [ratio] * len(self.layers) if isinstance(ratio, (int, float)) else list(ratio)
        layers = [replace(t, forward=t.forward * r, forward_nograd=t.forward_nograd * r, backward=t.backward * r,
                          recompute=None if t.recompute is None else t.recompute * r)
                  for t, r in zip(self.layers, ratios, strict=True)]
        return replace(self, loss=self.loss * (ratios[-1] if ratios else 1.0), layers=layers)

    def balance(self, partitions: int, checkpoint: str, owners: Sequence[int] | None = None,
                microbatches: int = 1) -> list[int]:
        """The min-max split of measured time into `partitions` contiguous chunks (`owners`: each chunk's stage)."""
        return partition.balance_stages(self.balance_costs(checkpoint), partitions, owners, microbatches)

    @staticmethod
    def from_json(data: dict[str, Any]) -> CostProfile:
        """The profile from its `dataclasses.asdict` form."""
        layers = [LayerTiming(**t) for t in data["layers"]]
        return CostProfile(int(data["microbatch_size"]), int(data["input_bytes"]), float(data["loss"]), layers)


def profile(spec: ModelSpec, inputs: Any, targets: torch.Tensor, seed: int, repeats: int = 5,
            device: torch.device | str = "cpu") -> CostProfile:
    """Time every layer of `spec` on one micro-batch `inputs` (with its `targets` for the loss) on `device`."""
    measured = profile_layers(spec.factories(), inputs, seed, device, repeats,
                              loss=lambda output: spec.loss(output, targets))
    layers = [LayerTiming(spec.layers[i].name, p.forward, p.forward_nograd, p.backward, p.output_bytes, p.recompute)
              for i, p in enumerate(measured)]
    loss = measured.loss.seconds if measured.loss is not None else 0.0
    return CostProfile(microbatch.batch_size(inputs), measured.input_bytes, loss, layers)
