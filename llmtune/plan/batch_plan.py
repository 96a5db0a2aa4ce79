"""The plan of a run's batch: how the global batch is split, the checkpointing, and what the planner predicted."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from llmtune.errors import UserError
from llmtune.plan.estimate import MemoryEstimate
from llmtune.plan.generation import GenerationEstimate
from llmtune.recipe import Checkpointing
from llmtune.units import format_bytes


class MemoryPlanError(UserError, ValueError):
    """Even micro-batch 1 does not fit the memory budget."""


class SequenceParallelError(UserError, ValueError):
    """A sequence-parallel degree the launch's processes or the model cannot be split into."""


@dataclass
class BatchPlan:
    """How the global batch is split (global = micro x accumulation x processes) and what that costs in memory.

    `source` says who chose the micro-batch: "recipe", "planner", or "planner, shrunk after out-of-memory".
    A plan from the planner also carries its predicted peak, the budget it fits and the estimate behind it.
    The predicted peak is what the budget is held against: on CUDA the allocator's reserved bytes
    (`MemoryEstimate.reserved_bytes`), on a CPU the live tensor bytes.
    """

    micro_batch_size: int
    grad_accum_steps: int
    num_processes: int = 1
    source: str = "planner"
    predicted_peak_bytes: int | None = None
    budget_bytes: int | None = None
    checkpointing: Checkpointing = Checkpointing(0)
    predicted_tokens_per_s: float | None = None  # the time model's (llmtune.plan.timing), for this process
    rates_source: str | None = None
    frontier: list[dict[str, Any]] = field(default_factory=list)  # what the planner weighed (Candidate.to_dict)
    generation_rows: int = 0  # grpo: rows per generate call (0: not planned, all of a process's rows in one)
    # The chunked loss's token rows per chunk, as the estimate traced them (`llmtune.ops.loss.chunk_rows`); None: a plan
    # from before they were planned, whose loss takes the CPU's rule.
    chunk_rows: int | None = None
    # Processes a row is split across along the sequence (llmtune.parallel.sequence); the data-parallel processes are
    # num_processes // sequence_parallel, and global = micro x accumulation x those.
    sequence_parallel: int = 1
    tiled_mlp: bool = False  # each decoder MLP runs in sequence tiles (llmtune.model.tiling)
    # What the planner weighed at each sequence-parallel degree and tiling (`llmtune.plan.search._summary`).
    degrees: list[dict[str, Any]] = field(default_factory=list)
    estimate: MemoryEstimate | None = field(default=None, repr=False, compare=False)
    # grpo: the predicted peak of a generate call of `generation_rows` rows (llmtune.plan.generation)
    generation: GenerationEstimate | None = field(default=None, repr=False, compare=False)

    @property
    def fits(self) -> bool:
        """False only when an estimate says a peak (the training step's, or grpo's generation) is over the budget."""
        step = self.predicted_peak_bytes is None or self.predicted_peak_bytes <= self.budget_bytes
        return step and (self.generation is None or self.generation.peak_bytes <= self.budget_bytes)

    def describe(self) -> str:
        if self.predicted_peak_bytes is None:
            return "micro-batch fixed by the recipe (set training.micro_batch_size: auto to plan it)"
        text = f"predicted peak {format_bytes(self.predicted_peak_bytes)} of a {format_bytes(self.budget_bytes)} budget"
        if self.generation is not None:
            text += f"; generation {self.generation_rows} rows a call, {format_bytes(self.generation.peak_bytes)}"
        return text

    def state(self) -> dict[str, Any]:
        """The plan without its estimates: what a checkpoint keeps and `from_state` reads back."""
        state = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("estimate", "generation")}
        return state | {"checkpointing": asdict(self.checkpointing)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> BatchPlan:
        """A state from `state`; fields added since a checkpoint was saved take their defaults (generation_rows 0)."""
        return cls(**state | {"checkpointing": Checkpointing(**state.get("checkpointing") or {"every_n_layers": 0})})

    def to_dict(self) -> dict[str, Any]:
        """The plan, readable sizes and (from the planner) the estimate: `llmtune estimate --json`, run_summary.json."""
        out = self.state()
        if self.predicted_peak_bytes is not None:
            out["predicted_peak"] = format_bytes(self.predicted_peak_bytes)
            out["fits"] = self.fits
        if self.budget_bytes is not None:
            out["budget"] = format_bytes(self.budget_bytes)
        if self.estimate is not None:
            out |= {
                "peak_bytes": self.estimate.peak_bytes,
                "peak_phase": self.estimate.peak_phase,
                "breakdown": self.estimate.breakdown,
                "estimate": self.estimate.to_dict(),
            }
        if self.generation is not None:
            out["generation"] = self.generation.to_dict()
        return out
