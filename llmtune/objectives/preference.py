"""Preference tuning (DPO and its IPO/RPO variants, ORPO, SimPO) as an objective: the loss, log-probs and reference
are llmtune.objectives.pair_losses's; this says how the loop trains them (pairs are the unit, the reference where it
runs)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llmtune.errors import SetupError
from llmtune.model.load import weights_signature
from llmtune.objectives import pair_losses as preference
from llmtune.objectives.base import FromData, Objective
from llmtune.parallel import sequence
from llmtune.recipe import PreferenceConfig

if TYPE_CHECKING:
    from llmtune.data import PreparedData
    from llmtune.objectives.base import AttachContext


class Preference(FromData, Objective):
    def __init__(self, name: str, cfg: PreferenceConfig, reference: str) -> None:
        self.name, self.cfg, self.reference = name, cfg, reference  # resolved (preference.resolve_reference)

    def wrap(
        self, model: torch.nn.Module, loss_impl: str, frozen: torch.nn.Module | None, chunk_size: int | None
    ) -> torch.nn.Module:
        return preference.PreferenceModel(model, loss_impl, self.name, self.cfg, self.reference, frozen, chunk_size)

    collate = staticmethod(preference.collate_pairs)

    def longest_example(self, length: int, packed: bool) -> dict:
        """One pair filling a row of `length` tokens, every token trained: packed, chosen and rejected halves of the
        row; unpacked (a row a sequence), two sequences of `length // 2` tokens, at least 2 (one token predicts
        nothing). With a precomputed reference, its log-probs."""
        first = length // 2 if packed else max(2, length // 2)
        second = length - first if packed else first
        ids = [0] * (first + second)
        example = {"input_ids": ids, "labels": ids, "position_ids": [*range(first), *range(second)]}
        if self.reference == "precomputed":
            example["ref_logps"] = [0.0, 0.0]
        return example

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return preference.pairs_in(batch)

    def metrics(self, sums: list[float], units: int) -> dict[str, float]:
        return preference.step_metrics(sums, units)

    def check_engine(self, engine: str) -> None:
        if engine == "zero3" and self.reference == "copy":
            # The copy would be a second whole model on every process, outside the engine: the deepcopy of a model
            # loaded partition by partition (zero3_init_flag) holds empty tensors, and nothing gathers them.
            raise SetupError(
                "preference.reference=copy cannot run under DeepSpeed ZeRO-3 (the copy would hold empty partitions);"
                " use preference.reference=precomputed (the same reference, computed through the sharded model) or"
                " recipes/accelerate/deepspeed_zero2.yaml"
            )

    def attach(self, prepared: torch.nn.Module, data: PreparedData, context: AttachContext) -> PreparedData:
        """With a precomputed reference: train (and eval) rows with their reference log-probs, computed once by all
        processes through the prepared module and cached in output_dir (reused on resume and by any later run with
        the same model, data and settings). Before any update or resume (preference.compute_reference)."""
        if self.reference != "precomputed":
            return data
        r = context.recipe
        m = r.model
        settings = {
            "model": [m.name_or_path, m.revision, m.attn_implementation, m.random_init and r.seed],
            "weights": [] if m.random_init else weights_signature(m.name_or_path),
            "precision": context.precision,
            "loss": context.loss_impl,
            "peft": r.peft.method,
        }
        cache = Path(r.output_dir) / "reference"

        def collate_rows(examples: list[dict]) -> dict[str, Any]:
            group = sequence.current()  # split along the sequence, this process's part of each row
            multiple = sequence.rows_padded_to(group.degree)
            batch = preference.collate_pairs(
                examples, pad_token_id=context.pad_token_id, packed=data.packed, pad_to_multiple_of=multiple
            )
            return sequence.shard_batch(batch, group)

        def attach_rows(rows: Any) -> Any:
            acc, batch = context.accelerator, context.plan.micro_batch_size
            return preference.with_reference(prepared, rows, collate_rows, batch, acc, cache, settings)

        return replace(data, train=attach_rows(data.train), eval=None if data.eval is None else attach_rows(data.eval))
