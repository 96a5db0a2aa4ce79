"""The GPUs llmtune knows offline: the memory of common cards (`llmtune estimate --gpu h100-80gb`) and their
datasheet figures (tensor-core and FP32 peaks, HBM bandwidth, host and peer links, compute capability) that the time
model and the planner use.
"""

from __future__ import annotations

import difflib
import re

from llmtune.errors import UserError

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


# The name each catalogued card reports (`torch.cuda.get_device_name()`, nvidia-smi's), which the datasheet tables
# below match, as they match the card a run trains on: a catalogue name alone matched the wrong row ("h100-94gb", the
# H100 NVL, took the SXM's figures) or none ("rtx-4090", "4090"). Where a catalogue name covers two boards, the one
# its memory and the tables' other rows take: the A100s' SXM4 (NVLink peers), the V100s' PCIe (its lower peak).
REPORTED_NAMES = {
    "h200": "NVIDIA H200",
    "h100-80gb": "NVIDIA H100 80GB HBM3",
    "h100-94gb": "NVIDIA H100 NVL",  # 95830 MiB is the NVL's memory as nvidia-smi reports it
    "a100-80gb": "NVIDIA A100-SXM4-80GB",
    "a100-40gb": "NVIDIA A100-SXM4-40GB",
    "l40s": "NVIDIA L40S",
    "a6000": "NVIDIA RTX A6000",
    "l4": "NVIDIA L4",
    "a10g": "NVIDIA A10G",
    "rtx-4090": "NVIDIA GeForce RTX 4090",
    "rtx-3090": "NVIDIA GeForce RTX 3090",
    "v100-32gb": "Tesla V100-PCIE-32GB",
    "v100-16gb": "Tesla V100-PCIE-16GB",
    "t4": "Tesla T4",
}


class CatalogueError(UserError, ValueError):
    """A name the catalogue does not know; the message lists what it does know."""


def _catalogue_key(name: str) -> str:
    """`name` as the catalogue spells its cards (case and spaces ignored: "H100 80GB" = "h100-80gb"; aliases)."""
    key = name.strip().lower().replace(" ", "-").replace("_", "-")
    return _GPU_ALIASES.get(key, key)


def reported_name(name: str) -> str:
    """The device name of the catalogued card called `name` (`REPORTED_NAMES`); any other name as it is."""
    return REPORTED_NAMES.get(_catalogue_key(name), name)


def gpu_memory(name: str) -> int:
    """Total memory in bytes of the card called `name` (case and spaces ignored: "H100 80GB" = "h100-80gb")."""
    key = _catalogue_key(name)
    if key not in GPUS:
        close = difflib.get_close_matches(key, list(GPUS), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}? " if close else ""
        raise CatalogueError(
            f"--gpu {name}: unknown card ({hint}known: {', '.join(GPUS)}); or give its memory with --device-memory"
        )
    return GPUS[key]


# Dense (no 2:4 sparsity) bf16/fp16 tensor-core peaks from NVIDIA's datasheets and architecture whitepapers,
# in TFLOP/s, matched in order on the lower-cased device name (`torch.cuda.get_device_name()`, or a catalogued card's
# `REPORTED_NAMES`). Datasheets print the sparse figure; the dense one is half. GeForce/RTX cards: FP32 accumulate
# (what PyTorch uses), half the FP16-accumulate figure. A card without a published figure has no row: AWS's A10G
# (NVIDIA publishes no datasheet for it, and its tensor rate is not the A10's 125) is measured on the card, and
# `llmtune estimate --gpu a10g` predicts no time.
DATASHEET_PEAKS: list[tuple[str, float]] = [
    (r"h200 nvl", 835.5),  # H200 product page: NVL BF16 1,671 sparse
    (r"h200", 989.5),  # H200 product page: SXM BF16 1,979 sparse; the H100 SXM's tensor cores
    (r"h100 nvl", 835.5),  # H100 NVL datasheet: BF16 1,671 sparse (catalogue: h100-94gb)
    (r"h100 pcie", 756.5),  # H100 datasheet: PCIe BF16 1,513 sparse
    (r"h100", 989.5),  # H100 datasheet: SXM BF16 1,979 sparse ("NVIDIA H100 80GB HBM3")
    (r"h800", 989.5),
    (r"a100", 312.0),  # A100 datasheet: BF16 312 dense (624 sparse), SXM and PCIe, 40 and 80 GB
    (r"a800", 312.0),
    (r"l40s", 362.05),  # L40S datasheet: BF16 362.05 dense (733 sparse)
    (r"l40\b", 181.05),  # L40 datasheet: BF16 181.05 dense
    (r"\bl4\b", 121.0),  # L4 datasheet: BF16 242 sparse
    (r"\ba10\b", 125.0),  # A10 datasheet: BF16 125 dense (250 sparse); not the A10G
    (r"rtx 4090", 165.2),  # Ada whitepaper, appendix A: FP16/BF16 with FP32 accumulate 165.2/330.4
    (r"rtx 3090", 71.0),  # GA102 whitepaper, appendix A: FP16 with FP32 accumulate 71/142
    (r"a6000", 154.8),  # GA102 whitepaper, RTX A6000: BF16 with FP32 accumulate 154.8/309.6
    (r"v100.*sxm", 125.0),  # V100 datasheet: SXM2 tensor 125; fp16 only (no bf16)
    (r"v100", 112.0),  # V100 datasheet: PCIe tensor 112 (catalogue: v100-32gb, v100-16gb)
    (r"\bt4\b", 65.0),  # T4 datasheet: mixed precision FP16/FP32 65; fp16 only
]


