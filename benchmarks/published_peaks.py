"""llmtune's memory estimate against peak GPU memory other projects published for their own fine-tuning runs.

    python -m benchmarks.published_peaks [--rows benchmarks/published_peaks.json]
                                         [--out benchmarks/results/published_peaks.json] [--only SUBSTRING]

Issue 28's figure "Published GPU peaks": nobody outside can see our GPU runs, so the estimator is checked against
public resource tables instead (litgpt's, Qwen's, LLaMA-Factory's), each row a run whose settings are given well
enough to be planned: model, method (full / LoRA / QLoRA, rank, target modules, dropout), precision, sequence
length and layout, micro-batch, checkpointing, attention kernel, optimizer. `benchmarks/published_peaks.json`
holds the rows with their provenance (repository + path + commit, the table's row text), every assumption made
where a source leaves a setting out, the rows dropped and why, and where each model's config.json comes from
(`llmtune/catalogue/` or `benchmarks/published_configs/`).

Each row is estimated with `llmtune.plan.estimate(config, ..., device="cuda")` on its settings, nothing tuned
to the rows. The estimate compared is the one matching what the source measured:
- "allocated": `torch.cuda.max_memory_allocated()` (litgpt's "Memory used" / "Peak memory"): `peak_bytes`;
- "reserved": the caching allocator's reserved bytes: `reserved_bytes`;
- "nvidia-smi": the process as the driver sees it: `reserved_bytes` + `CUDA_CONTEXT_BYTES`;
- "unstated": a GPU-memory figure whose tool the source does not name: `reserved_bytes` (what a PyTorch
  process holds on the device, short of its CUDA context).
Prints one line per row (published, estimate, ratio estimate / published) and writes per-row results and the
summary (count, median ratio, share within +-10%, min and max) for all rows, for the rows run with transformers'
models (framework "transformers"; also with the remote-code Qwen-1 rows), for litgpt's rows, for the unflagged
rows and per method, to `benchmarks/results/published_peaks.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig

from benchmarks import RESULTS, ROOT
from llmtune.plan import LoraSpec, estimate

ROWS = Path(__file__).resolve().parent / "published_peaks.json"
CUDA_CONTEXT_BYTES = 512 * 1024**2  # what nvidia-smi shows beyond the allocator (context, kernels): ~0.5 GiB
WITHIN = 0.10  # "within +-10%"


def estimate_kwargs(settings: dict[str, Any]) -> dict[str, Any]:
    """The row's settings as `estimate` takes them (its `lora` block as a `LoraSpec`)."""
    kwargs = {k: v for k, v in settings.items() if k != "lora"}
    kwargs["device"] = "cuda"
    lora = settings.get("lora")
    if lora:
        kwargs["lora"] = LoraSpec(
            rank=lora["rank"],
            target_modules=tuple(lora["target_modules"]),
            dropout=bool(lora["dropout"]),
            alpha=lora["alpha"],
            method=lora["method"],
            dtype=lora.get("dtype", "fp32"),
        )
    return kwargs


def compared_bytes(est: Any, compare: str) -> int:
    """The estimate's figure that matches what the source measured (see the module docstring)."""
    if compare == "allocated":
        return est.peak_bytes
    if compare in ("reserved", "unstated"):
        return est.reserved_bytes
    if compare == "nvidia-smi":
        return est.reserved_bytes + CUDA_CONTEXT_BYTES
    raise ValueError(f"compare={compare!r}; expected allocated, reserved, nvidia-smi or unstated")


