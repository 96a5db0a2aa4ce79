"""llmtune vs the HF `transformers.Trainer`, side by side on this CPU: trained tokens/s and peak memory.

Same model (a Llama-style config, random init, vocab 32000, built from a config: nothing from the hub),
same tokenizer (byte-level BPE trained offline to 32000 tokens on synthetic text), same data (a synthetic
chat set of variable length, tokenised once by llmtune's pipeline and handed to both), same number of
optimizer steps, trials alternating in one process (the order reversed every other round, so a machine
that gets busier moves both alike; ratios are taken per round).

Modes:
- `identical`: the same micro-batch, accumulation, precision (`--precision`, default `auto`: bf16 autocast
  where this CPU runs bf16 natively, fp32 where bf16 would be emulated), checkpointing (off),
  padding (no packing), optimizer (torch AdamW, fused), loss (transformers' ForCausalLMLoss: llmtune
  `training.loss=hf`), and the very same micro-batches in the same order (HF gets a sequential sampler
  over llmtune's step order). Targets: llmtune tokens/s >= 1.0x HF's, peak memory <= 1.0x.
- `defaults`: each tool as recommended, for one memory budget. llmtune: its recipe defaults (packing,
  gradient checkpointing, `loss: auto` = chunked, `micro_batch_size: auto` planned under `memory.budget`).
  HF: per_device_train_batch_size 8 (its default), bf16=True (with bf16), its default optimizer (fused AdamW), no
  packing; if that does not fit the budget, what a user does next, in order: gradient checkpointing, then
  halve the batch (accumulation keeps the global batch). Fit is judged by the estimator's prediction
  first, then checked against the measured peak (a measured overshoot moves on to the next setting).
  Targets: tokens/s >= 1.5x, memory <= 0.6x.
- `compiled`: `defaults` plus each tool's compile switch (llmtune `training.compile`, HF
  `torch_compile=True`). No target.
- `throughput`: llmtune compiled without checkpointing (the fastest setting that fits the budget)
  against HF compiled. No target; with the others it shows where MFU can reach.

Per trial: peak memory is the steady-state peak of live tensor bytes (`PeakMemoryTracker`, steps 2-3:
step 1 allocates AdamW's states); tokens/s is the median over the timed steps of trained (label != -100)
tokens / step time, a step's time running from the end of the step before to its own end: the whole loop,
data loading, collation and logging included, for both tools (llmtune: metrics.jsonl's `time`; HF:
on_step_end). Timed are the steps after the tracked ones (the tracker slows a CPU step down); compiled
modes also skip two steps that compile, and the median keeps a later recompile (a new mask type or shape:
both tools meet some) or a busy moment of the machine from deciding the figure. MFU is llmtune's model FLOPs
(`metrics.model_flops`) against the highest matmul peak measured in the run in the trials' dtype (each
trial's own measurement, 2048^3 and 4096^3; 256^3 and 512^3 where bf16 is emulated).

    .venv/bin/python -m benchmarks.vs_hf --quick      # 1 round of 4 modes, ~6 min on 2 quiet cores
    .venv/bin/python -m benchmarks.vs_hf              # 2 rounds, more steps
    .venv/bin/python -m benchmarks.vs_hf --profile    # + torch.profiler top ops of one step each

Writes benchmarks/results/vs_hf_cpu.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import yaml

from benchmarks import RESULTS

OUTPUT = RESULTS / "vs_hf_cpu.json"
TRACKED_STEPS = 3  # llmtune measures memory on steps 1-3 on CPU; the HF callback does the same
GLOBAL_BATCH = 8
IDENTICAL_MICRO = 4
# (tokens/s ratio >=, memory ratio <=). `compiled` (defaults + each tool's compile switch) and `throughput`
# (llmtune compiled without checkpointing, against HF compiled) have no targets: reported beside the others.
TARGETS: dict[str, tuple[float, float] | None] = {
    "identical": (1.0, 1.0),
    "defaults": (1.5, 0.6),
    "compiled": None,
    "throughput": None,
}
MODES = list(TARGETS)
MFU_TARGET = 0.5
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
log = logging.getLogger("benchmarks.vs_hf")


# ---------------------------------------------------------------- assets: tokenizer, model config, data


def random_lexicon(rng: random.Random, size: int) -> list[str]:
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiouy"
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 4))))
    return sorted(words)


def random_sentence(rng: random.Random, lexicon: list[str], weights: list[float], n: int) -> str:
    return " ".join(rng.choices(lexicon, weights=weights, k=n))


def make_assets(
    folder: Path, *, layers: int, hidden: int, examples: int, max_length: int, seed: int = 0, vocab: int = 32000
) -> dict:
    """Tokenizer (BPE, `vocab`), Llama config (vocab `vocab`) and a chat jsonl of variable length."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    rng = random.Random(seed)
    lexicon = random_lexicon(rng, 40000)
    weights = [1.0 / (i + 10) for i in range(len(lexicon))]  # Zipf-like word frequencies
    corpus = [random_sentence(rng, lexicon, weights, 50) for _ in range(500)] + lexicon
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = CHATML
    model_dir = folder / "model"
    fast.save_pretrained(model_dir)
    LlamaConfig(
        vocab_size=vocab,  # >= the trained tokenizer (BPE may stop a few merges short)
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=max(2048, max_length),
        tie_word_embeddings=False,
        pad_token_id=fast.pad_token_id,
        bos_token_id=bos,
        eos_token_id=fast.eos_token_id,
    ).save_pretrained(model_dir)
    # Chat rows: a short-to-long user turn and a longer answer; lengths spread from ~30 to > max_length
    # tokens (long ones are truncated), the long tail of real SFT sets.
    rows = []
    for _ in range(examples):
        n_user = int(min(400, rng.lognormvariate(3.3, 0.8)))
        n_answer = int(min(600, rng.lognormvariate(4.3, 0.8)))
        messages = [
            {"role": "user", "content": random_sentence(rng, lexicon, weights, max(3, n_user))},
            {"role": "assistant", "content": random_sentence(rng, lexicon, weights, max(3, n_answer))},
        ]
        rows.append({"messages": messages})
    data = folder / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model_dir": str(model_dir), "data": str(data), "tokenizer_vocab": tok.get_vocab_size()}


