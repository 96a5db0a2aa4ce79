"""The plan as a user reads it: the breakdown at the predicted peak, the choice, and what the planner weighed."""

from __future__ import annotations

from typing import Any

from llmtune.plan.batch_plan import BatchPlan
from llmtune.plan.timing import NOMINAL_RATES
from llmtune.units import format_bytes

_METHOD_NAMES = {"lora": "LoRA", "dora": "DoRA", "qlora": "QLoRA (4-bit NF4 base)"}


def forecasts(plan: BatchPlan) -> bool:
    """Whether the plan's speeds are a forecast, not only a ranking: from a datasheet's rates or ones measured on the
    device, not `NOMINAL_RATES` (a compiled run's rates say so after theirs, `timing.compiled`)."""
    return not (plan.rates_source or "").startswith(NOMINAL_RATES.source)


def speeds_shown(plan: BatchPlan, speeds: list[float | None]) -> list[str]:
    """Predicted tokens/s as a table shows them: in tokens/s where `plan`'s rates forecast (`forecasts`), else as a
    share of the fastest ("0.68"), which ranks without claiming a time; '-' for none."""
    if forecasts(plan):
        return [f"{v:,.0f}" if v else "-" for v in speeds]
    top = max((v for v in speeds if v), default=1.0)
    return [f"{v / top:.2f}" if v else "-" for v in speeds]


def format_plan(plan: BatchPlan, title: str) -> str:
    """A readable table: the breakdown at the predicted peak, then the choice."""
    e = plan.estimate
    width = max(len(k) for k in e.breakdown) + 2
    lines = [title, "", f"{'at the peak':<{width}}{'bytes':>12}  share"]
    for name, value in e.breakdown.items():
        lines.append(f"{name:<{width}}{format_bytes(value):>12}  {value / e.peak_bytes:6.1%}")
    s = e.settings
    lines += [
        f"{'peak':<{width}}{format_bytes(e.peak_bytes):>12}  during {e.peak_phase}",
        "",
        f"micro-batch {plan.micro_batch_size} x {s['seq_len']} tokens, gradient accumulation {plan.grad_accum_steps},"
        f" {s['num_processes']} process(es), sharding {s['sharding']}" + _split(plan),
        f"{s['precision']}, checkpointing {plan.checkpointing.describe(e.settings['layers'])},"
        f" {s['attn_implementation']} attention, {s['optimizer']}, {s['loss']} loss"
        + _objective(s)
        + (f", {_METHOD_NAMES[s['lora']['method']]} r={s['lora']['rank']}" if s.get("lora") else "")
        + (" (bf16 adapters)" if (s.get("lora") or {}).get("dtype") == "bf16" else ""),
        f"predicted peak {format_bytes(plan.predicted_peak_bytes)} of a {format_bytes(plan.budget_bytes)} budget"
        + ("" if plan.fits else ": DOES NOT FIT")
        + (
            f" (reserved by the caching allocator, {format_bytes(e.peak_bytes)} of it in live tensors,"
            f" expandable segments {'on' if s['expandable_segments'] else 'off'}, with the cuBLAS workspaces; the"
            " CUDA context and NCCL's buffers are outside it)"
            if s["device"] == "cuda"
            else " (live tensors only: Python objects and the data pipeline are outside it)"
        ),
    ]
    if e.pinned_host_bytes:
        lines.append(
            f"offloading pins {format_bytes(e.pinned_host_bytes)} of host memory a process (each copy rounded up to a"
            " power of two by PyTorch's pinned-memory allocator, and kept cached)"
        )
    if plan.generation is not None:
        lines += ["", *format_generation(plan)]
    if len(plan.frontier) > 1:
        lines += ["", *format_frontier(plan)]
    if len(plan.degrees) > 1:
        lines += ["", *format_degrees(plan)]
    return "\n".join(lines)


