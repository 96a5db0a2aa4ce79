"""The objective protocol (see llmtune.objectives) and what every objective shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from llmtune.data import IGNORE
from llmtune.recipe import Recipe

if TYPE_CHECKING:
    from accelerate import Accelerator

    from llmtune.data import PreparedData


class Objective(Protocol):
    name: str

    def module(
        self, model: torch.nn.Module, loss_impl: str, device: torch.device, weights_dtype: torch.dtype | None
    ) -> torch.nn.Module: ...

    def collate(
        self, examples: list[dict], *, pad_token_id: int, packed: bool, pad_to_multiple_of: int | None = None
    ) -> dict[str, torch.Tensor]: ...

    def units(self, batch: dict[str, torch.Tensor]) -> int: ...

    def metrics(self, sums: list[float], units: int) -> dict[str, float]: ...

    def check_engine(self, engine: str) -> None: ...

    def attach(self, prepared: torch.nn.Module, data: PreparedData, context: AttachContext) -> PreparedData: ...


@dataclass(frozen=True)
class AttachContext:
    """What `Objective.attach` may read of the run being built (llmtune.train.build)."""

    recipe: Recipe
    accelerator: Accelerator
    precision: str
    loss_impl: str
    pad_token_id: int
    micro_batch_size: int


def trained_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens with a label in a micro-batch (the first position of a row predicts nothing)."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())
