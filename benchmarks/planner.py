"""The planner's pick against every configuration measured, on this machine.

    python -m benchmarks.planner            # 2 models x 3 budgets -> benchmarks/results/planner_cpu.{json,md}
    python -m benchmarks.planner --quick    # the small model only, fewer rounds
    python -m benchmarks.planner --device cuda --quick --out DIR/planner_gpu.json   # the GPU check's version

For each model, every candidate the planner weighs -- micro-batch (divisors of the global batch) x checkpointing
(none, every k-th layer, every layer, on a GPU every layer offloaded, selective) -- trains as `llmtune train`
trains it (load_model with that checkpointing, CausalLMWithLoss with the chunked loss, make_optimizer, packed
collated batches). Each candidate's
steady-state peak is measured (PeakMemoryTracker on its second step) and its tokens/s timed over several rounds,
the candidates alternating within each round (these machines are shared and noisy: the median of the rounds).

Then for three budgets per model -- tight (every layer recomputed at the largest micro-batch just fits), middle,
loose (nothing recomputed fits at the largest micro-batch) -- the planner plans (`plan_micro_batch`, gradient
checkpointing auto, with the rates `measure_rates` measures here), and its pick is compared with
- the measured best: the fastest candidate whose measured peak fits the budget;
- today's choice: every layer recomputed, the largest micro-batch the planner fits (the planner before v2).
Those two ratios are then measured again head to head (`head_to_head`: pick and other, step after step, twice
the sweep's rounds): the sweep's own ratios (kept as `sweep_pick_over_*`) carry minutes of this host's drift and
the bias of a maximum over many noisy figures.
Time model: each candidate's predicted tokens/s against its measured, raw and calibrated (scaled by the pick's
measured / predicted, as a run's first timed steps would scale it).

On a GPU (`--device cuda`) the models are wider (a 1B-like layer shape, 4 layers) and longer (1024 tokens), in
bf16-true (bf16 weights, no autocast: the loop's own bf16 mode, which needs no accelerator to set up), and
"peak" and the budgets are the caching allocator's reserved bytes, which is what the planner holds a CUDA budget
against.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import LlamaConfig

from benchmarks import RESULTS
from llmtune.data import collate
from llmtune.model.load import load_model
from llmtune.ops.loss import CausalLMWithLoss
from llmtune.ops.measure import PeakMemoryTracker
from llmtune.ops.optim import make_optimizer
from llmtune.plan import checkpointing_choices, plan_micro_batch
from llmtune.plan.timing import Rates, measure_rates
from llmtune.recipe import Checkpointing, DataConfig, ModelConfig, Recipe, TrainingConfig
from llmtune.run.parallelize import adapt
from llmtune.units import format_bytes

GLOBAL_BATCH = 8


@dataclass(frozen=True)
class Device:
    """Where the candidates train, and how."""

    name: str  # "cpu" or "cuda"
    precision: str
    seq: int

    @property
    def settings(self) -> dict:
        """The estimator's settings for a candidate, as `llmtune train` would run it here."""
        optimizer = "adamw_bf16" if self.precision == "bf16-true" else "adamw_fused"
        return dict(seq_len=self.seq, precision=self.precision, device=self.name, loss="chunked",
                    optimizer=optimizer, layout="packed")  # fmt: skip

    def sync(self) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize()


CPU = Device("cpu", "fp32", 256)
GPU = Device("cuda", "bf16-true", 1024)
TINY = Device("cpu", "fp32", 64)  # the GPU check's toy run on a CPU (CI): every step of the benchmark, in seconds


def llama(hidden: int, layers: int, heads: int, vocab: int, seq: int) -> LlamaConfig:
    """A Llama of the usual proportions: MLP 2.6875x (Llama's 11008 / 4096), half as many K/V heads (4x on GPUs)."""
    kv = heads // 4 if hidden >= 2048 else heads // 2
    return LlamaConfig(
        hidden_size=hidden, intermediate_size=4 * hidden if hidden >= 2048 else int(2.6875 * hidden),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
        max_position_embeddings=seq,
    )  # fmt: skip


