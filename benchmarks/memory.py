"""Memory estimator accuracy on CPU, and the micro-batch picker against accelerate's OOM retry.

    python -m benchmarks.memory            # full accuracy matrix -> memory_accuracy_cpu.json
    python -m benchmarks.memory --quick    # a subset (minutes)
    python -m benchmarks.memory --picker   # picker benchmark -> picker_cpu.json

Accuracy: for each case (architecture x packed or padded rows x HF or chunked loss x LoRA x
checkpointing x precision) a tiny model, built and trained as `llmtune train` builds and trains it
(load_model, CausalLMWithLoss, make_optimizer, real collated batches), runs two real steps; the 2nd
(steady-state) step's peak, counted by PyTorch's MemTracker -- which shares no code with the
estimator -- is compared with `estimate(...)` given the planner's settings for the same recipe.

Picker: for several budgets, the micro-batch `plan_micro_batch` picks vs the true largest one
(found by measuring every allowed micro-batch), and the trials/time accelerate's
`find_executable_batch_size` needs from the same upper bound, with PeakMemoryTracker(limit_bytes)
making out-of-memory real on CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
import weakref
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.utils._pytree as pytree
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    Gemma2Config,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from benchmarks import RESULTS
from llmtune.data import collate
from llmtune.model.load import load_model
from llmtune.ops.loss import CausalLMWithLoss
from llmtune.ops.measure import PeakMemoryTracker
from llmtune.ops.optim import make_optimizer
from llmtune.plan import MemoryPlanError, estimate_settings, plan_micro_batch
from llmtune.plan.estimate import MemoryEstimate, estimate
from llmtune.recipe import DataConfig, ModelConfig, PeftConfig, Recipe, TrainingConfig
from llmtune.run.parallelize import adapt
from llmtune.units import format_bytes

VOCAB = 1024


def configs() -> dict[str, transformers.PretrainedConfig]:
    """Small models of seven families: GQA + SwiGLU + RMSNorm (Llama), tied embeddings + qkv bias
    (Qwen2), learned positions + Conv1D + GELU + dropout (GPT-2), parallel residual + partial rotary
    (GPT-NeoX), sliding-window attention (Mistral, window shorter than the rows), q/k norms (Qwen3),
    soft-capping + alternating sliding/global layers + eager-only attention (Gemma-2)."""
    common = dict(vocab_size=VOCAB, max_position_embeddings=1024)
    gqa = dict(
        hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    return {
        "llama": LlamaConfig(**gqa, **common),
        "qwen2": Qwen2Config(**gqa, tie_word_embeddings=True, **common),
        "gpt2": GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=1024),
        "gptneox": GPTNeoXConfig(
            hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, **common
        ),
        "mistral": MistralConfig(**gqa, sliding_window=64, **common),
        "qwen3": Qwen3Config(**gqa, head_dim=32, **common),
        "gemma2": Gemma2Config(**gqa, head_dim=32, sliding_window=64, **common),
    }


@dataclass(frozen=True)
class Case:
    arch: str
    layout: str  # packed | padded
    loss: str  # hf | chunked
    lora: bool
    checkpointing: bool
    precision: str  # fp32 | bf16
    micro_batch: int = 4
    seq_len: int = 256
    lora_targets: tuple[str, ...] = ()  # peft.target_modules; empty: all-linear

    def recipe(self) -> Recipe:
        attn = "eager" if self.arch == "gemma2" else "sdpa"
        return Recipe(
            model=ModelConfig(name_or_path=self.arch, random_init=True, attn_implementation=attn),
            data=DataConfig(max_length=self.seq_len, packing=self.layout == "packed"),
            training=TrainingConfig(
                precision=self.precision,
                global_batch_size=self.micro_batch,
                micro_batch_size=self.micro_batch,
                gradient_checkpointing=self.checkpointing,
                loss=self.loss,
            ),
            peft=PeftConfig(
                method="lora" if self.lora else "none",
                rank=8,
                alpha=16.0,
                target_modules=list(self.lora_targets) or "all-linear",
            ),
        )


def cases(quick: bool) -> list[Case]:
    """Per architecture: every layout x loss x LoRA in fp32, then checkpointing and bf16 on two of them."""
    out = []
    for arch in configs():
        for layout, loss, lora in itertools.product(["packed", "padded"], ["hf", "chunked"], [False, True]):
            out.append(Case(arch, layout, loss, lora, checkpointing=False, precision="fp32"))
        out.append(Case(arch, "packed", "chunked", True, checkpointing=True, precision="fp32"))
        out.append(Case(arch, "packed", "hf", False, checkpointing=True, precision="fp32"))
        out.append(Case(arch, "packed", "hf", False, checkpointing=False, precision="bf16"))
        out.append(Case(arch, "padded", "chunked", True, checkpointing=True, precision="bf16"))
    return out[::4] if quick else out


def batch_of(case: Case, seed: int) -> dict[str, torch.Tensor]:
    """A real micro-batch from llmtune.data.collate: packed rows of 2-5 examples filling the row, or padded
    rows of similar lengths (as group_by_length makes them; the longest full, the others 8 tokens shorter
    each) -- what the training loop feeds the model in its largest micro-batch, which the estimate is for.
    A quarter of each example (the prompt) is not trained."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for row in range(case.micro_batch):
        if case.layout == "packed":
            count = int(torch.randint(1, 5, (1,), generator=g))
            cuts = sorted((torch.randperm(case.seq_len - 2, generator=g)[:count] + 1).tolist())
            bounds = [0, *cuts, case.seq_len]
            positions = [p for a, b in itertools.pairwise(bounds) for p in range(b - a)]
            n = case.seq_len
        else:
            n = case.seq_len - 8 * row
            positions = list(range(n))
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        labels = [-100] * (n // 4) + ids[n // 4 :]  # prompt tokens untrained, as in a chat example
        examples.append({"input_ids": ids, "labels": labels, "position_ids": positions})
    return collate(examples, pad_token_id=0, packed=case.layout == "packed")


def build(case: Case, cfg: transformers.PretrainedConfig):
    """The model, loss module and optimizer as the training loop builds them for `case`."""
    recipe = case.recipe()
    torch.manual_seed(0)
    model = adapt(load_model(recipe, case.precision, cfg), recipe)
    model.train()
    return CausalLMWithLoss(model, case.loss), model, make_optimizer(model, recipe, torch.device("cpu"))


def train_step(case: Case, step_module, opt, batches: list[dict[str, torch.Tensor]]) -> None:
    """One optimizer step over the micro-batches (gradient accumulation); the loop keeps only the loss."""
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.precision == "bf16"):
            loss = step_module(**batch)
        loss.backward()
        del loss
    opt.step()
    opt.zero_grad(set_to_none=True)


