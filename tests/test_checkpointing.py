"""Partial and selective activation checkpointing compute what no checkpointing computes (issue 17, item 4).

Model level: one forward/backward of a tiny model (6 decoder layers, fp32, CPU, a packed batch) with
`llmtune.model.blocks.apply_checkpointing` and without it; the loss and the gradient of every trainable parameter must
agree to 1e-6 -- for every k-th layer (k = 1, 2, 3) and selective, on Llama and Qwen2, with dropout (GPT-2,
Llama), under LoRA, and with compiled blocks. On CPU in fp32 a recomputation runs the same kernels on the same
inputs, so the results are in fact bitwise equal. Equal gradients alone would also pass if checkpointing did
nothing, so each test also checks what was recomputed: forward pre-hooks on the children of every decoder layer
count the layers run again in backward (exactly layers 0, k, 2k, ...), and a dispatch mode counts the aten ops
backward runs: selective checkpointing must re-run exactly the element-wise ops full checkpointing re-runs and
none of the matmuls or attention. Inside compiled blocks, where neither can look, the bytes saved for backward
show it.

Launch level: 2 processes (DDP, FSDP2) with `{every_n_layers: 2}` or `selective` against 1 process without
checkpointing, with the scale-out tests' recipe and launcher (tests/test_scale_out.py).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import test_scale_out
import torch
from test_distributed import RUNS
from test_memory import real_batch, tiny_config
from test_scale_out import STEPS, assert_same_losses, final_tensors, launch, then, write_recipe
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from llmtune.model.adapters import apply_peft
from llmtune.model.blocks import apply_checkpointing, compile_blocks, decoder_blocks
from llmtune.recipe import Checkpointing, PeftConfig, load_recipe
from llmtune.run.loop import train

LAYERS = 6
TOL = dict(atol=1e-6, rtol=1e-6)
NONE = Checkpointing(0)
PARTIAL = [Checkpointing(1), Checkpointing(2), Checkpointing(3)]
SELECTIVE = [Checkpointing(1, selective=True), Checkpointing(2, selective=True)]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Kernels of a 64-wide model are too small to share between threads, and on a busy 2-core machine a second
    OpenMP thread waits for a core: these steps took 0.05 s on one thread and 0.4-4 s on two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def spec_id(spec: Checkpointing) -> str:
    return f"every{spec.every_n_layers}" + ("-selective" if spec.selective else "")


def is_matmul(op: torch._ops.OpOverload) -> bool:
    """What selective checkpointing must keep, named here rather than read from llmtune.model.blocks, so that an op
    missing from its list shows up as a recomputed matmul."""
    name = op.name()
    if name.startswith("aten::_scaled_dot_product"):
        return not name.endswith("_backward")
    return name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm")


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run while it is active (selective checkpointing's cached ops never reach it:
    its own mode, entered later around the recomputation, answers them first)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Step:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    recomputed: list[int]  # decoder layers whose forward ran again in backward
    backward_ops: collections.Counter
    saved: int  # bytes autograd kept for backward (selective checkpointing's cache aside: it keeps its own)

    def matmuls(self) -> int:
        return sum(n for op, n in self.backward_ops.items() if is_matmul(op))

    def others(self) -> collections.Counter:
        return collections.Counter({op: n for op, n in self.backward_ops.items() if not is_matmul(op)})


def tiny_model(arch: str, **config) -> torch.nn.Module:
    """`tiny_config(arch)` with LAYERS layers, seeded weights, sdpa, training mode."""
    cfg = tiny_config(arch, layers=LAYERS)
    cfg.update(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    return model.train()


def step(model: torch.nn.Module, *, seed: int = 0, count: bool = True) -> Step:
    """One forward/backward of a fixed packed batch; the RNG seeded just before (dropout). `count`: count the
    layers and ops recomputed (not in compiled blocks: hooks would be traced into the graph, and a dispatch mode
    cannot run the compiled backward's higher-order ops)."""
    calls: collections.Counter = collections.Counter()
    handles = []
    if count:
        for i, block in enumerate(decoder_blocks(model)):
            handles += [c.register_forward_pre_hook(lambda *_, i=i: calls.update([i])) for c in block.children()]
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**real_batch(2, 32, "packed")).loss
    forward = calls.copy()
    ops = OpCounter()
    with ops if count else contextlib.nullcontext():
        loss.backward()
    for h in handles:
        h.remove()
    recomputed = [i for i in sorted(calls) if calls[i] != forward[i]]
    assert all(calls[i] == 2 * forward[i] for i in recomputed), (forward, calls)  # at most once again
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.grad is not None for p in trainable.values())
    grads = {n: p.grad.detach().clone() for n, p in trainable.items()}
    return Step(loss.detach(), grads, recomputed, ops.counts, sum(saved.values()))


DROPOUT = {
    "gpt2": lambda p: {"resid_pdrop": p, "embd_pdrop": p, "attn_pdrop": p},
    "llama": lambda p: {"attention_dropout": p},
}