def models(quick: bool, device: Device = CPU) -> dict[str, LlamaConfig]:
    if device is TINY:
        return {"llama-h64-L2": llama(64, 2, 4, 256, device.seq)}
    if device is GPU:
        return {"llama-h2048-L4": llama(2048, 4, 32, 32000, device.seq)}
    out = {"llama-h256-L4": llama(256, 4, 4, 1024, device.seq), "llama-h512-L6": llama(512, 6, 8, 1024, device.seq)}
    return dict(list(out.items())[:1]) if quick else out


def recipe_for(checkpointing: Checkpointing, micro: int, device: Device) -> Recipe:
    return Recipe(
        model=ModelConfig(name_or_path="bench", random_init=True),
        data=DataConfig(max_length=device.seq),
        training=TrainingConfig(
            precision=device.precision,
            global_batch_size=GLOBAL_BATCH,
            micro_batch_size=micro,
            gradient_checkpointing=checkpointing,
            loss="chunked",
        ),
    )


def batches(micro: int, vocab: int, device: Device) -> list[dict[str, torch.Tensor]]:
    """The global batch as packed rows of two examples each (position ids restart), every token trained."""
    g = torch.Generator().manual_seed(0)
    rows, seq = [], device.seq
    for i in range(GLOBAL_BATCH):
        ids = torch.randint(3, vocab, (seq,), generator=g).tolist()
        cut = seq // 2 + 8 * (i % 4)
        rows.append({"input_ids": ids, "labels": ids, "position_ids": list(range(cut)) + list(range(seq - cut))})
    collated = [collate(rows[i : i + micro], pad_token_id=0, packed=True) for i in range(0, GLOBAL_BATCH, micro)]
    return [{k: v.to(device.name) for k, v in b.items()} for b in collated]


class Trainer:
    """One candidate, built as the training loop builds it."""

    def __init__(self, cfg: LlamaConfig, checkpointing: Checkpointing, micro: int, device: Device) -> None:
        recipe = recipe_for(checkpointing, micro, device)
        self.device = device
        torch.manual_seed(0)
        self.model = adapt(load_model(recipe, device.precision, cfg, torch.device(device.name)), recipe, checkpointing)
        self.model.train()
        self.step_module = CausalLMWithLoss(self.model, "chunked")
        self.opt = make_optimizer(self.model, recipe, torch.device(device.name))
        self.batches = batches(micro, cfg.vocab_size, device)

    def step(self) -> float:
        self.device.sync()
        start = time.perf_counter()
        for batch in self.batches:
            self.step_module(**batch).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.device.sync()
        return time.perf_counter() - start

    def peak(self) -> int:
        """The steady-state peak the planner holds a budget against: on CUDA the reserved bytes."""
        with PeakMemoryTracker(self.device.name, baseline=[self.model, self.opt]) as tracker:
            self.step()  # AdamW's states appear here
            tracker.reset_peak()
            self.step()
        return tracker.peak_reserved_bytes


def measure_all(cfg: LlamaConfig, candidates: list[tuple[Checkpointing, int]], rounds: int, device: Device) -> dict:
    """Peak (first round) and the median over rounds of a timed step, candidates alternating within a round."""
    peaks, seconds = {}, {c: [] for c in candidates}
    for r in range(rounds):
        for c in candidates:
            trainer = Trainer(cfg, *c, device)
            if r == 0:
                peaks[c] = trainer.peak()
            else:
                trainer.step()  # warm-up: first-call allocations
            seconds[c] += [trainer.step(), trainer.step()]
            del trainer
            if device.name == "cuda":
                torch.cuda.empty_cache()  # each candidate's reserved peak from a clean allocator
        print(f"  round {r + 1}/{rounds} done", flush=True)
    tokens = GLOBAL_BATCH * device.seq
    return {c: {"peak_bytes": peaks[c], "tokens_per_s": tokens / statistics.median(seconds[c])} for c in candidates}


def plan(cfg: LlamaConfig, budget: int, rates, checkpointing, device: Device) -> tuple[Checkpointing, int, dict]:
    p = plan_micro_batch(
        cfg, global_batch_size=GLOBAL_BATCH, budget_bytes=budget, gradient_checkpointing=checkpointing, rates=rates,
        **device.settings,
    )  # fmt: skip
    return p.checkpointing, p.micro_batch_size, p


