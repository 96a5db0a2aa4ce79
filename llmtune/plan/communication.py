"""What a data-parallel engine sends between processes in an optimizer step, and how long it takes over the link.

Each engine's collectives, for a window of micro-steps (`llmtune.parallel.engines.micro_step` says when each
synchronises):
- DDP: one all-reduce of the trainable gradients, in the window's last backward (`no_sync` before it), overlapped
  with that backward by its gradient buckets.
- FSDP2 (`fsdp`): every micro-step, an all-gather of every block's weights in forward and again in backward (the
  blocks reshard after forward), and a reduce-scatter of the trainable gradients; each overlapped with the
  micro-step's compute by FSDP2's prefetching.
- FSDP2 without resharding (`fsdp_no_reshard`): one all-gather a micro-step; the blocks stay gathered to backward.
- ZeRO-2: every micro-step a reduce-scatter of the trainable gradients (overlapped with backward); after the
  update, an all-gather of the updated trainable weights, with nothing left to hide behind.
- ZeRO-3: as FSDP2 resharding after forward.

Times follow NCCL's bus-bandwidth model (nccl-tests `doc/PERFORMANCE.md`): a ring all-reduce of S bytes moves
2(N-1)/N x S over each process's link, an all-gather or a reduce-scatter (N-1)/N x S (S: the whole gathered
tensor), at the link's bus bandwidth. Gathered weights travel in the dtype the blocks compute in (FSDP2's
`MixedPrecisionPolicy.param_dtype`, DeepSpeed's bf16 weights), gradients in the dtype they are reduced in (fp32 for
DDP under autocast and for FSDP2's `reduce_dtype`, 16-bit for DeepSpeed's bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

# NCCL's bus bandwidth reaches ~75-80% of a link's datasheet rate a direction on large messages (nccl-tests on
# NVLink and PCIe boards); a step's collectives are large (whole layers, gradient buckets).
LINK_EFFICIENCY = 0.75
HALF_PRECISIONS = ("bf16", "fp16", "bf16-true")


@dataclass(frozen=True)
class Traffic:
    """Bus bytes (what crosses each process's link) of one optimizer step's collectives, by what they overlap."""

    per_micro_step: float = 0.0  # during each micro-step's forward and backward
    last_backward: float = 0.0  # during the window's last backward only (DDP's all-reduce)
    after_update: float = 0.0  # after the optimizer step, exposed (ZeRO-2's all-gather of the updated weights)


def all_reduce(nbytes: float, n: int) -> float:
    """Bus bytes of a ring all-reduce of `nbytes` over `n` processes."""
    return 2 * (n - 1) / n * nbytes


def all_gather(nbytes: float, n: int) -> float:
    """Bus bytes of an all-gather whose output is `nbytes` (a reduce-scatter of an `nbytes` input: the same)."""
    return (n - 1) / n * nbytes


def engine_traffic(sharding: str, n: int, precision: str, parameters: int, trainable: int) -> Traffic:
    """What `sharding` (the estimator's name: none = DDP, fsdp, fsdp_no_reshard, zero2, zero3) sends a step on `n`
    processes training `trainable` of a model's `parameters` at `precision`."""
    if n < 2:
        return Traffic()
    half = precision in HALF_PRECISIONS
    gathered = parameters * (2 if half else 4)  # weights as the blocks compute with them
    if sharding == "none":
        return Traffic(last_backward=all_reduce(trainable * (2 if precision == "bf16-true" else 4), n))
    if sharding in ("fsdp", "fsdp_no_reshard"):
        gathers = 2 if sharding == "fsdp" else 1
        grads = trainable * 4  # reduce_dtype fp32, bf16-true included (llmtune.parallel.engines.shard_fsdp2)
        return Traffic(per_micro_step=gathers * all_gather(gathered, n) + all_gather(grads, n))
    grads = trainable * (2 if half else 4)  # DeepSpeed reduces in its weights' dtype
    if sharding == "zero2":
        return Traffic(per_micro_step=all_gather(grads, n), after_update=all_gather(grads, n))
    return Traffic(per_micro_step=2 * all_gather(gathered, n) + all_gather(grads, n))


def step_seconds(
    micro_seconds: float, micro_steps: int, update_seconds: float, traffic: Traffic, link_bytes_per_s: float | None
) -> float:
    """An optimizer step of `micro_steps` micro-steps of `micro_seconds` compute each and an update of
    `update_seconds`, with `traffic` over a link of `link_bytes_per_s` (None: not known, communication free).

    Collectives run on their own stream beside the compute they overlap: a micro-step takes the longer of the two.
    DDP's all-reduce starts with the last backward (about two thirds of a micro-step's compute: backward is twice
    forward's FLOPs), so the last micro-step takes at least its forward plus the all-reduce."""
    if not link_bytes_per_s:
        return micro_steps * micro_seconds + update_seconds
    bus = LINK_EFFICIENCY * link_bytes_per_s
    micro = max(micro_seconds, traffic.per_micro_step / bus)
    last = max(micro, micro_seconds / 3 + traffic.last_backward / bus)
    return (micro_steps - 1) * micro + last + update_seconds + traffic.after_update / bus
