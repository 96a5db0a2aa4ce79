"""The planner's pick against every configuration measured, on this machine.

    python scripts/bench_planner.py            # 2 models x 3 budgets -> benchmarks/results/planner_cpu.{json,md}
    python scripts/bench_planner.py --quick    # the small model only, fewer rounds (a GPU check's size)

For each model, every candidate the planner weighs -- micro-batch (divisors of the global batch) x checkpointing
(none, every k-th layer, every layer, selective) -- trains as `llmtune train` trains it (load_model with that
checkpointing, CausalLMWithLoss with the chunked loss, make_optimizer, packed collated batches). Each candidate's
steady-state peak is measured (PeakMemoryTracker on its second step) and its tokens/s timed over several rounds,
the candidates alternating within each round (these machines are shared and noisy: the median of the rounds).

Then for three budgets per model -- tight (every layer recomputed at the largest micro-batch just fits), middle,
loose (nothing recomputed fits at the largest micro-batch) -- the planner plans (`plan_micro_batch`, gradient
checkpointing auto, with the rates `measure_rates` measures here), and its pick is compared with
- the measured best: the fastest candidate whose measured peak fits the budget;
- today's choice: every layer recomputed, the largest micro-batch the planner fits (the planner before v2).
Time model: each candidate's predicted tokens/s against its measured, raw and calibrated (scaled by the pick's
measured / predicted, as a run's first timed steps would scale it).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import LlamaConfig

from llmtune.data import collate
from llmtune.loss import CausalLMWithLoss
from llmtune.memory.measure import PeakMemoryTracker
from llmtune.memory.plan import checkpointing_choices, plan_micro_batch
from llmtune.memory.speed import Rates, measure_rates
from llmtune.model import load_model
from llmtune.optim import make_optimizer
from llmtune.recipe import Checkpointing, DataConfig, ModelConfig, Recipe, TrainingConfig
from llmtune.units import format_bytes

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
VOCAB = 1024
GLOBAL_BATCH = 8
SEQ = 256
SETTINGS = dict(seq_len=SEQ, precision="fp32", device="cpu", loss="chunked", optimizer="adamw_fused", layout="packed")


def models(quick: bool) -> dict[str, LlamaConfig]:
    common = dict(vocab_size=VOCAB, max_position_embeddings=SEQ)
    out = {
        "llama-h256-L4": LlamaConfig(
            hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            **common,
        ),
        "llama-h512-L6": LlamaConfig(
            hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
            **common,
        ),
    }  # fmt: skip
    return dict(list(out.items())[:1]) if quick else out


def recipe_for(checkpointing: Checkpointing, micro: int) -> Recipe:
    return Recipe(
        model=ModelConfig(name_or_path="bench", random_init=True),
        data=DataConfig(max_length=SEQ),
        training=TrainingConfig(
            precision="fp32",
            global_batch_size=GLOBAL_BATCH,
            micro_batch_size=micro,
            gradient_checkpointing=checkpointing,
            loss="chunked",
        ),
    )


def batches(micro: int) -> list[dict[str, torch.Tensor]]:
    """The global batch as packed rows of two examples each (position ids restart), every token trained."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(GLOBAL_BATCH):
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g).tolist()
        cut = SEQ // 2 + 8 * (i % 4)
        rows.append({"input_ids": ids, "labels": ids, "position_ids": list(range(cut)) + list(range(SEQ - cut))})
    return [collate(rows[i : i + micro], pad_token_id=0, packed=True) for i in range(0, GLOBAL_BATCH, micro)]


class Trainer:
    """One candidate, built as the training loop builds it."""

    def __init__(self, cfg: LlamaConfig, checkpointing: Checkpointing, micro: int) -> None:
        recipe = recipe_for(checkpointing, micro)
        torch.manual_seed(0)
        self.model = load_model(recipe, "fp32", cfg, checkpointing=checkpointing)
        self.model.train()
        self.step_module = CausalLMWithLoss(self.model, "chunked")
        self.opt = make_optimizer(self.model, recipe, torch.device("cpu"))
        self.batches = batches(micro)

    def step(self) -> float:
        start = time.perf_counter()
        for batch in self.batches:
            self.step_module(**batch).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def peak(self) -> int:
        with PeakMemoryTracker("cpu", baseline=[self.model, self.opt]) as tracker:
            self.step()  # AdamW's states appear here
            tracker.reset_peak()
            self.step()
        return tracker.peak_bytes


