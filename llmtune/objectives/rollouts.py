"""GRPO (and its Dr. GRPO and DAPO losses): online RL on the policy's own completions, rewarded by functions.

The machinery llmtune.objectives.grpo plugs into the loop:

* rewards (`load_rewards`, `score`): `module:function` names from the recipe, called with prompt=, completion=
  and the row's other fields; anything but a finite number stops the run naming the function and the prompt;
* advantages (`group_advantages`): each completion's reward less its group's mean, divided by the group's (or
  the batch's) std, as TRL 1.16 computes them;
* sampling (`generate_completions`, inside `GRPOModel`'s forward): the group's completions of each prompt with a
  KV cache (transformers' `generate`, one call for prompts of every length, left-padded), ending at any of the stop
  ids. Each completion's noise is counter-based, keyed by its own seed (the run's seed, the step, the row's content
  and its place in the group) and hashed on the device (Gumbel-max: the argmax of logits / T + Gumbel noise is a
  sample of the softmax), so a completion is the same whatever the batch or the number of processes. Nothing else
  touches the scores (`without_card_defaults`), and the blocks decode eager: a compiled block stays compiled for
  training. Under FSDP2 the weights are gathered once a rollout (`gathered_once`);
* the loss (`token_losses`, `GRPOModel`): TRL's clipped importance-weighted per-token loss with the k3 KL
  estimator, summed over the objective's units (completions; completions x max_new_tokens; tokens) so the loop
  divides by the units of the whole window on all processes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from llmtune.data import IGNORE
from llmtune.errors import UserError
from llmtune.objectives.pair_losses import labelled_logps
from llmtune.ops.loss import LossImpl, default_chunk_size, loss_rows, text_config
from llmtune.ops.noise import hashed_bits, uniform
from llmtune.parallel import sequence
from llmtune.recipe import GRPOConfig, RewardConfig

STATS = ("clipped_tokens", "kl", "completion_tokens")


class RewardError(UserError, ValueError):
    """A reward function that cannot be found, raises, or returns something other than a finite number."""


class Reward(NamedTuple):
    name: str  # as the recipe names it: module:function
    fn: Callable[..., Any]
    weight: float


# ---------------------------------------------------------------- rewards


def load_rewards(configs: Sequence[RewardConfig]) -> list[Reward]:
    """Import every reward function the recipe names, before anything heavy loads."""
    rewards = []
    for i, cfg in enumerate(configs):
        module_name, _, attr = cfg.function.partition(":")
        where = f"grpo.rewards[{i}].function {cfg.function!r}"
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise RewardError(f"{where}: cannot import module {module_name!r} ({err})") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            found = "not callable" if fn is not None else "not found"
            raise RewardError(f"{where}: {attr!r} is {found} in module {module_name!r} ({module.__file__})")
        rewards.append(Reward(cfg.function, fn, cfg.weight))
    return rewards


def score(rewards: Sequence[Reward], rows: Sequence[dict], completions: Sequence[str], step: int) -> Tensor:
    """Rewards [completions, functions]; `rows[i]` is the prompt row completion i answers (its `fields`)."""
    out = torch.zeros(len(completions), len(rewards), dtype=torch.float64)
    for i, (row, completion) in enumerate(zip(rows, completions, strict=True)):
        fields = json.loads(row["fields"])
        prompt = fields.pop("prompt")
        for j, reward in enumerate(rewards):
            where = (
                f"reward {reward.name} on the completion {completion!r:.60} of prompt {prompt!r:.80} (step {step + 1})"
            )
            try:
                value = reward.fn(prompt=prompt, completion=completion, **fields)
            except Exception as err:  # the user's code: any failure stops the run with one line
                raise RewardError(f"{where}: raised {type(err).__name__}: {err}") from err
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardError(f"{where}: returned {value!r:.40} ({type(value).__name__}), not a finite number")
            out[i, j] = float(value)
    return out


def group_advantages(rewards: Tensor, group: int, scale: str) -> tuple[Tensor, Tensor]:
    """(advantages, each completion's group std) of summed rewards [N] in consecutive groups of `group`, as TRL:
    reward less the group's mean, divided by the group's (scale=group) or the batch's (batch) std + 1e-4, whose
    Bessel correction TRL's `nanstd` applies too."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(1).repeat_interleave(group)
    group_std = grouped.std(1).repeat_interleave(group)
    std = rewards.std().expand_as(rewards) if scale == "batch" else group_std
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return advantages, group_std


# ---------------------------------------------------------------- sampling


def completion_seed(seed: int, step: int, row: dict, k: int) -> int:
    """The seed of the k-th completion of a prompt row at a step: from its content, not its place in the batch."""
    return zlib.crc32(json.dumps([seed, step, row["input_ids"], row["fields"], k]).encode())


def _int32(x: int) -> int:
    """`x` wrapped to a signed int32, as the hash's tensors hold it."""
    return (x + 2**31) % 2**32 - 2**31


# The step's key advances by an odd constant (2^32 / golden ratio): distinct for 2^32 steps, and far apart in bits.
_STEP_KEY = 0x9E3779B9


class GumbelSampling(LogitsProcessor):
    """Temperature, top-p, then per-row Gumbel noise: greedy decoding of these scores samples each row from its
    own seed (`seeds`), independent of the other rows. The noise is counter-based (llmtune.ops.noise): a hash of (the
    row's seed, the decoding step, the token id), computed on the scores' device, so nothing is drawn on the host
    nor copied to the device per token, and a row's noise depends on nothing else in its batch."""

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float):
        self.keys = torch.tensor([[_int32(s), _int32(mix_seed(s))] for s in seeds], dtype=torch.int32)
        self.temperature, self.top_p = temperature, top_p
        self.step = 0  # decoding steps so far: one processor serves one `generate` call
        self.tokens: Tensor | None = None  # the token ids [vocab] (int32), on the scores' device

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        scores = scores.float() / self.temperature
        if self.top_p < 1.0:  # as transformers' TopPLogitsWarper: drop the tail outside the top_p mass
            ordered, order = scores.sort(-1, descending=False)
            tail = ordered.softmax(-1).cumsum(-1) <= 1 - self.top_p
            tail[:, -1] = False  # the most likely token always stays
            scores = scores.masked_fill(tail.scatter(1, order, tail), -math.inf)
        if self.tokens is None:  # once a call: the row keys' only copy to the device
            self.tokens = torch.arange(scores.shape[-1], dtype=torch.int32, device=scores.device)
            self.keys = self.keys.to(scores.device)
        step_key = self.keys[:, 1:] + _int32(self.step * _STEP_KEY)  # a scalar argument, not a copy
        self.step += 1
        gumbel = uniform(hashed_bits(self.tokens, self.keys[:, :1], step_key)).log_().neg_().log_().neg_()
        return scores.add_(gumbel)  # scores / T is this processor's own tensor


