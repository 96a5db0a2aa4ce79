"""Memory estimator vs an independent measurement: PyTorch's own CPU allocator events, on models deeper than the
estimator traces (so its layer extrapolation is exercised).

    python -m benchmarks.memory_independent [--quick] [--out benchmarks/results/memory_independent_cpu.json]

Measurement (`allocator_peak`): `torch.profiler.profile(profile_memory=True)` records every allocation and free
of the c10 CPU allocator with its size (the profiler's Allocation events). The running sum of those sizes over one
steady-state training step (the 2nd: AdamW's states exist from the 1st), plus the bytes alive when the step
starts (parameters, buffers, optimizer states and the batch: the same baseline the estimator's `peak_bytes`
includes), gives the step's high-water of allocated bytes. No dispatch mode and no weakref on storages: it shares
nothing with `llmtune.ops.measure` or the estimator's counter. Every case runs in a fresh subprocess.

The step itself is benchmarks.memory's (the model, loss module, optimizer and collated batches as `llmtune train`
builds them); the estimate is `estimate(...)` with the planner's settings for the same recipe, default
`max_traced_layers=4`, so the 8-12 layer models here are traced at 1 and 2 layer periods and extrapolated.

Found (benchmarks/results/memory_independent_cpu.json): the steps agree to the byte but for gemma2 (256 bytes
under, both precisions). Until 2026-12-06 checkpointed steps were under by 5056 bytes per checkpointed layer
alive at the peak: the CPU RNG state (`torch.get_rng_state()`) torch.utils.checkpoint keeps per layer
(preserve_rng_state), made without an ATen op, which no dispatch-mode counter sees; the estimator's trace now
counts it (`llmtune.plan.trace`), benchmarks.memory's StorageHighWater still does not. The LoRA cases under the
chunked loss (2026-12-06, LoRA on the head too in three families) are within 1 KB, but for qwen2 and phi3 in bf16
with checkpointing: 70 KB under, which oneDNN's bf16 matmul scratch makes through the c10 allocator outside any
ATen op (with `torch.backends.mkldnn.flags(enabled=False)` the qwen2 case is 544 bytes under).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from benchmarks import RESULTS
from benchmarks.memory import Case, batch_of, build, predict, state_tensors, train_step
from llmtune.model.precision import cpu_supports_bf16
from llmtune.units import format_bytes

VOCAB = 2048


def allocator_events(prof: profile) -> list[tuple[int, int]]:
    """(time ns, bytes: + allocated, - freed) of every c10 allocator event the profiler recorded, in time order."""
    out: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        if ev.tag == _EventType.Allocation and ev.extra_fields.device.type == torch.device("cpu").type:
            out.append((ev.start_time_ns, int(ev.extra_fields.alloc_size)))
        stack.extend(ev.children)
    return sorted(out)


def allocator_peak(fn, baseline_bytes: int = 0) -> tuple[int, int]:
    """Run `fn` under the profiler; (peak, net) allocated bytes: `baseline_bytes` plus the running sum of the
    allocator's events, its maximum and its end value."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    now = peak = baseline_bytes
    for _, delta in allocator_events(prof):
        now += delta
        peak = max(peak, now)
    return peak, now


