"""What the time model forecasts for issue 42's hot path on a card it has a datasheet for: Llama-3.2-1B shape (the
catalogue's config), full fine-tune, bf16 mixed, 8 x 2048 packed rows, checkpointing off, fused AdamW.

Each row is the estimator's traced step (fake tensors, nothing loaded) timed by `llmtune.plan.timing` at the card's
datasheet rates, issue 42's changes added one at a time: eager blocks and 128-row loss chunks as before it
(`loss.default_chunk_size` at vocab 128256), compiled blocks (`training.compile: auto`), varlen attention, and the
loss chunk a run plans on the card (`llmtune.plan.loss_chunk_rows`: `llmtune.ops.loss.chunk_rows` of the card's
datasheet peak over its bandwidth, within its memory budget as `llmtune estimate --gpu` takes it). Each term (matmul
FLOPs, memory-bound bytes in and out of the blocks, launches) is given, so what a change moves is visible. The loss's
in-place fp32 weight-gradient accumulation (issue 42's loss head) is in every row: the code traced is today's.
Attention's FLOPs are set by hand: the trace runs the kernel a run loads (`llmtune_varlen`: flash's varlen on a GPU)
over its rows of one document each, and torch's formula counts every L^2 pair of a document, causal or not, so the
traced step counts what the dense mask computed before; a varlen kernel runs each document's causal block only.

    .venv/bin/python -m benchmarks.hotpath_forecast [--gpu h100-80gb] [--doc-tokens 512]

Writes benchmarks/results/hotpath_forecast_<gpu>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from datetime import datetime, timezone

from benchmarks import RESULTS

MICRO, SEQ = 8, 2048


def traced(config, chunk_size: int | None):
    from llmtune.plan.estimate import estimate

    return estimate(
        config, micro_batch_size=MICRO, seq_len=SEQ, precision="bf16", gradient_checkpointing=False,
        loss="chunked", optimizer="adamw_fused", device="cuda", chunk_size=chunk_size,
    )  # fmt: skip


def attention_flops(config, doc_tokens: int | None) -> float:
    """Forward + backward attention FLOPs of the step: QK^T and PV (4 x pairs x head_dim a head), backward 2.5 x
    forward (torch's formula, as flash's backward runs: the scores recomputed, then dV, dP, dQ and dK); every L^2 pair
    of a row (`doc_tokens` None: what the trace counts), or each document's causal half."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    pairs = SEQ * SEQ if doc_tokens is None else (SEQ // doc_tokens) * doc_tokens * (doc_tokens + 1) / 2
    return 3.5 * 4 * MICRO * pairs * heads * head_dim * text.num_hidden_layers


def flops_per_token(config, doc_tokens: int) -> float:
    """The run's MFU numerator a token (`llmtune.run.metrics.model_flops`, every token trained) in documents of
    `doc_tokens`."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmtune.run.metrics import model_flops

    with torch.device("meta"):
        flops = model_flops(AutoModelForCausalLM.from_config(config))
    return flops.per_token + flops.per_trained_token + flops.attention * doc_tokens


def row(name: str, rates, est, flops_off: float = 0.0) -> dict:
    from llmtune.plan.timing import COMPILED_BLOCK_BYTES, COMPILED_BLOCK_OPS

    w = replace(est.work, flops=est.work.flops - flops_off)
    fused = rates.compiled_blocks
    block_bytes = w.block_bytes * (COMPILED_BLOCK_BYTES if fused else 1.0)
    micro = rates.seconds(w, rows=MICRO * SEQ)
    update = rates.seconds(est.optimizer_work)
    step = micro + update
    return {
        "case": name,
        "step_s": step,
        "tokens_per_s": MICRO * SEQ / step,
        "matmul_s": w.flops / rates.flop_rate(),
        "block_bytes_s": block_bytes / rates.bytes_per_s,
        "other_bytes_s": (w.bytes - w.block_bytes) / rates.bytes_per_s,
        "launches": w.ops - w.block_ops * (1 - COMPILED_BLOCK_OPS if fused else 0.0),
        "optimizer_s": update,
    }


def main(argv: list[str] | None = None) -> dict:
    from llmtune.catalogue import datasheet_peak_flops
    from llmtune.model.load import resolve_config
    from llmtune.plan import loss_chunk_rows
    from llmtune.plan.budget import planning_target
    from llmtune.plan.timing import compiled, datasheet_rates

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="h100-80gb")
    p.add_argument("--doc-tokens", type=int, default=512, help="document length the packed rows hold (varlen row)")
    a = p.parse_args(argv)
    config = resolve_config("llama-3.2-1b")
    eager = datasheet_rates(a.gpu, "bf16")
    peak = datasheet_peak_flops(a.gpu.lower().replace("-", " "))
    budget = planning_target(device_memory=None, gpu=a.gpu, device="cuda").budget_bytes
    chunk = loss_chunk_rows(config, device="cuda", gpu=a.gpu, budget_bytes=budget)
    before, planned = traced(config, None), traced(config, chunk)
    dense, varlen = attention_flops(config, None), attention_flops(config, a.doc_tokens)
    rows = [
        row("eager blocks, 128-row loss chunks, dense-mask attention", eager, before),
        row("+ compile (training.compile: auto)", compiled(eager), before),
        row(f"+ varlen attention ({a.doc_tokens}-token documents)", compiled(eager), before, dense - varlen),
        row(
            f"+ the planned loss chunk ({chunk} rows: llmtune.ops.loss.chunk_rows)",
            compiled(eager),
            planned,
            dense - varlen,
        ),
    ]
    per_token = flops_per_token(config, a.doc_tokens)
    for r in rows:
        r["mfu"] = r["tokens_per_s"] * per_token / peak
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.hotpath_forecast " + " ".join(argv if argv is not None else sys.argv[1:]),
        "gpu": a.gpu,
        "rates": eager.source,
        "loss_chunk_rows": chunk,
        "model_flops_per_token": per_token,
        "rows": rows,
    }
    stem = RESULTS / f"hotpath_forecast_{a.gpu}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# Time-model forecast: Llama-3.2-1B shape, full fine-tune bf16, {MICRO} x {SEQ} packed, on {a.gpu}",
        "",
        f"`{result['command']}` ({result['date']}); rates: {eager.source}. MFU: model FLOPs"
        f" ({per_token / 1e9:.2f} GFLOP a token, attention over {a.doc_tokens}-token documents) against the"
        f" {peak / 1e12:.0f} TFLOP/s dense bf16 peak.",
        "",
        "| case | step | tokens/s | MFU | matmuls | block bytes | other bytes | launches | optimizer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['case']} | {r['step_s'] * 1e3:.0f} ms | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} |"
        f" {r['matmul_s'] * 1e3:.0f} ms | {r['block_bytes_s'] * 1e3:.0f} ms | {r['other_bytes_s'] * 1e3:.0f} ms |"
        f" {r['launches']:,.0f} | {r['optimizer_s'] * 1e3:.0f} ms |"
        for r in rows
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))  # noqa: T201
    return result


if __name__ == "__main__":
    main()
