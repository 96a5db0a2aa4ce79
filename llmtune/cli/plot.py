"""Charts a person reads at a glance: a run's curves (`llmtune plot`) and a bench's bars (`llmtune bench`).

matplotlib is optional (`pip install 'llmtune[plot]'`): it is imported only when a chart is drawn, with
the Agg backend (files only, no display needed), and its absence is a `PlotDependencyError` that says
what to install.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from llmtune.errors import UserError

CURVES_FILE = "curves.png"


class PlotError(UserError, ValueError):
    """Nothing to plot (no metrics.jsonl, no steps)."""


class PlotDependencyError(PlotError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotDependencyError(
            "plotting needs matplotlib, which is not installed: pip install matplotlib (or pip install 'llmtune[plot]')"
        ) from None
    matplotlib.use("Agg")  # files only; a display backend would fail on a headless machine
    import matplotlib.pyplot as plt

    return plt


# ---------------------------------------------------------------- a run's curves


def read_metrics(output_dir: Path) -> tuple[list[dict], list[dict]]:
    """(step records, eval records) from output_dir/metrics.jsonl.

    A resumed run appends to the same file and logs again the steps after its checkpoint; the last record
    of a step wins, so the curves show the run that produced the final model.
    """
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path}: not found (is {output_dir} a run's output_dir?)")
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise PlotError(f"{path}:{n}: not a JSON line") from None
        if "eval_loss" in record:
            evals[record["step"]] = record
        elif "loss" in record:
            steps[record["step"]] = record
    if not steps:
        raise PlotError(f"{path}: no training steps logged yet")
    return [steps[s] for s in sorted(steps)], [evals[s] for s in sorted(evals)]


def _series(records: list[dict], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    """Steps and values where `key` was logged as a finite number (peak memory is logged on some steps only)."""
    pairs = [
        (r["step"], r[key] * scale) for r in records if isinstance(r.get(key), int | float) and math.isfinite(r[key])
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_run(output_dir: Path) -> list[Path]:
    """Draw loss (with eval loss), learning rate, grad norm, tokens/s, MFU and peak memory against the step
    (and, for preference objectives, the rewards and the preference accuracy; for grpo the rewards, the completions'
    lengths and the groups without signal) into one multi-panel
    `output_dir/curves.png`; returns the files written."""
    output_dir = Path(output_dir)
    steps, evals = read_metrics(output_dir)
    preference = any("reward_margin" in r for r in steps)
    grpo = any("frac_reward_zero_std" in r for r in steps)
    plt = _pyplot()
    third = preference or grpo
    fig, axes = plt.subplots(3 if third else 2, 3, figsize=(15, 12 if third else 8), constrained_layout=True)
    (ax_loss, ax_lr, ax_grad), (ax_tok, ax_mfu, ax_mem) = axes[:2]
    if preference:
        _plot_preference(steps, *axes[2])
    if grpo:
        _plot_grpo(steps, *axes[2])

    x, y = _series(steps, "loss")
    ax_loss.plot(x, y, label=f"train loss (per {'pair' if preference else 'trained token'})", color="tab:blue")
    ex, ey = _series(evals, "eval_loss")
    if ex:
        ax_loss.plot(ex, ey, "o-", label="eval loss", color="tab:orange")
    ax_loss.set_title("loss")
    ax_loss.legend()

    for ax, key, title, scale, color in (
        (ax_lr, "lr", "learning rate", 1.0, "tab:green"),
        (ax_grad, "grad_norm", "grad norm (before clipping)", 1.0, "tab:red"),
        (ax_tok, "tokens_per_s", "trained tokens / s", 1.0, "tab:purple"),
        (ax_mfu, "mfu", "MFU (%)", 100.0, "tab:brown"),
        (ax_mem, "peak_memory_bytes", "peak memory (MiB, measured steps only)", 1 / 2**20, "tab:gray"),
    ):
        x, y = _series(steps, key, scale)
        ax.plot(x, y, "o-" if len(x) <= 20 else "-", color=color, markersize=3)
        ax.set_title(title)
        if not x:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    from matplotlib.ticker import MaxNLocator

    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    last = steps[-1]
    fig.suptitle(
        f"{output_dir.name}: {len(steps)} steps, last loss {last['loss']:.4f}"
        + (f", last eval loss {evals[-1]['eval_loss']:.4f}" if evals else "")
    )
    path = output_dir / CURVES_FILE
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def _plot_preference(steps: list[dict], ax_rewards: Any, ax_accuracy: Any, ax_unused: Any) -> None:
    for key, label, color in (
        ("rewards_chosen", "chosen", "tab:green"),
        ("rewards_rejected", "rejected", "tab:red"),
        ("reward_margin", "margin", "tab:blue"),
    ):
        ax_rewards.plot(*_series(steps, key), label=label, color=color)
    ax_rewards.set_title("rewards (mean per pair)")
    ax_rewards.legend()
    ax_accuracy.plot(*_series(steps, "preference_accuracy", 100.0), color="tab:olive")
    ax_accuracy.set_title("preference accuracy (%: chosen rewarded above rejected)")
    ax_unused.axis("off")


def _plot_grpo(steps: list[dict], ax_rewards: Any, ax_length: Any, ax_signal: Any) -> None:
    x, mean = _series(steps, "reward")
    _, std = _series(steps, "reward_std")
    ax_rewards.plot(x, mean, label="reward (sum)", color="tab:blue")
    if len(std) == len(mean):
        ax_rewards.fill_between(
            x,
            [m - s for m, s in zip(mean, std, strict=True)],
            [m + s for m, s in zip(mean, std, strict=True)],
            alpha=0.2,
        )
    for key in sorted(k for k in steps[-1] if k.startswith("rewards/") and k.endswith("/mean")):
        ax_rewards.plot(*_series(steps, key), label=key.removeprefix("rewards/").removesuffix("/mean"), alpha=0.7)
    ax_rewards.set_title("reward (mean; band: mean std within a group)")
    ax_rewards.legend(fontsize=7)
    ax_length.plot(*_series(steps, "completion_length"), color="tab:cyan")
    ax_length.set_title("completion length (tokens)")
    ax_signal.plot(*_series(steps, "frac_reward_zero_std", 100.0), label="groups all alike", color="tab:red")
    ax_signal.plot(*_series(steps, "clip_ratio", 100.0), label="clipped tokens", color="tab:olive")
    ax_signal.set_title("% of groups without signal, % of tokens clipped")
    ax_signal.legend()


# ---------------------------------------------------------------- a bench's bars


def plot_bench(rows: list[dict], path: Path) -> Path:
    """Three bar panels (peak memory, trained tokens/s, largest micro-batch in the budget), each bar labelled
    with its ratio to fp32 without checkpointing; skipped trials are shown with the reason, emulated ones
    (bf16 on a CPU without native bf16) are labelled so."""
    plt = _pyplot()
    labels = [_trial_label(r) for r in rows]
    colors = [
        {"fp32": "tab:blue", "bf16": "tab:orange", "fp16": "tab:green"}.get(r["precision"], "tab:gray") for r in rows
    ]
    panels = (
        ("peak_memory_bytes", "peak_memory_rel", "steady-state peak memory (MiB)", 1 / 2**20, "lower is better"),
        ("tokens_per_s", "tokens_per_s_rel", "trained tokens / s (median step)", 1.0, "higher is better"),
        ("max_micro_batch_size", "max_micro_batch_rel", "largest micro-batch in budget (estimate)", 1.0, "higher"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), constrained_layout=True)
    for ax, (key, rel, title, scale, better) in zip(axes, panels, strict=True):
        values = [(r.get(key) or 0) * scale for r in rows]
        bars = ax.bar(range(len(rows)), values, color=colors)
        for bar, row in zip(bars, rows, strict=True):
            if row.get("gradient_checkpointing"):
                bar.set_hatch("//")
            if row.get("skipped"):
                text = "skipped"
            elif row.get(rel) is not None:
                text = f"x{row[rel]:.2f}"
            else:
                text = ""
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right")
        ax.set_title(f"{title}\n({better}; x = ratio to fp32, no ckpt)", fontsize=10)
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
    skipped = sorted({f"{r['precision']}: {r['skipped']}" for r in rows if r.get("skipped")})
    if skipped:  # supxlabel: constrained layout makes room for it below the tick labels
        fig.supxlabel("\n".join(_shorten(s, 200) for s in skipped), fontsize=7, color="gray")
    setup = rows[0].get("setup", {}) if rows else {}
    where = f": {setup['recipe']} on {setup['device']}, {setup['date']}" if "recipe" in setup else ""
    fig.suptitle(f"llmtune bench{where} (hatched: gradient checkpointing on)")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


# ---------------------------------------------------------------- a memory estimate


def plot_estimate(plan: Any, title: str, path: str | Path) -> Path:
    """Predicted peak memory against predicted tokens/s of what the planner weighed (`BatchPlan.frontier`), the
    budget as a vertical line, the choice circled: the tutorial's trade, memory saved for speed paid, drawn for
    this model. Candidates ruled out without an estimate have no peak and are not drawn."""
    plt = _pyplot()
    points = [c for c in plan.frontier if c["predicted_peak_bytes"] is not None]
    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    for fits, color in ((True, "tab:green"), (False, "tab:gray")):
        chosen = [c for c in points if bool(c["fits"]) == fits]
        ax.scatter(
            [c["predicted_peak_bytes"] / 2**30 for c in chosen],
            [c["predicted_tokens_per_s"] for c in chosen],
            color=color,
            label="fits" if fits else "over the budget",
        )
        for c in chosen:
            ax.annotate(
                f"{c['checkpointing']}, micro {c['micro_batch_size']}",
                (c["predicted_peak_bytes"] / 2**30, c["predicted_tokens_per_s"]),
                fontsize=7,
                xytext=(4, 2),
                textcoords="offset points",
            )
    ax.scatter(
        [plan.predicted_peak_bytes / 2**30],
        [plan.predicted_tokens_per_s or 0],
        s=200,
        facecolors="none",
        edgecolors="black",
        label="chosen",
    )
    ax.axvline(plan.budget_bytes / 2**30, color="red", linestyle="--", label="budget")
    ax.set_xlabel("predicted peak memory per process, GiB")
    ax.set_ylabel("predicted tokens/s per process")
    ax.set_title(_shorten(title, 90), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def _trial_label(row: dict) -> str:
    emulated = " (emulated)" if row.get("emulated") else ""
    return row["precision"] + emulated + (" + ckpt" if row.get("gradient_checkpointing") else "")


def _shorten(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


# ---------------------------------------------------------------- command line


def cmd_plot(args: argparse.Namespace) -> int:
    try:
        paths = plot_run(Path(args.output_dir))
    except PlotError as err:
        print(f"llmtune: error: {err}", file=sys.stderr)  # noqa: T201 (a command's own output)
        return 2
    for path in paths:
        print(path)  # noqa: T201
    return 0


def add_plot_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `llmtune plot OUTPUT_DIR` on the CLI's subparsers."""
    p = sub.add_parser("plot", help="draw a run's curves (loss, eval loss, lr, tokens/s, memory) into curves.png")
    p.add_argument("output_dir", help="a run's output_dir (holds metrics.jsonl)")
    p.set_defaults(func=cmd_plot)
    return p
