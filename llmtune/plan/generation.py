"""The generation phase of a grpo step: the peak of sampling `rows` completions in one `generate` call, and the rows
the planner lets one call take (`plan_generation_rows`).

A closed form, from what transformers 5's `generate` (generation/utils.py `_sample`) and `DynamicCache`
(cache_utils.py `DynamicLayer`) allocate, checked against the live tensors of real calls (tests/test_grpo_plan.py):

* resident: what training holds between steps (weights, optimizer states, a frozen reference; gradients are freed
  by `zero_grad(set_to_none=True)` before the rollout) -- `generation_resident` takes it from the training estimate.
  Under autocast (mixed precision without sharding) its cache of cast weights lives for the whole call: autocast
  caches the cast of every fp32 leaf that requires grad, under `no_grad` too, until the outermost autocast exits.
* under FSDP2, the whole model's weights, all-gathered once for the rollout
  (llmtune.objectives.rollouts.gathered_once) beside the shards training keeps.
* the KV cache: per layer a key and a value [rows, kv_heads, tokens, head_dim]. `DynamicLayer.update` grows them by
  `torch.cat` each step, so while a layer updates, its old key (or value) lives beside the new one. Its last forward
  holds prompt + max_new_tokens - 1 tokens (the last token is sampled, never fed back). Under autocast the keys are
  fp32: the rotary tables follow the fp32 residual stream and `k * cos` promotes the projection's bf16 output.
* prefill: one forward of rows x prompt tokens without grad. Its peak is in the last layer's MLP, with the whole
  prompt cached: act(gate), up and their product (3 x intermediate; LoRA a 4th: peft adds the adapter's output to
  the base's), beside the embedding output (held by the decoder's forward), the layer's input, the attention
  residual and the normed input (4 x hidden) and the rotary cos/sin tables. Only the last position's logits are
  computed (`logits_to_keep=1`). Under LoRA with autocast (or QLoRA) each frozen base weight is made 16-bit for its
  matmul and freed after it (`weight_cast_bytes`).
* sampling, at every step: the model's logits [rows, vocab] (the compute dtype), `next_token_logits` (an fp32 copy),
  the previous step's scores (still bound in `_sample` while the processor runs), and what llmtune.objectives.rollouts's
  `GumbelSampling` makes: scores / T, the hashed int32 bits of its counter-based noise and their shifted copy, the
  uniforms and their logs (in place), added into scores / T -- at most 24 bytes a logit beside the model's logits,
  and the int32 token ids [vocab] it hashes, kept for the call. top-p adds its sorted scores, the sort's int64
  indices and the tail mask (13 bytes a logit), kept until the processor returns.
* the decode forward: one token a row, with the previous step's fp32 logits and scores still bound (and, under
  LoRA's casts, the head's 16-bit copy).
* ids: input_ids and the attention mask (int64), each copied by `torch.cat` per step.

Over-stated on purpose: under autocast the cast cache is taken whole from the start (the prefill's peak comes before
the last layer's down projection and the head are cast); every prompt is taken at data.max_length tokens.
Not modelled: sliding-window layers (their cache stops growing at the window; over-stated here), mixture-of-experts
MLPs (taken as a dense MLP of `intermediate_size`), the attention kernels' workspaces (flash / memory-efficient:
small), the CUDA allocator's fragmentation by the growing cache beyond the training step's overhead (added as it is),
and num_iterations > 1's forward of the completions for their old log-probs (a no-grad forward of a micro-batch: less
than the training step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmtune.units import format_bytes

FP32, INT64 = 4, 8
SAMPLING_BYTES = 24  # a logit's fp32 buffers in a sampling step beside the model's logits (see the docstring)
TOP_P_BYTES = 13  # top-p's sorted scores (4), sort indices (8) and tail mask (1)
STATE_TAGS = ("weights", "optimizer_states", "reference_weights", "sharding_buffers")


@dataclass(frozen=True)
class DecoderShape:
    """What a decoder's generation memory depends on, from its (text) config."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> DecoderShape:
        """num_key_value_heads absent: multi-head attention; head_dim absent: hidden / heads."""
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(c.num_attention_heads)
        return cls(
            layers=int(c.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
            hidden=int(c.hidden_size),
            intermediate=int(getattr(c, "intermediate_size", None) or 4 * c.hidden_size),
            vocab=int(c.vocab_size),
        )


@dataclass(frozen=True)
class Widths:
    """Bytes per element of what generation keeps: cached keys and values, the residual stream (embedding, norms,
    rotary tables), and matmul outputs (projections, the MLP, the logits); and whether autocast casts the weights."""

    key: int
    value: int
    residual: int
    matmul: int
    autocast: bool = False


def generation_widths(precision: str, sharding: str = "none") -> Widths:
    """fp32: all fp32. bf16-true, or mixed precision under a sharding engine (FSDP2 and DeepSpeed cast the weights
    to 16 bits and run without autocast): all 16-bit. Mixed precision otherwise runs under autocast: fp32 residual
    stream and keys (see the module docstring), 16-bit values and matmul outputs."""
    if precision == "fp32":
        return Widths(FP32, FP32, FP32, FP32)
    if precision == "bf16-true" or sharding != "none":
        return Widths(2, 2, 2, 2)
    return Widths(FP32, 2 if values_stay_16_bit() else FP32, FP32, 2, autocast=True)


def values_stay_16_bit() -> bool:
    """Whether transformers caches autocast's 16-bit values as they are: 5.25 does; 5.17 (the floor) caches them in
    fp32 like the keys (measured on a real cache, tests/test_grpo_plan.py, on both)."""
    from transformers import __version__

    major, minor = (int(part) for part in __version__.split(".")[:2])
    return (major, minor) >= (5, 25)


@dataclass(frozen=True)
class GenerationEstimate:
    """Predicted peak of one `generate` call of `rows` rows, with what was live at it."""

    rows: int
    peak_bytes: int
    peak_phase: str  # prefill | decode forward | sampling
    breakdown: dict[str, int]
    prompt_tokens: int
    max_new_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "peak_bytes": self.peak_bytes,
            "peak": format_bytes(self.peak_bytes),
            "peak_phase": self.peak_phase,
            "breakdown": self.breakdown,
            "prompt_tokens": self.prompt_tokens,
            "max_new_tokens": self.max_new_tokens,
        }


