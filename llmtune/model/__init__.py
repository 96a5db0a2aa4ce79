"""The causal LM and what changes it, each in its module: `precision` (what this device runs), `load` (tokenizer,
config, model), `blocks` (activation checkpointing, regional compile), `adapters` (PEFT), `attention` (packed
documents kept apart, by device and shape), `tiling` (MLPs in sequence tiles), `decode` (where a reply ends), `merge`
(an adapter into its base), `experts` (a mixture of experts' kernel and its LoRA). The order they apply in is
llmtune.run.parallelize's."""

from llmtune.model.adapters import apply_peft, count_parameters
from llmtune.model.blocks import apply_checkpointing, compile_blocks, decoder_blocks
from llmtune.model.load import load_config, load_model, load_tokenizer, resolve_config
from llmtune.model.precision import choose_precision, resolve_precision

__all__ = [
    "apply_checkpointing",
    "apply_peft",
    "choose_precision",
    "compile_blocks",
    "count_parameters",
    "decoder_blocks",
    "load_config",
    "load_model",
    "load_tokenizer",
    "resolve_config",
    "resolve_precision",
]