def mix_seed(seed: int) -> int:
    """A second 32-bit key from a seed (a completion's: crc32 values, or small test integers)."""
    return zlib.crc32(seed.to_bytes(8, "little", signed=True))


class Sampling(NamedTuple):
    """What to sample: one completion per (prompt, seed), `batch_rows` rows per `generate` call at most; `synced`:
    every process runs as many forwards as the longest (ZeRO-3: each forward gathers weights with the others)."""

    prompts: Sequence[list[int]]
    seeds: Sequence[int]
    cfg: GRPOConfig
    stop: Sequence[int]
    pad: int
    batch_rows: int
    synced: bool


def left_padded(prompts: Sequence[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """(ids, attention mask) of prompts of any length, padded on the left: every row's last prompt token sits in the
    last column, where `generate` appends; transformers numbers each row's positions from its mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def generate_completions(model: Any, s: Sampling) -> list[list[int]]:
    """Each completion's ids up to and with its first stop id (or max_new_tokens of them).

    One `generate` call per `batch_rows` rows whatever their prompts' lengths (left-padded, `left_padded`), the
    rows sorted by length so that a call pads little. A row's tokens are what it would sample alone: its noise is
    its own (`GumbelSampling`) and the mask hides the pads. Greedy decoding of GumbelSampling's scores is the only
    processing of the logits (`without_card_defaults`).

    Decoding runs the blocks eager, compiled (`training.compile`) or not: through a compiled block every token
    changes Dynamo's guards (the KV cache grows), so one rollout spent the blocks' recompile limit and every
    training step after it, whose shapes Dynamo had not met yet, ran eager for the rest of the run."""
    device = next(model.parameters()).device
    config = GenerationConfig(
        max_new_tokens=s.cfg.max_new_tokens, do_sample=False, eos_token_id=list(s.stop), pad_token_id=s.pad
    )
    order = sorted(range(len(s.prompts)), key=lambda i: len(s.prompts[i]))
    out: list[list[int]] = [[] for _ in s.prompts]
    with torch.compiler.set_stance("force_eager"), without_card_defaults(model):
        for start in range(0, len(order), s.batch_rows):
            chunk = order[start : start + s.batch_rows]
            ids, mask = left_padded([s.prompts[i] for i in chunk], s.pad)
            processor = GumbelSampling([s.seeds[i] for i in chunk], s.cfg.temperature, s.cfg.top_p)
            generated = model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                generation_config=config,
                logits_processor=LogitsProcessorList([processor]),
                synced_gpus=s.synced,
            )
            for row, i in zip(generated[:, ids.shape[1] :].tolist(), chunk, strict=True):
                end = next((k + 1 for k, token in enumerate(row) if token in s.stop), len(row))
                out[i] = row[:end]
    return out


@contextlib.contextmanager
def without_card_defaults(model: Any) -> Iterator[None]:
    """The model's own generation_config (its card's decoding preferences) set aside for a blank one while it
    samples. `generate` fills each field its config leaves None from the model's: Qwen2.5-Instruct's
    repetition_penalty 1.05 would act at every token, and a field whose "off" is None (bad_words_ids,
    suppress_tokens, sequence_bias, min_p, forced_eos_token_id, ...) is one a passed config cannot turn off. The
    loss takes the completions for samples of the policy's softmax at the recipe's temperature and top_p, so
    nothing but `GumbelSampling` may touch the scores: what `generate_completions` leaves unset is transformers'
    global default, neutral. A peft model's `generate` runs on its base model, which reads its config there."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    card = base.generation_config
    base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = card


@contextlib.contextmanager
def gathered_once(module: torch.nn.Module) -> Iterator[None]:
    """Under FSDP2, every sharded module of `module` all-gathered once for a whole rollout and kept gathered across
    its forwards (one per decoded token), then resharded: without it each block all-gathers its weights at every
    token, and every process must run as many forwards as the longest (`synced_gpus`). Costs the whole model's
    unsharded weights for the rollout (llmtune.plan.generation counts them). Called inside the root's forward,
    after FSDP2's lazy initialisation has fixed which module is the root. Anything else: nothing to do."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    # Each module's reshard-after-forward as set by sharding (blocks True, the root False), restored after.
    groups = [_param_groups(m._get_fsdp_state()) for m in sharded]
    reshards = [any(g.post_forward_mesh_info is not None for g in gs) for gs in groups]
    for m in sharded:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m, reshard in zip(sharded, reshards, strict=True):
            m.set_reshard_after_forward(reshard, recurse=False)
            m.reshard()


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 module's parameter groups: a list since torch 2.12, one group (or None) before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


# ---------------------------------------------------------------- the loss


def token_losses(
    logps: Tensor, old: Tensor, advantages: Tensor, ref: Tensor | None, cfg: GRPOConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """(per-token loss, per-token KL, clipped tokens) as TRL's `_compute_loss` (token-level importance sampling):
    -min(r * A, clip(r, 1 - eps, 1 + eps_high) * A) + beta * (exp(ref - logp) - (ref - logp) - 1)."""
    high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    ratio = torch.exp(logps - old)
    clipped_ratio = ratio.clamp(1 - cfg.epsilon, 1 + high)
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    kl = torch.zeros_like(logps)
    if cfg.beta != 0.0:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        loss = loss + cfg.beta * kl
    # TRL's clip_ratio/region_mean: the tokens whose gradient the clip removed.
    clipped = ((ratio < 1 - cfg.epsilon) & (advantages < 0)) | ((ratio > 1 + high) & (advantages > 0))
    return loss, kl, clipped


def reduce_losses(loss: Tensor, row: Tensor, rows: int, kind: str) -> Tensor:
    """The loss summed over the objective's units: per-completion means summed (grpo), or the tokens' sum."""
    if kind != "grpo":
        return loss.sum()
    sums = torch.zeros(rows, dtype=loss.dtype, device=loss.device).index_add(0, row, loss)
    counts = torch.zeros(rows, dtype=loss.dtype, device=loss.device).index_add(0, row, torch.ones_like(loss))
    # Split along the sequence (llmtune.parallel.sequence), a completion's tokens are spread over the group's
    # processes: each divides its part of the sum by the whole count, and the gradient reduction sums the parts.
    return (sums / sequence.sum_over_group(counts).clamp(min=1)).sum()


def units_of(batch: dict[str, Tensor], cfg: GRPOConfig) -> int:
    """What the loss is averaged over: completions (grpo), completions x max_new_tokens (dr_grpo), tokens (dapo)."""
    completions = int(batch["advantages"].numel())
    if cfg.loss == "grpo":
        return completions
    if cfg.loss == "dr_grpo":
        return completions * cfg.max_new_tokens
    return int((batch["labels"][:, 1:] != IGNORE).sum())


class GRPOModel(torch.nn.Module):
    """A causal LM whose forward returns [loss summed over units, *STATS summed] (the loop's contract).

    `reference`: adapter_disabled (the same peft model, adapters off), copy (`reference_model`, frozen, outside
    this module's parameters) or none (beta 0). With `logps_only`, the forward returns the labelled tokens'
    log-probs (the old log-probs of num_iterations > 1, computed through the prepared module)."""

    def __init__(
        self,
        model: torch.nn.Module,
        impl: LossImpl,
        cfg: GRPOConfig,
        reference: str,
        reference_model: torch.nn.Module | None = None,
        chunk_size: int | None = None,
    ):
        super().__init__()
        self.model, self.impl, self.cfg, self.reference = model, impl, cfg, reference
        self.chunk_size = chunk_size or default_chunk_size(text_config(model.config).vocab_size)
        self._reference_model = (reference_model,)  # a tuple: not registered as a submodule

    def logps(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return labelled_logps(model, self.impl, self.chunk_size, batch, self.cfg.temperature)

    def reference_logps(self, batch: dict[str, Tensor]) -> Tensor | None:
        if self.reference == "none":
            return None
        with torch.no_grad():
            if self.reference == "adapter_disabled":
                with self.model.disable_adapter():
                    return self.logps(self.model, batch)[0]
            return self.logps(self._reference_model[0], batch)[0]

    def forward(self, logps_only: bool = False, sample: Sampling | None = None, **batch: Tensor) -> Any:
        if sample is not None:
            # Sampling runs inside this module's forward: under FSDP2 only the root's forward gathers the root's
            # weights (embeddings, final norm, head), and the blocks may run only after it.
            with gathered_once(self):
                return generate_completions(self.model, sample)
        if logps_only:
            return self.logps(self.model, batch)[0]
        # The reference runs first, under no_grad: its activations are gone before the policy's are kept.
        ref = self.reference_logps(batch)
        logps, flat = self.logps(self.model, batch)
        row = flat // batch["input_ids"].shape[1]
        old = batch["old_logps"] if "old_logps" in batch else logps.detach()
        loss, kl, clipped = token_losses(logps, old, batch["advantages"][row].float(), ref, self.cfg)
        total = reduce_losses(loss, row, batch["input_ids"].shape[0], self.cfg.loss)
        stats = torch.stack([clipped.float().sum(), kl.detach().sum(), torch.tensor(float(len(logps)))])
        return torch.cat([total.unsqueeze(0), stats.to(total.device)])


def completion_rows(
    prompts: Sequence[list[int]], completions: Sequence[list[int]], advantages: Sequence[float]
) -> list[dict]:
    """Prompt + completion rows, only the completion labelled, each with its advantage (`collate_completions`'s
    examples)."""
    return [
        {"input_ids": p + c, "labels": [IGNORE] * len(p) + c, "advantage": a}
        for p, c, a in zip(prompts, completions, advantages, strict=True)
    ]


def collate_completions(
    examples: list[dict], *, pad_token_id: int, packed: bool = False, pad_to_multiple_of: int | None = None
) -> dict[str, Tensor]:
    """Prompt + completion rows, right-padded (llmtune.data.collate), with each row's advantage and, when the
    rollout kept them, its tokens' old log-probs (flat, in the order `labelled_logps` returns tokens)."""
    from llmtune.data import collate

    rows = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
    batch = collate(rows, pad_token_id=pad_token_id, packed=False, pad_to_multiple_of=pad_to_multiple_of)
    batch["advantages"] = torch.tensor([e["advantage"] for e in examples], dtype=torch.float32)
    if "old_logps" in examples[0]:
        batch["old_logps"] = torch.tensor([x for e in examples for x in e["old_logps"]], dtype=torch.float32)
    batch["loss_rows"] = loss_rows(batch["labels"])  # on the host: the log-probs never wait for the device
    return batch