def kv_cache_bytes(shape: DecoderShape, widths: Widths, rows: int, tokens: int) -> int:
    """Keys and values of every layer for `rows` x `tokens`."""
    return shape.layers * shape.kv_heads * shape.head_dim * rows * tokens * (widths.key + widths.value)


def forward_activation_bytes(
    shape: DecoderShape, widths: Widths, queries: int, keys: int, *, eager: bool = False, lora: str | None = None
) -> int:
    """The most a decoder layer's forward holds for one row of `queries` tokens attending to `keys`, without grad:
    the MLP's three intermediates (act(gate), up, their product; four under LoRA, whose `result + lora_B(...) *
    scaling` holds the base output, the adapter's and its scaled copy beside act(gate)), or attention's query, its
    rotated copy, output and transposed output, key and value, whichever is more; beside four residual-stream
    vectors and the rotary cos/sin a token.

    Eager attention also materialises the scores: the scaled matmul and softmax's fp32 output while attention runs;
    the layer keeps the probabilities (returned as attention weights) through its MLP, and the model its additive
    mask [rows, 1, queries, keys] in the residual's dtype through the whole forward."""
    s, w = shape, widths
    scores = s.heads * queries * keys if eager else 0
    mlp = (4 if lora else 3) * s.intermediate * w.matmul * queries + scores * w.matmul
    attention = (4 * s.heads + 2 * s.kv_heads) * s.head_dim * w.matmul * queries + scores * (w.matmul + FP32)
    mask = queries * keys * w.residual if eager else 0
    return max(mlp, attention) + (4 * s.hidden + 2 * s.head_dim) * w.residual * queries + mask


def weight_cast_bytes(shape: DecoderShape, widths: Widths, lora: str | None, *, head: bool) -> int:
    """A frozen weight made 16-bit for its one matmul, freed after it: under LoRA autocast casts the base weights op
    by op (it caches only weights that require grad) and QLoRA dequantises its 4-bit ones. The largest an MLP weight
    or, with `head` (a decode step, whose head runs beside the whole cache), the head's too."""
    if lora is None or not (widths.autocast or lora == "qlora"):
        return 0
    return 2 * shape.hidden * (max(shape.intermediate, shape.vocab) if head else shape.intermediate)


def generation_peak(
    config: Any,
    *,
    rows: int,
    prompt_tokens: int,
    max_new_tokens: int,
    resident_bytes: int = 0,
    precision: str = "fp32",
    sharding: str = "none",
    top_p: float = 1.0,
    attn_implementation: str = "sdpa",
    lora: str | None = None,
) -> GenerationEstimate:
    """The peak of `generate` on `rows` prompts of `prompt_tokens` (no padding) sampling up to `max_new_tokens`, with
    `resident_bytes` live throughout: the largest of its prefill, last decode forward and last sampling step.
    `lora`: the adapters' method (lora, dora, qlora) where the policy has them."""
    if rows < 1 or prompt_tokens < 1 or max_new_tokens < 1:
        raise ValueError(
            f"rows, prompt_tokens and max_new_tokens must be >= 1, got {rows}, {prompt_tokens}, {max_new_tokens}"
        )
    s, w = DecoderShape.of(config), generation_widths(precision, sharding)
    phases = _phases(s, w, rows, prompt_tokens, max_new_tokens, top_p, attn_implementation == "eager", lora)
    phase, parts = max(phases.items(), key=lambda kv: sum(kv[1].values()))
    ids = 4 * rows * (prompt_tokens + max_new_tokens) * INT64  # input_ids and mask, old and new during cat
    breakdown = {"resident": resident_bytes, **{k: v for k, v in parts.items() if v}, "ids": ids}
    return GenerationEstimate(rows, sum(breakdown.values()), phase, breakdown, prompt_tokens, max_new_tokens)


