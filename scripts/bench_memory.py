"""Memory estimator accuracy on CPU, and the micro-batch picker against accelerate's OOM retry.

    python scripts/bench_memory.py            # full accuracy matrix -> memory_accuracy_cpu.json
    python scripts/bench_memory.py --quick    # a subset (minutes)
    python scripts/bench_memory.py --picker   # picker benchmark -> picker_cpu.json

Accuracy: for each (architecture, max length, micro-batch, precision, checkpointing, attention)
a tiny model built from a config runs two real AdamW steps under PeakMemoryTracker; the steady
state (2nd step) peak is compared with `estimate(..., device="cpu")`.

Picker: for several budgets, the micro-batch `plan_micro_batch` picks vs the true largest one
(found by measuring every allowed micro-batch), and the trials/time accelerate's
`find_executable_batch_size` needs from the same upper bound, with PeakMemoryTracker(limit_bytes)
making out-of-memory real on CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

from llmtune.memory.estimate import estimate
from llmtune.memory.measure import PeakMemoryTracker
from llmtune.memory.plan import MemoryPlanError, plan_micro_batch
from llmtune.units import format_bytes

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
VOCAB = 1024


def configs() -> dict[str, transformers.PretrainedConfig]:
    """Small models of four families: GQA + SwiGLU + RMSNorm (Llama), tied embeddings + qkv bias
    (Qwen2), learned positions + Conv1D + GELU + dropout (GPT-2), parallel residual + partial
    rotary (GPT-NeoX)."""
    common = dict(vocab_size=VOCAB, max_position_embeddings=1024)
    return {
        "llama": LlamaConfig(
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            **common,
        ),
        "qwen2": Qwen2Config(
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            **common,
        ),
        "gpt2": GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=1024),
        "gptneox": GPTNeoXConfig(
            hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, **common
        ),
    }


def build(cfg, precision: str, checkpointing: bool, attn: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = False
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model, opt, batch: torch.Tensor, precision: str, accum: int = 1) -> None:
    """One optimizer step over `accum` micro-batches; the loop keeps only the loss."""
    for _ in range(accum):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        del loss
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(cfg, *, mb: int, seq: int, precision: str, ckpt: bool, attn: str, accum: int = 1) -> int:
    model, opt = build(cfg, precision, ckpt, attn)
    batch = torch.randint(0, VOCAB, (mb, seq))
    with PeakMemoryTracker("cpu", baseline=[model, opt]) as t:
        train_step(model, opt, batch, precision, accum)  # AdamW states appear here
        t.reset_peak()
        train_step(model, opt, batch, precision, accum)
    return t.peak_bytes


def accuracy(quick: bool) -> dict:
    cfgs = configs()
    archs = list(cfgs)
    seqs, mbs = ([128, 1024], [1, 8]) if quick else ([128, 512, 1024], [1, 2, 4, 8])
    rows = []
    matrix = list(itertools.product(archs, seqs, mbs, ["fp32", "bf16"], [False, True], ["sdpa", "eager"]))
    for i, (arch, seq, mb, precision, ckpt, attn) in enumerate(matrix):
        t0 = time.perf_counter()
        meas = measure(cfgs[arch], mb=mb, seq=seq, precision=precision, ckpt=ckpt, attn=attn)
        t1 = time.perf_counter()
        est = estimate(
            cfgs[arch],
            micro_batch_size=mb,
            seq_len=seq,
            precision=precision,
            gradient_checkpointing=ckpt,
            attn_implementation=attn,
            device="cpu",
        )
        t2 = time.perf_counter()
        err = est.peak_bytes / meas - 1
        rows.append(
            dict(
                arch=arch,
                seq_len=seq,
                micro_batch=mb,
                precision=precision,
                checkpointing=ckpt,
                attn=attn,
                measured_bytes=meas,
                predicted_bytes=est.peak_bytes,
                rel_error=err,
                peak_phase=est.peak_phase,
                measure_s=round(t1 - t0, 3),
                estimate_s=round(t2 - t1, 3),
            )
        )
        print(
            f"[{i + 1:3d}/{len(matrix)}] {arch:8s} s={seq:5d} b={mb} {precision:5s} ckpt={int(ckpt)} {attn:5s} "
            f"measured {format_bytes(meas):>11s} predicted {format_bytes(est.peak_bytes):>11s} {err:+7.2%} "
            f"({est.peak_phase}, est {t2 - t1:.2f}s)",
            flush=True,
        )
    errs = [r["rel_error"] for r in rows]
    summary = dict(
        cases=len(rows),
        median_abs_rel_error=statistics.median(abs(e) for e in errs),
        worst_abs_rel_error=max(abs(e) for e in errs),
        worst_underestimate=min(min(errs), 0.0),
        median_estimate_s=statistics.median(r["estimate_s"] for r in rows),
    )
    print(
        f"\n{summary['cases']} cases: median |error| {summary['median_abs_rel_error']:.3%}, "
        f"worst |error| {summary['worst_abs_rel_error']:.3%}, worst underestimate "
        f"{summary['worst_underestimate']:+.3%}, median estimate time {summary['median_estimate_s']:.2f}s"
    )
    return dict(summary=summary, rows=rows)


def picker() -> dict:
    """Largest fitting micro-batch: planner vs truth vs accelerate's halving retry."""
    from accelerate.utils import find_executable_batch_size

    cfg = configs()["llama"]
    gbs, seq, precision, ckpt, attn = 32, 256, "fp32", False, "sdpa"
    divisors = [m for m in range(1, gbs + 1) if gbs % m == 0]
    data = torch.randint(0, VOCAB, (gbs, seq))

    truth_peaks = {}
    for m in divisors:
        truth_peaks[m] = measure(cfg, mb=m, seq=seq, precision=precision, ckpt=ckpt, attn=attn, accum=gbs // m)
        print(f"measured peak at micro-batch {m:2d} (accum {gbs // m:2d}): {format_bytes(truth_peaks[m])}", flush=True)

    def run_training(m: int, budget: int, steps: int = 2) -> None:
        """What a trial costs: build, then `steps` optimizer steps under the enforced budget
        (2, because AdamW's states appear only at the first step)."""
        model, opt = build(cfg, precision, ckpt, attn)
        with PeakMemoryTracker("cpu", baseline=[model, opt], limit_bytes=budget):
            for _ in range(steps):
                for k in range(gbs // m):
                    batch = data[k * m : (k + 1) * m]
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                        loss = model(input_ids=batch, labels=batch).loss
                    loss.backward()
                    del loss
                opt.step()
                opt.zero_grad(set_to_none=True)

    # Budgets half-way between consecutive measured peaks, plus one under micro-batch 1.
    ms = sorted(truth_peaks)
    budgets = [int(truth_peaks[1] * 0.9)] + [
        (truth_peaks[a] + truth_peaks[b]) // 2 for a, b in zip(ms, ms[1:], strict=False)
    ]
    budgets.append(int(truth_peaks[ms[-1]] * 1.1))
    rows = []
    for budget in budgets:
        fitting = [m for m in ms if truth_peaks[m] <= budget]
        truth = max(fitting) if fitting else None

        t0 = time.perf_counter()
        try:
            plan = plan_micro_batch(
                cfg,
                global_batch_size=gbs,
                num_processes=1,
                budget_bytes=budget,
                seq_len=seq,
                precision=precision,
                gradient_checkpointing=ckpt,
                attn_implementation=attn,
                device="cpu",
            )
            planned = plan.micro_batch_size
        except MemoryPlanError:
            planned = None
        plan_s = time.perf_counter() - t0
        planned_ok = None
        if planned is not None:
            try:
                run_training(planned, budget)
                planned_ok = True
            except torch.OutOfMemoryError:
                planned_ok = False
        planner_total_s = time.perf_counter() - t0

        trials: list[int] = []
        t0 = time.perf_counter()

        @find_executable_batch_size(starting_batch_size=gbs)
        def accelerate_loop(batch_size: int, trials: list[int] = trials, budget: int = budget) -> int:
            trials.append(batch_size)
            run_training(batch_size, budget)
            return batch_size

        try:
            acc_m = accelerate_loop()
        except RuntimeError:  # "No executable batch size found, reached zero."
            acc_m = None
        acc_s = time.perf_counter() - t0

        row = dict(
            budget_bytes=budget,
            budget=format_bytes(budget),
            true_largest_micro_batch=truth,
            planner_micro_batch=planned,
            planner_step_fits=planned_ok,
            planner_estimate_s=round(plan_s, 2),
            planner_time_to_working_batch_s=round(planner_total_s, 2),
            planner_trial_steps=1 if planned is not None else 0,
            accelerate_micro_batch=acc_m,
            accelerate_trials=len(trials),
            accelerate_trial_batches=trials,
            accelerate_time_to_working_batch_s=round(acc_s, 2),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    setup = dict(
        arch="llama",
        config=cfg.to_dict(),
        global_batch_size=gbs,
        seq_len=seq,
        precision=precision,
        gradient_checkpointing=ckpt,
        attn=attn,
        measured_peaks={str(k): v for k, v in truth_peaks.items()},
    )
    return dict(setup=setup, rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a subset of the accuracy matrix")
    ap.add_argument("--picker", action="store_true", help="run the picker benchmark instead")
    ap.add_argument("--out", type=Path, default=None, help="JSON output path")
    args = ap.parse_args()
    torch.set_num_threads(2)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    result = picker() if args.picker else accuracy(args.quick)
    name = "picker_cpu.json" if args.picker else "memory_accuracy_cpu.json"
    if args.quick and not args.picker:
        name = "memory_accuracy_cpu_quick.json"
    out = args.out or RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    result["meta"] = dict(
        started=started,
        wall_s=round(time.perf_counter() - t0, 1),
        command="python scripts/bench_memory.py" + (" --picker" if args.picker else " --quick" if args.quick else ""),
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        cpu_threads=torch.get_num_threads(),
    )
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
