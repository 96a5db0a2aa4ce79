"""`llmtune bench`: measure what mixed precision and gradient checkpointing buy on this machine.

For each precision (fp32, fp16, bf16 — every one the device can run at all; the others get a row saying
why not) and gradient checkpointing off and on, the recipe's own model, data, batch and PEFT section train for
a few steps through the real loop (`llmtune.run.setup.build` / `fit`, in this process). Trials run in rounds,
each round every trial once, the order reversed every other round, so a machine that gets busier or
quieter during the bench moves all trials alike and the ratios to fp32 stay meaningful.

bf16 on a CPU without native bf16 (AVX2 only) is emulated, ~30x slower than fp32: it is still measured, so a
user there learns what bf16 buys (less memory) and costs (speed), but in the first round only and for
EMULATED_STEPS steps, and its rows say `emulated`.

Per trial:
- peak memory: run_summary's `peak_memory_bytes`, the steady-state peak (steps after the first, once
  AdamW's states exist). On CPU it is peak live tensor bytes, not the process's RSS.
- trained tokens/s: from metrics.jsonl, leaving out the warm-up steps, and preferring steps that ran
  without the memory tracker (on CPU the loop counts live tensors on its first 3 steps, ~1.5x slower).
- what fits the memory budget, from the memory estimator (pure; nothing is run): the micro-batch the
  planner picks for the recipe's global batch, and the largest micro-batch in the budget, uncapped.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "bf16")
DEFAULT_STEPS = 6  # per trial and round: steps 1-3 are memory-tracked on CPU, 4-6 give the tokens/s
DEFAULT_REPEATS = 2
WARMUP_STEPS = 2  # step 1 allocates AdamW's states and warms kernels up; step 2 can still be slow
# An emulated trial runs once, not once per round, for 2 steps: step 1 allocates AdamW's states, step 2 is
# the steady state measured (one emulated quickstart step takes ~15 s on 2 cores; kernel warm-up is noise
# next to that).
EMULATED_STEPS = 2
MAX_MICRO_BATCH = 1 << 20  # search cap: "the budget is no limit" for any real model


@dataclass(frozen=True)
class Trial:
    precision: str
    gradient_checkpointing: bool
    skipped: str | None = None  # why this trial cannot run here
    emulated: bool = False  # bf16 on a CPU without native bf16: measured, but fewer steps (slow)

    @property
    def name(self) -> str:
        return f"{self.precision}{'-ckpt' if self.gradient_checkpointing else ''}"


# ---------------------------------------------------------------- what to run


def plan_trials(device_type: str, precisions: Iterable[str] = PRECISIONS) -> list[Trial]:
    """Every precision x checkpointing off/on; trials this device cannot run carry the reason."""
    from llmtune.errors import SetupError
    from llmtune.model.precision import cpu_supports_bf16, resolve_precision

    trials = []
    for precision in precisions:
        reason = None
        try:
            resolve_precision(precision, device_type)
        except SetupError as err:
            reason = str(err)
        emulated = reason is None and precision.startswith("bf16") and device_type == "cpu" and not cpu_supports_bf16()
        trials += [Trial(precision, gc, reason, emulated) for gc in (False, True)]
    return trials


def trial_overrides(trial: Trial, steps: int, warmup_steps: int, output_dir: Path) -> list[str]:
    """Overrides appended after the user's, so they win: a short, quiet, checkpoint-free run."""
    return [
        f"training.precision={trial.precision}",
        f"training.gradient_checkpointing={str(trial.gradient_checkpointing).lower()}",
        f"training.max_steps={steps}",
        f"training.warmup_steps={min(warmup_steps, steps)}",
        "training.eval_every_n_steps=0",
        "data.eval=[]",
        "data.eval_fraction=0.0",
        "checkpoint.every_n_steps=0",
        "checkpoint.resume=none",
        # Logged steps are memory-tracked on CPU (slower); log none after the first three.
        f"logging.every_n_steps={steps + 1}",
        "logging.progress_bar=false",
        "logging.report_to=[]",
        f"output_dir={json.dumps(str(output_dir))}",  # quoted: YAML reads the value
    ]


# ---------------------------------------------------------------- measuring


