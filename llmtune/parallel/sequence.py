"""Ulysses sequence parallelism: each row split along the sequence across a group of processes (DeepSpeed-Ulysses,
Jacobs et al. 2023; ALST, Bekman et al. 2025).

A group of N processes trains the same rows; each holds a contiguous 1/N of every row's tokens (`shard_batch`): its
embeddings, norms, MLPs, loss and their activations are those of L/N tokens. Attention alone needs whole sequences:
`ulysses_attention`, registered with transformers' `AttentionInterface` as `ULYSSES`, trades the sequence split for a
head split with one all-to-all (q, k, v: [B, H, L/N, D] -> [B, H/N, L, D]), runs each document's causal block over
the whole rows (`llmtune.model.attention.varlen_attention`, with the documents of the whole rows, which the shards carry
unchanged), and trades back ([B, L, H/N, D] -> [B, L/N, H, D]). Backward runs the inverse all-to-alls.

What keeps it exact:
* position ids stay global (rotary embeddings see each token's own position), and the targets are shifted before
  the split (`shard_batch`: the last token of a shard predicts the next shard's first);
* a loss summed over tokens is summed over the shards by the gradient reduction the engine already does: a group's
  processes are data-parallel processes to DDP and FSDP2 (FSDP2 shards over the whole (data x sequence) mesh, as
  torchtitan shards over its flattened dp_shard x cp), and the loop counts each row's units once per group
  (llmtune.run.batches.step_batches);
* what a loss needs whole per sequence (a preference pair's log-probs, a completion's token count) is summed across
  the group (`sum_over_group`) before the loss.

KV heads fewer than N (or not a multiple of it) are repeated up to a multiple of N (`kv_for_degree`): each process
then holds the KV heads its query heads read. The query heads must divide by N (`refusal`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PretrainedConfig

from llmtune.data.batch import next_tokens, with_documents
from llmtune.data.render import IGNORE
from llmtune.model.attention import ULYSSES, autocast_inputs, varlen_attention, varlen_refusal


@dataclass(frozen=True)
class SequenceGroup:
    """This process's sequence group: `degree` processes, this one `rank` among them (it holds tokens
    [rank L / degree, (rank + 1) L / degree) of every row), over `group` (None: one process, or a plan traced as on
    `degree` processes without any: `planned_degree`)."""

    degree: int = 1
    rank: int = 0
    group: Any = None
    # Where the group sits among the data-parallel groups: which rows it trains (llmtune.data.batch_for_step).
    data_rank: int = 0
    data_world: int = 1


# The group the attention and the losses run in. A plain global, as `llmtune.model.attention._planned_device`: a
# compiled block reads it, and Dynamo guards on a global's value.
_current = SequenceGroup()


def current() -> SequenceGroup:
    return _current


def use(group: SequenceGroup) -> None:
    """Attention and losses run in `group` from now on: a run's, set once where it is built (llmtune.run.loop)."""
    global _current
    _current = group


@contextlib.contextmanager
def planned_degree(degree: int) -> Iterator[None]:
    """As on `degree` processes, without a process group: each all-to-all is a fresh buffer of its output's shape,
    so a fake-tensor trace (llmtune.plan) allocates what a run's process does."""
    before = _current
    use(SequenceGroup(degree))
    try:
        yield
    finally:
        use(before)