def measure_all(cfg: LlamaConfig, candidates: list[tuple[Checkpointing, int]], rounds: int) -> dict:
    """Peak (first round) and the median over rounds of a timed step, candidates alternating within a round."""
    peaks, seconds = {}, {c: [] for c in candidates}
    for r in range(rounds):
        for c in candidates:
            trainer = Trainer(cfg, *c)
            if r == 0:
                peaks[c] = trainer.peak()
            else:
                trainer.step()  # warm-up: first-call allocations
            seconds[c] += [trainer.step(), trainer.step()]
            del trainer
        print(f"  round {r + 1}/{rounds} done", flush=True)
    tokens = GLOBAL_BATCH * SEQ
    return {c: {"peak_bytes": peaks[c], "tokens_per_s": tokens / statistics.median(seconds[c])} for c in candidates}


def plan(cfg: LlamaConfig, budget: int, rates, checkpointing) -> tuple[Checkpointing, int, dict]:
    p = plan_micro_batch(
        cfg, global_batch_size=GLOBAL_BATCH, budget_bytes=budget, gradient_checkpointing=checkpointing, rates=rates,
        **SETTINGS,
    )  # fmt: skip
    return p.checkpointing, p.micro_batch_size, p


def run_model(name: str, cfg: LlamaConfig, rounds: int) -> dict:
    layers = cfg.num_hidden_layers
    sizes = [m for m in range(1, GLOBAL_BATCH + 1) if GLOBAL_BATCH % m == 0]
    candidates = [(mode, m) for mode in checkpointing_choices(layers) for m in sizes]
    rates = measure_rates("cpu", torch.float32, cfg)
    print(f"{name}: {len(candidates)} candidates; rates {rates}", flush=True)
    return evaluate(name, cfg, rates, measure_all(cfg, candidates, rounds))


def replanned(name: str, cfg: LlamaConfig, earlier: dict) -> dict:
    """`evaluate` of an earlier run's measurements and rates (`--replan FILE`) with this code's planner."""
    modes = {c.describe(cfg.num_hidden_layers): c for c in checkpointing_choices(cfg.num_hidden_layers)}
    run = next(r for r in earlier["results"] if r["model"] == name)
    measured = {
        (modes[m["checkpointing"]], m["micro_batch_size"]): {k: m[k] for k in ("peak_bytes", "tokens_per_s")}
        for m in run["measured"]
    }
    rates = Rates(**run["rates"])
    return evaluate(name, cfg, rates, measured)


def evaluate(name: str, cfg: LlamaConfig, rates: Rates, measured: dict) -> dict:
    """The planner's picks and the time model's predictions against the measured candidates."""
    layers = cfg.num_hidden_layers
    every, none = measured[(Checkpointing(1), GLOBAL_BATCH)], measured[(Checkpointing(0), GLOBAL_BATCH)]
    budgets = {
        "tight": int(every["peak_bytes"] * 1.02),
        "middle": int((every["peak_bytes"] + none["peak_bytes"]) / 2),
        "loose": int(none["peak_bytes"] * 1.02),
    }
    # The time model's prediction of every candidate (the planner's own, from a budget everything fits).
    _, _, roomy = plan(cfg, 2**40, rates, "auto")
    predicted = {(c["every_n_layers"], c["selective"], c["micro_batch_size"]): c for c in roomy.frontier}
    key = lambda c: (c[0].every_n_layers, c[0].selective, c[1])  # noqa: E731
    cases = []
    for label, budget in budgets.items():
        fitting = {c: v for c, v in measured.items() if v["peak_bytes"] <= budget}
        best = max(fitting, key=lambda c: fitting[c]["tokens_per_s"])
        mode, micro, p = plan(cfg, budget, rates, "auto")
        today_mode, today_micro, _ = plan(cfg, budget, rates, True)
        pick, today = measured[(mode, micro)], measured[(today_mode, today_micro)]
        calibration = pick["tokens_per_s"] / p.predicted_tokens_per_s
        cases.append(
            {
                "model": name,
                "budget": label,
                "budget_bytes": budget,
                "pick": {"checkpointing": mode.describe(layers), "micro_batch_size": micro, **pick},
                "pick_fits_measured": pick["peak_bytes"] <= budget,
                "best": {"checkpointing": best[0].describe(layers), "micro_batch_size": best[1], **fitting[best]},
                "today": {"checkpointing": today_mode.describe(layers), "micro_batch_size": today_micro, **today},
                "pick_over_best": pick["tokens_per_s"] / fitting[best]["tokens_per_s"],
                "pick_over_today": pick["tokens_per_s"] / today["tokens_per_s"],
                "room_for_less_than_full": any(c[0] != Checkpointing(1) for c in fitting),
                "calibration": calibration,
            }
        )
    errors = [
        {
            "candidate": f"{c[0].describe(layers)}, micro {c[1]}",
            "predicted": predicted[key(c)]["predicted_tokens_per_s"],
            "measured": v["tokens_per_s"],
        }
        for c, v in measured.items()
    ]
    return {
        "model": name,
        "rates": vars(rates),
        "cases": cases,
        "time_model": errors,
        "measured": [
            {"checkpointing": c[0].describe(layers), "micro_batch_size": c[1], **v} for c, v in measured.items()
        ],
    }


