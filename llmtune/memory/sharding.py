"""What sharding and data parallelism change in a process's memory: the states it keeps a share of, and the
buffers the wrapper holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sharding:
    """What sharding does to one process's step: the share it keeps of each tag's bytes, and the wrapper's buffers."""

    scale: dict[str, float]
    fwd_bwd_extra: int  # bytes held during forward/backward only
    bwd_extra: int  # more bytes during backward only
    always_extra: int  # bytes held the whole step


def sharding_plan(
    sharding: str,
    num_processes: int,
    layer_bytes: int,
    layer_grad_bytes: int,
    grad_bytes: int,
    ddp_bucket_view: bool,
) -> Sharding:
    """How `sharding` ("none": DDP when several processes) over `num_processes` changes one process's memory."""
    w = max(1, num_processes)
    if sharding == "none":
        # DDP allocates its gradient buckets (a second copy of all grads) at wrap time, unless
        # gradient_as_bucket_view=True makes .grad a view into them. One process: no DDP.
        extra = grad_bytes if (w > 1 and not ddp_bucket_view) else 0
        return Sharding({}, 0, 0, extra)
    # The optimizer runs on each process's shard only, so its temporaries shrink too.
    states = {"gradients": 1 / w, "optimizer_states": 1 / w, "optimizer_step_temporaries": 1 / w}
    if sharding == "zero2":
        # Weights replicated; grads reduce-scattered into shards; bucket buffers not modelled.
        return Sharding(states, 0, 0, 0)
    # fsdp (FSDP2 full shard) and zero3: parameters sharded too; while a layer runs, its
    # parameters are all-gathered and the next layer's are prefetched (2 layers), and in backward
    # one layer's unsharded gradients wait for the reduce-scatter.
    return Sharding({**states, "weights": 1 / w}, 2 * layer_bytes, layer_grad_bytes, 0)
