"""Supervised fine-tuning: the summed next-token loss over trained tokens (llmtune.ops.loss)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from llmtune.data import collate
from llmtune.data.batch import with_documents
from llmtune.objectives.base import FromData, Objective, trained_tokens
from llmtune.ops.loss import CausalLMWithLoss, loss_rows

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

    @staticmethod
    def collate(
        examples: list[dict], *, pad_token_id: int, packed: bool, pad_to_multiple_of: int | None = None
    ) -> dict[str, Any]:
        """`llmtune.data.collate`'s micro-batch; packed, with its documents (`with_documents`): the attention
        implementations that read them (llmtune.model.attention's, flash_attention_2) run each document alone. With the
        trained rows (`loss_rows`), found here on the host so that the loss never waits for the device."""
        batch = collate(examples, pad_token_id=pad_token_id, packed=packed, pad_to_multiple_of=pad_to_multiple_of)
        batch["loss_rows"] = loss_rows(batch["labels"])
        return with_documents(batch) if packed else batch

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