def steady_steps(records: list[dict], warmup: int = WARMUP_STEPS) -> tuple[list[dict], bool]:
    """The step records to time: after the warm-up, and without the memory tracker when there are such
    steps. Returns (records, tracked): tracked is True when only memory-tracked steps were left (on CPU
    they run slower, so tokens/s is then an underestimate; on CUDA tracking is free and every step is)."""
    steady = [r for r in records if "loss" in r and r["step"] > warmup]
    untracked = [r for r in steady if r.get("peak_memory_bytes") is None]
    return (untracked, False) if untracked else (steady, True)


def tokens_per_s(records: list[dict]) -> float:
    """Pooled: all trained tokens over all seconds (a slow step weighs by its duration, as in a real run)."""
    seconds = sum(r["seconds"] for r in records)
    return sum(r["trained_tokens"] for r in records) / seconds if seconds else 0.0


def step_rates(records: list[dict]) -> list[float]:
    """Trained tokens/s of each step. On a shared machine a burst of other work stalls a few steps for
    seconds; the median of these is what the bench reports, as the pooled figure follows the bursts."""
    return [r["trained_tokens"] / r["seconds"] for r in records if r["seconds"] > 0]


def run_trial(recipe_path: str, overrides: list[str], output_dir: Path) -> dict[str, Any]:
    """Train one trial in this process; `overrides` must set output_dir (see `trial_overrides`)."""
    from llmtune.recipe import load_recipe
    from llmtune.run.loop import fit
    from llmtune.run.setup import build

    recipe = load_recipe(recipe_path, overrides)
    started = time.perf_counter()
    run = build(recipe)
    summary = fit(run)
    del run
    gc.collect()  # the next trial starts without this one's model and optimizer alive
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {"summary": summary, "records": records, "wall_s": time.perf_counter() - started}


def _measure_trials(
    recipe_path: str, overrides: list[str], trials: list[Trial], steps: int, repeats: int, warmup: int, out_dir: Path
) -> dict[str, list[dict]]:
    runnable = [t for t in trials if t.skipped is None]
    results: dict[str, list[dict]] = {t.name: [] for t in runnable}
    with tempfile.TemporaryDirectory(prefix="llmtune-bench-") as tmp:
        for round_ in range(repeats):
            # Reversed every other round: a drifting machine load then hits every trial alike.
            order = runnable if round_ % 2 == 0 else runnable[::-1]
            order = [t for t in order if round_ == 0 or not t.emulated]
            for i, trial in enumerate(order, 1):
                log.info("bench round %d/%d, trial %d/%d: %s", round_ + 1, repeats, i, len(order), trial.name)
                trial_dir = Path(tmp) / f"{trial.name}-r{round_}"
                trial_steps = min(steps, EMULATED_STEPS) if trial.emulated else steps
                extra = trial_overrides(trial, trial_steps, warmup, trial_dir)
                results[trial.name].append(run_trial(recipe_path, [*overrides, *extra], trial_dir))
                # Keep what the figures come from (not the trained weights).
                kept = out_dir / "trials" / trial_dir.name
                kept.mkdir(parents=True, exist_ok=True)
                for name in ("metrics.jsonl", "run_summary.json"):
                    shutil.copy(trial_dir / name, kept / name)
    return results


# ---------------------------------------------------------------- the memory budget


def describe_budget(text: str, device_type: str) -> tuple[int, str]:
    """Bytes a process may use, and where that figure comes from (`auto`: the planner's default budget)."""
    from llmtune.plan import resolve_budget
    from llmtune.units import format_bytes

    budget = resolve_budget(text, device_type)
    if text != "auto":
        return budget, text
    where = "free GPU memory less 10% + 512 MiB" if device_type == "cuda" else "available RAM less max(1 GiB, 10%)"
    return budget, f"auto: {format_bytes(budget)} ({where}, at the start of the bench)"


