"""Preference tuning: DPO (sigmoid or IPO), ORPO and SimPO on chosen/rejected pairs.

The preference objective's machinery (llmtune.objectives.preference plugs it into the loop):

* batch assembly (`collate_pairs`, on `llmtune.data.collate`): a pair is two sequences (llmtune.data.pairs),
  chosen first. Packed, rows hold whole pairs back to back with position ids restarting per sequence, and the
  micro-batch carries each sequence as a document (`with_documents`), which the log-prob forwards pass to the
  model: its attention runs each sequence's causal block alone, as for packed SFT (llmtune.model.attention); unpacked,
  each sequence gets its own padded row (chosen, rejected, chosen, ...; the layout TRL uses). `segment_ids` numbers
  the sequences of the micro-batch (2k chosen, 2k + 1 rejected of pair k; -1 on padding), so log-probabilities are
  summed per sequence the same way in both layouts.
* per-sequence log-probabilities (`sequence_logps`): the decoder's hidden states, then `token_logps`,
  which computes the completion tokens' log-probabilities chunk by chunk and never holds the N x V
  logits (backward recomputes each chunk's logits: one extra lm_head matmul per chunk).
* the losses (`pair_losses`) from summed log-probabilities and token counts, per pair;
* the reference: under LoRA the same model with its adapters disabled, a frozen copy, or log-probabilities
  computed once before training through the prepared module (`compute_reference`) and cached in output_dir.

`PreferenceModel` is the module the loop (and DDP/FSDP) wraps; its forward returns
[loss summed over pairs, chosen rewards summed, rejected rewards summed, correctly ordered pairs], only the
first carrying gradients. The loop divides by the pairs of the whole window on all processes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from llmtune.data import IGNORE, collate, sequences_of
from llmtune.data.batch import next_tokens, to_device, with_documents
from llmtune.ops.loss import (
    ChunkGrads,
    ChunkHead,
    ChunkSettings,
    LossImpl,
    LowRank,
    chunk_settings,
    decoder_and_head,
    default_chunk_size,
    dtypes_of,
    head_lora,
    logit_transform,
    loss_rows,
    text_config,
)
from llmtune.parallel import sequence
from llmtune.recipe import PreferenceConfig

log = logging.getLogger(__name__)

STATS = ("rewards_chosen", "rewards_rejected", "preference_accuracy")


# ---------------------------------------------------------------- batches


def collate_pairs(
    examples: list[dict], *, pad_token_id: int, packed: bool, pad_to_multiple_of: int | None = None
) -> dict[str, Any]:
    """One micro-batch of pairs (see the module docstring): `collate`'s rows (unpacked, one per sequence) with
    `segment_ids` and `pair_ids`, `ref_logps` [pairs, 2] when the rows carry them, and packed, the rows' documents
    (`with_documents`: found here on the host, where no layer then waits for the device to find them)."""
    if not examples:
        raise ValueError("collate_pairs: empty micro-batch")
    keys = ("input_ids", "labels", "position_ids")
    rows = examples if packed else [{k: e[k][a:b] for k in keys} for e in examples for a, b in sequences_of(e)]
    batch = collate(rows, pad_token_id=pad_token_id, packed=packed, pad_to_multiple_of=pad_to_multiple_of)
    segments = torch.full(batch["input_ids"].shape, -1, dtype=torch.long)
    sequence = 0
    for i, row in enumerate(rows):
        starts = (torch.as_tensor(row["position_ids"]) == 0).long()
        segments[i, : len(starts)] = sequence + starts.cumsum(0) - 1
        sequence += int(starts.sum())
    batch["segment_ids"] = segments
    # pair_ids [pairs]: its SHAPE tells the forward how many pairs there are, so the forward needs no
    # data-dependent count (the memory estimator traces it on fake tensors).
    batch["pair_ids"] = torch.arange(sequence // 2)
    batch["loss_rows"] = loss_rows(batch["labels"])  # on the host: the log-probs never wait for the device
    if "ref_logps" in examples[0]:
        values = [v for e in examples for v in e["ref_logps"]]
        batch["ref_logps"] = torch.tensor(values, dtype=torch.float32).view(-1, 2)
    return with_documents(batch) if packed else batch


def pairs_in(batch: dict[str, Tensor]) -> int:
    """Pairs with trained tokens on both sides (eval's filler rows, all labels -100, are not pairs to count)."""
    return int(_trained_pairs(batch["labels"], batch["segment_ids"], len(batch["pair_ids"])).sum())


def _trained_pairs(labels: Tensor, segments: Tensor, pairs: int) -> Tensor:
    """[pairs] bool: both sequences of the pair have a trained token."""
    trained = segments[(labels != IGNORE) & (segments >= 0)]
    return (torch.bincount(trained, minlength=2 * pairs) > 0).view(-1, 2).all(1)


# ---------------------------------------------------------------- log-probabilities


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(logits)[target] per row, chunked (`ChunkHead`); backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, lora_u, lora_b, targets, settings: ChunkSettings) -> Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        head = ChunkHead(weight, bias, lora_b, settings)
        for start in range(0, hidden.shape[0], settings.chunk_size):
            rows = slice(start, start + settings.chunk_size)
            z, _ = head.logits(hidden[rows].to(settings.compute_dtype), None if lora_u is None else lora_u[rows])
            target = targets[rows].unsqueeze(1)
            out[rows] = (z.gather(1, target) - z.logsumexp(1, keepdim=True)).squeeze(1)
        ctx.save_for_backward(hidden, weight, bias, lora_u, lora_b, targets)
        ctx.settings = settings
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        *inputs, targets = ctx.saved_tensors
        settings = ctx.settings
        hidden, weight, bias, lora_u, lora_b = inputs
        grads = ChunkGrads(ctx.needs_input_grad[:5], *inputs)
        head = ChunkHead(weight, bias, lora_b, settings)
        for start in range(0, hidden.shape[0], settings.chunk_size):
            rows = slice(start, start + settings.chunk_size)
            h, u = hidden[rows].to(settings.compute_dtype), None if lora_u is None else lora_u[rows]
            z, tanh = head.logits(h, u)
            go = grad_out[rows].float().unsqueeze(1)
            # d logp[target] / d logits = onehot(target) - softmax, times the upstream gradient.
            grad = z.softmax(1).mul_(-go)
            grad.scatter_add_(1, targets[rows].unsqueeze(1), go)
            del z
            grad_c, grad_l = head.split(grad, tanh, grads)
            del grad, tanh
            head.accumulate(grads, rows, h, u, grad_c, grad_l)
        return *grads.result(dtypes_of(*inputs)), None, None


