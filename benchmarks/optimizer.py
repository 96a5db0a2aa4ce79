"""BF16AdamW against torch's AdamW on the same bf16 parameters: step time and kernels launched per step.

The parameters are Llama-3.2-1B's shapes (16 layers, GQA 32/8 heads, SwiGLU, tied 128256-token embedding) with
every width divided by a scale: 2 (~309M parameters, tensors of 1k-66M elements, as the GPU check runs it) and 8
(~19M, 256-4M elements: there a fixed cost per parameter weighs 16x more than at 2 and ~64x more than on the real
model). Gradients are fixed random bf16 tensors, shared by every optimizer, so each takes the same work every step.
Compared, in one process, each on its own copy of the parameters, the order reversed every other round, each ratio
taken within a round (a machine that gets busier moves both sides alike): BF16AdamW compiled (one fused kernel a
parameter), BF16AdamW eager (its fallback: chunk by chunk), torch's AdamW fused=True and foreach=True. torch's
AdamW rounds to nearest (most small updates are lost on bf16 weights, llmtune.ops.optim's docstring): the speed to
match, not an alternative.

Kernels per step: the profiler's top-level aten ops plus compiled kernels (compiled with
`cpp.enable_kernel_profile`, which names them in the profile), in one step after the timed ones.

    python -m benchmarks.optimizer                  # scales 2 and 8, 10 rounds: ~2 min on 2 cores, 9 GB
    python -m benchmarks.optimizer --scales 16 --rounds 3

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
from llmtune.ops.optim import BF16AdamW


def llama_1b_shapes(scale: int) -> list[tuple[int, ...]]:
    """Llama-3.2-1B's parameter shapes, widths divided by `scale` (heads kept at 64 dims)."""
    hidden, inter, vocab, kv = 2048 // scale, 8192 // scale, 128256 // scale, 512 // scale
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]  # q, k, v, o
    layer += [(inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]  # gate, up, down, 2 norms
    return [(vocab, hidden), *layer * 16, (hidden,)]


def make(kind: str, shapes: list[tuple[int, ...]], grads: list[torch.Tensor], device: str) -> torch.optim.Optimizer:
    """An optimizer of `kind` over fresh bf16 parameters (the same values for every kind) with gradients `grads`, in
    make_optimizer's two groups."""
    g = torch.Generator().manual_seed(0)
    params = []
    for shape, grad in zip(shapes, grads, strict=True):
        p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).to(device, torch.bfloat16))
        p.grad = grad
        params.append(p)
    groups = [{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2]}]
    groups[1]["weight_decay"] = 0.0
    build: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "bf16adamw_compiled": lambda: BF16AdamW(groups, lr=1e-4, compile=True),
        "bf16adamw_eager": lambda: BF16AdamW(groups, lr=1e-4, compile=False),
        "torch_fused": lambda: torch.optim.AdamW(groups, lr=1e-4, fused=True),
        "torch_foreach": lambda: torch.optim.AdamW(groups, lr=1e-4, foreach=True),
    }
    return build[kind]()


def gradients(shapes: list[tuple[int, ...]], device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(shape, generator=g) * 1e-3).to(device, torch.bfloat16) for shape in shapes]


# Ops that alias or allocate: no kernel runs for them.
NO_KERNEL = {"view", "select", "as_strided", "slice", "unbind", "detach", "detach_", "alias", "lift_fresh",
             "empty", "empty_strided", "empty_like", "_local_scalar_dense"}  # fmt: skip


def launches(opt: torch.optim.Optimizer) -> int:
    """Top-level aten ops that run a kernel, and compiled kernels, in one step as the profiler records them (a
    compiled CPU kernel appears only where it was compiled under `kernels_profiled`)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    count = 0
    for e in prof.events():
        parent = e.cpu_parent
        top_aten = e.name.startswith("aten::") and not (parent and parent.name.startswith("aten::"))
        op = e.name.removeprefix("aten::")
        copied_nothing = op == "to" and not e.cpu_children  # already on that device, in that dtype
        top_aten = top_aten and op not in NO_KERNEL and not copied_nothing
        count += top_aten or "cpp_fused" in e.name or e.name.startswith("triton_")
    return count


def kernels_profiled() -> object:
    """Inductor's C++ kernels compiled in here record themselves for the profiler, as Triton's always do."""
    import torch._inductor.config as inductor

    return inductor.patch({"cpp.enable_kernel_profile": True})


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(scale: int, rounds: int, device: str) -> dict:
    """Every optimizer at one scale: warm-up (states, and the compile), then `rounds` alternating timed steps."""
    shapes = llama_1b_shapes(scale)
    grads = gradients(shapes, device)
    kinds = ["bf16adamw_compiled", "bf16adamw_eager", "torch_fused", "torch_foreach"]
    opts = {k: make(k, shapes, grads, device) for k in kinds}
    warmup = {}
    for k, opt in opts.items():  # the first step allocates the states; the compiled one also compiles
        t0 = time.perf_counter()
        with kernels_profiled():
            opt.step()
        sync(device)
        warmup[k] = time.perf_counter() - t0
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        for k in kinds if r % 2 == 0 else kinds[::-1]:
            t0 = time.perf_counter()
            opts[k].step()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    median = {k: statistics.median(v) for k, v in times.items()}
    # Paired: each round's step against torch's fused one of the same round (adjacent in time), then the median, so a
    # machine whose speed drifts between rounds moves both sides of each ratio alike.
    fused = times["torch_fused"]
    ratio = {k: statistics.median(a / b for a, b in zip(v, fused, strict=True)) for k, v in times.items()}
    counts = {k: launches(opt) for k, opt in opts.items()}
    return {
        "parameters": sum(torch.Size(s).numel() for s in shapes),
        "tensors": len(shapes),
        "compiled_fell_back_to_eager": opts["bf16adamw_compiled"]._fused.failed,
        "warmup_s": warmup,
        "step_s": times,
        "median_step_s": median,
        "vs_torch_fused": ratio,
        "launches_per_step": counts,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", type=int, nargs="+", default=[2, 8], help="divide Llama-3.2-1B's widths by these")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    started = time.perf_counter()
    results = {**run_header("optimizer", argv, a.device), "target": "bf16adamw_compiled <= 1.3x torch_fused"}
    results["by_scale"] = {}
    for scale in a.scales:
        r = results["by_scale"][str(scale)] = measure(scale, a.rounds, a.device)
        print(f"scale {scale}: {r['parameters'] / 1e6:.1f}M parameters in {r['tensors']} tensors, {a.device}")
        print(f"{'optimizer':20s} {'step ms':>8s} {'vs fused':>8s} {'launches':>8s} {'warm-up s':>9s}")
        for k, step in r["median_step_s"].items():
            print(f"{k:20s} {step * 1e3:8.2f} {r['vs_torch_fused'][k]:7.2f}x {r['launches_per_step'][k]:8d} "
                  f"{r['warmup_s'][k]:9.1f}")  # fmt: skip
    results["seconds"] = time.perf_counter() - started
    write_results(results, "optimizer", a.device)
    return results


if __name__ == "__main__":
    main()
