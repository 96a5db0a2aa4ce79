"""`llmtune data --show N [--json]`: rendered rows with the trained tokens marked, and the statistics."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from llmtune.data.render import IGNORE
from llmtune.data.stats import summary

if TYPE_CHECKING:
    from llmtune.data.prepare import PreparedData


def _spans(row: dict[str, Any]) -> list[tuple[list[int], bool, bool]]:
    """(ids, trained, starts a new example) runs of one row."""
    positions = row.get("position_ids") or list(range(len(row["input_ids"])))
    spans: list[tuple[list[int], bool, bool]] = []
    for i, (token, label) in enumerate(zip(row["input_ids"], row["labels"], strict=True)):
        trained, boundary = label != IGNORE, i > 0 and positions[i] == 0
        if spans and not boundary and spans[-1][1] == trained:
            spans[-1][0].append(token)
        else:
            spans.append(([token], trained, boundary))
    return spans


def render_row(row: dict[str, Any], tokenizer: Any, color: bool = False) -> str:
    """One row as text; trained tokens in [[...]] (or green when color), packed examples split by ' ║ '."""
    out = []
    for ids, trained, boundary in _spans(row):
        if boundary:
            out.append("\n║ next example ║\n" if not color else "\n\x1b[2m║ next example ║\x1b[0m\n")
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if trained:
            out.append(f"\x1b[32m{text}\x1b[0m" if color else f"[[{text}]]")
        else:
            out.append(text)
    return "".join(out)


def render_report(data: PreparedData, tokenizer: Any, n: int, color: bool | None = None) -> str:
    """`llmtune data --show N`: N training rows with trained tokens marked, then the statistics."""
    if color is None:
        color = sys.stdout.isatty()
    marker = "green" if color else "[[...]]"
    lines = [f"Trained tokens are shown {marker}; the rest is context the loss ignores.", ""]
    for i in range(min(n, len(data.train))):
        row = data.train[i]
        trained = sum(1 for label in row["labels"] if label != IGNORE)
        lines += [
            f"── row {i}: {len(row['input_ids'])} tokens, {trained} trained ──",
            render_row(row, tokenizer, color),
            "",
        ]
    lines.append("train: " + summary(data.stats))
    lines += [f"  {k}: {v}" for k, v in data.stats.to_dict().items()]
    if data.eval_stats is not None:
        lines.append("eval: " + summary(data.eval_stats))
    return "\n".join(lines)


def report_json(data: PreparedData, n: int) -> dict:
    """Machine-readable `llmtune data --show N --json`."""
    keep = ["input_ids", "labels", "position_ids"] if data.packed else ["input_ids", "labels"]
    rows = [{k: data.train[i][k] for k in keep} for i in range(min(n, len(data.train)))]
    out: dict[str, Any] = {"rows": rows, "stats": data.stats.to_dict(), "packed": data.packed}
    if data.eval_stats is not None:
        out["eval_stats"] = data.eval_stats.to_dict()
    return out
