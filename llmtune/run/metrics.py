"""What a run reports: metrics.jsonl, Accelerate trackers, the progress bar, MFU.

MFU = model FLOPs per second / the device's peak. Model FLOPs follow the PaLM appendix — 6 x parameters
for the forward and backward matmuls, plus 12 x layers x hidden x length^2 for the attention scores of a
sequence — split by what each token needs:
- every processed token (real tokens, prompts included, padding not) runs the decoder: 6 x its
  parameters (4 x for frozen ones under LoRA, which need no weight gradient);
- attention is counted per example, not per row: a packed row of examples of lengths l_i attends
  block-diagonally and costs sum(l_i^2), not (sum l_i)^2 nor max_length^2;
- only trained tokens (those with a label) need the output projection: 6 x vocab x hidden (4 x when
  frozen). The chunked loss computes no logits for the others; HF's loss does, and that work is waste,
  not model FLOPs. The input embedding is a lookup and counts nothing; a tied head counts as a head.
Recomputation under gradient checkpointing does not count (it costs time and lowers MFU, which is the
point of measuring it).

The peak: the datasheet's dense 16-bit tensor-core figure for GPUs we know by name (`DATASHEET_PEAKS`);
a measured matmul peak only for other devices, CPUs and fp32. A single measured matmul overstates MFU on
fast GPUs: a 2048^3 bf16 matmul is a ~25 us kernel in a ~50 us timing window, far from the card's peak.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from llmtune.catalogue import DATASHEET_PEAKS, datasheet_peak_flops  # noqa: F401 (DATASHEET_PEAKS: re-exported)
from llmtune.errors import UserError
from llmtune.model.adapters import numel
from llmtune.recipe import flatten

log = logging.getLogger(__name__)

# Module each tracker needs, so a typo or a missing install fails at start, not at the first log.
TRACKER_MODULES = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
    "trackio": ("trackio",),
}


class TrackerError(UserError, ValueError):
    pass


def check_trackers(names: list[str]) -> None:
    for name in names:
        if name not in TRACKER_MODULES:
            raise TrackerError(f"logging.report_to: unknown tracker {name!r}; choose from {sorted(TRACKER_MODULES)}")
        if not any(importlib.util.find_spec(m) for m in TRACKER_MODULES[name]):
            raise TrackerError(f"logging.report_to names {name!r}, which is not installed: pip install {name}")


@dataclass(frozen=True)
class ModelFlops:
    """Model FLOPs of a training step (forward + backward), split as the module docstring says."""

    per_token: float  # every processed token: the decoder's matmuls
    per_trained_token: float  # tokens with a label: the output projection
    attention: float  # an example of l tokens: this x l^2

    def step(self, processed_tokens: int, trained_tokens: int, squared_lengths: int) -> float:
        """FLOPs of a step; `squared_lengths` is the sum of l^2 over its examples (packed ones apart)."""
        return (
            processed_tokens * self.per_token
            + trained_tokens * self.per_trained_token
            + squared_lengths * self.attention
        )


def model_flops(model: torch.nn.Module) -> ModelFlops:
    """`model` is a transformers causal LM or a peft model around one."""
    config = model.config.get_text_config()
    embedding = {id(p) for p in model.get_input_embeddings().parameters()}
    head = list(model.get_output_embeddings().parameters())
    head_ids = {id(p) for p in head}
    body = [p for p in model.parameters() if id(p) not in embedding | head_ids]  # tied weights come once
    decoder = sum((6 if p.requires_grad else 4) * numel(p) for p in body)
    head_flops = (6 if any(p.requires_grad for p in head) else 4) * config.vocab_size * config.hidden_size
    attention = 12 * config.num_hidden_layers * config.hidden_size
    return ModelFlops(float(decoder), float(head_flops), float(attention))


@functools.cache  # measured once per process and device: every run of a process (bench, tests) shares it
def peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """The MFU denominator for this device and precision, and where it comes from."""
    if device.type == "cuda" and precision in ("bf16", "bf16-true", "fp16"):
        name = torch.cuda.get_device_name(device)
        known = datasheet_peak_flops(name)
        if known is not None:
            return known, f"datasheet: {name}, dense {precision}"
    return measure_peak_flops(device, precision), f"measured: matmul in {precision} on {device.type}"


# A CPU core reaches its matmul rate by 1024^3 (Zen 4, one thread: fp32 97 GFLOP/s at 1024, 94 at 2048; bf16 214
# and 208), where a matmul takes ~20 ms; 2048^3 took ~0.17 s, and this runs at the start of every process.
MAX_MATMUL_S = 0.05


def measure_peak_flops(device: torch.device, precision: str, max_size: int = 2048, repeats: int = 5) -> float:
    """Dense matmul FLOP/s in the dtype the run computes in: best of a few square matmuls after a warm-up.

    The size doubles from 256 up to `max_size` while the next size's matmul would still take under
    MAX_MATMUL_S: where a dtype is emulated (bf16 on an AVX2-only CPU, ~1 GFLOP/s) one 2048^3 matmul
    takes ~20 s, so a fixed size would cost minutes at the start of every run. A single cold sample
    under-measured by up to 3x on a shared CPU, hence the best of several.
    """
    dtype = {"bf16": torch.bfloat16, "bf16-true": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    size = 256
    while size < max_size and 2 * size**3 / matmul_flops(device, dtype, size, 1) * 8 < MAX_MATMUL_S:
        size *= 2
    return matmul_flops(device, dtype, size, repeats)


def matmul_flops(device: torch.device, dtype: torch.dtype, size: int, calls: int) -> float:
    """FLOP/s of the fastest of `calls` size^3 matmuls, after one untimed call (thread-pool start-up, caches)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for i in range(calls + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 1:
            best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


# A step's loss and reward are noisy (a GRPO step's reward is a few hundred samples): the printed line gives their
# mean over the steps since the last line, as the HF Trainer and TRL do; metrics.jsonl keeps every step.
_WINDOW_MEANS = ("loss", "reward", "completion_length")


def _step_line(step: int, values: dict[str, float]) -> str:
    """The line printed every logging.every_n_steps."""
    return (
        f"step {step:>6}  loss {values['loss']:.4f}  lr {values['lr']:.2e}  grad_norm {values['grad_norm']:.3f}"
        f"  {values['tokens_per_s']:.0f} trained tok/s  MFU {values['mfu']:.1%}"
        + (f"  peak {values['peak_memory_bytes'] / 2**20:.0f} MiB" if values["peak_memory_bytes"] else "")
        # grpo's loss hovers near 0 by construction: its reward is what a person watches
        + (f"  reward {values['reward']:.3f}  length {values['completion_length']:.1f}" if "reward" in values else "")
    )


class MetricsLogger:
    """Writes one JSON line per optimizer step (main process) and forwards to Accelerate trackers."""

    def __init__(self, accelerator: Accelerator, output_dir: Path, recipe: Any, *, total_steps: int, start_step: int):
        self.acc = accelerator
        self.every = recipe.logging.every_n_steps
        self.main = accelerator.is_main_process
        self._steady = [0, 0.0]  # trained tokens, seconds
        self._other = [0, 0.0]
        self._window: dict[str, list[float]] = {}  # the steps since the last printed line
        # A resumed run appends (its earlier steps stay); a fresh one starts the file over.
        mode = "a" if start_step else "w"
        self._file = open(output_dir / "metrics.jsonl", mode) if self.main else None  # noqa: SIM115
        # Drawn only where it can be: tqdm's `disable=None` leaves it off where stderr is no terminal (a log file, a CI
        # log), in which its redraws were carriage-return fragments re-printed before every log line; the step lines
        # say the same. A notebook draws its widget.
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            disable=None if self.main and recipe.logging.progress_bar else True,
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
        )
        if recipe.logging.report_to:
            accelerator.init_trackers(
                "llmtune",
                config={
                    k: v if isinstance(v, int | float | str | bool) else str(v)
                    for k, v in flatten(recipe.to_dict(), sep="/").items()
                },
            )

    @property
    def drawn(self) -> bool:
        """Whether the progress bar is on screen (log lines must then go through its writer)."""
        return not self._bar.disable

    def log_step(self, step: int, *, memory_tracked: bool, **values: float) -> None:
        # Throughput for the summary leaves out warm-up (steps 1-2) and CPU steps slowed by memory counting.
        steady = step > 2 and not (memory_tracked and self.acc.device.type == "cpu")
        pool = self._steady if steady else self._other
        pool[0] += values["trained_tokens"]
        pool[1] += values["seconds"]
        # Wall clock at the end of the step: differences between steps cover the whole loop (data, logging).
        record = {"step": step, **values, "time": time.time()}
        self._write(record)
        self._bar.update(1)
        self._bar.set_postfix(
            loss=f"{values['loss']:.4f}", trained_tok_s=f"{values['tokens_per_s']:.0f}", refresh=False
        )
        for key in _WINDOW_MEANS:
            if key in values:
                self._window.setdefault(key, []).append(values[key])
        if step % self.every == 0:
            means = {key: sum(v) / len(v) for key, v in self._window.items()}
            self._window.clear()
            if self.main:
                self._bar.write(_step_line(step, {**values, **means}))

    def log_eval(self, step: int, loss: float) -> None:
        record = {"step": step, "eval_loss": loss, "eval_perplexity": float(torch.tensor(loss).exp())}
        self._write(record)
        if self.main:
            self._bar.write(f"step {step:>6}  eval_loss {loss:.4f}  perplexity {record['eval_perplexity']:.2f}")

    def _write(self, record: dict[str, Any]) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        values = {k: v for k, v in record.items() if k not in ("step", "time") and v is not None}
        self.acc.log(values, step=record["step"])

    def tokens_per_s(self) -> float:
        """Steady-state trained tokens per second (see log_step); all steps when none qualified (short runs)."""
        tokens, seconds = self._steady if self._steady[1] else self._other
        return tokens / seconds if seconds else 0.0

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self._bar.close()
        if self._file:
            self._file.close()
        if summary is not None and self.main:
            path = Path(self._file.name).with_name("run_summary.json")
            path.write_text(json.dumps(summary, indent=2))
        # Not `end_training()`, which also ends the process group: the group belongs to the launch, and a launch
        # may train several recipes (llmtune.cli.main ends it).
        for tracker in self.acc.trackers:
            tracker.finish()
