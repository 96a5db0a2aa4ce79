"""Supervised fine-tuning: the summed next-token loss over trained tokens (llmtune.loss)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmtune.data import collate
from llmtune.loss import CausalLMWithLoss
from llmtune.objectives.base import FromData, Objective, trained_tokens

if TYPE_CHECKING:
    from llmtune.data import PreparedData
    from llmtune.objectives.base import AttachContext


class SFT(FromData, Objective):
    name = "sft"
    reference = "none"

    def wrap(
        self, model: torch.nn.Module, loss_impl: str, frozen: torch.nn.Module | None, chunk_size: int | None
    ) -> torch.nn.Module:
        return CausalLMWithLoss(model, loss_impl, chunk_size)

    collate = staticmethod(collate)

    def longest_example(self, length: int, packed: bool) -> dict:
        """A row of `length` tokens, every one trained."""
        ids = [0] * length
        return {"input_ids": ids, "labels": ids, "position_ids": list(range(length))}

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return trained_tokens(batch)

    def metrics(self, sums: list[float], units: int) -> dict[str, float]:
        return {}

    def check_engine(self, engine: str) -> None:
        return None

    def attach(self, prepared: torch.nn.Module, data: PreparedData, context: AttachContext) -> PreparedData:
        return data
