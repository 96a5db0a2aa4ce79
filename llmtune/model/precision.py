"""Which precision this device runs (`auto` decided, a mode it cannot run refused) and what the recipe needs installed
or on which device (bitsandbytes, a GPU for offloading), refused before any model loads."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

import torch

from llmtune.errors import SetupError
from llmtune.recipe import Recipe, checkpointing_of


def cpu_supports_bf16() -> bool:
    # Without native bf16 instructions (AVX512-BF16 / AMX) oneDNN emulates bf16: ~30x slower than fp32
    # on an AVX2-only CPU (benchmarks/results/measurements.md).
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def choose_precision(requested: str, device_type: str) -> tuple[str, str]:
    """The concrete precision for `requested` on this device, and why; refuses modes it cannot really run.

    Accelerate silently drops fp16 autocast on a CPU (it trains fp32 and says nothing), and CPU fp16
    matmuls run at 1-2 GFLOP/s here, so fp16 on a CPU is refused rather than quietly replaced. bf16 on a
    CPU without native bf16 runs (emulated, slowly) when asked for by name: it still saves memory, and
    `llmtune bench` shows what it costs; `auto` never picks it there.
    """
    if device_type == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
        if requested == "auto":
            return ("bf16", "auto: this GPU supports bf16") if bf16 else ("fp16", "auto: this GPU has no bf16")
        if requested in ("bf16", "bf16-true") and not bf16:
            raise SetupError(f"training.precision={requested}: this GPU has no bf16 support; use fp16 or fp32")
        return requested, "set by the recipe"
    native = device_type == "cpu" and cpu_supports_bf16()
    if requested == "auto":
        if native:
            return "bf16", "auto: this CPU has native bf16 (AVX512-BF16/AMX)"
        return "fp32", "auto: this CPU has no native bf16 (emulated bf16 runs ~30x slower than fp32)"
    if requested == "fp16":
        raise SetupError(
            f"training.precision=fp16 cannot run on {device_type}: Accelerate would silently train fp32, and"
            " CPU fp16 matmuls are ~100x slower than bf16. Use bf16 (or auto) here, fp16 on a CUDA GPU."
        )
    if requested in ("bf16", "bf16-true") and not native:
        return requested, "set by the recipe; this CPU has no native bf16, so it is emulated and much slower than fp32"
    return requested, "set by the recipe"


def resolve_precision(requested: str, device_type: str) -> str:
    return choose_precision(requested, device_type)[0]


def check_bitsandbytes_device(peft_method: str, optimizer: str, device_type: str) -> str | None:
    """What needs bitsandbytes (QLoRA's 4-bit base, 8-bit AdamW); refused on a device other than CUDA.
    The memory estimator refuses the same, in the same words, when planning for a CPU."""
    what = "peft.method=qlora" if peft_method == "qlora" else "training.optimizer=adamw_8bit"
    if (peft_method == "qlora" or optimizer == "adamw_8bit") and device_type != "cuda":
        raise SetupError(
            f"{what} needs bitsandbytes on a CUDA GPU; a CPU cannot run it. Use peft.method=lora"
            " (16-bit base weights) and training.optimizer=adamw there."
        )
    return what if peft_method == "qlora" or optimizer == "adamw_8bit" else None


OFFLOAD_NEEDS_CUDA = (
    "training.gradient_checkpointing.offload moves the inputs checkpointing saves from a GPU to host memory; on a"
    " CPU they are in host memory already (and the pinned copies need CUDA): remove offload"
)


# bitsandbytes before 0.43.2 kept each 4-bit matmul's input on its autograd node until the whole backward ended
# (MatMul4Bit's `ctx.tensors = (A, B)`, dropped by bitsandbytes PR #1270): under non-reentrant checkpointing, every
# layer's inputs, past checkpointing and past the memory plan, which models the current kernel (memory/kernels.py).
QLORA_MIN_BITSANDBYTES = (0, 43, 2)


def release(version: str) -> tuple[int, ...]:
    """A version string's release numbers: "0.44.1+cu121" -> (0, 44, 1), "0.43.2.dev0" -> (0, 43, 2)."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])


def check_requirements(recipe: Recipe, device_type: str) -> None:
    """Refuse, before any download or model load, what needs hardware or packages this machine lacks."""
    checkpointing = checkpointing_of(recipe.training.gradient_checkpointing)
    if checkpointing is not None and checkpointing.offload and device_type != "cuda":
        raise SetupError(OFFLOAD_NEEDS_CUDA)
    what = check_bitsandbytes_device(recipe.peft.method, recipe.training.optimizer, device_type)
    if what is not None and importlib.util.find_spec("bitsandbytes") is None:
        raise SetupError(f"{what} needs bitsandbytes: pip install bitsandbytes")
    if what is not None and recipe.peft.method == "qlora":
        have = importlib.metadata.version("bitsandbytes")
        if release(have) < QLORA_MIN_BITSANDBYTES:
            least = ".".join(map(str, QLORA_MIN_BITSANDBYTES))
            raise SetupError(
                f"peft.method=qlora needs bitsandbytes >= {least}, found {have}: earlier versions"
                " keep every 4-bit layer's input until backward ends, past checkpointing and the memory plan."
                " pip install -U bitsandbytes"
            )
