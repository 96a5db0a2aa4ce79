"""GRPO's loss, gradients, KL and clipped share beside TRL 1.16's `GRPOTrainer._compute_loss` on the same
completions: the quickstart's SFT model samples 8 answers to each of 16 training questions (llmtune's sampler),
`exact_match` rewards them, one Adam step moves the policy off the weights that sampled (as the second of
num_iterations 2 does, so ratios leave 1 and the clip acts), and both codes score that step's batch for each loss
type. TRL runs its own method on a stand-in trainer (its state, none of its loop). Time is each side's forward +
backward with the reference's forward (beta 0.04), taking turns, as a ratio. The Adam step's rate is the demo's.

    .venv/bin/python -m benchmarks.grpo_vs_trl              # needs runs/quickstart/final (make train); ~1 minute

Writes benchmarks/results/grpo_vs_trl_cpu.json and prints the table.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import platform
import statistics
import time
import types
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks import RESULTS, ROOT
from llmtune.data import IGNORE
from llmtune.data.prompts import render_prompt_row
from llmtune.model.decode import pad_id, stop_ids, until_stop
from llmtune.objectives import rollouts as grpo
from llmtune.recipe import GRPOConfig

OUTPUT = RESULTS / "grpo_vs_trl_cpu.json"
QUESTIONS = ROOT / "assets" / "quickstart" / "train.jsonl"
LOSSES = ("grpo", "dr_grpo", "dapo")


def trl_layout(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TRL's inputs from our right-padded prompt + completion rows: left-padded prompts and right-padded
    completions, each a tensor of its own."""
    prompts, completions = [], []
    for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"], strict=True):
        n = int(mask.sum())
        start = int((labels[:n] != IGNORE).nonzero()[0])
        prompts.append(ids[:start])
        completions.append(ids[start:n])

    def pad(seqs: list[torch.Tensor], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            where = slice(width - len(s), width) if left else slice(0, len(s))
            ids[i, where], mask[i, where] = s, 1
        return ids, mask

    (prompt_ids, prompt_mask), (completion_ids, completion_mask) = pad(prompts, True), pad(completions, False)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }


