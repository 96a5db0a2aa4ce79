"""What a run optimises, behind one small protocol: the loop (llmtune.train) calls these and never asks which.

An objective says
* `module`: the torch module the loop trains, whose forward returns [loss summed over units, *stats summed] (or
  the summed loss alone); it wraps the causal LM before any engine (DDP, FSDP2, DeepSpeed) wraps it. `Objective`
  gives it to the classes that subclass it: their `wrap` of the model and its frozen reference (a copy of the
  model where `reference` is copy; the memory estimator passes one it built, and a chunk size);
* `collate`: how examples become one micro-batch;
* `longest_example`: an example as long as the rows go, as `collate` takes it (what the memory estimator collates);
* `units`: what the loss is averaged over in a batch (SFT: trained tokens; preference: pairs);
* `metrics`: its own metrics.jsonl values from the summed stats of a step;
* `check_engine`: what it refuses under an engine, before anything loads;
* `attach`: what must run on the prepared module before the first update (DPO's precomputed reference);
* `draw`: which data step, and how many of its rows, an optimizer step takes (GRPO: prompts, num_iterations steps
  on each batch);
* `rollout`: the rows a step trains on, made from the rows drawn (GRPO: the policy's completions, rewarded);
  `FromData` gives both for objectives that train on their data's rows as they are.

A new objective is a new module here with a class that has these, and a line in `objective_named` (and in
`reference_for` where it has a reference).
"""

from __future__ import annotations

from llmtune.objectives.base import AttachContext, Objective, trained_tokens
from llmtune.recipe import GRPOConfig, PreferenceConfig, Recipe


def objective_for(recipe: Recipe) -> Objective:
    """The recipe's `training.objective`, with the reference the recipe resolves to (`reference_for`)."""
    name, reference = recipe.training.objective, reference_for(recipe)
    return objective_named(name, reference, preference=recipe.preference, grpo=recipe.grpo, seed=recipe.seed)


def reference_for(recipe: Recipe) -> str:
    """What the objective's reference forward runs on: none (sft, orpo, simpo, grpo with beta 0), adapter_disabled
    (LoRA's base), copy (a frozen copy of the starting weights) or precomputed (dpo's cached log-probs)."""
    name, peft_method = recipe.training.objective, recipe.peft.method
    if name == "sft":
        return "none"
    if name == "grpo":
        return "none" if recipe.grpo.beta == 0 else ("adapter_disabled" if peft_method != "none" else "copy")
    # Only here: llmtune.preference brings in the data pipeline (datasets, pyarrow: ~1 s of imports).
    from llmtune.preference import resolve_reference

    return resolve_reference(name, recipe.preference, peft_method)


def objective_named(
    name: str,
    reference: str = "none",
    *,
    preference: PreferenceConfig | None = None,
    grpo: GRPOConfig | None = None,
    seed: int = 0,
) -> Objective:
    """The objective `name` with its `reference` resolved; each objective's module is imported only when named.

    Settings left out are the defaults, grpo's beta 0 exactly when no reference runs: the objective as the memory
    estimator traces it (llmtune.memory.step), whose settings name no more than the objective and its reference
    (nothing else in them changes what a step keeps)."""
    if name == "sft":
        from llmtune.objectives.sft import SFT

        return SFT()
    if name == "grpo":
        from llmtune.objectives.grpo import GRPO

        return GRPO(grpo or GRPOConfig(beta=0.0 if reference == "none" else 0.04), reference, seed)
    from llmtune.objectives.preference import Preference

    return Preference(name, preference or PreferenceConfig(), reference)


__all__ = ["AttachContext", "Objective", "objective_for", "objective_named", "reference_for", "trained_tokens"]
