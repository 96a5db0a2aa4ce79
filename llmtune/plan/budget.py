"""The memory budget a plan must fit: what the device has free less a margin, a size, or a named card's."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from llmtune.plan.batch_plan import MemoryPlanError
from llmtune.units import format_bytes, parse_bytes

_GiB = 1024**3


def default_budget(device: str | torch.device = "cuda") -> int:
    """Budget for `memory.budget: auto`: what the device has free, less a margin.

    CUDA: free memory from `mem_get_info` (the CUDA context, already created by that call, is
    outside it) less 10% of the card + 512 MiB, because the estimate is of
    the caching allocator's reserved bytes (`allocator.reserved_peak`), which leave out NCCL's buffers, and
    model the allocator without several streams or its retry.
    CPU: MemAvailable less max(1 GiB, 10%): live tensor bytes leave out Python objects, the
    data pipeline, malloc fragmentation, and whatever else the machine runs meanwhile.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_budget(*torch.cuda.mem_get_info(device))
    available = _mem_available_bytes()
    return max(0, available - max(_GiB, int(0.10 * available)))


def host_budget(processes_here: int) -> int:
    """Host memory one of `processes_here` processes on this machine may pin for activation offloading: what the
    host has available less the same margin as a CPU's budget, shared between them."""
    return default_budget("cpu") // max(1, processes_here)


def _cuda_budget(free: int, total: int) -> int:
    return max(0, free - int(0.10 * total) - 512 * 1024**2)


def resolve_budget(text: str, device: str | torch.device) -> int:
    """`memory.budget` in bytes: a size like 20GiB, or `auto` (default_budget of the device)."""
    return default_budget(device) if text == "auto" else parse_bytes(text)


# The CUDA context of a card we cannot ask (`--gpu NAME`): ~0.3-0.6 GiB with lazy module loading (CUDA >= 11.7).
CUDA_CONTEXT_BYTES = 512 * 1024**2


@dataclass(frozen=True)
class Target:
    """The device a plan is for, its budget per process, and how both were chosen (shown with the plan)."""

    device: str  # "cuda" or "cpu"
    budget_bytes: int
    why: str


def planning_target(
    *, device_memory: str | None, gpu: str | None, device: str | None, recipe_budget: str = "auto"
) -> Target:
    """Where `llmtune estimate` plans for: a device's memory (`--device-memory`: a CUDA card's, less what `--gpu`
    takes off a known card's; a CPU's as given), a known card (`--gpu`), the recipe's `memory.budget`, or else this
    machine's own device as `train` would use it (a GPU if there is one, else the CPU's free RAM). `device`
    ("cuda"/"cpu", `--device`) names the kind of device when it is not this machine's."""
    from llmtune.catalogue import gpu_memory

    if device_memory:
        try:
            total = parse_bytes(device_memory)
        except ValueError as err:
            raise MemoryPlanError(f"--device-memory: {err}") from None
        if (device or "cuda") == "cpu":
            return Target("cpu", total, f"--device-memory {device_memory}")
        return _card_target(total, f"--device-memory {device_memory}")
    if gpu:
        return _card_target(gpu_memory(gpu), f"--gpu {gpu}")
    here = "cuda" if torch.cuda.is_available() else "cpu"
    if recipe_budget != "auto":
        return Target(device or here, parse_bytes(recipe_budget), f"memory.budget {recipe_budget}")
    if device == "cuda" and here != "cuda":
        raise MemoryPlanError(
            "--device cuda: no GPU here to read free memory from; name the card (--gpu h100-80gb) or its memory"
            " (--device-memory 80GiB)"
        )
    if here == "cuda":
        return Target("cuda", default_budget("cuda"), "this machine's GPU: free memory less 10% and 512 MiB")
    return Target(
        "cpu",
        default_budget("cpu"),
        "this machine's CPU (no GPU here; plan for one with --gpu NAME or --device-memory 24GiB):"
        " available RAM less max(1 GiB, 10%)",
    )


def _card_target(total: int, flag: str) -> Target:
    """A CUDA card of `total` bytes that cannot be asked for its free memory (`--gpu`, or `--device-memory` as a card's
    size): what `memory.budget: auto` would leave of it on the card, the CUDA context taken first."""
    budget = _cuda_budget(total - CUDA_CONTEXT_BYTES, total)
    return Target(
        "cuda", budget, f"{flag}: {format_bytes(total)} less the CUDA context, 10% and 512 MiB for workspaces"
    )


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB, meaning KiB
    except OSError:
        pass
    # No /proc (macOS): total physical memory is the best we can do without psutil.
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