def _phases(
    s: DecoderShape, w: Widths, rows: int, prompt: int, new: int, top_p: float, eager: bool, lora: str | None
) -> dict[str, dict[str, int]]:
    """What each phase holds at its peak beside the resident state and the ids (see the module docstring)."""
    last = prompt + new - 1  # tokens cached by the last forward
    logits = rows * s.vocab
    per_logit = w.matmul + SAMPLING_BYTES + (TOP_P_BYTES if top_p < 1.0 else 0)
    return {
        "prefill": {
            "kv_cache": kv_cache_bytes(s, w, rows, prompt),
            "activations": rows * forward_activation_bytes(s, w, prompt, prompt, eager=eager, lora=lora),
            "weight_cast": weight_cast_bytes(s, w, lora, head=False),
        },
        "decode forward": {
            # One layer's old key (or value) lives beside the cache while `torch.cat` grows it.
            "kv_cache": kv_cache_bytes(s, w, rows, last) + kv_cache_bytes(s, w, rows, last) // (2 * s.layers),
            "activations": rows * forward_activation_bytes(s, w, 1, last, eager=eager, lora=lora),
            "weight_cast": weight_cast_bytes(s, w, lora, head=True),
            "logits_and_sampling": 2 * FP32 * logits,  # the previous step's next_token_logits and scores
            "noise_counters": FP32 * s.vocab,  # GumbelSampling's int32 token ids, kept for the call
        },
        "sampling": {
            "kv_cache": kv_cache_bytes(s, w, rows, last),
            "logits_and_sampling": per_logit * logits,
            "noise_counters": FP32 * s.vocab,
        },
    }


def generation_resident(training: Any) -> int:
    """What a training estimate (`MemoryEstimate`) says stays live into the rollout: each state's largest share in any
    segment of the step (weights, optimizer states, a frozen reference, a sharding engine's gathered layers), under
    FSDP2 the whole model gathered for the rollout, the autocast cache of the trainable weights' casts where autocast
    runs, and the CUDA allocator's overhead.

    The autocast cache: a full fine-tune's is the step's own (`autocast_weight_copies`: every matmul weight);
    under LoRA the step also keeps the frozen base's casts for backward, which generation casts op by op
    (`weight_cast_bytes`), so only the adapters' 16-bit copies count."""
    segments = training.segment_peaks.values()
    s = training.settings
    states = sum(max((seg.get(tag, 0) for seg in segments), default=0) for tag in STATE_TAGS)
    if s["sharding"].startswith("fsdp") and s["num_processes"] > 1:
        # llmtune.objectives.rollouts.gathered_once: the whole model unsharded for the rollout beside its shards,
        # gathered in the compute dtype (mixed precision: bf16 or fp16 copies of fp32 shards).
        shards = max((seg.get("weights", 0) for seg in segments), default=0)
        states += shards * s["num_processes"] // (2 if s["precision"] in ("bf16", "fp16") else 1)
    if generation_widths(s["precision"], s["sharding"]).autocast:
        if s.get("lora"):
            states += 2 * training.totals["trainable_parameters"]
        else:
            states += max((seg.get("autocast_weight_copies", 0) for seg in segments), default=0)
    return states + training.reserved_bytes - training.peak_bytes


def plan_generation_rows(
    peak_of: Callable[[int], GenerationEstimate], *, group: int, per_process: int, budget_bytes: int | None
) -> tuple[int, GenerationEstimate]:
    """The rows of one `generate` call: the largest multiple of `group` (whole groups), up to `per_process`, whose
    peak (`peak_of(rows)`, a `GenerationEstimate`) fits `budget_bytes`; without a budget all `per_process` rows.
    Where not even one group fits, the largest smaller count that does (sampling needs no whole group: each
    completion has its own noise), else 1 row, over the budget (the plan then does not fit)."""
    if budget_bytes is None:
        return per_process, peak_of(per_process)
    wholes = range(per_process - per_process % group, 0, -group)
    for rows in (*wholes, *range(min(group - 1, per_process), 0, -1)):
        est = peak_of(rows)
        if est.peak_bytes <= budget_bytes:
            return rows, est
    return 1, peak_of(1)