class StorageHighWater(TorchDispatchMode):
    """Peak bytes of live tensor storages, written for this benchmark and sharing no code with the
    estimator or llmtune.ops.measure: every op's outputs are followed by a weak reference to their
    storage until it is freed. Cross-checked against PyTorch's MemTracker (`mem_tracker_bytes`), which
    cannot run on models with frozen parameters (it hooks every parameter's gradient)."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        super().__init__()
        self.live: dict[int, weakref.ref] = {}
        self.now = self.peak = 0
        for t in tensors:
            self._follow(t)

    def _free(self, key: int, nbytes: int) -> None:
        if self.live.pop(key, None) is not None:
            self.now -= nbytes

    def _follow(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live or st.nbytes() == 0:
            return
        n = st.nbytes()
        self.live[key] = weakref.ref(st, lambda _ref, key=key, n=n: self._free(key, n))
        self.now += n
        self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._follow(t)
        return out


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return [*model.parameters(), *model.buffers(), *states]


def measure(case: Case, cfg: transformers.PretrainedConfig, accum: int = 1) -> tuple[int, int | None]:
    """Peak bytes of the 2nd real training step (AdamW states exist from the 1st), by StorageHighWater and,
    where it can run, by PyTorch's MemTracker: (high-water bytes, MemTracker bytes or None)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    step_module, model, opt = build(case, cfg)
    train_step(case, step_module, opt, [batch_of(case, k) for k in range(accum)])
    batches = [batch_of(case, accum + k) for k in range(accum)]
    inputs = [v for b in batches for v in b.values()]
    with StorageHighWater(*state_tensors(model, opt), *inputs) as high_water:
        train_step(case, step_module, opt, batches)
    if accum > 1 or not all(p.requires_grad for p in model.parameters()):
        return high_water.peak, None  # MemTracker follows one call per module and no frozen parameters
    tracker = MemTracker()
    tracker.track_external(model, opt, *inputs)
    with tracker:
        train_step(case, step_module, opt, batches)
    return high_water.peak, int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def trained_fraction(case: Case) -> float:
    """What training gives the planner (DataStats.max_trained_fraction): the most trained tokens in a row
    of the data, per row length -- here, over every batch the measurement saw."""
    rows = [row for seed in range(2) for row in batch_of(case, seed)["labels"]]
    return max(int((row != -100).sum()) for row in rows) / case.seq_len


