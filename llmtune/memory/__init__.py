"""Training memory: estimate the peak before running, measure it while running, plan the micro-batch.

- `estimate(config, ...)`: predicted steady-state peak of one training micro-step, with a breakdown.
- `PeakMemoryTracker`: measured peak (live tensor bytes on CPU, the allocator's peak on CUDA),
  optionally enforcing a budget with a real `torch.OutOfMemoryError`.
- `plan_micro_batch(config, ...)`: the largest micro-batch that fits a budget and divides the
  global batch; `default_budget(device)` for `memory.budget: auto`.
"""

from llmtune.memory.estimate import LoraSpec, MemoryEstimate, estimate
from llmtune.memory.measure import PeakMemoryTracker
from llmtune.memory.plan import BatchPlan, MemoryPlanError, default_budget, plan_micro_batch
from llmtune.units import format_bytes, parse_bytes

__all__ = [
    "BatchPlan",
    "LoraSpec",
    "MemoryEstimate",
    "MemoryPlanError",
    "PeakMemoryTracker",
    "default_budget",
    "estimate",
    "format_bytes",
    "parse_bytes",
    "plan_micro_batch",
]