def datasheet_peak_flops(device_name: str) -> float | None:
    """Dense 16-bit tensor-core FLOP/s of a GPU known by name, or None."""
    return _first_match(DATASHEET_PEAKS, device_name, 1e12)


# Memory bandwidth in TB/s from the same datasheets and whitepapers, matched in order like DATASHEET_PEAKS (the time
# model's memory-bound ops).
DATASHEET_BANDWIDTH: list[tuple[str, float]] = [
    (r"h200", 4.8),  # H200 product page: 4.8 TB/s, SXM and NVL
    (r"h100 nvl", 3.9),  # H100 NVL datasheet: 94 GB HBM3, 3.9 TB/s
    (r"h100 pcie", 2.0),  # H100 datasheet: PCIe 2 TB/s
    (r"h100", 3.35),  # H100 datasheet: SXM 3.35 TB/s
    (r"h800", 3.35),
    (r"a100.*40", 1.555),  # A100 datasheet: 40 GB HBM2 1,555 GB/s
    (r"a100", 2.039),  # A100 datasheet: 80 GB HBM2e SXM 2,039 GB/s
    (r"a800", 2.039),
    (r"l40", 0.864),  # L40 and L40S datasheets: 864 GB/s
    (r"\bl4\b", 0.3),  # L4 datasheet: 300 GB/s
    (r"\ba10g?\b", 0.6),  # A10 datasheet: 600 GB/s; the A10G's 24 GB GDDR6 the same (Baseten, A10 vs A10G)
    (r"rtx 4090", 1.008),  # Ada whitepaper, appendix A: 1008 GB/s
    (r"rtx 3090", 0.936),  # GA102 whitepaper, appendix A: 936 GB/s
    (r"a6000", 0.768),  # RTX A6000 datasheet: 768 GB/s
    (r"v100", 0.9),  # V100 datasheet: 900 GB/s, PCIe and SXM2
    (r"\bt4\b", 0.32),  # T4 datasheet: 320 GB/s
]


def datasheet_bandwidth(device_name: str) -> float | None:
    """HBM bytes/s of a GPU known by name, or None."""
    return _first_match(DATASHEET_BANDWIDTH, device_name, 1e12)


def _first_match(table: list[tuple[str, float]], device_name: str, unit: float) -> float | None:
    name = reported_name(device_name).lower()
    return next((value * unit for pattern, value in table if re.search(pattern, name)), None)


# The card's host link in GB/s a direction (PCIe x16: gen5 64, gen4 32, gen3 16), matched like DATASHEET_PEAKS:
# what activation offloading copies over.
DATASHEET_HOST_LINK: list[tuple[str, float]] = [
    (r"h200|h100|h800", 64.0),
    (r"a100|a800|l40|\bl4\b|\ba10g?\b|rtx 4090|rtx 3090|a6000", 32.0),
    (r"v100|\bt4\b", 16.0),
]


