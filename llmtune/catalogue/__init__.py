"""What llmtune knows offline about popular models and GPUs, for planning a run before anything is downloaded.

Models: each folder here holds a model's published `config.json` (no weights, no tokenizer), copied from its
hub repository, so `llmtune estimate --model llama-3.1-8b` answers without a network or a hub login (several
of these repositories are gated). GPUs: the memory of common cards, for `llmtune estimate --gpu h100-80gb`.
"""

from __future__ import annotations

import difflib
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

_MiB = 1024**2
# Total memory per card as the driver reports it (nvidia-smi's MiB figures; slightly below the marketed size).
GPUS = {
    "h200": 143771 * _MiB,
    "h100-80gb": 81559 * _MiB,
    "h100-94gb": 95830 * _MiB,
    "a100-80gb": 81920 * _MiB,
    "a100-40gb": 40960 * _MiB,
    "l40s": 46068 * _MiB,
    "a6000": 49140 * _MiB,
    "l4": 23034 * _MiB,
    "a10g": 23028 * _MiB,
    "rtx-4090": 24564 * _MiB,
    "rtx-3090": 24576 * _MiB,
    "v100-32gb": 32768 * _MiB,
    "v100-16gb": 16384 * _MiB,
    "t4": 15360 * _MiB,
}
_GPU_ALIASES = {
    "h200-141gb": "h200",
    "h100": "h100-80gb",
    "a100": "a100-80gb",
    "l40s-48gb": "l40s",
    "l4-24gb": "l4",
    "a10g-24gb": "a10g",
    "4090": "rtx-4090",
    "rtx4090": "rtx-4090",
    "3090": "rtx-3090",
    "rtx3090": "rtx-3090",
}


class CatalogueError(ValueError):
    """A name the catalogue does not know; the message lists what it does know."""


def model_config_dir(name: str) -> Path | None:
    """The catalogue folder holding the config.json of `name` (a catalogue name, or the hub id it comes from),
    or None when the catalogue does not have it."""
    key = name.lower()
    key = next((k for k, hub_id in MODELS.items() if hub_id.lower() == key), key)
    folder = CATALOGUE_DIR / key
    return folder if key in MODELS and (folder / "config.json").is_file() else None


def gpu_memory(name: str) -> int:
    """Total memory in bytes of the card called `name` (case and spaces ignored: "H100 80GB" = "h100-80gb")."""
    key = name.strip().lower().replace(" ", "-").replace("_", "-")
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS:
        close = difflib.get_close_matches(key, list(GPUS), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}? " if close else ""
        raise CatalogueError(
            f"--gpu {name}: unknown card ({hint}known: {', '.join(GPUS)}); or give its memory with --device-memory"
        )
    return GPUS[key]