def choices(cfg: LlamaConfig, device: Device) -> list[Checkpointing]:
    """The settings the planner weighs on `device` (offloading on a GPU only)."""
    return checkpointing_choices(cfg.num_hidden_layers, offload=device.name == "cuda")


def head_to_head(cfg: LlamaConfig, a: tuple, b: tuple, rounds: int, device: Device) -> float:
    """Tokens/s of candidate `a` over `b`, each step timed right after the other's (the order alternating): the
    median of the rounds' ratios. The sweep's rounds take minutes each, over which this host's speed drifts by
    10-20%; a ratio of neighbouring steps cancels the drift, and re-measuring the sweep's best removes the bias
    of taking the largest of many noisy figures."""
    ta, tb = Trainer(cfg, *a, device), Trainer(cfg, *b, device)
    ta.step(), tb.step()  # warm-up
    ratios = []
    for r in range(rounds):
        if r % 2:
            sb, sa = tb.step(), ta.step()
        else:
            sa, sb = ta.step(), tb.step()
        ratios.append(sb / sa)
    return statistics.median(ratios)


def confirm(cfg: LlamaConfig, result: dict, rounds: int, device: Device) -> None:
    """Each case's pick against its measured best and against today's choice, head to head (`head_to_head`); the
    sweep's ratios stay beside them."""
    modes = {c.describe(cfg.num_hidden_layers): c for c in choices(cfg, device)}
    key = lambda c: (modes[c["checkpointing"]], c["micro_batch_size"])  # noqa: E731
    for case in result["cases"]:
        for other in ("best", "today"):
            case[f"sweep_pick_over_{other}"] = case[f"pick_over_{other}"]
            if key(case["pick"]) != key(case[other]):
                case[f"pick_over_{other}"] = head_to_head(cfg, key(case["pick"]), key(case[other]), rounds, device)
        print(f"  {case['budget']}: pick/best {case['pick_over_best']:.3f}, pick/today {case['pick_over_today']:.3f}"
              " head to head", flush=True)  # fmt: skip


def run_model(name: str, cfg: LlamaConfig, rounds: int, device: Device) -> dict:
    sizes = [m for m in range(1, GLOBAL_BATCH + 1) if GLOBAL_BATCH % m == 0]
    candidates = [(mode, m) for mode in choices(cfg, device) for m in sizes]
    dtype = torch.bfloat16 if device.precision.startswith("bf16") else torch.float32
    rates = measure_rates(device.name, dtype, cfg)
    print(f"{name}: {len(candidates)} candidates; rates {rates}", flush=True)
    result = evaluate(name, cfg, rates, measure_all(cfg, candidates, rounds, device), device)
    confirm(cfg, result, 2 * rounds, device)
    return result


def replanned(name: str, cfg: LlamaConfig, earlier: dict, device: Device) -> dict:
    """`evaluate` of an earlier run's measurements and rates (`--replan FILE`) with this code's planner (the sweep's
    ratios only: nothing trains)."""
    modes = {c.describe(cfg.num_hidden_layers): c for c in choices(cfg, device)}
    run = next(r for r in earlier["results"] if r["model"] == name)
    measured = {
        (modes[m["checkpointing"]], m["micro_batch_size"]): {k: m[k] for k in ("peak_bytes", "tokens_per_s")}
        for m in run["measured"]
    }
    rates = Rates(**run["rates"] | {"flops_by_rows": tuple(map(tuple, run["rates"].get("flops_by_rows", ())))})
    return evaluate(name, cfg, rates, measured, device)


