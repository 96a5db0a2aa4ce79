"""What `llmtune estimate` answers and a run is planned with: the peak memory and time of a training step, predicted
before running, and the micro-batch, checkpointing, engine and sequence split that fit.

- `estimate(config, ...)`: predicted steady-state peak of one training micro-step, with a breakdown.
- `plan_micro_batch(config, ...)`: the fastest micro-batch and checkpointing that fit a budget and divide the
  global batch; `default_budget(device)` for `memory.budget: auto`. The measured peak is llmtune.ops.measure's.

The modules, in the order data flows through them:
- `settings`: what an estimate takes, checked; `step`: what the traced step runs (model, optimizer, batch, module);
- `counter`, `sharding`, `offload`, `trace`: one step traced on fake tensors (with `kernels`, `allocator` for what
  cannot run here); `extrapolate`, `cache`: deep models from short traces, cached and run in parallel;
- `estimate`: the `MemoryEstimate` of a step; `timing`, `communication`: the time model (a step's work at the card's
  rates, the engines' collectives);
- `batch_plan`: the `BatchPlan`; `search`: the planner; `budget`: the budget; `from_recipe`: a recipe's settings,
  rates and plan; `generation`: grpo's generation phase (its peak, the rows a generate call takes); `report`: the
  plan as text; `planning`: a run's plan, made once on the main process and shared, and the engines compared.
The catalogue of models and cards it plans for offline is llmtune.catalogue.
"""

from llmtune.plan.batch_plan import BatchPlan, MemoryPlanError, SequenceParallelError
from llmtune.plan.budget import default_budget, host_budget, planning_target, resolve_budget
from llmtune.plan.estimate import LoraSpec, MemoryEstimate, estimate, estimate_all
from llmtune.plan.from_recipe import (
    estimate_settings,
    expandable_segments,
    loss_chunk_rows,
    plan_for_budget,
    plan_rates,
    planned_precision,
    recipe_for_model,
    training_rows,
    unsplittable,
)
from llmtune.plan.generation import GenerationEstimate, generation_peak
from llmtune.plan.report import format_frontier, format_plan
from llmtune.plan.search import checkpointing_choices, plan_micro_batch, sequence_degrees

__all__ = [
    "BatchPlan",
    "GenerationEstimate",
    "LoraSpec",
    "MemoryEstimate",
    "MemoryPlanError",
    "SequenceParallelError",
    "checkpointing_choices",
    "default_budget",
    "estimate",
    "estimate_all",
    "estimate_settings",
    "expandable_segments",
    "format_frontier",
    "format_plan",
    "generation_peak",
    "host_budget",
    "loss_chunk_rows",
    "plan_for_budget",
    "plan_micro_batch",
    "plan_rates",
    "planned_precision",
    "planning_target",
    "recipe_for_model",
    "resolve_budget",
    "sequence_degrees",
    "training_rows",
    "unsplittable",
]
