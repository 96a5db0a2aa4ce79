"""The objective a recipe names, and the reference its forward runs on; each objective's module is imported only
when named."""

from __future__ import annotations

from llmtune.objectives.base import Objective
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
    # Only here: llmtune.objectives.pair_losses brings in the data pipeline (datasets, pyarrow: ~1 s of imports).
    from llmtune.objectives.pair_losses import resolve_reference

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
    estimator traces it (llmtune.plan.step), whose settings name no more than the objective and its reference
    (nothing else in them changes what a step keeps)."""
    if name == "sft":
        from llmtune.objectives.sft import SFT

        return SFT()
    if name == "grpo":
        from llmtune.objectives.grpo import GRPO

        return GRPO(grpo or GRPOConfig(beta=0.0 if reference == "none" else 0.04), reference, seed)
    from llmtune.objectives.preference import Preference

    return Preference(name, preference or PreferenceConfig(), reference)