def summarise(results: list[dict]) -> dict:
    cases = [c for r in results for c in r["cases"]]
    room = [c["pick_over_today"] for c in cases if c["room_for_less_than_full"]]
    raw, calibrated = [], []
    for r in results:
        scale = statistics.median(c["calibration"] for c in r["cases"])
        for e in r["time_model"]:
            raw.append(abs(e["measured"] / e["predicted"] - 1))
            calibrated.append(abs(e["measured"] / (e["predicted"] * scale) - 1))
    return {
        "cases": len(cases),
        "pick_over_best_min": min(c["pick_over_best"] for c in cases),
        "out_of_budget_picks": sum(not c["pick_fits_measured"] for c in cases),
        "cases_with_room_for_less_than_full_checkpointing": len(room),
        "pick_over_today_median_where_room": statistics.median(room) if room else None,
        "pick_over_today_min": min(c["pick_over_today"] for c in cases),
        "time_model_median_abs_error_raw": statistics.median(raw),
        "time_model_median_abs_error_calibrated": statistics.median(calibrated),
    }


def table(results: list[dict], summary: dict) -> str:
    lines = [
        "| model | budget | pick | tokens/s | best measured | tokens/s | pick/best | today (every layer)"
        " | pick/today |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for c in r["cases"]:
            p, b, t = c["pick"], c["best"], c["today"]
            lines.append(
                f"| {c['model']} | {c['budget']} {format_bytes(c['budget_bytes'])} | {p['checkpointing']}, micro"
                f" {p['micro_batch_size']} | {p['tokens_per_s']:.0f} | {b['checkpointing']},"
                f" micro {b['micro_batch_size']} | {b['tokens_per_s']:.0f} | {c['pick_over_best']:.2f}"
                f" | micro {t['micro_batch_size']}: {t['tokens_per_s']:.0f} | {c['pick_over_today']:.2f} |"
            )
    lines += ["", *(f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in summary.items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=str(RESULTS / "planner_cpu.json"))
    parser.add_argument("--replan", help="re-plan the measurements and rates of an earlier run's JSON (no training)")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    rounds = 2 if args.quick else args.rounds
    started = time.time()
    if args.replan:
        earlier = json.loads(Path(args.replan).read_text())
        results = [replanned(name, cfg, earlier) for name, cfg in models(args.quick).items()]
    else:
        results = [run_model(name, cfg, rounds) for name, cfg in models(args.quick).items()]
    summary = summarise(results)
    out = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/bench_planner.py"
        + (" --quick" if args.quick else "")
        + (f" --replan {args.replan} (measured {earlier['date']})" if args.replan else ""),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "seconds": round(time.time() - started),
        "summary": summary,
        "results": results,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    md = table(results, summary)
    path.with_suffix(".md").write_text(f"# Planner v2 on this CPU ({out['date']})\n\n`{out['command']}`\n\n{md}\n")
    print(md)


if __name__ == "__main__":
    main()