def largest_fitting(peak_of: Callable[[int], tuple[int, str]], budget: int, start: int) -> tuple[int, str]:
    """Largest micro-batch b with peak_of(b) <= budget, and how it was found.

    `peak_of(b)` returns (peak bytes, the phase of the step that peaks). Each phase's peak is affine in the
    micro-batch at a fixed length (docs: memory-facts), so the step's peak is the max of a few lines:
    once two micro-batches b and 2b peak in the same phase, the line through them gives the answer without
    estimating at large micro-batches (each estimate costs seconds, more for large ones). When the budget
    falls between two estimated points, bisect.
    """
    cache: dict[int, tuple[int, str]] = {}

    def peak(b: int) -> tuple[int, str]:
        if b not in cache:
            cache[b] = peak_of(b)
        return cache[b]

    b1 = max(1, start)
    while b1 > 1 and peak(b1)[0] > budget:
        b1 //= 2
    if peak(b1)[0] > budget:
        return 0, f"micro-batch 1 needs {peak(1)[0] / 2**20:.0f} MiB, over the budget"
    # Double until two points peak in the same phase and that phase grows with the micro-batch (at small
    # micro-batches the optimizer step, which does not grow, is often the peak).
    while True:
        b2 = 2 * b1
        (p1, s1), (p2, s2) = peak(b1), peak(b2)
        if p2 > budget:
            lo, hi = b1, b2  # peak(lo) fits, peak(hi) does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if peak(mid)[0] <= budget else (lo, mid)
            return lo, f"bisection of estimates between micro-batch {b1} and {b2}"
        if s1 == s2 and p2 > p1:
            break
        if b2 >= MAX_MICRO_BATCH:
            return MAX_MICRO_BATCH, "the estimated peak stays within the budget up to the search cap"
        b1 = b2
    slope = (p2 - p1) / (b2 - b1)
    fit = min(MAX_MICRO_BATCH, b2 + int((budget - p2) // slope))
    return fit, f"line through estimates at micro-batch {b1} and {b2} (both peak in {s2}), extrapolated"


def estimate_kwargs(recipe: Any, precision: str, gradient_checkpointing: bool, device_type: str) -> dict[str, Any]:
    """The memory estimator's settings for a trial of this recipe, as the training loop would run it."""
    from dataclasses import replace

    from llmtune.model.load import load_config
    from llmtune.ops.loss import resolve_loss_impl
    from llmtune.plan import estimate_settings

    trial = replace(recipe, training=replace(recipe.training, gradient_checkpointing=gradient_checkpointing))
    loss = resolve_loss_impl(recipe.training.loss, load_config(recipe.model))
    device = "cuda" if device_type == "cuda" else "cpu"
    return estimate_settings(trial, loss=loss, device=device, precision=precision)


def micro_batch_capacity(
    recipe: Any, precision: str, gradient_checkpointing: bool, budget: int, device_type: str
) -> dict[str, Any]:
    """What fits the budget, from the memory estimator (pure: nothing is allocated or run).

    - `planned_micro_batch_size`: what `llmtune.plan.plan_micro_batch` picks for the recipe's global
      batch (a divisor of it: what `training.micro_batch_size: auto` would train with);
    - `max_micro_batch_size`: the largest micro-batch in the budget, not capped by the recipe's batch (a
      small model fits its whole batch in any setting; this shows how much room each setting leaves).
    Sequences are taken at data.max_length (the planner's worst case).
    """
    from llmtune.model.load import load_config
    from llmtune.plan import MemoryPlanError, loss_chunk_rows, plan_micro_batch
    from llmtune.plan.estimate import estimate

    config = load_config(recipe.model)
    kwargs = estimate_kwargs(recipe, precision, gradient_checkpointing, device_type)
    # The loss chunk a run within `budget` on this device trains with (`planning.plan_run`).
    kwargs["chunk_size"] = loss_chunk_rows(config, device=kwargs["device"], gpu=None, budget_bytes=budget)
    t, seq_len = recipe.training, recipe.data.max_length
    try:
        planned = plan_micro_batch(
            config, global_batch_size=t.global_batch_size, budget_bytes=budget, seq_len=seq_len, **kwargs
        )
        planned_size, planned_peak = planned.micro_batch_size, planned.predicted_peak_bytes
    except MemoryPlanError:
        planned_size, planned_peak = 0, None
    start = t.micro_batch_size if isinstance(t.micro_batch_size, int) else max(1, planned_size)
    # Accumulation as the recipe runs: with accumulation the previous micro-steps' gradients are alive.
    accumulation = max(1, t.global_batch_size // start)

    def peak_of(b: int) -> tuple[int, str]:
        e = estimate(config, micro_batch_size=b, seq_len=seq_len, grad_accum_steps=accumulation, **kwargs)
        return e.peak_bytes, e.settings["peak_segment"]

    size, how = largest_fitting(peak_of, budget, start)
    return {
        "max_micro_batch_size": size,
        "max_micro_batch_method": how,
        "planned_micro_batch_size": planned_size,
        "planned_peak_bytes": planned_peak,
    }


def planner_choice(recipe: Any, budget: int, device_type: str) -> list[str]:
    """What `gradient_checkpointing: auto` picks for this recipe within `budget`, in the tutorial's terms: the
    memory it saves and the speed it pays against no checkpointing and against every layer recomputed, at the
    same micro-batch (estimated peaks, the time model's tokens/s), then everything it weighed."""
    from dataclasses import replace

    from llmtune.model.load import load_config
    from llmtune.model.precision import resolve_precision
    from llmtune.plan import MemoryPlanError, format_frontier
    from llmtune.plan.estimate import estimate
    from llmtune.plan.planning import plan_recipe
    from llmtune.recipe import Checkpointing
    from llmtune.units import format_bytes

    auto = replace(recipe, training=replace(recipe.training, gradient_checkpointing="auto"))
    config = load_config(recipe.model)
    device = "cuda" if device_type == "cuda" else "cpu"
    precision = resolve_precision(recipe.training.precision, device)
    try:
        plan, settings = plan_recipe(
            auto, config, device=device, budget_bytes=budget, num_processes=1, precision=precision
        )
    except MemoryPlanError as err:
        return [f"planner: {err}"]
    layers, m = int(config.get_text_config().num_hidden_layers), plan.micro_batch_size
    lines = [
        f"planner (gradient_checkpointing: auto, {format_bytes(budget)} budget): checkpointing"
        f" {plan.checkpointing.describe(layers)}, micro-batch {m}: peak {format_bytes(plan.predicted_peak_bytes)},"
        f" {plan.predicted_tokens_per_s:,.0f} tokens/s predicted"
    ]
    speed = {(c["checkpointing"], c["micro_batch_size"]): c for c in plan.frontier}
    for other in (Checkpointing(0), Checkpointing(1)):
        if other == plan.checkpointing:
            continue
        kw = {k: v for k, v in settings.items() if k != "gradient_checkpointing"}
        peak = estimate(
            config, micro_batch_size=m, seq_len=recipe.data.max_length, gradient_checkpointing=other,
            grad_accum_steps=plan.grad_accum_steps, **kw,
        ).reserved_bytes  # fmt: skip
        tokens = speed[(other.describe(layers), m)]["predicted_tokens_per_s"]
        saved = 1 - plan.predicted_peak_bytes / peak
        paid = 1 - plan.predicted_tokens_per_s / tokens
        lines.append(
            f"  against checkpointing {other.describe(layers)} at micro-batch {m}: {format_bytes(peak)}, {tokens:,.0f}"
            f" tokens/s -> the choice {'saves' if saved >= 0 else 'spends'} {abs(saved):.0%} of the memory and"
            f" {'pays' if paid >= 0 else 'gains'} {abs(paid):.0%} of the speed"
            + ("" if peak <= budget else " (over the budget)")
        )
    return lines + format_frontier(plan)


# ---------------------------------------------------------------- the bench


def run_bench(
    recipe_path: str,
    overrides: list[str],
    out_dir: Path | None,
    *,
    steps: int = DEFAULT_STEPS,
    repeats: int = DEFAULT_REPEATS,
    budget: str | None = None,
    precisions: Iterable[str] = PRECISIONS,
) -> list[dict[str, Any]]:
    """Measure every trial, write out_dir/bench.json, bench.md and bench.png, return the rows.

    `out_dir` defaults to `<recipe output_dir>/bench`; `budget` (e.g. "8GiB") to the recipe's memory.budget.
    """
    import torch  # here, not at the top: `llmtune --help` should not wait for torch

    from llmtune.recipe import load_recipe

    if steps < 3:
        raise ValueError(f"steps={steps}: a trial needs at least 3 steps (a warm-up, then steady ones)")
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be >= 1")
    recipe = load_recipe(recipe_path, overrides)
    out_dir = Path(out_dir) if out_dir is not None else Path(recipe.output_dir) / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("llmtune bench -> %s (bench.json, bench.md, bench.png, one run per trial)", out_dir.resolve())
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    budget_bytes, budget_how = describe_budget(budget or recipe.memory.budget, device_type)
    trials = plan_trials(device_type, precisions)

    started, cpu_started = time.perf_counter(), time.process_time()
    measured = _measure_trials(recipe_path, overrides, trials, steps, repeats, recipe.training.warmup_steps, out_dir)
    setup = {
        "recipe": str(recipe_path),
        "overrides": list(overrides),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if device_type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "steps": steps,
        "repeats": repeats,
        "budget_bytes": budget_bytes,
        "budget": budget_how,
    }
    rows = [{**_trial_row(trial, recipe, measured, budget_bytes, device_type), "setup": setup} for trial in trials]
    _add_ratios(rows)
    setup["total_s"] = round(time.perf_counter() - started, 1)
    # CPU seconds of this process (all threads): on a machine others share, wall time overstates the cost.
    setup["process_cpu_s"] = round(time.process_time() - cpu_started, 1)
    setup["planner"] = planner_choice(recipe, budget_bytes, device_type)
    _write_outputs(rows, out_dir)
    log.info("bench: %d trials x %d rounds in %.0f s; results in %s", len(measured), repeats, setup["total_s"], out_dir)
    return rows


def _trial_row(trial: Trial, recipe: Any, measured: dict, budget_bytes: int, device_type: str) -> dict[str, Any]:
    """A trial's figures: measured (peak, tokens/s) and estimated (the largest micro-batch within the budget)."""
    row: dict[str, Any] = {
        "precision": trial.precision,
        "gradient_checkpointing": trial.gradient_checkpointing,
        "peft": recipe.peft.method,
        "skipped": trial.skipped,
        "emulated": trial.emulated,
        "peak_memory_bytes": None,
        "tokens_per_s": None,
        "max_micro_batch_size": None,
    }
    if trial.skipped is not None:
        return row
    row.update(_summarise(measured[trial.name], device_type, 1 if trial.emulated else WARMUP_STEPS))
    try:
        row.update(
            micro_batch_capacity(recipe, trial.precision, trial.gradient_checkpointing, budget_bytes, device_type)
        )
    except Exception as err:  # the estimator must not cost the measured figures
        log.warning("bench: memory estimate failed for %s: %r", trial.name, err)
        row["max_micro_batch_method"] = f"estimator failed: {type(err).__name__}: {err}"
    return row


def _write_outputs(rows: list[dict[str, Any]], out_dir: Path) -> None:
    """bench.json, bench.md (the table and the planner's choice) and bench.png (where matplotlib is installed)."""
    (out_dir / "bench.json").write_text(json.dumps(rows, indent=2) + "\n")
    choice = rows[0]["setup"]["planner"]
    (out_dir / "bench.md").write_text(format_table(rows) + "\n\n" + "\n".join(choice) + "\n")
    try:
        from llmtune.cli.plot import PlotDependencyError, plot_bench

        plot_bench(rows, out_dir / "bench.png")
    except PlotDependencyError as err:
        log.warning("bench.png not written: %s", err)


def _summarise(results: list[dict], device_type: str, warmup: int) -> dict[str, Any]:
    """One row from a trial's rounds: peak = max; tokens/s = median step of the chosen steps of all rounds."""
    chosen, per_round, tracked = [], [], False
    for r in results:
        steps, was_tracked = steady_steps(r["records"], warmup)
        chosen += steps
        per_round.append(round(tokens_per_s(steps), 1))
        tracked |= was_tracked
    step_numbers = sorted({s["step"] for s in chosen})
    how = f"steps {step_numbers[0]}-{step_numbers[-1]} of each round ({len(chosen)} steps in all)"
    if tracked and device_type == "cpu":
        how += ", memory-tracked (slower on CPU; run more steps for untracked ones)"
    elif not tracked:
        how += ", memory tracker off"
    rates = sorted(step_rates(chosen))
    summary = results[0]["summary"]
    losses = [[s for s in r["records"] if "loss" in s][-1]["loss"] for r in results]
    return {
        "peak_memory_bytes": max(r["summary"]["peak_memory_bytes"] for r in results),
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_best": rates[-1],
        "tokens_per_s_per_round": per_round,  # pooled per round, to show the spread between rounds
        "tokens_per_s_steps": how,
        "micro_batch_size": summary["micro_batch_size"],
        "grad_accum_steps": summary["grad_accum_steps"],
        "final_loss": sum(losses) / len(losses),
        "wall_s": round(sum(r["wall_s"] for r in results), 1),
    }


def _add_ratios(rows: list[dict]) -> None:
    base = next(
        (r for r in rows if r["precision"] == "fp32" and not r["gradient_checkpointing"] and not r["skipped"]), None
    )
    for row in rows:
        for key, rel in (
            ("peak_memory_bytes", "peak_memory_rel"),
            ("tokens_per_s", "tokens_per_s_rel"),
            ("tokens_per_s_best", "tokens_per_s_best_rel"),
            ("max_micro_batch_size", "max_micro_batch_rel"),
        ):
            ok = base is not None and row.get(key) is not None and base.get(key)
            row[rel] = row[key] / base[key] if ok else None


def format_table(rows: list[dict]) -> str:
    """A Markdown table of the rows (ratios to fp32 without checkpointing in parentheses). Tokens/s: the
    median step, and the fastest step (closest to an idle machine when others share it)."""

    def rel(value: float | None) -> str:
        return f" (x{value:.2f})" if value is not None else ""

    lines = [
        "| precision | grad. ckpt | peak memory, MiB | trained tokens/s, median step | fastest step"
        " | max micro-batch in budget | final loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ckpt = "on" if r["gradient_checkpointing"] else "off"
        precision = r["precision"] + (" (emulated)" if r.get("emulated") else "")
        if r["skipped"]:
            reason = r["skipped"].split(":")[0] if len(r["skipped"]) > 80 else r["skipped"]
            lines.append(f"| {precision} | {ckpt} | skipped: {reason} | | | | |")
            continue
        lines.append(
            f"| {precision} | {ckpt} "
            f"| {r['peak_memory_bytes'] / 2**20:.1f}{rel(r['peak_memory_rel'])} "
            f"| {r['tokens_per_s']:.0f}{rel(r['tokens_per_s_rel'])} "
            f"| {r['tokens_per_s_best']:.0f}{rel(r['tokens_per_s_best_rel'])} "
            f"| {r['max_micro_batch_size']}{rel(r['max_micro_batch_rel'])} "
            f"| {r['final_loss']:.3f} |"
        )
    if any(r.get("emulated") and not r["skipped"] for r in rows):
        lines.append(
            f"\nemulated: this CPU has no native bf16 (AVX512-BF16/AMX), so bf16 runs in software; measured in one"
            f" round of {EMULATED_STEPS} steps, the second timed (memory-tracked). Its memory figures hold anywhere;"
            " its speed is this CPU's only."
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def cmd_bench(args: argparse.Namespace) -> int:
    rows = run_bench(
        args.recipe,
        args.overrides,
        Path(args.out) if args.out else None,
        steps=args.steps,
        repeats=args.repeats,
        budget=args.budget,
    )
    print(format_table(rows))  # noqa: T201 (the command's output)
    print("\n" + "\n".join(rows[0]["setup"]["planner"]))  # noqa: T201
    return 0


def _at_least(n: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < n:
            raise argparse.ArgumentTypeError(f"must be at least {n}, got {value}")
        return value

    return parse


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `llmtune bench --recipe R [overrides] [--out DIR] [--steps N] [--repeats N] [--budget 8GiB]`."""
    p = sub.add_parser(
        "bench", help="measure memory, tokens/s and max micro-batch for fp32/fp16/bf16 x gradient checkpointing"
    )
    p.add_argument("--recipe", required=True, help="recipe YAML file")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied to every trial, e.g. data.max_length=256")
    p.add_argument(
        "--out", default=None, help="folder for bench.json / bench.md / bench.png (default: <output_dir>/bench)"
    )
    p.add_argument(
        "--steps", type=_at_least(3), default=DEFAULT_STEPS, help=f"optimizer steps per trial (default {DEFAULT_STEPS})"
    )
    p.add_argument(
        "--repeats",
        type=_at_least(1),
        default=DEFAULT_REPEATS,
        help=f"rounds of all trials, interleaved (default {DEFAULT_REPEATS})",
    )
    p.add_argument(
        "--budget", default=None, help="memory budget for the max micro-batch, e.g. 8GiB (default: memory.budget)"
    )
    p.set_defaults(func=cmd_bench)
    return p
