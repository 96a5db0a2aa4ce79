"""What `training.compile` buys: eager vs compiled decoder blocks, with and without checkpointing.

One Llama-style model per setting (built from a config, random init, the same seed), bf16 autocast, the
chunked loss, fused AdamW, one fixed packed batch of `--micro-batch` rows x `--seq-len` tokens (two
examples per row, every token trained). After `--warmup` steps (the compiled ones compile there), the
settings take turns step by step, the order reversed every round, so a machine that gets busier moves all
alike. Reports the median step time, tokens/s, MFU (`metrics.model_flops` against the best bf16
matmul peak measured in the run) and each setting's speed relative to eager at the same checkpointing.

    .venv/bin/python -m benchmarks.compile                 # h=512, 4 layers, vocab 32000: ~3 min
    .venv/bin/python -m benchmarks.compile --hidden 256 --layers 2

The warm-up column includes compiling; inductor caches compiled graphs on disk, so for a cold compile run
with an empty cache: `TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) .venv/bin/python -m benchmarks.compile`.

Writes benchmarks/results/compile_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks import RESULTS
from llmtune.model.blocks import apply_checkpointing, compile_blocks
from llmtune.ops.loss import CausalLMWithLoss
from llmtune.recipe import Checkpointing
from llmtune.run.metrics import measure_peak_flops, model_flops

OUTPUT = RESULTS / "compile_cpu.json"
SETTINGS = [(False, False), (True, False), (False, True), (True, True)]  # (compiled, checkpointing)


def name(compiled: bool, checkpointing: bool) -> str:
    return f"{'compiled' if compiled else 'eager'}{' + ckpt' if checkpointing else ''}"


def make_step(config, batch: dict, *, compiled: bool, checkpointing: bool):
    """A closure running one optimizer step of a fresh model; returns (step function, model)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.config.use_cache = False
    if checkpointing:
        apply_checkpointing(model, Checkpointing())  # every layer, non-reentrant: what the loop does for `true`
    if compiled:
        compile_blocks(model)
    model.train()
    wrapped = CausalLMWithLoss(model, "chunked")
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, fused=True)
    tokens = batch["labels"].numel()

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = wrapped(**batch)
        (loss / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()) / tokens

    return step, model


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per setting (compiling happens here)")
    p.add_argument("--rounds", type=int, default=8, help="timed steps per setting, taken in turns")
    p.add_argument("--output", type=Path, default=OUTPUT)
    a = p.parse_args(argv)
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.75),
        num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64, num_key_value_heads=a.hidden // 128,
        max_position_embeddings=max(2048, a.seq_len), tie_word_embeddings=False,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len), generator=gen)
    half = a.seq_len // 2
    positions = torch.cat([torch.arange(half), torch.arange(a.seq_len - half)]).repeat(a.micro_batch, 1)
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}
    tokens = ids.numel()

    started = time.perf_counter()
    steps, warm, losses = {}, {}, {}
    for compiled, ckpt in SETTINGS:
        step, model = make_step(config, batch, compiled=compiled, checkpointing=ckpt)
        t0 = time.perf_counter()
        losses[name(compiled, ckpt)] = [step() for _ in range(a.warmup)]
        warm[name(compiled, ckpt)] = time.perf_counter() - t0
        steps[name(compiled, ckpt)] = step
        print(f"{name(compiled, ckpt):18s} warm-up {a.warmup} steps {warm[name(compiled, ckpt)]:6.1f} s", flush=True)
    # Every token is trained here; each row packs two examples (attention counted per example).
    flops = model_flops(model).step(tokens, tokens, a.micro_batch * (half**2 + (a.seq_len - half) ** 2))
    peaks = [measure_peak_flops(torch.device("cpu"), "bf16")]
    times: dict[str, list[float]] = {n: [] for n in steps}
    for r in range(a.rounds):
        for n in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            t0 = time.perf_counter()
            steps[n]()
            times[n].append(time.perf_counter() - t0)
    peaks.append(measure_peak_flops(torch.device("cpu"), "bf16"))
    peak = max(peaks)

    rows = {}
    for compiled, ckpt in SETTINGS:
        n = name(compiled, ckpt)
        med = statistics.median(times[n])
        rows[n] = {
            "compiled": compiled,
            "checkpointing": ckpt,
            "warmup_s": warm[n],
            "step_s": times[n],
            "median_step_s": med,
            "tokens_per_s": tokens / med,
            "mfu": flops / med / peak,
            "warmup_losses": losses[n],
        }
    for row in rows.values():
        eager = rows[name(False, row["checkpointing"])]
        row["speed_vs_eager"] = eager["median_step_s"] / row["median_step_s"]
    results = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.compile " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__},
        "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default (warm if run before)"),
        "settings": vars(a) | {"output": str(a.output)},
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_flops": peaks,
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }
    print(f"\n{'setting':18s} {'step s':>7s} {'tok/s':>7s} {'MFU':>6s} {'vs eager':>8s} {'warm-up s':>9s}")
    for n, row in rows.items():
        print(
            f"{n:18s} {row['median_step_s']:7.2f} {row['tokens_per_s']:7.0f} {row['mfu']:6.1%}"
            f" {row['speed_vs_eager']:7.2f}x {row['warmup_s']:9.1f}"
        )
    print(f"bf16 peak {peak / 1e9:.0f} GFLOP/s (best of {[round(x / 1e9) for x in peaks]})")
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {a.output} in {results['seconds']:.0f} s")
    return results


if __name__ == "__main__":
    main()
