"""What sharding and data parallelism change in a process's memory: the states it keeps a share of, and the
buffers the wrapper holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmtune.plan.settings import Settings


@dataclass
class Sharding:
    """What sharding does to one process's step: the share it keeps of each tag's bytes, and the wrapper's buffers."""

    scale: dict[str, float]
    fwd_bwd_extra: int  # bytes held during forward/backward only
    bwd_extra: int  # more bytes during backward only
    always_extra: int  # bytes held the whole step


@dataclass(frozen=True)
class ModelBytes:
    """The traced model's parameter bytes (in the dtype it computes in): all, trainable, per decoder layer (the
    largest; `layers` of them) and the rest (embeddings, final norm, lm head: FSDP2's root)."""

    weights: int
    trainable: int
    layers: int
    layer: int
    layer_grads: int
    root: int


def sharding_plan(s: Settings, b: ModelBytes) -> Sharding:
    """How `s.sharding` ("none": DDP when several processes) over `s.num_processes` changes one process's memory."""
    w = max(1, s.num_processes)
    if s.sharding == "none":
        # DDP allocates its gradient buckets (a second copy of all grads) at wrap time, unless
        # gradient_as_bucket_view=True makes .grad a view into them. One process: no DDP.
        return Sharding({}, 0, 0, b.trainable if (w > 1 and not s.ddp_bucket_view) else 0)
    # Mixed precision traces 16-bit weights (`Settings.sharded_16bit`); the engines keep fp32 masters, gradients and
    # optimizer states, twice the traced bytes. DeepSpeed's modules also keep their 16-bit weights (whole under
    # ZeRO-2, partitioned under ZeRO-3) beside the fp32 masters of the trained ones.
    fp32 = 2.0 if s.sharded_16bit else 1.0
    states = {"gradients": fp32 / w, "optimizer_states": fp32 / w, "optimizer_step_temporaries": fp32 / w}
    masters = 2.0 if s.sharded_16bit else 0.0  # DeepSpeed's fp32 masters beside its 16-bit weights, per traced byte
    if s.sharding == "zero2":
        # Weights replicated; grads reduce-scattered into shards; bucket buffers not modelled.
        return Sharding(states | {"weights": 1 + masters * b.trainable / max(1, b.weights) / w}, 0, 0, 0)
    if s.sharding == "zero3":
        # While a layer runs its parameters are all-gathered and the next layer's prefetched (2 layers); in backward
        # one layer's unsharded gradients wait for the reduce-scatter.
        return Sharding(states | {"weights": (1 + masters) / w}, 2 * b.layer, b.layer_grads, 0)
    # FSDP2 keeps fp32 shards only (its 16-bit copies are the gathered ones). The root (embeddings, norm, lm head)
    # stays gathered from forward to backward; the blocks are gathered two at a time (the running one and the
    # prefetched one), or, not resharding after forward, all of them by backward's start.
    gathered = 2 * b.layer if s.sharding == "fsdp" else b.layers * b.layer
    return Sharding(states | {"weights": fp32 / w}, gathered + b.root, b.layer_grads, 0)
