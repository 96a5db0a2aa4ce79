"""BF16AdamW against torch's AdamW on the same bf16 parameters: step time and kernels launched per step.

The parameters are Llama-3.2-1B's shapes (16 layers, GQA 32/8 heads, SwiGLU, tied 128256-token embedding) with
every width divided by `--scale` (8 by default: ~19M parameters, a size a CPU steps in milliseconds); gradients
are fixed random bf16 tensors, so each optimizer takes the same work every step. Compared, in one process, each
on its own copy of the parameters, the order reversed every other round (a machine that gets busier moves all
alike): BF16AdamW compiled (one fused kernel a parameter), BF16AdamW eager (its fallback: chunk by chunk),
torch's AdamW fused=True and foreach=True. torch's AdamW rounds to nearest (most small updates are lost on bf16
weights, llmtune.optim's docstring): the speed to match, not an alternative.

Kernels per step: the profiler's top-level aten ops plus compiled kernels (`cpp.enable_kernel_profile`), in one
step after the timed ones.

    python -m benchmarks.optimizer             # 10 rounds, ~2 min on 2 cores
    python -m benchmarks.optimizer --scale 16 --rounds 3

Writes benchmarks/results/optimizer_cpu.json (optimizer_cuda.json on a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import run_header, write_results
from llmtune.optim import BF16AdamW


def llama_1b_shapes(scale: int) -> list[tuple[int, ...]]:
    """Llama-3.2-1B's parameter shapes, widths divided by `scale` (heads kept at 64 dims)."""
    hidden, inter, vocab, kv = 2048 // scale, 8192 // scale, 128256 // scale, 512 // scale
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]  # q, k, v, o
    layer += [(inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]  # gate, up, down, 2 norms
    return [(vocab, hidden), *layer * 16, (hidden,)]


def make(kind: str, shapes: list[tuple[int, ...]], device: str) -> tuple[torch.optim.Optimizer, list]:
    """An optimizer of `kind` over fresh bf16 parameters with fixed gradients, in make_optimizer's two groups."""
    g = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).to(device, torch.bfloat16))
        p.grad = (torch.randn(shape, generator=g) * 1e-3).to(device, torch.bfloat16)
        params.append(p)
    groups = [{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2]}]
    groups[1]["weight_decay"] = 0.0
    build: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "bf16adamw_compiled": lambda: BF16AdamW(groups, lr=1e-4, compile=True),
        "bf16adamw_eager": lambda: BF16AdamW(groups, lr=1e-4, compile=False),
        "torch_fused": lambda: torch.optim.AdamW(groups, lr=1e-4, fused=True),
        "torch_foreach": lambda: torch.optim.AdamW(groups, lr=1e-4, foreach=True),
    }
    return build[kind](), params


# Ops that alias or allocate: no kernel runs for them.
NO_KERNEL = {"view", "select", "as_strided", "slice", "unbind", "detach", "detach_", "alias", "lift_fresh",
             "empty", "empty_strided", "empty_like", "_local_scalar_dense"}  # fmt: skip


def launches(opt: torch.optim.Optimizer) -> int:
    """Top-level aten ops that run a kernel, and compiled kernels, in one step as the profiler records them."""
    import torch._inductor.config as inductor

    with inductor.patch({"cpp.enable_kernel_profile": True}), profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    count = 0
    for e in prof.events():
        parent = e.cpu_parent
        top_aten = e.name.startswith("aten::") and not (parent and parent.name.startswith("aten::"))
        top_aten = top_aten and e.name.removeprefix("aten::") not in NO_KERNEL
        count += top_aten or "cpp_fused" in e.name or e.name.startswith("triton_")
    return count


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=8, help="divide Llama-3.2-1B's widths by this")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    started = time.perf_counter()
    shapes = llama_1b_shapes(a.scale)
    kinds = ["bf16adamw_compiled", "bf16adamw_eager", "torch_fused", "torch_foreach"]
    opts = {k: make(k, shapes, a.device)[0] for k in kinds}
    warmup = {}
    for k, opt in opts.items():  # the first step allocates the states; the compiled one also compiles
        t0 = time.perf_counter()
        opt.step()
        sync(a.device)
        warmup[k] = time.perf_counter() - t0
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(a.rounds):
        for k in kinds if r % 2 == 0 else kinds[::-1]:
            t0 = time.perf_counter()
            opts[k].step()
            sync(a.device)
            times[k].append(time.perf_counter() - t0)
    median = {k: statistics.median(v) for k, v in times.items()}
    counts = {k: launches(opt) for k, opt in opts.items()}
    compiled_failed = opts["bf16adamw_compiled"]._fused.failed
    results = {
        **run_header("optimizer", argv, a.device),
        "parameters": sum(torch.Size(s).numel() for s in shapes),
        "tensors": len(shapes),
        "compiled_fell_back_to_eager": compiled_failed,
        "warmup_s": warmup,
        "step_s": times,
        "median_step_s": median,
        "vs_torch_fused": {k: median[k] / median["torch_fused"] for k in kinds},
        "launches_per_step": counts,
        "target": "bf16adamw_compiled <= 1.3x torch_fused",
        "seconds": time.perf_counter() - started,
    }
    print(f"{results['parameters'] / 1e6:.1f}M parameters in {len(shapes)} tensors, {a.device}")
    print(f"{'optimizer':20s} {'step ms':>8s} {'vs fused':>8s} {'launches':>8s} {'warm-up s':>9s}")
    for k in kinds:
        print(f"{k:20s} {median[k] * 1e3:8.2f} {results['vs_torch_fused'][k]:7.2f}x {counts[k]:8d} {warmup[k]:9.1f}")
    write_results(results, "optimizer", a.device)
    return results


if __name__ == "__main__":
    main()