def run_row(row: dict[str, Any], configs: dict[str, Any]) -> dict[str, Any]:
    """Estimate one row; its published and estimated bytes and their ratio."""
    config = AutoConfig.from_pretrained(ROOT / configs[row["config"]]["path"])
    # Where the run's own code computes a layer otherwise than transformers' class does (its assumptions say why).
    for key, value in row.get("config_overrides", {}).items():
        setattr(config, key, value)
    t0 = time.perf_counter()
    est = estimate(config, **estimate_kwargs(row["settings"]))
    published = row["published"]["bytes"]
    predicted = compared_bytes(est, row["published"]["compare"])
    return {
        "id": row["id"],
        "model": row["model"],
        "framework": row["framework"],
        "gpu": row["gpu"],
        "method": (row["settings"].get("lora") or {}).get("method", "full"),
        "compare": row["published"]["compare"],
        "flags": row.get("flags", []),
        "published_bytes": published,
        "estimated_bytes": predicted,
        "ratio": predicted / published,
        "estimate_peak_bytes": est.peak_bytes,
        "estimate_reserved_bytes": est.reserved_bytes,
        "peak_phase": est.peak_phase,
        "breakdown": est.breakdown,
        "estimate_s": round(time.perf_counter() - t0, 2),
    }


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Count, median ratio, share within +-10%, min and max of the rows' ratios."""
    ratios = [r["ratio"] for r in results]
    if not ratios:
        return {"count": 0}
    return {
        "count": len(ratios),
        "median_ratio": statistics.median(ratios),
        "share_within_10pct": sum(abs(x - 1) <= WITHIN for x in ratios) / len(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "below_0.85": sum(x < 0.85 for x in ratios),
    }


def summaries(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of all rows, of the transformers-run rows, of the others, of each method and of each source (the
    row id's first part: one project's table)."""
    groups = {
        "all": results,
        "transformers": [r for r in results if r["framework"] == "transformers"],
        "transformers_incl_remote_code": [r for r in results if r["framework"].startswith("transformers")],
        "litgpt": [r for r in results if r["framework"] == "litgpt"],
        "unflagged": [r for r in results if not r["flags"]],
    }
    for method in sorted({r["method"] for r in results}):
        groups[f"method={method}"] = [r for r in results if r["method"] == method]
    for source in sorted({r["id"].split("/")[0] for r in results}):
        groups[f"source={source}"] = [r for r in results if r["id"].split("/")[0] == source]
    return {name: summary(rows) for name, rows in groups.items()}


def gb(n: int) -> str:
    return f"{n / 1e9:6.2f} GB"


def print_table(results: list[dict[str, Any]], sums: dict[str, Any]) -> None:
    print(f"{'row':46} {'framework':12} {'vs':10} {'published':>10} {'estimate':>10} {'ratio':>6}")
    for r in results:
        flag = " *" if r["flags"] else ""
        print(
            f"{r['id']:46} {r['framework']:12} {r['compare']:10} {gb(r['published_bytes'])} "
            f"{gb(r['estimated_bytes'])} {r['ratio']:6.3f}{flag}"
        )
    print("(* flagged row: see its flags in benchmarks/published_peaks.json)")
    for name, s in sums.items():
        if s["count"]:
            print(
                f"{name:18} n={s['count']:3}  median {s['median_ratio']:.3f}  within +-10% "
                f"{s['share_within_10pct']:.0%}  min {s['min_ratio']:.3f}  max {s['max_ratio']:.3f}  "
                f"below 0.85: {s['below_0.85']}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=str(ROWS))
    parser.add_argument("--out", default=str(RESULTS / "published_peaks.json"))
    parser.add_argument("--only", default="", help="run the rows whose id contains this")
    args = parser.parse_args()
    data = json.loads(Path(args.rows).read_text())
    rows = [r for r in data["rows"] if args.only in r["id"]]
    results = []
    for row in rows:
        results.append(run_row(row, data["configs"]))
        print(f"  {row['id']}: ratio {results[-1]['ratio']:.3f}", file=sys.stderr, flush=True)
    sums = summaries(results)
    print_table(results, sums)
    out = {
        "what": __doc__.splitlines()[0],
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "rows_file": str(Path(args.rows).resolve().relative_to(ROOT)),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_context_bytes": CUDA_CONTEXT_BYTES,
        "summary": sums,
        "dropped": data.get("dropped", []),
        "rows": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