def resident_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors` (what is allocated before the measured step)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def configs() -> dict[str, transformers.PretrainedConfig]:
    """Six families, 8-12 layers (deeper than the 4 layer periods the estimator traces whole)."""
    from transformers import Gemma2Config, GPTNeoXConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    common = dict(vocab_size=VOCAB, max_position_embeddings=1024)
    return {
        "llama": LlamaConfig(
            hidden_size=128, intermediate_size=344, num_hidden_layers=10, num_attention_heads=4,
            num_key_value_heads=2, **common,
        ),
        "mistral": MistralConfig(
            hidden_size=192, intermediate_size=512, num_hidden_layers=12, num_attention_heads=6,
            num_key_value_heads=2, sliding_window=64, **common,
        ),
        "qwen2": Qwen2Config(
            hidden_size=256, intermediate_size=688, num_hidden_layers=9, num_attention_heads=8,
            num_key_value_heads=2, tie_word_embeddings=True, **common,
        ),
        "gptneox": GPTNeoXConfig(
            hidden_size=128, intermediate_size=512, num_hidden_layers=11, num_attention_heads=4, **common
        ),
        "phi3": Phi3Config(
            hidden_size=192, intermediate_size=512, num_hidden_layers=8, num_attention_heads=6,
            num_key_value_heads=3, pad_token_id=0, **common,
        ),
        "gemma2": Gemma2Config(
            hidden_size=128, intermediate_size=344, num_hidden_layers=10, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, sliding_window=64, **common,
        ),
    }  # fmt: skip


# LoRA on the output head too, by each family's module names (GPT-NeoX's head is embed_out; Qwen2's here is tied).
HEAD_TARGETS = {
    "llama": ("q_proj", "v_proj", "lm_head"),
    "qwen2": ("q_proj", "v_proj", "lm_head"),
    "gptneox": ("query_key_value", "embed_out"),
}


def cases(quick: bool) -> list[Case]:
    """Per family one fp32 case, one checkpointed case (bf16 autocast where the CPU has native bf16) and one packed
    LoRA case under the chunked loss; three families with LoRA on the head as well."""
    precision = "bf16" if cpu_supports_bf16() else "fp32"
    out = []
    for i, arch in enumerate(configs()):
        mb, seq = (2, 256) if i % 2 else (4, 128)
        for ckpt, prec in ((False, "fp32"), (True, precision)):
            out.append(Case(arch, "padded", "hf", False, ckpt, prec, micro_batch=mb, seq_len=seq))
        out.append(Case(arch, "packed", "chunked", True, i % 2 == 0, precision, micro_batch=mb, seq_len=seq))
    for arch, targets in HEAD_TARGETS.items():
        out.append(Case(arch, "packed", "chunked", True, True, precision, 2, 256, lora_targets=targets))
    return out[::3] if quick else out


def measure(case: Case, cfg: transformers.PretrainedConfig) -> int:
    """Allocator high-water of the 2nd real training step of `case`."""
    step_module, model, opt = build(case, cfg)
    train_step(case, step_module, opt, [batch_of(case, 0)])
    batch = batch_of(case, 1)
    base = resident_bytes([*state_tensors(model, opt), *batch.values()])
    peak, _ = allocator_peak(lambda: train_step(case, step_module, opt, [batch]), base)
    return peak


def run_case(case: Case, cfg: transformers.PretrainedConfig | None = None) -> dict:
    cfg = cfg if cfg is not None else configs()[case.arch]
    t0 = time.perf_counter()
    meas = measure(case, cfg)
    t1 = time.perf_counter()
    est = predict(case, cfg)
    t2 = time.perf_counter()
    return asdict(case) | dict(
        layers=int(cfg.num_hidden_layers),
        traced_layers=est.settings["traced_layers"],
        estimated_bytes=est.peak_bytes,
        measured_bytes=meas,
        rel_error=est.peak_bytes / meas - 1,
        peak_phase=est.peak_phase,
        measure_s=round(t1 - t0, 2),
        estimate_s=round(t2 - t1, 2),
    )


def in_subprocess(case: Case) -> dict:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.memory_independent", "--case", json.dumps(asdict(case))]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{case} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool) -> dict:
    rows = []
    print(f"{'case':60s} {'layers':>6s} {'traced':>7s} {'estimate':>11s} {'measured':>11s} {'error':>8s}")
    for case in cases(quick):
        r = in_subprocess(case)
        rows.append(r)
        lora = f" lora{'+head' if case.lora_targets else ''} {case.loss}" if case.lora else ""
        shape = f"ckpt={int(case.checkpointing)} mb={case.micro_batch} seq={case.seq_len}"
        name = f"{case.arch}{lora} {case.precision} {shape}"
        traced = ",".join(map(str, r["traced_layers"]))
        print(
            f"{name:60s} {r['layers']:6d} {traced:>7s} {format_bytes(r['estimated_bytes']):>11s}"
            f" {format_bytes(r['measured_bytes']):>11s} {r['rel_error']:+8.2%}",
            flush=True,
        )
    errs = [r["rel_error"] for r in rows]
    abs_errs = sorted(abs(e) for e in errs)
    summary = {
        "cases": len(rows),
        "median_abs_rel_error": statistics.median(abs_errs),
        "worst_abs_rel_error": abs_errs[-1],
        "worst_underestimate": min(0.0, *errs),
    }
    print(f"\n{len(rows)} cases: median |error| {statistics.median(abs_errs):.2%}, worst |error| {abs_errs[-1]:.2%},"
          f" most under {min(0.0, *errs):+.2%}")  # fmt: skip
    return dict(summary=summary, rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a third of the cases")
    ap.add_argument("--out", type=Path, default=RESULTS / "memory_independent_cpu.json")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this (child) process; prints its row
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.case:
        print(json.dumps(run_case(Case(**json.loads(args.case)))))
        return
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    result = run(args.quick)
    result["meta"] = dict(
        started=started,
        wall_s=round(time.perf_counter() - t0, 1),
        command="python -m benchmarks.memory_independent" + (" --quick" if args.quick else ""),
        method="torch.profiler allocator events (profile_memory=True), running high-water + resident baseline",
        bf16_native=cpu_supports_bf16(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
