"""Per-process peak memory of real 2-process CPU runs with each row split along the sequence, against the estimate.

    python -m benchmarks.sequence_parallel [--lengths 4096 8192 16384] [--steps 3]

Trains the quickstart model (fp32, every layer checkpointed, packed rows of each length, micro-batch 1, global batch 2)
with `accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes 2`, whole rows (one per process)
and split in two (`parallel.sequence_parallel=2`: both processes on one row), and reads the main process's
steady-state peak of live tensor bytes (run_summary.json); then asks `llmtune estimate` for the same run
(`--num-processes 2 --sequence-parallel 1|2`). Prints a table, writes benchmarks/results/sequence_parallel.json:
the estimate's error on each, and what splitting saves (split peak / whole peak), measured and estimated.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import RESULTS, ROOT


def overrides(length: int, steps: int) -> list[str]:
    return [
        "training.precision=fp32",
        "training.gradient_checkpointing=true",
        f"training.max_steps={steps}",
        "training.micro_batch_size=1",
        "training.global_batch_size=2",
        f"data.max_length={length}",
        "data.packing=true",
        "logging.every_n_steps=1",
        "logging.progress_bar=false",
        "data.eval=[]",
        "checkpoint.every_n_steps=0",
    ]


def measured_peak(recipe: str, extra: list[str], degree: int, out: Path) -> int:
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    cmd = [accelerate, "launch", "--config_file", str(ROOT / "recipes" / "accelerate" / "fsdp2.yaml")]
    cmd += ["--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += [str(ROOT / "scripts" / "finetune.py"), "--recipe", recipe, *extra, f"parallel.sequence_parallel={degree}"]
    subprocess.run([*cmd, f"output_dir={out}"], check=True, capture_output=True)
    return json.loads((out / "run_summary.json").read_text())["peak_memory_bytes"]


def estimated_peak(recipe: str, extra: list[str], degree: int) -> int:
    llmtune = str(Path(sys.executable).with_name("llmtune"))
    cmd = [llmtune, "estimate", "--recipe", recipe, *extra, "--device", "cpu", "--num-processes", "2"]
    cmd += ["--sharding", "fsdp", "--sequence-parallel", str(degree), "--tiled-mlp", "off", "--json"]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["peak_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "sequence_parallel.json"))
    args = parser.parse_args()
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for length in args.lengths:
            extra = overrides(length, args.steps)
            peaks = {}
            for degree in (1, 2):
                measured = measured_peak(recipe, extra, degree, Path(tmp) / f"{length}-{degree}")
                predicted = estimated_peak(recipe, extra, degree)
                peaks[degree] = (measured, predicted)
                rows.append(
                    {
                        "tokens_per_row": length,
                        "sequence_parallel": degree,
                        "measured_peak_bytes": measured,
                        "estimated_peak_bytes": predicted,
                        "error": predicted / measured - 1,
                    }
                )
                print(
                    f"{length:6d} tokens  sequence_parallel {degree}  measured {measured / 2**20:8.2f} MiB"
                    f"  estimated {predicted / 2**20:8.2f} MiB  ({rows[-1]['error']:+.1%})",
                    flush=True,
                )
            (m1, p1), (m2, p2) = peaks[1], peaks[2]
            print(f"{length:6d} tokens  split / whole: measured {m2 / m1:.2f}x, estimated {p2 / p1:.2f}x", flush=True)
    Path(args.out).write_text(json.dumps({"processes": 2, "engine": "fsdp2", "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