def predict(case: Case, cfg: transformers.PretrainedConfig) -> MemoryEstimate:
    settings = estimate_settings(
        case.recipe(), loss=case.loss, device="cpu", precision=case.precision, trained_fraction=trained_fraction(case)
    )
    return estimate(cfg, micro_batch_size=case.micro_batch, seq_len=case.seq_len, **settings)


def accuracy(quick: bool) -> dict:
    cfgs = configs()
    rows = []
    matrix = cases(quick)
    for i, case in enumerate(matrix):
        t0 = time.perf_counter()
        meas, by_mem_tracker = measure(case, cfgs[case.arch])
        t1 = time.perf_counter()
        est = predict(case, cfgs[case.arch])
        t2 = time.perf_counter()
        err = est.peak_bytes / meas - 1
        rows.append(
            asdict(case)
            | dict(
                measured_bytes=meas,
                mem_tracker_bytes=by_mem_tracker,
                predicted_bytes=est.peak_bytes,
                rel_error=err,
                peak_phase=est.peak_phase,
                measure_s=round(t1 - t0, 3),
                estimate_s=round(t2 - t1, 3),
            )
        )
        print(
            f"[{i + 1:3d}/{len(matrix)}] {case.arch:8s} {case.layout:6s} {case.loss:7s} lora={int(case.lora)}"
            f" ckpt={int(case.checkpointing)} {case.precision:5s} measured {format_bytes(meas):>11s}"
            f" predicted {format_bytes(est.peak_bytes):>11s} {err:+7.2%} ({est.peak_phase})",
            flush=True,
        )
    errs = [r["rel_error"] for r in rows]
    summary = dict(
        cases=len(rows),
        median_abs_rel_error=statistics.median(abs(e) for e in errs),
        worst_abs_rel_error=max(abs(e) for e in errs),
        worst_underestimate=min(min(errs), 0.0),
        median_estimate_s=statistics.median(r["estimate_s"] for r in rows),
    )
    print(
        f"\n{summary['cases']} cases: median |error| {summary['median_abs_rel_error']:.3%}, "
        f"worst |error| {summary['worst_abs_rel_error']:.3%}, worst underestimate "
        f"{summary['worst_underestimate']:+.3%}, median estimate time {summary['median_estimate_s']:.2f}s"
    )
    return dict(summary=summary, rows=rows)


