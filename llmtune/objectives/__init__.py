"""What a run optimises, behind one small protocol: the loop (llmtune.train) calls these and never asks which.

An objective says
* `module`: the torch module the loop trains, whose forward returns [loss summed over units, *stats summed] (or
  the summed loss alone); it wraps the causal LM before any engine (DDP, FSDP2, DeepSpeed) wraps it;
* `collate`: how examples become one micro-batch;
* `units`: what the loss is averaged over in a batch (SFT: trained tokens; preference: pairs);
* `metrics`: its own metrics.jsonl values from the summed stats of a step;
* `check_engine`: what it refuses under an engine, before anything loads;
* `attach`: what must run on the prepared module before the first update (DPO's precomputed reference);
* `draw`: which data step, and how many of its rows, an optimizer step takes (GRPO: prompts, num_iterations steps
  on each batch);
* `rollout`: the rows a step trains on, made from the rows drawn (GRPO: the policy's completions, rewarded);
  `FromData` gives both for objectives that train on their data's rows as they are.

A new objective is a new module here with a class that has these, and one line in `objective_for`.
"""

from __future__ import annotations

from llmtune.objectives.base import AttachContext, Objective, trained_tokens
from llmtune.recipe import Recipe


def objective_for(recipe: Recipe) -> Objective:
    """The recipe's `training.objective`; each objective's module is imported only when a recipe names it."""
    name = recipe.training.objective
    if name == "sft":
        from llmtune.objectives.sft import SFT

        return SFT()
    if name == "grpo":
        from llmtune.objectives.grpo import GRPO

        return GRPO(recipe.grpo, recipe.peft.method, recipe.seed)
    from llmtune.objectives.preference import Preference

    return Preference(name, recipe.preference, recipe.peft.method)


__all__ = ["AttachContext", "Objective", "objective_for", "trained_tokens"]