def token_logps(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    lora: LowRank | None = None,
    chunk_size: int = 1024,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> Tensor:
    """fp32 log-probability of each row's target: hidden [N, h], weight [V, h], targets [N] -> [N].

    Equal to `log_softmax(hidden @ weight.T + bias).gather(targets)` without holding more than `chunk_size`
    rows of logits, in forward or backward. The matmul runs in the autocast dtype when autocast is on; `lora` adds
    its low-rank term to the lm_head's output as peft does.
    """
    settings = chunk_settings(hidden, weight, lora, chunk_size, logit_scale, softcap)
    u, lora_b = (None, None) if lora is None else (lora.u, lora.weight)
    # The Function casts explicitly; autocast must not re-cast its matmuls.
    with torch.autocast(hidden.device.type, enabled=False):
        return _TokenLogProbs.apply(hidden, weight, bias, u, lora_b, targets.long(), settings)


def labelled_logps(
    model: torch.nn.Module, impl: LossImpl, chunk_size: int, batch: dict[str, Any], temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """(fp32 log-prob of each labelled token, its flat index in the [rows, width] batch), in row-major order.

    `temperature` divides the logits first (GRPO scores its samples as they were drawn, as TRL does). The labelled
    tokens are the batch's `loss_rows`, found by its collate on the host; without them, found here (on a GPU, a wait
    for it). A packed batch's documents go to the model with its rows (`documents_of`)."""
    inputs = {k: batch.get(k) for k in ("input_ids", "attention_mask", "position_ids")} | documents_of(batch)
    # hidden[t] predicts token t + 1: targets are shifted left by one (a sequence shard's already are).
    targets = next_tokens(batch, "labels", IGNORE).reshape(-1)
    rows = batch["loss_rows"] if "loss_rows" in batch else loss_rows(batch["labels"])
    scale, cap = logit_transform(model.config) if impl == "chunked" else (1.0, None)
    if impl == "chunked" and (cap is None or temperature == 1.0):
        decoder, head = decoder_and_head(model)
        hidden = decoder(**inputs, use_cache=False).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
        logps = token_logps(
            hidden,
            head.weight,
            targets[rows],
            bias=head.bias,
            lora=head_lora(head, hidden),
            chunk_size=chunk_size,
            logit_scale=scale / temperature,
            softcap=cap,
        )
    else:  # the model's own logits (full N x V, fp32): models whose logits the chunked path does not reproduce
        logits = model(**inputs, use_cache=False).logits
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, rows).float()
        if temperature != 1.0:  # a pass over N x V logits and a transient their size: only where it changes them
            logits = logits / temperature
        logps = logits.log_softmax(-1).gather(1, targets[rows].unsqueeze(1)).squeeze(1)
    return logps, rows


def documents_of(batch: dict[str, Any]) -> dict[str, Any]:
    """A packed batch's documents (`llmtune.data.batch.with_documents`: cu_seq_lens_q/k, max_length_q/k), as the
    model's forward takes them for its attention; none for an unpacked one."""
    return {k: v for k, v in batch.items() if k.startswith(("cu_seq_lens_", "max_length_"))}


def sequence_logps(
    model: torch.nn.Module, impl: LossImpl, chunk_size: int, batch: dict[str, Any]
) -> tuple[Tensor, Tensor]:
    """(summed completion log-probs, completion tokens) per sequence, each [pairs, 2] (chosen, rejected)."""
    logps, rows = labelled_logps(model, impl, chunk_size, batch)
    segments = next_tokens(batch, "segment_ids", -1).reshape(-1)
    count = 2 * batch["pair_ids"].shape[0]
    seq = segments[rows]
    sums = torch.zeros(count, dtype=torch.float32, device=logps.device).index_add(0, seq, logps)
    # index_add rather than bincount: an output shape fixed by `count` (bincount's depends on the data).
    tokens = torch.zeros(count, dtype=torch.float32, device=logps.device).index_add(0, seq, torch.ones_like(logps))
    # Split along the sequence (llmtune.parallel.sequence), each process holds part of each sequence's tokens.
    return sequence.sum_over_group(sums).view(-1, 2), sequence.sum_over_group(tokens).view(-1, 2)


# ---------------------------------------------------------------- losses


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def pair_losses(
    objective: str, cfg: PreferenceConfig, logps: Tensor, tokens: Tensor, ref_logps: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, chosen reward, rejected reward) per pair from [pairs, 2] summed log-probs and token counts.

    dpo sigmoid (Rafailov et al. 2023, eq. 7): -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)));
    ipo (Azar et al. 2023, eq. 17, on per-token averaged log-ratios as TRL and the IPO authors do):
    (delta - 1 / (2 beta))^2; either plus `nll_weight` times the chosen completion's NLL per token (RPO, Pang
    et al. 2024; averaged per pair, where TRL's rpo_alpha averages over the tokens of the whole batch: the two
    agree pair by pair); simpo (Meng et al. 2024, eq. 6): -log sigmoid(beta * (avg_c - avg_r) - gamma);
    orpo (Hong et al. 2024, eq. 6-7): NLL of the chosen completion (per token) - beta * log sigmoid(log odds
    ratio of the per-token averaged probabilities). Rewards: beta * log-ratio (dpo sigmoid), beta * per-token
    averaged log-ratio (ipo: the ratios its loss uses, so the margin tends to 1/2; TRL 1.16 logs summed ones),
    beta * average log-prob (simpo, orpo).
    """
    beta = cfg.beta_for(objective)
    average = logps / tokens.clamp(min=1)
    if objective == "dpo":
        ratios = logps - ref_logps
        if cfg.loss == "ipo":
            # The rewards use the log-ratios the loss uses: the reported margin is then beta * the loss's delta
            # (driven toward 1/2), and the accuracy orders pairs as the loss does; summed ratios would order
            # pairs of unequal lengths by length as much as by preference.
            ratios = ratios / tokens.clamp(min=1)
            loss = (ratios[:, 0] - ratios[:, 1] - 1 / (2 * beta)) ** 2
        else:
            loss = -F.logsigmoid(beta * (ratios[:, 0] - ratios[:, 1]))
        rewards = beta * ratios.detach()
        if cfg.nll_weight:
            loss = loss - cfg.nll_weight * average[:, 0]
    elif objective == "simpo":
        rewards = beta * average.detach()
        loss = -F.logsigmoid(beta * (average[:, 0] - average[:, 1]) - cfg.gamma)
    elif objective == "orpo":
        rewards = beta * average.detach()
        log_odds = (average[:, 0] - average[:, 1]) - (_log1mexp(average[:, 0]) - _log1mexp(average[:, 1]))
        loss = -average[:, 0] - beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"not a preference objective: {objective!r}")
    return loss, rewards[:, 0], rewards[:, 1]


def step_metrics(sums: list[float], pairs: int) -> dict[str, float]:
    """metrics.jsonl values from the summed STATS of a step (all processes) and its pairs."""
    chosen, rejected, correct = (s / max(pairs, 1) for s in sums)
    return {
        "rewards_chosen": chosen,
        "rewards_rejected": rejected,
        "reward_margin": chosen - rejected,
        "preference_accuracy": correct,
    }


# ---------------------------------------------------------------- the module the loop trains


def resolve_reference(objective: str, cfg: PreferenceConfig, peft_method: str) -> str:
    """The reference actually used: none (orpo, simpo), or dpo's setting with `auto` resolved."""
    if objective != "dpo":
        return "none"
    if cfg.reference == "auto":
        return "adapter_disabled" if peft_method != "none" else "precomputed"
    return cfg.reference