@functools.cache
def run(arch: str, spec: Checkpointing, dropout: float = 0.0, seed: int = 0) -> Step:
    config = DROPOUT[arch](dropout) if dropout else {}
    model = tiny_model(arch, **config)
    apply_checkpointing(model, spec)
    return step(model, seed=seed)


def assert_same(got: Step, want: Step, tol: dict = TOL) -> None:
    torch.testing.assert_close(got.loss, want.loss, **tol)
    assert got.grads.keys() == want.grads.keys()
    for name, grad in want.grads.items():
        torch.testing.assert_close(got.grads[name], grad, **tol, msg=lambda m, name=name: f"{name}: {m}")


def checkpointed(spec: Checkpointing) -> list[int]:
    return list(range(0, LAYERS, spec.every_n_layers))


def assert_equal_to_none(arch: str, spec: Checkpointing, dropout: float = 0.0) -> None:
    """Same loss and gradients as without checkpointing, and the layers and ops recomputed that `spec` says."""
    got, none = run(arch, spec, dropout), run(arch, NONE, dropout)
    assert_same(got, none)
    assert none.recomputed == []
    assert got.recomputed == checkpointed(spec)
    assert got.others() != none.others()  # the element-wise ops did run again
    if spec.selective:
        # ... exactly those full checkpointing of the same layers re-runs, and no matmul or attention did.
        full = run(arch, Checkpointing(spec.every_n_layers), dropout)
        assert got.others() == full.others()
        assert got.matmuls() == none.matmuls() < full.matmuls()
    else:
        assert got.matmuls() > none.matmuls()
        assert got.saved < none.saved


@pytest.mark.parametrize("spec", PARTIAL + SELECTIVE, ids=spec_id)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_checkpointing_gives_the_losses_and_gradients_of_none(arch, spec):
    assert_equal_to_none(arch, spec)


@pytest.mark.gpu
def test_offloaded_checkpointing_gives_the_losses_and_gradients_of_none_on_cuda():
    """Offloading (CUDA only) moves what each checkpoint saves to pinned host memory and back: nothing else."""

    def cuda_step(spec: Checkpointing) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = tiny_model("llama").cuda()
        apply_checkpointing(model, spec)
        loss = model(**{k: v.cuda() for k, v in real_batch(2, 32, "packed").items()}).loss
        loss.backward()
        return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    (loss, grads), (want_loss, want_grads) = cuda_step(Checkpointing(1, offload=True)), cuda_step(NONE)
    torch.testing.assert_close(loss, want_loss, **TOL)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("spec", [Checkpointing(1), Checkpointing(2), Checkpointing(2, selective=True)], ids=spec_id)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_dropout_draws_the_same_masks_when_recomputed(arch, spec):
    """GPT-2: embedding, attention and residual dropout; Llama: attention dropout (inside sdpa). The recomputation
    must restore the RNG state of the forward, and leave it where the forward left it."""
    assert run(arch, NONE, 0.1).loss != run(arch, NONE, 0.1, seed=1).loss  # dropout is on: the seed matters
    assert_equal_to_none(arch, spec, 0.1)


@pytest.mark.parametrize(
    "spec", [Checkpointing(2), Checkpointing(1, selective=True), Checkpointing(3, selective=True)], ids=spec_id
)
def test_lora_adapters_get_the_gradients_of_none(spec):
    """Under LoRA the embeddings are frozen: layer 0, checkpointed, gets inputs that need no grad unless apply_peft
    makes them; its adapters would then get no gradient. Adapter dropout on, as recipes have it."""

    def adapted(spec: Checkpointing) -> Step:
        model = tiny_model("llama")
        apply_checkpointing(model, spec)
        model = apply_peft(model, PeftConfig(method="lora", rank=4, dropout=0.1), gradient_checkpointing=spec.enabled)
        torch.manual_seed(1)
        with torch.no_grad():  # lora_B starts at 0, which zeroes lora_A's gradient; give B values so both get one
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.02)
        return step(model)

    got, none = adapted(spec), adapted(NONE)
    assert got.grads and all("lora_" in n for n in got.grads)  # the adapters, and only they, train
    assert_same(got, none)
    assert got.recomputed == checkpointed(spec)
    layers = {int(n.split(".layers.")[1].split(".")[0]) for n, g in got.grads.items() if g.abs().sum() > 0}
    assert layers == set(range(LAYERS))


@functools.cache
def compiled_run(spec: Checkpointing) -> Step:
    model = tiny_model("llama")
    apply_checkpointing(model, spec)
    assert compile_blocks(model) == LAYERS  # load_model's order: checkpointing, then compile
    counters.clear()
    done = step(model, count=False)
    assert not counters["graph_break"], dict(counters["graph_break"])  # a break runs the whole block eagerly
    return done