def base_recipe(assets: dict, out: Path, *, max_length: int, steps: int, seed: int, precision: str) -> dict:
    return {
        "output_dir": str(out),
        "seed": seed,
        "model": {"name_or_path": assets["model_dir"], "random_init": True, "attn_implementation": "sdpa"},
        "data": {"train": [{"path": assets["data"], "format": "messages"}], "max_length": max_length},
        "training": {
            "precision": precision,
            "global_batch_size": GLOBAL_BATCH,
            "max_steps": steps,
            "learning_rate": 1e-4,
            "lr_schedule": "cosine",
            "warmup_steps": 0,
        },
        # Memory is tracked on steps 1-3 only (every_n_steps never reached): the later steps are timed.
        "logging": {"every_n_steps": 100000, "progress_bar": False},
        "checkpoint": {"resume": "none", "every_n_steps": 0},
    }


def merge(into: dict, new: dict) -> dict:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v
    return into


# ---------------------------------------------------------------- llmtune trial


def run_llmtune(recipe: dict, tmp: Path, *, skip: int = 0, after: Callable[[Any], dict] | None = None) -> dict:
    """`recipe` trained by llmtune's loop, timed from its metrics.jsonl; `after(run)`, if given, runs on the trained
    run before it is freed (a profiled step) and its dict is kept under "after"."""
    from llmtune.recipe import load_recipe
    from llmtune.run.loop import fit
    from llmtune.run.setup import build

    path = tmp / f"recipe-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run = build(load_recipe(path))
    summary = fit(run)
    records = [json.loads(x) for x in (Path(recipe["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    # A step's time: from the end of the one before to its own end (the whole loop, as for HF below).
    wall = {r["step"]: r["time"] - prev["time"] for prev, r in zip(steps, steps[1:], strict=False)}
    timed = [r for r in steps if r["step"] > TRACKED_STEPS + skip]
    result = {
        "micro_batch_size": summary["micro_batch_size"],
        "grad_accum_steps": summary["grad_accum_steps"],
        "gradient_checkpointing": summary["gradient_checkpointing"],
        "compile": run.recipe.training.compiles(run.accelerator.device.type),
        "attn_implementation": run.recipe.model.attn_implementation,
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "step_tokens_per_s": [r["trained_tokens"] / wall[r["step"]] for r in timed],
        # The loop's own MFU times train_step only; scaled to the whole-loop step time like tokens/s.
        "mfu": statistics.median(r["mfu"] * r["seconds"] / wall[r["step"]] for r in timed),
        "peak_flops_measured": run.peak_flops,
        "model_flops": dataclasses.asdict(run.flops),
        "losses": [r["loss"] for r in steps],
        "trained_tokens_per_step": [r["trained_tokens"] for r in steps],
        "loss_impl": run.model.impl if hasattr(run.model, "impl") else None,
        "packed": run.data.packed,
        "packing_fill": run.data.stats.packing_fill,
    }
    result["tokens_per_s"] = statistics.median(result["step_tokens_per_s"])
    if after is not None:
        result["after"] = after(run)
    del run
    gc.collect()
    return result


# ---------------------------------------------------------------- HF Trainer trial


def hf_dataset(recipe: dict, tmp: Path, steps: int):
    """llmtune's own tokenised (unpacked) rows, in the order llmtune's loop trains them, step by step."""
    import datasets

    from llmtune.data import batch_for_step, prepare_data
    from llmtune.model.load import load_tokenizer
    from llmtune.recipe import load_recipe

    path = tmp / "recipe-hfdata.yaml"
    # HF's rows are plain examples (its default: no packing), in llmtune's unpacked step order.
    path.write_text(yaml.safe_dump(merge(json.loads(json.dumps(recipe)), {"data": {"packing": False}})))
    r = load_recipe(path)
    tokenizer = load_tokenizer(r.model)
    data = prepare_data(r.data, tokenizer, seed=r.seed)
    rows = []
    for step in range(steps):
        rows += batch_for_step(
            data.train, step=step, global_batch_size=GLOBAL_BATCH, seed=r.seed, rank=0, world_size=1,
            group_by_length=False,
        )  # fmt: skip
    ds = datasets.Dataset.from_dict(
        {"input_ids": [x["input_ids"] for x in rows], "labels": [x["labels"] for x in rows]}
    )
    trained = [
        sum(sum(1 for t in x["labels"][1:] if t != -100) for x in rows[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH])
        for s in range(steps)
    ]
    return tokenizer, ds, trained


def run_hf(
    assets: dict, tokenizer, ds, trained: list[int], *, micro: int, checkpointing: bool, optim: str, steps: int,
    seed: int, tmp: Path, precision: str, profile_step: int | None = None, compile: bool = False, skip: int = 0,
    device: str = "cpu",
) -> dict:  # fmt: skip
    from accelerate.state import AcceleratorState
    from torch.utils.data import SequentialSampler
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    from llmtune.ops.measure import PeakMemoryTracker

    class InOrder(Trainer):
        def _get_train_sampler(self, train_dataset=None):  # llmtune's step order, not a fresh shuffle
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    class Measure(TrainerCallback):
        def __init__(self):
            self.ends, self.peaks, self.losses, self.tracker = {}, {}, [], None
            self.autocast, self.prof = None, None

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
            step = state.global_step + 1
            if step <= TRACKED_STEPS:
                self.tracker = PeakMemoryTracker(device, baseline=[model, optimizer])
                self.tracker.__enter__()
            if step == profile_step:
                self.prof = make_profiler(device).__enter__()

        def on_step_end(self, args, state, control, **kw):
            step = state.global_step
            if self.prof is not None:
                self.prof.__exit__(None, None, None)
                self.profile, self.prof = self.prof, None
            if self.tracker is not None:
                self.tracker.__exit__(None, None, None)
                self.peaks[step], self.tracker = self.tracker.peak_bytes, None
            self.ends[step] = time.perf_counter()  # after the tracker's exit: its cost stays out of step + 1

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    AcceleratorState._reset_state()  # llmtune's trial left its Accelerate state in the singleton
    set_seed(seed)
    config = AutoConfig.from_pretrained(assets["model_dir"])
    config.use_cache = False
    with torch.device(device):  # initialised where it trains (a GPU initialises a 1B model ~10x faster)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    measure = Measure()

    def autocast_probe(module, inputs, output):  # does bf16=True on a CPU really autocast?
        if measure.autocast is None:
            measure.autocast = {"autocast_enabled": torch.is_autocast_enabled(device), "q_proj_out": str(output.dtype)}

    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(autocast_probe)
    args = TrainingArguments(
        output_dir=str(tmp / "hf"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=GLOBAL_BATCH // micro,
        max_steps=steps,
        learning_rate=1e-4,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        bf16=precision == "bf16",
        gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if checkpointing else None,
        optim=optim,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        dataloader_num_workers=0,
        use_cpu=device == "cpu",  # without it, bf16=True on a GPU-less machine is refused
        torch_compile=compile,
    )
    trainer = InOrder(
        model=model,
        args=args,
        train_dataset=ds,
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100),
        callbacks=[measure],
    )
    trainer.train()
    hook.remove()
    # Profiling slows a step; the first untracked step of a compiled model compiles.
    # A step's time: from the end of the one before to its own end (data loading, collation, callbacks).
    seconds = {s: measure.ends[s] - measure.ends[s - 1] for s in measure.ends if s - 1 in measure.ends}
    timed = [s for s in seconds if s > TRACKED_STEPS + skip and s != profile_step]
    result = {
        "micro_batch_size": micro,
        "grad_accum_steps": GLOBAL_BATCH // micro,
        "gradient_checkpointing": checkpointing,
        "compile": compile,
        "optim": optim,
        "peak_memory_bytes": max(v for k, v in measure.peaks.items() if k > 1),
        "step_tokens_per_s": [trained[s - 1] / seconds[s] for s in timed],
        "losses": measure.losses,
        "trained_tokens_per_step": trained,
        "autocast_check": measure.autocast,
        "optimizer_class": type(trainer.optimizer.optimizer).__name__,
    }
    result["tokens_per_s"] = statistics.median(result["step_tokens_per_s"])
    if getattr(measure, "profile", None) is not None:
        result["profile"] = profile_table(measure.profile)
    del trainer, model
    gc.collect()
    return result


def run_trl(
    model_dir: str, data: str, *, max_length: int, micro: int, steps: int, seed: int, tmp: Path, device: str,
    timed_after: int, profile_step: int | None = None,
) -> dict:  # fmt: skip
    """TRL's SFTTrainer as its docs recommend for speed: its SFTConfig defaults (gradient checkpointing on, bf16,
    lr 2e-5) with `packing=True` (best-fit decreasing, which turns on `padding_free`: each micro-batch's packed rows
    flattened into one sequence with position ids) on the text rows of `data`, `micro` rows of `max_length` a
    micro-step, one micro-step a step. Attention: flash_attention_2 where flash-attn is installed (what TRL's
    padding-free is written for), else sdpa (transformers then masks the flattened documents apart). Tokens/s: the
    step's trained tokens (labels not -100) over its time, end of the step before to its own end, steps after
    `timed_after`."""
    import importlib.util

    import datasets
    from accelerate.state import AcceleratorState
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl import SFTConfig, SFTTrainer

    attn = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
    trained: dict[int, int] = {}

    class Timed(SFTTrainer):
        def training_step(self, model, inputs, *args, **kwargs):
            step = self.state.global_step + 1
            trained[step] = trained.get(step, 0) + int((inputs["labels"] != -100).sum())
            return super().training_step(model, inputs, *args, **kwargs)

    class Measure(TrainerCallback):
        def __init__(self):
            self.ends, self.prof, self.profile = {}, None, None

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step + 1 == profile_step:
                self.prof = make_profiler(device).__enter__()

        def on_step_end(self, args, state, control, **kw):
            if self.prof is not None:
                if device == "cuda":
                    torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                self.profile, self.prof = profile_table(self.prof), None
            self.ends[state.global_step] = time.perf_counter()

    AcceleratorState._reset_state()
    set_seed(seed)
    config = AutoConfig.from_pretrained(model_dir)
    config.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    args = SFTConfig(
        output_dir=str(tmp / "trl"), max_length=max_length, packing=True, per_device_train_batch_size=micro,
        gradient_accumulation_steps=1, max_steps=steps, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=seed, dataloader_num_workers=0, use_cpu=device == "cpu", bf16=True,
        dataset_num_proc=1,
    )  # fmt: skip
    measure = Measure()
    trainer = Timed(
        model=model, args=args, train_dataset=datasets.load_dataset("json", data_files=data, split="train"),
        processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[measure],
    )  # fmt: skip
    trainer.train()
    seconds = {s: measure.ends[s] - measure.ends[s - 1] for s in measure.ends if s - 1 in measure.ends}
    timed = [s for s in seconds if s > timed_after and s != profile_step]
    result = {
        "micro_batch_size": micro,
        "gradient_checkpointing": bool(args.gradient_checkpointing),
        "padding_free": trainer.padding_free,
        "attn_implementation": attn,
        "step_tokens_per_s": [trained[s] / seconds[s] for s in timed],
        "trained_tokens_per_step": [trained[s] for s in sorted(trained)],
        "profile": measure.profile,
    }
    result["tokens_per_s"] = statistics.median(result["step_tokens_per_s"])
    del trainer, model
    gc.collect()
    return result


# ---------------------------------------------------------------- profiling and peak FLOPs


def make_profiler(device: str = "cpu"):
    """torch.profiler over the host's ops, and the GPU's kernels where `device` is cuda (no memory: on a GPU it
    records every allocation, a cost the timed steps never pay)."""
    from torch.profiler import ProfilerActivity, profile

    if device == "cuda":
        return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False)
    return profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)


def profile_table(prof, top: int = 12) -> dict:
    """The top ops of a profile by self time: the GPU's (kernels) where it recorded any, else the host's."""
    events = prof.key_averages()
    device_total = sum(e.self_device_time_total for e in events)
    if device_total:
        by_device = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]
        return {
            "self_device_share": {e.key: round(e.self_device_time_total / device_total, 4) for e in by_device},
            "self_device_ms": round(device_total / 1e3, 2),
            "self_cpu_ms": round(sum(e.self_cpu_time_total for e in events) / 1e3, 2),
        }
    total = sum(e.self_cpu_time_total for e in events) or 1
    by_time = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    by_mem = sorted(events, key=lambda e: e.self_cpu_memory_usage, reverse=True)[:top]
    return {
        "self_cpu_share": {e.key: round(e.self_cpu_time_total / total, 4) for e in by_time},
        "self_cpu_memory_mib": {e.key: round(e.self_cpu_memory_usage / 2**20, 1) for e in by_mem},
    }


def check_peak_flops(precision: str, repeats: int = 3) -> dict:
    """llmtune's `measure_peak_flops` next to larger matmuls in the trials' dtype, alternating (smaller
    ones where bf16 is emulated: a 4096^3 emulated bf16 matmul takes minutes)."""
    from llmtune.model.precision import cpu_supports_bf16
    from llmtune.run.metrics import matmul_flops, measure_peak_flops

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    small, large = (2048, 4096) if dtype == torch.float32 or cpu_supports_bf16() else (256, 512)

    rows: dict[str, list[float]] = {"llmtune_measure_peak_flops": [], "matmul_small": [], "matmul_large": []}
    for _ in range(repeats):
        rows["llmtune_measure_peak_flops"].append(measure_peak_flops(torch.device("cpu"), precision))
        rows["matmul_small"].append(matmul_flops(torch.device("cpu"), dtype, small, 5))
        rows["matmul_large"].append(matmul_flops(torch.device("cpu"), dtype, large, 3))
    return {k: max(v) for k, v in rows.items()} | {"all": rows, "sizes": [small, large], "dtype": str(dtype)}


# ---------------------------------------------------------------- defaults mode: what fits the budget


def estimate_peak(
    config, *, micro: int, seq_len: int, checkpointing: bool, loss: str, optimizer: str, precision: str,
    device: str = "cpu",
) -> int:  # fmt: skip
    from llmtune.plan.estimate import estimate

    return estimate(
        config, micro_batch_size=micro, seq_len=seq_len, precision=precision, gradient_checkpointing=checkpointing,
        loss=loss, optimizer=optimizer, device=device, grad_accum_steps=GLOBAL_BATCH // micro,
    ).peak_bytes  # fmt: skip


def identical_trial(precision: str, micro: int = IDENTICAL_MICRO) -> tuple[dict, dict]:
    """(llmtune recipe overrides, HF kwargs) of the `identical` mode."""
    return (
        {"data": {"packing": False, "group_by_length": False},
         "training": {"micro_batch_size": micro, "loss": "hf", "gradient_checkpointing": False}},
        {"micro": micro, "checkpointing": False, "optim": "adamw_torch_fused", "precision": precision},
    )  # fmt: skip


def hf_defaults(config, *, max_length: int, budget: int, precision: str, device: str = "cpu") -> tuple[dict, list]:
    """HF kwargs of the `defaults` mode: the first setting of `hf_user_sequence` predicted to fit `budget`
    (None when none does), and the settings tried."""
    tried = []
    for m, ckpt in hf_user_sequence():
        pred = estimate_peak(config, micro=m, seq_len=max_length, checkpointing=ckpt, loss="hf",
                             optimizer="adamw_fused", precision=precision, device=device)  # fmt: skip
        tried.append({"micro": m, "checkpointing": ckpt, "predicted_peak_bytes": pred})
        if pred <= budget:
            return {"micro": m, "checkpointing": ckpt, "optim": "adamw_torch_fused", "precision": precision}, tried
    return None, tried


def hf_user_sequence() -> list[tuple[int, bool]]:
    """What an HF user tries, in order: the default batch 8, then checkpointing, then halving."""
    out = []
    for micro in (8, 4, 2, 1):
        out += [(micro, False), (micro, True)]
    return out


# ---------------------------------------------------------------- main


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round, fewer timed steps (~6-8 min)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--timed-steps", type=int, default=None, help="steps timed after the 3 memory-tracked ones")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000, help="tokenizer and model vocabulary (small: a quick smoke run)")
    p.add_argument("--budget", default="2GiB", help="memory budget of the defaults mode")
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--peak-repeats", type=int, default=3, help="rounds of the matmul peak check (MFU's denominator)")
    p.add_argument("--profile", action="store_true", help="torch.profiler on one timed step of each trial")
    p.add_argument("--output", type=Path, default=OUTPUT)
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="both tools' precision; auto: bf16 where this CPU runs it natively, else fp32 (emulated bf16 is slow)",
    )
    a = p.parse_args(argv)
    from llmtune.model.precision import resolve_precision

    precision = resolve_precision(a.precision, "cpu")
    rounds = a.rounds or (1 if a.quick else 2)
    timed = a.timed_steps or (4 if a.quick else 6)
    steps = TRACKED_STEPS + timed
    # Not timed in the compiled mode: the first compiled step compiles, and the first new shape recompiles
    # with dynamic shapes (HF's padded batches change width every step).
    skip = {mode: 2 if mode in ("compiled", "throughput") else 0 for mode in MODES}
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoConfig

    from llmtune.units import format_bytes, parse_bytes

    started = time.perf_counter()
    budget = parse_bytes(a.budget)
    results: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.vs_hf " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "load_avg_start": os.getloadavg(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "settings": {
            "layers": a.layers,
            "hidden": a.hidden,
            "vocab": a.vocab,
            "max_length": a.max_length,
            "global_batch": GLOBAL_BATCH,
            "steps": steps,
            "timed_steps": timed,
            "rounds": rounds,
            "budget": a.budget,
            "precision": precision,
        },  # fmt: skip
        "modes": {},
    }
    import transformers

    results["machine"]["transformers"] = transformers.__version__
    with tempfile.TemporaryDirectory(prefix="bench-vs-hf-") as tmp_name:
        tmp = Path(tmp_name)
        assets = make_assets(
            tmp, layers=a.layers, hidden=a.hidden, examples=400, max_length=a.max_length, vocab=a.vocab
        )
        config = AutoConfig.from_pretrained(assets["model_dir"])
        results["settings"]["tokenizer_vocab"] = assets["tokenizer_vocab"]
        base = base_recipe(assets, tmp / "run", max_length=a.max_length, steps=steps, seed=0, precision=precision)
        tokenizer, ds, trained = hf_dataset(base, tmp, steps + max(skip.values()))
        lengths = [len(x) for x in ds["input_ids"]]
        results["settings"]["example_tokens"] = {"mean": statistics.mean(lengths), "max": max(lengths)}

        # What each side runs, per mode: (llmtune recipe overrides, HF kwargs, note).
        trials: dict[str, tuple[dict, dict, dict]] = {}
        if "identical" in a.modes:
            trials["identical"] = (*identical_trial(precision), {})
        if {"defaults", "compiled", "throughput"} & set(a.modes):
            note: dict[str, Any] = {
                "llmtune": "recipe defaults + memory.budget; micro_batch_size auto, planned by the loop"
            }
            hf_kwargs, note["hf_settings_tried"] = hf_defaults(
                config, max_length=a.max_length, budget=budget, precision=precision
            )
            if hf_kwargs is None:
                raise SystemExit(f"no HF setting fits {a.budget}")
            if "defaults" in a.modes:
                # llmtune: its recipe defaults (packing, checkpointing, `loss: auto`, `micro_batch_size: auto`)
                # and the budget, nothing else.
                trials["defaults"] = ({"memory": {"budget": a.budget}}, dict(hf_kwargs), note)
            if "compiled" in a.modes:
                trials["compiled"] = (
                    {"memory": {"budget": a.budget}, "training": {"compile": True}},
                    {**hf_kwargs, "compile": True},
                    {**note, "compile": "llmtune: training.compile (each decoder block); HF: torch_compile=True"},
                )
            if "throughput" in a.modes:
                trials["throughput"] = (
                    {"memory": {"budget": a.budget}, "training": {"compile": True, "gradient_checkpointing": False}},
                    {**hf_kwargs, "compile": True},
                    {**note, "llmtune": "recipe defaults + compile, checkpointing off + memory.budget"},
                )

        per_round: dict[str, list[dict]] = {mode: [] for mode in trials}
        # Round -1 warms the process up and is discarded: the first trial of a process runs ~1.5x slower
        # (oneDNN kernels, thread pool, first-touch pages), which would always penalise the same side.
        for rnd in range(-1, rounds):
            order = list(trials.items())[:1] if rnd < 0 else list(trials.items())
            for mode, (over, hf_kwargs, note) in order:
                pair = {}
                sides = ["llmtune", "hf"] if (rnd % 2 == 0) else ["hf", "llmtune"]
                for side in sides:
                    prof_step = steps if a.profile and rnd == 0 else None  # noqa: SIM108
                    t0 = time.perf_counter()
                    if side == "llmtune":
                        recipe = merge(json.loads(json.dumps(base)), over)
                        recipe["output_dir"] = str(tmp / f"run-{mode}-{rnd}")
                        recipe["training"]["max_steps"] = steps + skip[mode]
                        pair[side] = run_llmtune(recipe, tmp, skip=skip[mode])
                        if prof_step:
                            pair[side]["profile"] = profile_llmtune(recipe, tmp)
                    else:
                        while True:
                            res = run_hf(assets, tokenizer, ds, trained, steps=steps + skip[mode], seed=0, tmp=tmp,
                                         profile_step=prof_step, skip=skip[mode], **hf_kwargs)  # fmt: skip
                            if mode != "defaults" or res["peak_memory_bytes"] <= budget:
                                break
                            # Measured over the budget (an OOM for a real budget): the user's next setting.
                            seq = hf_user_sequence()
                            nxt = seq[seq.index((hf_kwargs["micro"], hf_kwargs["checkpointing"])) + 1]
                            note.setdefault("hf_measured_over_budget", []).append(
                                {"micro": hf_kwargs["micro"], "checkpointing": hf_kwargs["checkpointing"],
                                 "peak_memory_bytes": res["peak_memory_bytes"]})  # fmt: skip
                            hf_kwargs.update(micro=nxt[0], checkpointing=nxt[1])
                        pair[side] = res
                    pair[side]["wall_s"] = time.perf_counter() - t0
                    print(
                        f"[{time.perf_counter() - started:6.0f}s] round {rnd + 1 if rnd >= 0 else 'warm-up'} {mode:9s}"
                        f" {side:7s} "
                        f"{pair[side]['tokens_per_s']:7.0f} tok/s  peak {format_bytes(pair[side]['peak_memory_bytes'])}"
                        f"  micro {pair[side]['micro_batch_size']} ckpt {pair[side]['gradient_checkpointing']}",
                        flush=True,
                    )
                if rnd < 0:
                    continue
                pair["tokens_per_s_ratio"] = ratio(pair["llmtune"]["tokens_per_s"], pair["hf"]["tokens_per_s"])
                pair["memory_ratio"] = ratio(pair["llmtune"]["peak_memory_bytes"], pair["hf"]["peak_memory_bytes"])
                per_round[mode].append(pair)
        results["peak_flops_check"] = check_peak_flops(precision, a.peak_repeats)

    # Every trial measures the matmul peak once at start (a 0.3 s sample: a busy moment reads low and would
    # inflate that trial's MFU); MFU here is against the highest peak any measurement of the run saw.
    pf = results["peak_flops_check"]
    trial_peaks = [pr["llmtune"]["peak_flops_measured"] for prs in per_round.values() for pr in prs]
    best_peak = max([pf["matmul_small"], pf["matmul_large"], pf["llmtune_measure_peak_flops"], *trial_peaks])
    for mode, pairs in per_round.items():
        for pr in pairs:
            pr["llmtune"]["mfu_vs_best_peak"] = pr["llmtune"]["mfu"] * pr["llmtune"]["peak_flops_measured"] / best_peak
        speed = statistics.median(pr["tokens_per_s_ratio"] for pr in pairs)
        mem = statistics.median(pr["memory_ratio"] for pr in pairs)
        results["modes"][mode] = {
            "rounds": pairs,
            "settings_note": trials[mode][2],
            "tokens_per_s_ratio": speed,
            "memory_ratio": mem,
            "mfu_vs_best_peak": statistics.median(pr["llmtune"]["mfu_vs_best_peak"] for pr in pairs),
        }
        if TARGETS[mode]:
            speed_target, mem_target = TARGETS[mode]
            results["modes"][mode]["targets"] = {"tokens_per_s_ratio_min": speed_target, "memory_ratio_max": mem_target}
            results["modes"][mode]["met"] = {"speed": speed >= speed_target, "memory": mem <= mem_target}
    # The MFU target is judged on the best mode's median over rounds.
    per_mode = {mode: m["mfu_vs_best_peak"] for mode, m in results["modes"].items()}
    best_mode = max(per_mode, key=per_mode.get)
    results["mfu"] = {
        "best_peak_flops": best_peak,
        "per_mode_median": per_mode,
        "best_mode": best_mode,
        "target": MFU_TARGET,
        "met": per_mode[best_mode] >= MFU_TARGET,
    }
    results["machine"]["load_avg_end"] = os.getloadavg()
    results["seconds"] = time.perf_counter() - started
    print_table(results)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"wrote {a.output} in {results['seconds']:.0f} s")
    return results