def evaluate(name: str, cfg: LlamaConfig, rates: Rates, measured: dict, device: Device) -> dict:
    """The planner's picks and the time model's predictions against the measured candidates."""
    layers = cfg.num_hidden_layers
    every, none = measured[(Checkpointing(1), GLOBAL_BATCH)], measured[(Checkpointing(0), GLOBAL_BATCH)]
    budgets = {
        "tight": int(every["peak_bytes"] * 1.02),
        "middle": int((every["peak_bytes"] + none["peak_bytes"]) / 2),
        "loose": int(none["peak_bytes"] * 1.02),
    }
    # The time model's prediction of every candidate (the planner's own, from a budget everything fits).
    _, _, roomy = plan(cfg, 2**40, rates, "auto", device)
    predicted = {(c["checkpointing"], c["micro_batch_size"]): c for c in roomy.frontier}
    key = lambda c: (c[0].describe(layers), c[1])  # noqa: E731
    cases = []
    for label, budget in budgets.items():
        fitting = {c: v for c, v in measured.items() if v["peak_bytes"] <= budget}
        best = max(fitting, key=lambda c: fitting[c]["tokens_per_s"])
        mode, micro, p = plan(cfg, budget, rates, "auto", device)
        today_mode, today_micro, _ = plan(cfg, budget, rates, True, device)
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
        "sweep_pick_over_best_min": min(c.get("sweep_pick_over_best", c["pick_over_best"]) for c in cases),
        "out_of_budget_picks": sum(not c["pick_fits_measured"] for c in cases),
        "cases_with_room_for_less_than_full_checkpointing": len(room),
        "pick_over_today_median_where_room": statistics.median(room) if room else None,
        "pick_over_today_min": min(c["pick_over_today"] for c in cases),
        "time_model_median_abs_error_raw": statistics.median(raw),
        "time_model_median_abs_error_calibrated": statistics.median(calibrated),
    }


def table(results: list[dict], summary: dict) -> str:
    """Tokens/s from the sweep; the ratios head to head where they were measured so, the sweep's in brackets."""
    lines = [
        "| model | budget | pick | tokens/s (sweep) | best measured in the sweep | tokens/s | pick/best (sweep)"
        " | today (every layer) | pick/today (sweep) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def ratio(c: dict, other: str) -> str:
        sweep = c.get(f"sweep_pick_over_{other}")
        return f"{c[f'pick_over_{other}']:.2f}" + (f" ({sweep:.2f})" if sweep is not None else "")

    for r in results:
        for c in r["cases"]:
            p, b, t = c["pick"], c["best"], c["today"]
            lines.append(
                f"| {c['model']} | {c['budget']} {format_bytes(c['budget_bytes'])} | {p['checkpointing']}, micro"
                f" {p['micro_batch_size']} | {p['tokens_per_s']:.0f} | {b['checkpointing']},"
                f" micro {b['micro_batch_size']} | {b['tokens_per_s']:.0f} | {ratio(c, 'best')}"
                f" | micro {t['micro_batch_size']}: {t['tokens_per_s']:.0f} | {ratio(c, 'today')} |"
            )
    lines += ["", *(f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in summary.items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tiny", action="store_true", help="a toy model on the CPU, 1 round (tests this script)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=str(RESULTS / "planner_cpu.json"))
    parser.add_argument("--replan", help="re-plan the measurements and rates of an earlier run's JSON (no training)")
    args = parser.parse_args()
    device = TINY if args.tiny else GPU if args.device == "cuda" else CPU
    rounds = 1 if args.tiny else 2 if args.quick else args.rounds
    started = time.time()
    if args.replan:
        earlier = json.loads(Path(args.replan).read_text())
        results = [replanned(name, cfg, earlier, device) for name, cfg in models(args.quick, device).items()]
    else:
        results = [run_model(name, cfg, rounds, device) for name, cfg in models(args.quick, device).items()]
    summary = summarise(results)
    out = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.planner"
        + (" --quick" if args.quick else "")
        + (" --tiny" if args.tiny else "")
        + (" --device cuda" if device is GPU else "")
        + (f" --replan {args.replan} (measured {earlier['date']})" if args.replan else ""),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
        | ({"gpu": torch.cuda.get_device_name()} if device is GPU else {}),
        "torch": torch.__version__,
        "seconds": round(time.time() - started),
        "summary": summary,
        "results": results,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    md = table(results, summary)
    where = "GPU" if device is GPU else "CPU"
    path.with_suffix(".md").write_text(f"# Planner v2 on this {where} ({out['date']})\n\n`{out['command']}`\n\n{md}\n")
    print(md)


if __name__ == "__main__":
    main()