def picker() -> dict:
    """Largest fitting micro-batch: planner vs truth vs accelerate's halving retry."""
    from accelerate.utils import find_executable_batch_size

    cfg = configs()["llama"]
    gbs, seq = 32, 256
    divisors = [m for m in range(1, gbs + 1) if gbs % m == 0]

    def case_at(m: int) -> Case:  # accelerate's retries also try sizes that do not divide the batch
        return Case("llama", "packed", "hf", False, False, "fp32", micro_batch=m, seq_len=seq)

    truth_peaks = {}
    for m in divisors:
        truth_peaks[m] = measure(case_at(m), cfg, accum=gbs // m)[0]
        print(f"measured peak at micro-batch {m:2d} (accum {gbs // m:2d}): {format_bytes(truth_peaks[m])}", flush=True)

    def run_training(m: int, budget: int, steps: int = 2) -> None:
        """What a trial costs: build, then `steps` optimizer steps under the enforced budget
        (2, because AdamW's states appear only at the first step)."""
        step_module, model, opt = build(case_at(m), cfg)
        with PeakMemoryTracker("cpu", baseline=[model, opt], limit_bytes=budget):
            for s in range(steps):
                train_step(case_at(m), step_module, opt, [batch_of(case_at(m), s * gbs + k) for k in range(gbs // m)])

    # Budgets half-way between consecutive measured peaks, plus one under micro-batch 1.
    ms = sorted(truth_peaks)
    budgets = [int(truth_peaks[1] * 0.9)] + [
        (truth_peaks[a] + truth_peaks[b]) // 2 for a, b in zip(ms, ms[1:], strict=False)
    ]
    budgets.append(int(truth_peaks[ms[-1]] * 1.1))
    rows = []
    for budget in budgets:
        fitting = [m for m in ms if truth_peaks[m] <= budget]
        truth = max(fitting) if fitting else None

        t0 = time.perf_counter()
        try:
            plan = plan_micro_batch(
                cfg,
                global_batch_size=gbs,
                num_processes=1,
                budget_bytes=budget,
                seq_len=seq,
                **estimate_settings(case_at(1).recipe(), loss="hf", device="cpu", precision="fp32"),
            )
            planned = plan.micro_batch_size
        except MemoryPlanError:
            planned = None
        plan_s = time.perf_counter() - t0
        planned_ok = None
        if planned is not None:
            try:
                run_training(planned, budget)
                planned_ok = True
            except torch.OutOfMemoryError:
                planned_ok = False
        planner_total_s = time.perf_counter() - t0

        trials: list[int] = []
        t0 = time.perf_counter()

        @find_executable_batch_size(starting_batch_size=gbs)
        def accelerate_loop(batch_size: int, trials: list[int] = trials, budget: int = budget) -> int:
            trials.append(batch_size)
            run_training(batch_size, budget)
            return batch_size

        try:
            acc_m = accelerate_loop()
        except RuntimeError:  # "No executable batch size found, reached zero."
            acc_m = None
        acc_s = time.perf_counter() - t0

        row = dict(
            budget_bytes=budget,
            budget=format_bytes(budget),
            true_largest_micro_batch=truth,
            planner_micro_batch=planned,
            planner_step_fits=planned_ok,
            planner_estimate_s=round(plan_s, 2),
            planner_time_to_working_batch_s=round(planner_total_s, 2),
            planner_trial_steps=1 if planned is not None else 0,
            accelerate_micro_batch=acc_m,
            accelerate_trials=len(trials),
            accelerate_trial_batches=trials,
            accelerate_time_to_working_batch_s=round(acc_s, 2),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    setup = dict(
        arch="llama",
        config=cfg.to_dict(),
        global_batch_size=gbs,
        seq_len=seq,
        case=asdict(case_at(1)) | {"micro_batch": "varies"},
        measured_peaks={str(k): v for k, v in truth_peaks.items()},
    )
    return dict(setup=setup, rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a subset of the accuracy matrix")
    ap.add_argument("--picker", action="store_true", help="run the picker benchmark instead")
    ap.add_argument("--out", type=Path, default=None, help="JSON output path")
    args = ap.parse_args()
    torch.set_num_threads(2)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    result = picker() if args.picker else accuracy(args.quick)
    name = "picker_cpu.json" if args.picker else "memory_accuracy_cpu.json"
    if args.quick and not args.picker:
        name = "memory_accuracy_cpu_quick.json"
    out = args.out or RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    result["meta"] = dict(
        started=started,
        wall_s=round(time.perf_counter() - t0, 1),
        command="python -m benchmarks.memory" + (" --picker" if args.picker else " --quick" if args.quick else ""),
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        cpu_threads=torch.get_num_threads(),
    )
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
