"""The models llmtune knows offline: each folder of this package holds a model's published `config.json` (no weights,
no tokenizer), copied from its hub repository, so `llmtune estimate --model llama-3.1-8b` answers without a network
or a hub login (several of these repositories are gated).
"""

from __future__ import annotations

from pathlib import Path

CATALOGUE_DIR = Path(__file__).parent

# Catalogue name -> the hub repository its config.json comes from (shown in the plan, and where the weights are).
MODELS = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen2.5-32b": "Qwen/Qwen2.5-32B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "mistral-7b": "mistralai/Mistral-7B-v0.3",
    "gemma-2-9b": "google/gemma-2-9b",
    "phi-3.5-mini": "microsoft/Phi-3.5-mini-instruct",
}


def model_config_dir(name: str) -> Path | None:
    """The catalogue folder holding the config.json of `name` (a catalogue name, or the hub id it comes from),
    or None when the catalogue does not have it."""
    key = name.lower()
    key = next((k for k, hub_id in MODELS.items() if hub_id.lower() == key), key)
    folder = CATALOGUE_DIR / key
    return folder if key in MODELS and (folder / "config.json").is_file() else None