def profile_llmtune(recipe: dict, tmp: Path) -> dict:
    """torch.profiler over one llmtune optimizer step (after two warm-up steps), through `train_step`."""
    from llmtune.data import batch_for_step
    from llmtune.recipe import load_recipe
    from llmtune.run.loop import train_step
    from llmtune.run.setup import build

    recipe = json.loads(json.dumps(recipe))
    recipe["output_dir"] += "-profile"
    path = tmp / "recipe-profile.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run = build(load_recipe(path))
    for step in range(3):
        examples = batch_for_step(
            run.data.train, step=step, global_batch_size=GLOBAL_BATCH, seed=run.recipe.seed, rank=0, world_size=1,
            group_by_length=run.recipe.data.group_by_length,
        )  # fmt: skip
        if step < 2:
            train_step(run, examples)
            continue
        with make_profiler() as prof:
            train_step(run, examples)
    del run
    gc.collect()
    return profile_table(prof)


def print_table(results: dict) -> None:
    from llmtune.units import format_bytes

    print()
    print(f"{'mode':10s} {'tool':8s} {'micro':>5s} {'ckpt':>5s} {'tok/s':>8s} {'peak':>10s} {'MFU':>6s}")
    for mode, m in results["modes"].items():
        for side in ("llmtune", "hf"):
            rs = [pr[side] for pr in m["rounds"]]
            tps = statistics.median(r["tokens_per_s"] for r in rs)
            peak = max(r["peak_memory_bytes"] for r in rs)
            mfu = f"{m['mfu_vs_best_peak']:6.1%}" if side == "llmtune" else ""
            print(
                f"{mode:10s} {side:8s} {rs[0]['micro_batch_size']:5d} {str(rs[0]['gradient_checkpointing'])[0]:>5s}"
                f" {tps:8.0f} {format_bytes(peak):>10s} {mfu:>6s}"
            )
        targets = TARGETS[mode]
        speed, mem = f"tokens/s {m['tokens_per_s_ratio']:.2f}x", f"memory {m['memory_ratio']:.2f}x"
        if targets:
            speed += f" (target >= {targets[0]}) {'met' if m['met']['speed'] else 'MISSED'}"
            mem += f" (target <= {targets[1]}) {'met' if m['met']['memory'] else 'MISSED'}"
        print(f"{mode:10s} ratio    {speed};  {mem}")
    pf, mfu = results["peak_flops_check"], results["mfu"]
    (small, large), precision = pf["sizes"], results["settings"]["precision"]
    print(
        f"peak {precision} FLOP/s: measure_peak_flops {pf['llmtune_measure_peak_flops'] / 1e9:.0f} G, {small}^3 "
        f"{pf['matmul_small'] / 1e9:.0f} G, {large}^3 {pf['matmul_large'] / 1e9:.0f} G;"
        f" best of the run (trials included) {mfu['best_peak_flops'] / 1e9:.0f} G"
    )
    print(
        "MFU against the best peak, median over rounds: "
        + ", ".join(f"{k} {v:.1%}" for k, v in mfu["per_mode_median"].items())
        + f"; target >= {MFU_TARGET:.0%} {'met' if mfu['met'] else 'MISSED'} ({mfu['best_mode']})"
    )


if __name__ == "__main__":
    main()