class PreferenceModel(torch.nn.Module):
    """A causal LM whose forward returns [loss summed over pairs, *STATS summed] (see the module docstring).

    `reference`: adapter_disabled (the same peft model, adapters off), copy (`reference_model`, frozen and
    kept out of this module's parameters, so DDP, the optimizer and checkpoints never see it), precomputed
    (the batch carries `ref_logps`) or none.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        impl: LossImpl,
        objective: str,
        cfg: PreferenceConfig,
        reference: str,
        reference_model: torch.nn.Module | None = None,
        chunk_size: int | None = None,
    ):
        super().__init__()
        self.model = model
        self.impl, self.objective, self.cfg, self.reference = impl, objective, cfg, reference
        self.chunk_size = chunk_size or default_chunk_size(text_config(model.config).vocab_size)
        self._reference_model = (reference_model,)  # a tuple: not registered as a submodule

    def reference_logps(self, batch: dict[str, Any]) -> Tensor:
        with torch.no_grad():
            if self.reference == "adapter_disabled":
                with self.model.disable_adapter():
                    return sequence_logps(self.model, self.impl, self.chunk_size, batch)[0]
            # copy: the frozen copy; precomputed: the policy itself, at its starting weights (before training).
            reference = self._reference_model[0] if self.reference == "copy" else self.model
            return sequence_logps(reference, self.impl, self.chunk_size, batch)[0]

    def forward(self, reference_only: bool = False, **batch: Any) -> Tensor:
        if reference_only:  # compute_reference: through the prepared module, as the policy's own forward runs
            return self.reference_logps(batch)
        ref = batch.get("ref_logps")
        if self.reference in ("adapter_disabled", "copy"):
            # The reference forward runs first and under no_grad: its activations are freed before the
            # policy's forward starts keeping its own for backward, so the two never stack.
            ref = self.reference_logps(batch)
        logps, tokens = sequence_logps(self.model, self.impl, self.chunk_size, batch)
        # Pairs without trained tokens (eval's filler rows) add nothing, as in pairs_in; their log-prob of 0
        # (probability 1) is set to any finite value first, or ORPO's log(1 - p) would make the sum NaN.
        valid = (tokens > 0).all(1)
        logps = logps.masked_fill(~valid.unsqueeze(1), -1.0)
        loss, chosen, rejected = pair_losses(self.objective, self.cfg, logps, tokens, ref)
        keep = valid.float()
        stats = torch.stack(
            [(chosen * keep).sum(), (rejected * keep).sum(), ((chosen > rejected).float() * keep).sum()]
        )
        # Split along the sequence, every process of the group computed the pairs' whole losses: each keeps its share.
        return sequence.share_of_group(torch.cat([(loss * keep).sum().unsqueeze(0), stats]))


# ---------------------------------------------------------------- precomputed reference


def reference_key(settings: dict[str, Any], rows: Any) -> str:
    """A cache key from the model and run settings and the exact tokens of the rows (content, not file names)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for column in ("input_ids", "labels", "position_ids"):
        values = rows.with_format("arrow")[:].column(column).combine_chunks()
        digest.update(np.asarray(values.flatten()).tobytes() + np.asarray(values.offsets).tobytes())
    return digest.hexdigest()[:20]


