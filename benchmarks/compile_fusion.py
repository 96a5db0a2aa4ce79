"""What regional compile saves a decoder block in the time model's terms: bytes moved by its memory-bound ops, and
kernels launched, compiled against eager (the factors `llmtune.plan.timing.COMPILED_BLOCK` applies).

One Llama decoder layer shaped as Llama-3.2-1B's (hidden : MLP : heads : KV heads = 1 : 4 : 1/64 : 1/256, head dim
64; narrower, as the byte ratio is per element), forward and backward under bf16 autocast on fp32 weights (the run's
mixed precision). Eager: every op's input and output bytes as the estimator counts them (`timing.Work`), the
matmuls and attention aside (timed by their FLOPs either way). Compiled: Inductor's own count of the bytes each
generated kernel reads and writes (`GraphLowering.count_bytes`), extern kernels (matmuls, attention) aside. The
fusion decisions are Inductor's scheduler's, the same for its C++ and Triton back ends but for the CPU's
loop-level fusions, so the CPU measures what a GPU compile of the block moves.

    .venv/bin/python -m benchmarks.compile_fusion      # ~1 min on 2 cores (one compile)

Writes benchmarks/results/compile_fusion_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks import RESULTS

OUTPUT = RESULTS / "compile_fusion_cpu.json"


def block_and_inputs(hidden: int, batch: int, seq: int) -> tuple[torch.nn.Module, dict[str, Any], torch.Tensor]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256), head_dim=64, num_hidden_layers=1,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    block = LlamaDecoderLayer(config, layer_idx=0).train()
    x = torch.randn(batch, seq, hidden, requires_grad=True)
    positions = torch.arange(seq).expand(batch, seq)
    with torch.no_grad():
        cos, sin = LlamaRotaryEmbedding(config)(x, positions)
    kwargs = {"attention_mask": None, "position_ids": positions, "position_embeddings": (cos, sin)}
    return block, kwargs, x


def step(block: torch.nn.Module, kwargs: dict[str, Any], x: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))


def eager_counts(block: torch.nn.Module, kwargs: dict[str, Any], x: torch.Tensor) -> dict[str, float]:
    """Bytes and ops of the memory-bound ops, as the time model counts them (views and FLOP-timed ops aside)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    counts = {"bytes": 0.0, "ops": 0.0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            timed_by_flops = func._overloadpacket in flop_registry or "scaled_dot_product" in str(func)
            if not (timed_by_flops or func.is_view):
                from llmtune.plan.timing import Work

                work = Work()
                work.add(func, args, kwargs or {}, out)
                counts["bytes"] += work.bytes
                counts["ops"] += 1
            return out

    with Count():
        step(block, kwargs, x)
    return counts


def compiled_counts(block: torch.nn.Module, kwargs: dict[str, Any], x: torch.Tensor) -> dict[str, float]:
    """Bytes and kernels of Inductor's generated kernels for the block's forward and backward (extern kernels aside)."""
    from torch._inductor import metrics

    torch._dynamo.reset()
    metrics.reset()
    # A cached graph is not lowered again, and only lowering counts its bytes.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch._logging.set_logs(inductor_metrics=True)  # Inductor counts bytes only where its metrics log is on
    try:
        step(torch.compile(block), kwargs, x)
    finally:
        torch._logging.set_logs()
    from torch._inductor.scheduler import NopKernelSchedulerNode

    kernels = [
        (n, elems)
        for n, elems in metrics.nodes_num_elem
        if not (n.is_extern() or isinstance(n, NopKernelSchedulerNode))
    ]
    # count_bytes records num_bytes // 4 per node
    return {"bytes": float(sum(4 * elems for _, elems in kernels)), "ops": float(len(kernels))}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--out", type=Path, default=OUTPUT)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    block, kwargs, x = block_and_inputs(a.hidden, a.batch, a.seq)
    eager = eager_counts(block, kwargs, x)
    compiled = compiled_counts(block, kwargs, x)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.compile_fusion " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__,
        "settings": vars(a) | {"out": str(a.out)},
        "eager": eager,
        "compiled": compiled,
        "bytes_ratio": compiled["bytes"] / eager["bytes"],
        "ops_ratio": compiled["ops"] / eager["ops"],
    }
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("eager", "compiled", "bytes_ratio", "ops_ratio")}, indent=1))  # noqa: T201
    return result


if __name__ == "__main__":
    main()
