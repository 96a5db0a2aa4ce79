"""GRPO as an objective: each step's prompts become the policy's own completions, rewarded and compared within their
group (llmtune.objectives.rollouts), and those completions are what the step trains on.

A step draws global_batch_size / num_generations prompts; each process samples all num_generations completions
of its own prompts, so a group never spans processes, and the rewards of all processes are gathered to normalise
them (per group, or over the batch) and to report them. With num_iterations k, one batch of completions is
trained on for k optimizer steps, against the log-probs the policy gave them when they were sampled.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch

from llmtune.data import IGNORE
from llmtune.errors import SetupError
from llmtune.model.decode import pad_id, stop_ids, until_stop
from llmtune.objectives import rollouts as grpo
from llmtune.objectives.base import Objective
from llmtune.ops.measure import PeakMemoryTracker
from llmtune.parallel import sequence
from llmtune.recipe import GRPOConfig
from llmtune.units import format_bytes

if TYPE_CHECKING:
    from llmtune.data import PreparedData
    from llmtune.objectives.base import AttachContext

log = logging.getLogger(__name__)

# A reward that gave every completion of this many batches the same value is warned about: it teaches nothing.
CONSTANT_REWARD_BATCHES = 5


class GRPO(Objective):
    name = "grpo"

    def __init__(self, cfg: GRPOConfig, reference: str, seed: int) -> None:
        self.cfg, self.reference, self.seed = cfg, reference, seed  # reference: resolved (`reference_for`)
        self.rewards = grpo.load_rewards(cfg.rewards)  # a missing function stops the run before anything loads
        self.rows_per_example = cfg.num_generations
        self.context: AttachContext | None = None
        self.stop: list[int] = []
        self.prepared: torch.nn.Module | None = None
        self.batch: tuple[int, list[dict]] | None = None  # (generation, its completions' rows)
        self.rollout_metrics: dict[str, float] = {}
        self.varied = dict.fromkeys((r.name for r in self.rewards), False)
        self.generations = 0
        self.generation_peak: int | None = None  # bytes, of the last batch's sampling where it was measured

    def wrap(
        self, model: torch.nn.Module, loss_impl: str, frozen: torch.nn.Module | None, chunk_size: int | None
    ) -> torch.nn.Module:
        return grpo.GRPOModel(model, loss_impl, self.cfg, self.reference, frozen, chunk_size)

    collate = staticmethod(grpo.collate_completions)

    def longest_example(self, length: int, packed: bool) -> dict:
        """A prompt and its completion filling a row of `length` tokens (never packed), every token trained, with an
        advantage. No old log-probs (num_iterations > 1: 4 bytes a trained token): beside the logits, noise."""
        ids = [0] * length
        return {"input_ids": ids, "labels": ids, "advantage": 0.0}

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return grpo.units_of(batch, self.cfg)

    def metrics(self, sums: list[float], units: int) -> dict[str, float]:
        clipped, kl, tokens = sums
        out = {"clip_ratio": clipped / max(tokens, 1)}
        if self.cfg.beta:
            out["kl"] = kl / max(tokens, 1)
        return out | self.rollout_metrics

    def check_engine(self, engine: str) -> None:
        if engine == "zero3" and self.reference == "copy":
            raise SetupError(
                "grpo.beta > 0 without LoRA keeps a frozen copy of the model, which ZeRO-3's empty partitions cannot"
                " give; use LoRA (the reference is then the model with its adapters off), grpo.beta: 0, or ZeRO-2"
            )

    def attach(self, prepared: torch.nn.Module, data: PreparedData, context: AttachContext) -> PreparedData:
        self.prepared, self.context = prepared, context
        self.stop = stop_ids(context.accelerator.unwrap_model(prepared).model, context.tokenizer, chat=True)
        return data

    def draw(self, step: int, global_batch_size: int) -> tuple[int, int]:
        """(the data step, prompts in the global batch): num_iterations steps share one batch of prompts."""
        return step // self.cfg.num_iterations, global_batch_size // self.cfg.num_generations

    def rollout(self, examples: list[dict], step: int) -> list[dict]:
        """The completions this process trains on at `step`: sampled, rewarded and given their advantages at the
        first step of a batch, the same rows for the num_iterations - 1 steps after it."""
        generation = step // self.cfg.num_iterations
        if self.batch is not None and self.batch[0] == generation:
            return self.batch[1]
        rows = self.completion_rows(examples, generation)
        if self.cfg.num_iterations > 1:
            self.keep_old_logps(rows)
        self.batch = (generation, rows)
        return rows

    def completion_rows(self, examples: list[dict], generation: int) -> list[dict]:
        g, ctx = self.cfg.num_generations, self.context
        prompts = [e for e in examples for _ in range(g)]
        seeds = [grpo.completion_seed(self.seed, generation, e, k) for e in examples for k in range(g)]
        completions = self.sample([p["input_ids"] for p in prompts], seeds)
        texts = [ctx.tokenizer.decode(until_stop(c, self.stop), skip_special_tokens=True) for c in completions]
        scores = grpo.score(self.rewards, prompts, texts, generation)
        advantages = self.advantages(scores, completions)
        return grpo.completion_rows([p["input_ids"] for p in prompts], completions, advantages.tolist())

    def sample(self, prompts: list[list[int]], seeds: list[int]) -> list[list[int]]:
        """The policy's completions, sampled with the weights it trains now, through the prepared module's forward
        (where each engine has its weights: FSDP2 gathers the root's only there). The first two batches are
        measured on a CPU (counting tensors slows sampling down), every batch on CUDA (the allocator counts)."""
        ctx = self.context
        acc, plan = ctx.accelerator, ctx.plan
        request = grpo.Sampling(
            prompts, seeds, self.cfg, self.stop, pad_id(ctx.tokenizer, self.stop), plan.generation_rows or len(prompts),
            synced=acc.num_processes > 1 and ctx.engine == "zero3",  # FSDP2 gathers once (grpo.gathered_once)
        )  # fmt: skip
        measured = acc.device.type == "cuda" or self.generations < 2
        tracker = PeakMemoryTracker(acc.device, baseline=[self.prepared, ctx.optimizer]) if measured else None
        self.prepared.eval()  # no dropout while sampling; transformers keeps its KV cache only outside training mode
        try:
            model = acc.unwrap_model(self.prepared).model
            with torch.no_grad(), acc.autocast(), tracker or contextlib.nullcontext(), sequence.generating(model):
                completions = self.prepared(sample=request)
        finally:
            self.prepared.train()
        self.generation_peak = None if tracker is None else tracker.peak_bytes
        return completions

    def advantages(self, scores: torch.Tensor, completions: list[list[int]]) -> torch.Tensor:
        """This process's advantages, from the rewards of all processes (gathered: groups are normalised over the
        batch when scale_rewards is batch, and reported whole)."""
        acc = self.context.accelerator
        weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)
        lengths = torch.tensor(
            [[len(c), len(c) == self.cfg.max_new_tokens and c[-1] not in self.stop] for c in completions]
        )
        everything = acc.gather(torch.cat([scores.float(), lengths.float()], 1).to(acc.device)).cpu()
        # The processes of a sequence group sampled the same completions: one copy of each.
        group = sequence.current()
        everything = everything.view(acc.num_processes, -1, everything.shape[1])[:: group.degree].flatten(0, 1)
        per_function, lengths = everything[:, : len(self.rewards)], everything[:, len(self.rewards) :]
        summed = (per_function * weights).sum(1)
        advantages, group_std = grpo.group_advantages(summed, self.cfg.num_generations, self.cfg.scale_rewards)
        self.report(per_function, summed, group_std, lengths)
        mine = len(completions)
        return advantages[group.data_rank * mine : (group.data_rank + 1) * mine]

    def report(self, per_function: torch.Tensor, summed: torch.Tensor, group_std: torch.Tensor, lengths) -> None:
        """The step's reward metrics (TRL's names), and a warning for a reward that never varies."""
        out = {
            "reward": float(summed.mean()),
            "reward_std": float(group_std.mean()),
            "frac_reward_zero_std": float(torch.isclose(group_std, torch.zeros_like(group_std)).float().mean()),
            "completion_length": float(lengths[:, 0].mean()),
            "completions_clipped": float(lengths[:, 1].mean()),
        }
        for j, reward in enumerate(self.rewards):
            values = per_function[:, j]
            out[f"rewards/{reward.name}/mean"], out[f"rewards/{reward.name}/std"] = (
                float(values.mean()),
                float(values.std()),
            )
            self.varied[reward.name] |= bool((values != values[0]).any())
        if self.generation_peak is not None:
            out["generation_peak_bytes"] = self.generation_peak
            if self.generations == 1:
                self.log_generation_peak()
        self.rollout_metrics = out
        self.generations += 1
        if self.generations == CONSTANT_REWARD_BATCHES:
            for name, varied in self.varied.items():
                if not varied:
                    log.warning(
                        "reward %s gave every completion of the first %d batches the same value (%g): it gives the"
                        " policy nothing to learn from (is it reading the right field?)",
                        name, CONSTANT_REWARD_BATCHES, float(per_function[0, list(self.varied).index(name)]),
                    )  # fmt: skip

    def log_generation_peak(self) -> None:
        """The sampling peak of this process measured at the second batch (the first holds no optimizer state yet),
        beside the plan's prediction."""
        predicted = self.context.plan.generation
        said = f", the plan predicted {format_bytes(predicted.peak_bytes)}" if predicted is not None else ""
        log.info(
            "generation: %d rows a call, measured peak %s%s", self.context.plan.generation_rows or 0,
            format_bytes(self.generation_peak), said,
        )  # fmt: skip

    def keep_old_logps(self, rows: list[dict]) -> None:
        """num_iterations > 1: each token's log-prob under the weights that sampled it, through the prepared module
        (FSDP2 and ZeRO-3 gather the weights there), kept in its row for the later steps' importance ratios."""
        ctx = self.context
        m = ctx.plan.micro_batch_size
        with torch.no_grad():
            for i in range(0, len(rows), m):
                chunk = rows[i : i + m]
                batch = self.collate(chunk, pad_token_id=ctx.pad_token_id)
                batch = {k: v.to(ctx.accelerator.device) for k, v in batch.items()}
                logps = self.prepared(**batch, logps_only=True).float().cpu()
                for row, part in zip(
                    chunk, logps.split([len(r["input_ids"]) - r["labels"].count(IGNORE) for r in chunk]), strict=True
                ):
                    row["old_logps"] = part.tolist()
