"""The objective protocol (see llmtune.objectives) and what every objective shares."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from llmtune.data import IGNORE
from llmtune.ops.loss import runnable_impl
from llmtune.recipe import Recipe

if TYPE_CHECKING:
    from accelerate import Accelerator

    from llmtune.data import PreparedData


class Objective(Protocol):
    name: str
    reference: str  # what its reference forward runs on, resolved: none, adapter_disabled, copy or precomputed

    def module(
        self,
        model: torch.nn.Module,
        loss_impl: str,
        device: torch.device,
        weights_dtype: torch.dtype | None,
        *,
        chunk_size: int | None = None,
        reference_model: torch.nn.Module | None = None,
    ) -> torch.nn.Module:
        """`wrap` of `model`, with its frozen reference where `reference` is copy: `reference_model` where the caller
        built it (the memory estimator, on fake tensors), else `frozen_copy` of `model`. `chunk_size`: the chunked
        loss's rows per chunk; None, the vocabulary's default."""
        frozen = None
        if self.reference == "copy":
            frozen = frozen_copy(model, device, weights_dtype) if reference_model is None else reference_model
        return self.wrap(model, runnable_impl(model, loss_impl), frozen, chunk_size)

    def wrap(
        self, model: torch.nn.Module, loss_impl: str, frozen: torch.nn.Module | None, chunk_size: int | None
    ) -> torch.nn.Module: ...

    def collate(
        self, examples: list[dict], *, pad_token_id: int, packed: bool, pad_to_multiple_of: int | None = None
    ) -> dict[str, torch.Tensor]: ...

    def longest_example(self, length: int, packed: bool) -> dict: ...

    def units(self, batch: dict[str, torch.Tensor]) -> int: ...

    def metrics(self, sums: list[float], units: int) -> dict[str, float]: ...

    def check_engine(self, engine: str) -> None: ...

    def attach(self, prepared: torch.nn.Module, data: PreparedData, context: AttachContext) -> PreparedData: ...

    def draw(self, step: int, global_batch_size: int) -> tuple[int, int]: ...

    def rollout(self, examples: list[dict], step: int) -> list[dict]: ...


class FromData:
    """What an objective that trains on its data's rows as they are (SFT, preference) says to `draw` and `rollout`."""

    def draw(self, step: int, global_batch_size: int) -> tuple[int, int]:
        """(the data step whose rows optimizer step `step` trains on, rows in that global batch)."""
        return step, global_batch_size

    def rollout(self, examples: list[dict], step: int) -> list[dict]:
        """The rows the step trains on, made from the rows drawn for it."""
        return examples


class PlannedPeak(Protocol):
    peak_bytes: int


class PlannedBatch(Protocol):
    """What an objective reads of the run's plan (llmtune.plan.BatchPlan is one): the planner sits above the
    objectives, since it traces their steps, so they name only the fields they use."""

    micro_batch_size: int
    generation_rows: int  # grpo: rows a generate call takes (0: all of a process's rows)
    generation: PlannedPeak | None  # grpo: the predicted peak of such a call


@dataclass(frozen=True)
class AttachContext:
    """What `Objective.attach` may read of the run being built (llmtune.run.setup.build)."""

    recipe: Recipe
    accelerator: Accelerator
    precision: str
    loss_impl: str
    pad_token_id: int
    plan: PlannedBatch  # the micro-batch; grpo: the rows of a generate call and their predicted peak
    tokenizer: Any
    engine: str
    optimizer: torch.optim.Optimizer  # with the module, what is resident while a step's completions are sampled


def frozen_copy(model: torch.nn.Module, device: torch.device, weights_dtype: torch.dtype | None) -> torch.nn.Module:
    """The starting weights, frozen, before any update: a reference kept outside the prepared module goes to `device`
    with its parameters in `weights_dtype` (parallel.weights_dtype), as nothing else would put it where the policy
    computes."""
    frozen = copy.deepcopy(model).requires_grad_(False).eval().to(device)
    if weights_dtype is not None:
        for p in frozen.parameters():  # parameters only, as FSDP2 and DeepSpeed cast the policy's
            p.data = p.data.to(weights_dtype)
    return frozen


def trained_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens with a label in a micro-batch (the first position of a row predicts nothing)."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())
