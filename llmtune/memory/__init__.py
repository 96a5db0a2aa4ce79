"""Training memory: estimate the peak before running, measure it while running, plan the micro-batch.

- `estimate(config, ...)`: predicted steady-state peak of one training micro-step, with a breakdown.
- `PeakMemoryTracker`: measured peak (live tensor bytes on CPU, the allocator's peak on CUDA),
  optionally enforcing a budget with a real `torch.OutOfMemoryError`.
- `plan_micro_batch(config, ...)`: the fastest micro-batch and checkpointing that fit a budget and divide the
  global batch; `default_budget(device)` for `memory.budget: auto`.

The modules, in the order data flows through them:
- `settings`: what an estimate takes, checked; `step`: what the traced step runs (model, optimizer, batch, module);
- `counter`, `sharding`, `offload`, `trace`: one step traced on fake tensors (with `kernels`, `allocator` for what
  cannot run here); `extrapolate`, `cache`: deep models from short traces, cached and run in parallel;
- `estimate`: the `MemoryEstimate` of a step; `measure`: the measured peak of a real one;
- `plan`: the `BatchPlan`; `search`: the planner; `budget`: the budget; `from_recipe`: a recipe's settings, rates and
  plan; `generation`: grpo's generation phase (its peak, the rows a generate call takes); `report`: the plan as
  text. The time model is `llmtune.timing`.
"""

from llmtune.memory.budget import default_budget, host_budget, planning_target, resolve_budget
from llmtune.memory.estimate import LoraSpec, MemoryEstimate, estimate, estimate_all
from llmtune.memory.from_recipe import (
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
from llmtune.memory.generation import GenerationEstimate, generation_peak
from llmtune.memory.measure import PeakMemoryTracker
from llmtune.memory.plan import BatchPlan, MemoryPlanError, SequenceParallelError
from llmtune.memory.report import format_frontier, format_plan
from llmtune.memory.search import checkpointing_choices, plan_micro_batch, sequence_degrees
from llmtune.units import format_bytes, parse_bytes

__all__ = [
    "BatchPlan",
    "GenerationEstimate",
    "LoraSpec",
    "MemoryEstimate",
    "MemoryPlanError",
    "PeakMemoryTracker",
    "SequenceParallelError",
    "checkpointing_choices",
    "default_budget",
    "estimate",
    "estimate_all",
    "estimate_settings",
    "expandable_segments",
    "format_bytes",
    "format_frontier",
    "format_plan",
    "generation_peak",
    "host_budget",
    "loss_chunk_rows",
    "parse_bytes",
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
