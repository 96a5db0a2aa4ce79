"""What llmtune knows offline about popular models and GPUs, for planning a run before anything is downloaded.

Models (`models.py`): each folder here holds a model's published `config.json` (no weights, no tokenizer), copied
from its hub repository, so `llmtune estimate --model llama-3.1-8b` answers without a network or a hub login (several
of these repositories are gated). GPUs (`gpus.py`): the memory of common cards, for `llmtune estimate --gpu
h100-80gb`, and their datasheet figures.
"""

from llmtune.catalogue.gpus import (
    DATASHEET_ARCH,
    DATASHEET_BANDWIDTH,
    DATASHEET_FP32,
    DATASHEET_HOST_LINK,
    DATASHEET_PEAKS,
    DATASHEET_PEER_LINK,
    GPUS,
    NO_TF32,
    CatalogueError,
    compute_capability,
    datasheet_bandwidth,
    datasheet_fp32_flops,
    datasheet_host_link,
    datasheet_peak_flops,
    datasheet_peer_link,
    gpu_memory,
)
from llmtune.catalogue.models import CATALOGUE_DIR, MODELS, model_config_dir

__all__ = [
    "CATALOGUE_DIR",
    "DATASHEET_ARCH",
    "DATASHEET_BANDWIDTH",
    "DATASHEET_FP32",
    "DATASHEET_HOST_LINK",
    "DATASHEET_PEAKS",
    "DATASHEET_PEER_LINK",
    "GPUS",
    "MODELS",
    "NO_TF32",
    "CatalogueError",
    "compute_capability",
    "datasheet_bandwidth",
    "datasheet_fp32_flops",
    "datasheet_host_link",
    "datasheet_peak_flops",
    "datasheet_peer_link",
    "gpu_memory",
    "model_config_dir",
]