def datasheet_host_link(device_name: str) -> float | None:
    """Host link bytes/s a direction of a GPU known by name, or None."""
    return _first_match(DATASHEET_HOST_LINK, device_name, 1e9)


# FP32 on the CUDA cores in TFLOP/s (no tensor cores), matched like DATASHEET_PEAKS: the rate of fp32 matmuls when
# the run leaves TF32 off (PyTorch's default: torch.backends.cuda.matmul.allow_tf32 is False). With TF32 on, sm80
# and newer run them at half the 16-bit tensor-core peak; V100 and T4 have no TF32 and stay at these rates.
# Sources as DATASHEET_PEAKS' rows; the A10's 31.2 is not the A10G's (unpublished, faster CUDA cores).
DATASHEET_FP32: list[tuple[str, float]] = [
    (r"h200 nvl|h100 nvl", 60.0),
    (r"h100 pcie", 51.0),
    (r"h200|h100|h800", 67.0),
    (r"a100|a800", 19.5),
    (r"l40s", 91.6),
    (r"l40\b", 90.5),
    (r"\bl4\b", 30.3),
    (r"\ba10\b", 31.2),
    (r"rtx 4090", 82.6),
    (r"rtx 3090", 35.6),
    (r"a6000", 38.7),
    (r"v100.*sxm", 15.7),
    (r"v100", 14.0),
    (r"\bt4\b", 8.1),
]
NO_TF32 = r"v100|\bt4\b"  # cards before Ampere: fp32 matmuls run on the CUDA cores whatever the run sets


def datasheet_fp32_flops(device_name: str, tf32: bool) -> float | None:
    """FLOP/s of fp32 matmuls on a GPU known by name: TF32 tensor cores (half the 16-bit peak) where `tf32` is on
    and the card has them, else its CUDA cores' FP32 rate; None for an unknown card."""
    if tf32 and not re.search(NO_TF32, reported_name(device_name).lower()):
        peak = datasheet_peak_flops(device_name)
        return None if peak is None else peak / 2
    return _first_match(DATASHEET_FP32, device_name, 1e12)


# The link between the GPUs of one node, in GB/s a direction, matched like DATASHEET_PEAKS: what the data-parallel
# engines' collectives cross (llmtune.plan.communication). SXM boards: NVLink (gen 4 on Hopper: 900 GB/s both ways; gen
# 3 on the A100: 600; the export parts H800/A800: 400; gen 2 on the V100 SXM2: 300); NVL cards are bridged in pairs
# (600 both ways); every other card here talks over PCIe x16 (gen 5 64, gen 4 32, gen 3 16 a direction; GeForce
# cards without peer-to-peer go through host memory, taken as the same link).
DATASHEET_PEER_LINK: list[tuple[str, float]] = [
    (r"h200 nvl|h100 nvl", 300.0),
    (r"h100 pcie", 64.0),
    (r"h800|a800", 200.0),
    (r"h200|h100", 450.0),
    (r"a100.*pcie", 32.0),
    (r"a100", 300.0),
    (r"v100.*sxm", 150.0),
    (r"l40|\bl4\b|\ba10g?\b|rtx 4090|rtx 3090|a6000", 32.0),
    (r"v100|\bt4\b", 16.0),
]


def datasheet_peer_link(device_name: str) -> float | None:
    """Bytes/s a direction between two GPUs of one node, of a card known by name, or None."""
    return _first_match(DATASHEET_PEER_LINK, device_name, 1e9)


# CUDA compute capability, matched like DATASHEET_PEAKS: which attention kernels torch's `sdp_utils.cpp` lets run.
DATASHEET_ARCH: list[tuple[str, tuple[int, int]]] = [
    (r"h200|h100|h800", (9, 0)),
    (r"a100|a800", (8, 0)),
    (r"l40|\bl4\b|rtx 4090", (8, 9)),
    (r"\ba10g?\b|rtx 3090|a6000", (8, 6)),
    (r"\bt4\b", (7, 5)),
    (r"v100", (7, 0)),
]


def compute_capability(device_name: str) -> tuple[int, int] | None:
    """(major, minor) CUDA compute capability of a GPU known by name, or None."""
    name = reported_name(device_name).lower().replace("-", " ")
    return next((arch for pattern, arch in DATASHEET_ARCH if re.search(pattern, name)), None)