@torch.no_grad()
def compute_reference(model: torch.nn.Module, rows: Any, collate, batch_size: int, acc: Any) -> list[list[float]]:
    """Reference log-probs of every pair of every row ([c0, r0, c1, r1, ...] per row), each process its share
    (rows rank, rank + W, ...), summed over processes.

    `model` is the prepared module (DDP, a DeepSpeed engine or an FSDP2 root around a `PreferenceModel`) before its
    first update: the reference is then the policy's own step-0 forward, on the training device, at the policy's
    precision (autocast, FSDP2's or DeepSpeed's bf16 weights) and with ZeRO-3's partitions gathered. Those forwards
    are collectives (DDP's buffer broadcast, the all-gathers), so every process runs as many: a share one row
    shorter runs a filler batch whose values are dropped."""
    counts = [len(sequences_of(r)) // 2 for r in rows.select_columns(["position_ids"])]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    values = torch.zeros(int(offsets[-1]), 2, device=acc.device)
    # A sequence group's processes compute the same rows, each its part (`collate` shards them), and the group's
    # first writes them.
    group = sequence.current()
    mine = list(range(group.data_rank, len(rows), group.data_world))
    batches = math.ceil(math.ceil(len(rows) / group.data_world) / batch_size)
    was_training = model.training
    model.eval()
    for start in range(0, batches * batch_size, batch_size):
        index = mine[start : start + batch_size]
        batch = to_device(collate(rows.select(index or [0]).to_list()), acc.device)
        logps = model(**batch, reference_only=True)
        if index and group.rank == 0:
            at = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in index]).to(acc.device)
            values.index_copy_(0, at, logps.float())
    model.train(was_training)
    values = acc.reduce(values, reduction="sum").cpu()
    return [values[offsets[i] : offsets[i + 1]].reshape(-1).tolist() for i in range(len(rows))]


def with_reference(
    model: torch.nn.Module, rows: Any, collate, batch_size: int, acc: Any, cache_dir: Path, settings: dict[str, Any]
) -> Any:
    """`rows` with a `ref_logps` column, read from `cache_dir` when this model, data and settings were
    computed before (a resume, a second run), else computed once and written there."""
    from llmtune.parallel.engines import decided_by_main

    path = cache_dir / f"reference-{reference_key(settings, rows)}.json"
    # The main process's disk decides and all share what it read: a process that alone missed the file (another
    # node's disk, a shared one that lags) would compute alone and wait in collectives the others never join.
    values = decided_by_main(acc, lambda: json.loads(path.read_text()) if path.is_file() else None)
    if values is not None:
        log.info("reference log-probs: reusing %s", path)
    else:
        log.info("reference log-probs: computing %d rows once (cached in %s)", len(rows), path)
        values = compute_reference(model, rows, collate, batch_size, acc)
        if acc.is_main_process:
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(values))
            tmp.replace(path)  # atomic: a run killed while writing leaves no half cache
        acc.wait_for_everyone()
    return rows.add_column("ref_logps", values)