def _split(plan: BatchPlan) -> str:
    """How a row's work is split, where it is: across a sequence group, and the MLPs in tiles."""
    s = plan.estimate.settings
    parts = []
    if plan.sequence_parallel > 1:
        shard = -(-s["seq_len"] // plan.sequence_parallel)
        parts.append(f"sequence parallel {plan.sequence_parallel} (Ulysses: {shard:,} tokens of each row a process)")
    if plan.tiled_mlp:
        parts.append("MLPs in sequence tiles")
    return "".join(f", {p}" for p in parts)


def format_degrees(plan: BatchPlan) -> list[str]:
    """Each sequence-parallel degree and tiling the planner weighed: its choice (or its fastest candidate and why
    it lost), the choice marked."""
    shown = speeds_shown(plan, [d["predicted_tokens_per_s"] for d in plan.degrees])
    rows = [("degree", "tokens a process", "MLP", "micro", "checkpointing", "peak", _speed_heading(plan), "")]
    for d, speed in zip(plan.degrees, shown, strict=True):
        peak = d["predicted_peak_bytes"]
        rows.append(
            (
                str(d["sequence_parallel"]),
                f"{d['tokens_per_process']:,}",
                "tiled" if d["tiled_mlp"] else "whole",
                str(d["micro_batch_size"] or "-"),
                d["checkpointing"] or "-",
                format_bytes(peak) if peak is not None else "-",
                speed,
                "<- chosen" if d["chosen"] else d["why"],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(7)]
    per = "tokens/s a process" if forecasts(plan) else "speed against the fastest"
    lines = [f"sequence parallelism weighed ({per}, its all-to-alls over the cards' link):"]
    return lines + ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=False)) + "  " + r[7] for r in rows]


def _objective(s: dict[str, Any]) -> str:
    objective = s.get("objective", "sft")
    if objective == "sft":
        return ""
    rows = "prompt + completion rows" if objective == "grpo" else "pairs"
    return f", {objective} on {rows} (reference: {s['reference']})"


def format_generation(plan: BatchPlan) -> list[str]:
    """grpo's generation phase beside the training step above it: the rows of each generate call, its predicted
    peak and what is live at it."""
    g = plan.generation
    width = max(len(k) for k in g.breakdown) + 2
    lines = [
        f"generation (grpo): {plan.generation_rows} rows a generate call, prompts of up to {g.prompt_tokens} tokens"
        f" + {g.max_new_tokens} new",
        f"{'at its peak':<{width}}{'bytes':>12}  share",
    ]
    for name, value in g.breakdown.items():
        lines.append(f"{name:<{width}}{format_bytes(value):>12}  {value / max(1, g.peak_bytes):6.1%}")
    lines.append(
        f"{'peak':<{width}}{format_bytes(g.peak_bytes):>12}  during {g.peak_phase}, of a"
        f" {format_bytes(plan.budget_bytes)} budget" + ("" if g.peak_bytes <= plan.budget_bytes else ": DOES NOT FIT")
    )
    return lines


def format_frontier(plan: BatchPlan) -> list[str]:
    """What the planner weighed, fastest first: memory saved against speed paid, the choice marked. One row per
    setting -- its fastest candidate that fits, else its smallest micro-batch weighed (why it was ruled out),
    else its fastest not weighed -- and the choice. Nominal rates (no device to measure) give speeds relative to
    the fastest candidate only (`speeds_shown`)."""

    def is_chosen(c: dict[str, Any]) -> bool:
        ckpt = plan.checkpointing
        return (c["micro_batch_size"], c["every_n_layers"], c["selective"], c.get("offload", False)) == (
            plan.micro_batch_size,
            ckpt.every_n_layers,
            ckpt.selective,
            ckpt.offload,
        )

    shown: dict[str, dict[str, Any]] = {}
    for c in plan.frontier:  # fastest first
        kept = shown.get(c["checkpointing"])
        if kept is None or kept["fits"] is None or (c["fits"] is not None and not kept["fits"]) or is_chosen(c):
            shown[c["checkpointing"]] = c
    rows = [("checkpointing", "micro", "peak", _speed_heading(plan), "fits", "")]
    ordered = sorted(shown.values(), key=lambda c: -c["predicted_tokens_per_s"])  # the fastest of all among them
    for c, speed in zip(ordered, speeds_shown(plan, [c["predicted_tokens_per_s"] for c in ordered]), strict=True):
        rows.append(
            (
                c["checkpointing"],
                str(c["micro_batch_size"]),
                c["predicted_peak"] or "-",
                speed,
                {True: "yes", False: "no", None: "-"}[c["fits"]],
                ("<- chosen " if is_chosen(c) else "") + _pinned(c),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    at = f" at sequence parallel {plan.sequence_parallel}" if len(plan.degrees) > 1 else ""
    lines = [
        f"weighed{at} (time model: {plan.rates_source}; '-': not estimated, ruled out by a setting that did not fit"
        " or slower than the choice):"
    ]
    for r in rows:
        lines.append(
            "  "
            + r[0].ljust(widths[0])
            + "".join(f"  {r[i].rjust(widths[i])}" for i in range(1, 5))
            + (f"  {r[5]}" if r[5] else "")
        )
    return lines


def _speed_heading(plan: BatchPlan) -> str:
    return "tokens/s" if forecasts(plan) else "x fastest"


def _pinned(c: dict[str, Any]) -> str:
    pinned = c.get("pinned_host_bytes")
    return f"(pins {format_bytes(pinned)} of host memory)" if pinned else ""
