"""Data: from the recipe's sources to tokenised, masked (and optionally packed) training rows.

One module a stage, in the order data flows through them (`prepare.prepare_data` runs them):

    load      a source -> raw rows (local file or folder, `save_to_disk` folder, hub id)
    validate  the first problem with a row's values (shared by tokenise and load's diagnostics)
    render    a row -> input_ids + labels by format (text, prompt/completion, chats); IGNORE, DataError
    chat      a conversation -> its chat template's ids, the assistant turns' tokens found in them
    pairs     a preference row -> a chosen and a rejected sequence in one example
    tokenise  a loaded source -> tokenised examples, cached, under the length policy
    mix       the eval rows held out of each source, the train sources mixed by weight
    pack      several whole examples per row, position ids restarting per example
    stats     the counts of a split (DataStats)
    prepare   all of the above: PreparedData
    batch     the rows of a step (`batch_for_step`, pure), eval shards, `collate`
    report    `llmtune data --show`

This file only re-exports the public API, and lazily (PEP 562 `__getattr__`): `from llmtune.data import IGNORE`
and `from llmtune.data.render import ...` then import neither datasets, pyarrow nor torch, which only the
stages that handle datasets and tensors need.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module of this package that defines it.
_EXPORTS = {
    "CHATML_TEMPLATE": "chat",
    "IGNORE": "render",
    "DataError": "render",
    "alpaca_prompt": "render",
    "render_prompt": "render",
    "DataStats": "stats",
    "PreparedData": "prepare",
    "prepare_data": "prepare",
    "batch_for_step": "batch",
    "collate": "batch",
    "eval_batches": "batch",
    "sequences_of": "batch",
    "squared_lengths": "batch",
    "steps_per_epoch": "batch",
    "render_report": "report",
    "report_json": "report",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
