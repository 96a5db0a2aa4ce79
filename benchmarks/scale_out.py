"""Per-process peak memory of real 2-process CPU runs under each engine, against `llmtune estimate`.

    python -m benchmarks.scale_out [--steps 4] [--micro-batch 8]

Trains the quickstart model (fp32, checkpointing on) with `accelerate launch --config_file
recipes/accelerate/{ddp,fsdp2,deepspeed_zero2,deepspeed_zero3}.yaml --num_processes 2` and reads the main
process's steady-state peak of live tensor bytes (run_summary.json), then asks the estimator for the same
run (`--num-processes 2 --sharding none|fsdp|zero2|zero3`). Prints a table, writes
benchmarks/results/scale_out.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import RESULTS, ROOT

ENGINES = {"ddp": "none", "fsdp2": "fsdp", "deepspeed_zero2": "zero2", "deepspeed_zero3": "zero3"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS / "scale_out.json"))
    args = parser.parse_args()
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    overrides = [
        "training.precision=fp32",
        f"training.max_steps={args.steps}",
        f"training.micro_batch_size={args.micro_batch}",
        f"training.global_batch_size={args.micro_batch * 4}",  # 2 processes x accumulation 2
        "logging.every_n_steps=1",
        "logging.progress_bar=false",
        "data.eval=[]",
    ]
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    llmtune = str(Path(sys.executable).with_name("llmtune"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for config, sharding in ENGINES.items():
            out = Path(tmp) / config
            cmd = [accelerate, "launch", "--config_file", str(ROOT / "recipes" / "accelerate" / f"{config}.yaml")]
            cmd += ["--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no"]
            cmd += [str(ROOT / "scripts" / "finetune.py"), "--recipe", recipe, *overrides, f"output_dir={out}"]
            subprocess.run(cmd, check=True, capture_output=True)
            summary = json.loads((out / "run_summary.json").read_text())
            estimate_cmd = [llmtune, "estimate", "--recipe", recipe, *overrides, "--device", "cpu"]
            estimate_cmd += ["--num-processes", "2", "--sharding", sharding, "--json"]
            estimate = json.loads(subprocess.run(estimate_cmd, check=True, capture_output=True, text=True).stdout)
            measured, predicted = summary["peak_memory_bytes"], estimate["peak_bytes"]
            rows.append(
                {
                    "config": config,
                    "sharding": sharding,
                    "measured_peak_bytes": measured,
                    "estimated_peak_bytes": predicted,
                    "error": predicted / measured - 1,
                    "local_parameter_bytes": summary["local_parameter_bytes"],
                    "micro_batch_size": summary["micro_batch_size"],
                    "grad_accum_steps": summary["grad_accum_steps"],
                }
            )
            print(
                f"{config:16s} {sharding:6s} measured {measured / 2**20:8.2f} MiB  estimated"
                f" {predicted / 2**20:8.2f} MiB  ({rows[-1]['error']:+.1%})  params here"
                f" {summary['local_parameter_bytes'] / 2**20:6.2f} MiB",
                flush=True,
            )
    Path(args.out).write_text(json.dumps({"processes": 2, "overrides": overrides, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