def rows_padded_to(degree: int, length: int | None = None) -> int | None:
    """The multiple a collate pads rows to, as `shard_batch` splits each row in `degree` equal parts: the degree, or
    for a compiled run's one shape `length` (its max_length, which no packed row exceeds) rounded up to the degree,
    so that every row pads to that one width, the width the estimator traces (`llmtune.plan.step.micro_batch`); None
    where neither asks for one. (Not lcm(length, degree): 2050 tokens at degree 4 would pad to 4100.)"""
    multiple = -(-(length or 1) // degree) * degree
    return multiple if multiple > 1 else None


def mesh_group(device_type: str, rank: int, world: int, degree: int) -> SequenceGroup:
    """Process `rank`'s sequence group in the (data, sequence) mesh of `world` processes, sequence innermost: a group
    is `degree` consecutive ranks, which the launcher, filling nodes in rank order, puts on one node where `degree`
    divides a node's processes, so that its all-to-alls stay on the node's links (the planner's `auto` weighs only
    such degrees; a wider one sends over the network: `off_node_share`). Collective where `degree` > 1: every process
    calls it."""
    if degree == 1:
        return SequenceGroup(data_rank=rank, data_world=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world // degree, degree), mesh_dim_names=("data", "sequence"))
    rank, group = mesh.get_local_rank("sequence"), mesh.get_group("sequence")
    return SequenceGroup(degree, rank, group, data_rank=mesh.get_local_rank("data"), data_world=world // degree)


def off_node_share(degree: int, per_node: int, world: int) -> float:
    """The largest share of its all-to-all bytes a process sends to other nodes, `mesh_group`'s groups of `degree`
    consecutive ranks among `world` processes on nodes of `per_node`, filled in rank order: 0 where every group is on
    one node (`degree` divides `per_node`, or one node holds them all)."""
    worst = 0
    for start in range(0, world, degree):
        for node in range(start - start % per_node, start + degree, per_node):  # the nodes the group spans
            on_node = min(start + degree, node + per_node) - max(start, node)
            worst = max(worst, degree - on_node)
    return worst / (degree - 1) if degree > 1 else 0.0


def refusal(config: PretrainedConfig, degree: int) -> str | None:
    """Why `config`'s model cannot be split across `degree` processes, or None."""
    if degree == 1:
        return None
    why = varlen_refusal(config)
    if why is not None:
        return f"its attention cannot run as {ULYSSES}: {why}"
    heads = config.get_text_config().num_attention_heads
    if heads % degree:
        # (KV heads then repeat to a multiple of the degree: kv and the degree both divide heads, so lcm(kv, degree)
        # does too, and each process's query heads read only its own KV heads.)
        return f"its {heads} attention heads do not divide by {degree} processes"
    return None


def kv_for_degree(t: torch.Tensor, degree: int) -> torch.Tensor:
    """K or V [B, H_kv, L, D] with each head repeated (in place, as GQA groups them) up to a multiple of `degree`:
    after the head split each process holds the KV heads of its own query heads."""
    kv = t.shape[1]
    repeats = math.lcm(kv, degree) // kv
    return t if repeats == 1 else t.repeat_interleave(repeats, dim=1)


def alltoall_bytes_per_layer(config: PretrainedConfig, tokens: int, degree: int, dtype_bytes: int) -> int:
    """Bytes one process sends to the others per decoder layer in forward, for a micro-batch of `tokens` tokens a
    group holds: q, k, v (k and v with their KV heads as `kv_for_degree` repeats them) and the attention output, each
    (tokens / degree) x heads x head_dim elements, (degree - 1) / degree of it to other processes. Backward sends the
    same again; a checkpointed layer's recomputed forward, once more."""
    if degree == 1:
        return 0
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv = math.lcm(getattr(text, "num_key_value_heads", None) or heads, degree)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    elements = (tokens // degree) * head_dim * (2 * heads + 2 * kv)
    return elements * dtype_bytes * (degree - 1) // degree


# ---------------------------------------------------------------- the all-to-all


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: SequenceGroup) -> torch.Tensor:
    """`x`'s `scatter_dim` cut in `degree` pieces, piece j sent to process j; the pieces received concatenated along
    `gather_dim` in the group's order."""
    send = torch.stack(x.chunk(group.degree, dim=scatter_dim))
    received = torch.empty_like(send)
    if group.group is not None:
        import torch.distributed as dist

        dist.all_to_all_single(received, send, group=group.group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: SequenceGroup) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: SequenceGroup) -> torch.Tensor:
    """The differentiable all-to-all: its backward is the inverse all-to-all of the gradient."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient: each process's loss, computed from the sum, depends
    on every process's part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_group(x: torch.Tensor) -> torch.Tensor:
    """`x` summed over the current sequence group (itself in one process, or in a plan): per-sequence sums of a
    loss whose sequences the group's shards hold in parts. Differentiable: every process's loss depends on every
    process's part, so each part's gradient is the sum of the group's."""
    group = _current
    return x if group.group is None else _SumOverGroup.apply(x, group.group)


def share_of_group(x: torch.Tensor) -> torch.Tensor:
    """A loss each process of the group computes whole (from `sum_over_group`'s sums), as this process's share of it:
    the loop sums every process's loss and statistics, and the gradient reduction sums the group's gradients."""
    return x / _current.degree


# ---------------------------------------------------------------- attention


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract on a sequence shard: query [B, H, L/N, D], key/value [B, H_kv, L/N,
    D] -> [B, L/N, H, D], each document of the whole rows attended causally (the batch's cu_seq_lens are the whole
    rows'). In one process, `varlen_attention` as it is."""
    group = _current
    if group.degree == 1:
        return varlen_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    query, key, value = autocast_inputs(query, key, value)  # what attention computes in: what the all-to-alls move
    key, value = kv_for_degree(key, group.degree), kv_for_degree(value, group.degree)
    q, k, v = (all_to_all(t, 1, 2, group) for t in (query, key, value))  # heads split, whole rows
    out, _ = varlen_attention(module, q, k, v, None, dropout, scaling, **kwargs)  # [B, L, H/N, D]
    return all_to_all(out, 1, 2, group), None


AttentionInterface.register(ULYSSES, ulysses_attention)


@contextlib.contextmanager
def generating(model: Any) -> Iterator[None]:
    """Generation runs whole left-padded prompts in each process (GRPO's sampling; a group's processes sample the
    same completions): transformers' sdpa, with its masks, in place of `ULYSSES` while it runs."""
    if model.config._attn_implementation != ULYSSES:
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(ULYSSES)


# ---------------------------------------------------------------- batches


def shard_batch(batch: dict[str, Any], group: SequenceGroup) -> dict[str, Any]:
    """This process's part of a collated micro-batch: tokens [r L / N, (r + 1) L / N) of each row (L a multiple of N:
    `llmtune.run.batches.collate_for` pads to it), with
    * the position ids of those tokens in the whole row (an unpacked row's are 0..L-1: one document, its right
      padding after its tokens, which causal attention keeps out of theirs), and the whole rows' documents;
    * `shift_labels` (and a pair batch's `shift_segment_ids`) in place of `labels` (`segment_ids`): what each token
      predicts, shifted before the split, so the last token of a shard predicts the next shard's first;
    * `loss_rows`, the flat indices of the shard's trained positions.
    Keys of whole rows or pairs (advantages, pair_ids, reference log-probs) are kept as they are; no attention mask
    (the documents say it)."""
    from llmtune.ops.loss import trained_rows

    if group.degree == 1:
        return batch
    rows, length = batch["input_ids"].shape
    if length % group.degree:
        raise ValueError(f"rows of {length} tokens do not split across {group.degree} processes")
    if "cu_seq_lens_q" not in batch:
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(length).expand(rows, -1)
        batch = with_documents({k: v for k, v in batch.items() if k != "attention_mask"} | {"position_ids": positions})
    part = slice(group.rank * length // group.degree, (group.rank + 1) * length // group.degree)
    out = {k: v for k, v in batch.items() if k not in ("labels", "segment_ids", "loss_rows")}
    out["input_ids"], out["position_ids"] = batch["input_ids"][:, part], batch["position_ids"][:, part]
    out["shift_labels"] = next_tokens(batch, "labels", IGNORE)[:, part].contiguous()
    if "segment_ids" in batch:
        out["shift_segment_ids"] = next_tokens(batch, "segment_ids", -1)[:, part].contiguous()
    out["loss_rows"] = trained_rows(out["shift_labels"].reshape(-1))
    return out