@pytest.mark.slow
@pytest.mark.parametrize("spec", [Checkpointing(2), Checkpointing(2, selective=True)], ids=spec_id)
def test_compiled_blocks_with_partial_checkpointing_give_the_eager_losses_and_gradients(spec):
    got, compiled_none = compiled_run(spec), compiled_run(NONE)
    # Against eager without checkpointing: inductor's fused kernels (RMSNorm, softmax, rotary) reduce in their own
    # order, so compiled and eager differ by rounding (6e-8 measured here); 1e-5 allows for other CPUs' vector widths.
    assert_same(got, run("llama", NONE), dict(atol=1e-5, rtol=1e-5))
    # Against compiled without checkpointing: the same kernels, so 1e-6 (bitwise equal here).
    assert_same(got, compiled_none)
    # Hooks and dispatch modes cannot see inside the compiled blocks; what backward keeps can. Checkpointing every
    # 2nd layer keeps less than none, and selective keeps the matmul outputs that full recomputation drops.
    assert got.saved < compiled_none.saved
    if spec.selective:
        assert compiled_run(Checkpointing(2)).saved < got.saved


# ---------------------------------------------------------------- 2 processes (DDP, FSDP2) against 1 without


model_dir = test_scale_out.model_dir  # the fixture: conftest's tiny Llama (2 layers) with saved weights

# Counts, per process and run, the layers checkpointed and how often their forward ran (forward + recomputation).
COUNTING = """
import json, os
from pathlib import Path
import transformers.modeling_utils

counts = {"checkpointed": 0, "ran": 0}
real = transformers.modeling_utils.checkpoint
def checkpoint(function, *args, **kwargs):
    counts["checkpointed"] += 1
    def layer(*a, **k):
        counts["ran"] += 1
        return function(*a, **k)
    return real(layer, *args, **kwargs)
transformers.modeling_utils.checkpoint = checkpoint
def after_run(recipe):
    Path(recipe.output_dir, "counts-" + os.environ["RANK"]).write_text(json.dumps(counts))
    counts.update(checkpointed=0, ran=0)
"""
VALUES = {
    "every2": ("{every_n_layers: 2}", Checkpointing(2)),
    "selective": ("selective", Checkpointing(1, selective=True)),
}


@pytest.fixture(scope="module")
def unchecked(tmp_path_factory, model_dir, tiny_data) -> Path:
    """One process without checkpointing: the run each 2-process checkpointed run must reproduce."""
    folder = tmp_path_factory.mktemp("one-unchecked")
    recipe = write_recipe(folder, model_dir, tiny_data, "none")
    summary = train(load_recipe(recipe, ["training.gradient_checkpointing=false"]))
    assert not summary["gradient_checkpointing"]
    return folder / "run"


@pytest.fixture(scope="module")
def launched_checkpointing(tmp_path_factory, model_dir, tiny_data) -> Callable[[str], Path]:
    """engine -> the folder of its one launch (made on first use), which trains a run per entry of VALUES."""
    done: dict[str, Path] = {}

    def get(engine: str) -> Path:
        if engine not in done:
            folder = tmp_path_factory.mktemp(f"checkpointed-{engine}")
            recipe = write_recipe(folder, model_dir, tiny_data, "none", engine)
            (entry := folder / "counting_entry.py").write_text(COUNTING + RUNS)
            every2, selective = (f"training.gradient_checkpointing={value}" for value, _ in VALUES.values())
            more = then(recipe, folder / "selective", selective)
            proc = subprocess.run(
                launch(recipe, folder / "every2", engine, every2, *more, script=entry),
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert proc.returncode == 0, proc.stderr[-4000:]
            done[engine] = folder
        return done[engine]

    return get


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(VALUES))
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_two_processes_checkpointing_partially_or_selectively_equal_one_without(
    engine, name, unchecked, launched_checkpointing, model_dir
):
    run, spec = launched_checkpointing(engine) / name, VALUES[name][1]
    summary = json.loads((run / "run_summary.json").read_text())
    assert (summary["engine"], summary["num_processes"], summary["grad_accum_steps"]) == (engine, 2, 2)
    assert summary["checkpointing"] == asdict(spec)
    # Each process runs STEPS x 2 micro-batches; each checkpoints layers 0, k, ... (of 2) and runs them again in
    # backward: checkpointing happened under DDP and under FSDP2's hooks, and on the layers the recipe names.
    layers = len(range(0, AutoConfig.from_pretrained(model_dir).num_hidden_layers, spec.every_n_layers))
    for rank in (0, 1):
        counts = json.loads((run / f"counts-{rank}").read_text())
        assert counts == {"checkpointed": STEPS * 2 * layers, "ran": STEPS * 2 * layers * 2}, rank
    assert_same_losses(run, unchecked)  # to 1e-4, as every 2-process test: gloo sums gradients in another order
    got, want = final_tensors(run), final_tensors(unchecked)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].sub(tensor).abs().max() < 1e-4, name
