"""llmtune's benchmarks: each module measures one claim and writes its figures to `benchmarks/results/`.

Run them from the repository root, as modules (the package is found from there; nothing edits `sys.path`):

    python -m benchmarks.vs_hf --quick         # llmtune against the HF Trainer: tokens/s, memory, MFU
    python -m benchmarks.gpu_check --tiny      # the one-shot GPU check at toy size (`make gpu-check` on a GPU)

    compile     what `training.compile` buys, eager against compiled blocks
    data        packed against padded rows, and the data pipeline's speed
    loss        the chunked cross-entropy against HF's loss: memory and time
    memory      the memory estimator against measured peaks; the micro-batch picker against accelerate's retry
    planner     the planner's pick against every candidate measured
    preference  preference pairs packed into rows against one padded row per sequence
    grpo_vs_trl GRPO's loss, gradients, KL and clipping beside TRL's on the same completions
    scale_out   per-process peaks of 2-process runs under each engine against `llmtune estimate`
    vs_hf       llmtune against the HF Trainer on the same work
    faults      signals, a full disk, two launches, partial copies, changed resumes and bad inputs injected into
                real runs: what each leaves on disk, and whether the next run resumes the newest sound checkpoint
    optimizer   BF16AdamW's step against torch's fused and foreach AdamW: time and kernels launched
    generation  GRPO's sampling (one generate a batch, noise on the device) against plain `generate`: tokens/s
    packed_attention  per-document SDPA against one block-masked SDPA over packed rows, on a CPU
    compile_fusion    the bytes and kernels of a compiled decoder block against its eager ops (the time model's factors)
    hotpath_forecast  the time model's step on the Llama-3.2-1B shape, before and with compile, varlen, loss chunks
    sequence_parallel per-process peaks of 2-process runs, rows whole and split along the sequence, against the estimate
    tiled_mlp   a step's peak and time with the decoder MLPs in sequence tiles against whole
    gpu_check   what llmtune promises, measured on a GPU in one command
    gpu_report  the GPU check's markdown report (imported by gpu_check, not run)

Dated results committed before the package existed name these as `scripts/bench_<name>.py` and
`scripts/gpu_check.py`: the same code, now `python -m benchmarks.<name>` and `python -m benchmarks.gpu_check`.
"""

import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"  # committed figures, dated in their own files
ROOT = RESULTS.parents[1]  # the repository: recipes/, assets/, scripts/finetune.py


def run_header(module: str, argv: list[str] | None, device: str) -> dict:
    """When, how and where a benchmark ran: the head of its results file."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": f"python -m benchmarks.{module} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "device": device,
            "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },  # fmt: skip
    }


def write_results(results: dict, module: str, device: str) -> Path:
    """`results` (a `run_header` first, a `seconds` figure) as RESULTS/<module>_<device>.json, the path printed."""
    out = RESULTS / f"{module}_{device}.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out} in {results['seconds']:.0f} s")
    return out