def to_padded(flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Flat per-token values (row-major) -> [rows, completion width] at the mask's positions."""
    out = torch.zeros(mask.shape, dtype=flat.dtype)
    out[mask.bool()] = flat
    return out


def trl_loss(model: torch.nn.Module, inputs: dict, cfg: GRPOConfig) -> tuple[torch.Tensor, dict]:
    """TRL 1.16's GRPOTrainer._compute_loss (and the metrics it logs) on `inputs`, TRL's layout."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    metrics = collections.defaultdict(lambda: collections.defaultdict(list))
    accelerator = types.SimpleNamespace(
        device=torch.device("cpu"), num_processes=1, is_main_process=True,
        autocast=lambda: torch.autocast("cpu", enabled=False),
        gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x,
    )  # fmt: skip
    trainer = types.SimpleNamespace(
        accelerator=accelerator, aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=cfg.beta, loss_type=cfg.loss, epsilon_low=cfg.epsilon,
        epsilon_high=cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high, use_vllm=False,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1), model=model,
        current_gradient_accumulation_steps=1, max_completion_length=cfg.max_new_tokens, _metrics=metrics,
        _entropy_bonus_enabled=False,
    )  # fmt: skip
    trainer._get_per_token_logps_and_entropies = types.MethodType(
        GRPOTrainer._get_per_token_logps_and_entropies, trainer
    )
    loss = GRPOTrainer._compute_loss(trainer, model, inputs)
    return loss, metrics["train" if model.training else "eval"]


def with_trl_head(model: torch.nn.Module, cfg: GRPOConfig) -> torch.nn.Module:
    """TRL 1.16 computes log-probs through a head it fuses onto the model (our code ignores it)."""
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, temperature=cfg.temperature, outputs=("log_probs", "entropy"))
    return model


def gradients(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def trl_inputs(batch: dict[str, torch.Tensor], reference: torch.nn.Module | None, cfg: GRPOConfig) -> dict:
    """What TRL's `_compute_loss` reads for our batch: its layout, the advantages, the old log-probs and, for beta >
    0, the reference's log-probs (computed by our code: both sides read the same)."""
    inputs = trl_layout(batch)
    mask = inputs["completion_mask"]
    inputs |= {
        "advantages": batch["advantages"],
        "old_per_token_logps": to_padded(batch["old_logps"], mask),
        "num_items_in_batch": mask.sum(),
    }
    if reference is not None:
        with torch.no_grad():
            ref = grpo.GRPOModel(reference, "chunked", cfg, "none")(**batch, logps_only=True)
        inputs["ref_per_token_logps"] = to_padded(ref, mask)
    return inputs


def compare(
    policy: torch.nn.Module, reference: torch.nn.Module | None, batch: dict[str, torch.Tensor], cfg: GRPOConfig
) -> dict:
    """Ours and TRL's figures for one batch (`old_logps` in it; `reference` for beta > 0): the loss, its
    gradients, the KL and the share of clipped tokens."""
    ours = grpo.GRPOModel(policy, "chunked", cfg, "copy" if cfg.beta else "none", reference)
    out = ours(**batch)
    mine = out[0] / grpo.units_of(batch, cfg)
    mine_grads = gradients(policy, mine)
    clipped, kl, tokens = out[1:].tolist()

    theirs, metrics = trl_loss(policy, trl_inputs(batch, reference, cfg), cfg)
    theirs_grads = gradients(policy, theirs)
    norm = lambda gs: float(torch.linalg.vector_norm(torch.stack([g.norm() for g in gs])))  # noqa: E731
    return {
        "loss": [float(mine), float(theirs)],
        "grad_norm": [norm(mine_grads), norm(theirs_grads)],
        "grad_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(mine_grads, theirs_grads, strict=True)),
        "kl": [kl / tokens, float(metrics["kl"][0]) if metrics["kl"] else 0.0],
        "clip_ratio": [clipped / tokens, float(metrics["clip_ratio/region_mean"][0])],
    }


def rollout(model: torch.nn.Module, tokenizer, cfg: GRPOConfig, prompts: int) -> tuple[dict, dict]:
    """The first `prompts` training questions (every task), num_generations sampled answers each, rewarded and given
    their advantages."""
    lines = QUESTIONS.read_text().splitlines()[:prompts]
    rows = [render_prompt_row(json.loads(line), {"answer": "completion"}, "prompt", tokenizer) for line in lines]
    group = [r for r in rows for _ in range(cfg.num_generations)]
    seeds = [grpo.completion_seed(0, 0, r, k) for r in rows for k in range(cfg.num_generations)]
    stop = stop_ids(model, tokenizer, chat=True)
    sampling = grpo.Sampling([r["input_ids"] for r in group], seeds, cfg, stop, pad_id(tokenizer, stop), 128, False)
    with torch.no_grad():
        completions = grpo.generate_completions(model.eval(), sampling)
    texts = [tokenizer.decode(until_stop(c, stop), skip_special_tokens=True) for c in completions]
    rewards = grpo.score(grpo.load_rewards(cfg.rewards), group, texts, 0)[:, 0].float()
    advantages, group_std = grpo.group_advantages(rewards, cfg.num_generations, cfg.scale_rewards)
    examples = grpo.completion_rows([r["input_ids"] for r in group], completions, advantages.tolist())
    batch = grpo.collate_completions(examples, pad_token_id=pad_id(tokenizer, stop))
    stats = {
        "completions": len(completions),
        "reward_mean": float(rewards.mean()),
        "groups_without_signal": float(group_std.eq(0).float().mean()),
        "completion_tokens": int((batch["labels"] != IGNORE).sum()),
    }
    return batch, stats


def move_policy(policy: torch.nn.Module, batch: dict, cfg: GRPOConfig, lr: float) -> None:
    """The first update of num_iterations 2: the batch's old log-probs are the sampling weights', then one Adam
    step on the GRPO loss (without its KL term) moves the policy away from them."""
    cfg = dataclasses.replace(cfg, beta=0.0)
    module = grpo.GRPOModel(policy, "chunked", cfg, "none")
    with torch.no_grad():
        batch["old_logps"] = module(**batch, logps_only=True)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    out = module(**batch)
    (out[0] / grpo.units_of(batch, cfg)).backward()
    optimizer.step()
    policy.zero_grad(set_to_none=True)


def timed(policy, reference, batch, cfg, repeats: int) -> float:
    """TRL's forward + backward seconds over ours, taking turns (the median of the rounds' ratios)."""

    def ours() -> None:
        out = grpo.GRPOModel(policy, "chunked", cfg, "copy" if cfg.beta else "none", reference)(**batch)
        (out[0] / grpo.units_of(batch, cfg)).backward()

    def theirs() -> None:  # with the reference's forward, as ours runs it inside its own
        trl_loss(policy, trl_inputs(batch, reference, cfg), cfg)[0].backward()

    def seconds(fn) -> float:
        start = time.perf_counter()
        fn()
        policy.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    ours(), theirs()  # warm-up
    return statistics.median(seconds(theirs) / seconds(ours) for _ in range(repeats))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "runs" / "quickstart" / "final")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-5, help="the Adam step that moves the policy off the sampler")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=OUTPUT)
    a = p.parse_args(argv)
    if not (a.model / "config.json").exists():
        raise SystemExit(f"error: no model at {a.model} (run `make train` first, or pass --model DIR)")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    reference = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    base = GRPOConfig(
        num_generations=8, max_new_tokens=16, temperature=1.0, beta=0.04, epsilon=0.2, epsilon_high=0.28
    )  # fmt: skip
    assert base.rewards[0].function == "llmtune.rewards:exact_match"  # the default
    batch, stats = rollout(reference, tokenizer, base, a.prompts)
    policy = copy.deepcopy(reference).train()
    move_policy(policy, batch, base, a.lr)
    with_trl_head(policy, base)  # the reference's log-probs come from our code on both sides
    reference.eval()
    rows = {}
    for loss in LOSSES:
        cfg = dataclasses.replace(base, loss=loss)
        rows[loss] = compare(policy, reference, batch, cfg) | {
            "trl_over_ours_seconds": timed(policy, reference, batch, cfg, a.repeats)
        }
    result = {
        "command": "python -m benchmarks.grpo_vs_trl",
        "host": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "model": str(a.model.relative_to(ROOT) if a.model.is_relative_to(ROOT) else a.model),
        "settings": {k: getattr(base, k) for k in ("beta", "epsilon", "epsilon_high", "temperature")}
        | {"adam_lr": a.lr},
        "rollout": stats,
        "losses": rows,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {a.out}")
    return result


def table(result: dict) -> str:
    lines = [
        f"rollout: {result['rollout']}",
        "| loss | loss (ours / TRL) | grad norm (ours / TRL) | max abs grad diff | KL (ours / TRL) |"
        " clipped (ours / TRL) | TRL s / ours s |",
        "|---|---|---|---|---|---|---|",
    ]

    def pair(r: dict, k: str, f: str = ".6g") -> str:
        return f"{r[k][0]:{f}} / {r[k][1]:{f}}"

    for name, r in result["losses"].items():
        lines.append(
            f"| {name} | {pair(r, 'loss')} | {pair(r, 'grad_norm')} | {r['grad_max_abs_diff']:.2e} | {pair(r, 'kl')} |"
            f" {pair(r, 'clip_ratio', '.4f')} | {r['trl_over_ours_seconds']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
