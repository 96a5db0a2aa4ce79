"""Partial and selective activation checkpointing compute what no checkpointing computes (issue 17, item 4).

Each test runs one forward/backward of a tiny model (6 decoder layers, fp32, CPU, a packed batch) with
`llmtune.model.apply_checkpointing` and without it, and compares the loss and the gradient of every trainable
parameter to 1e-6. On CPU in fp32 a recomputation runs the same kernels on the same inputs, so the results are
in fact bitwise equal; 1e-6 leaves room for nothing but reduction order. Equal gradients alone would also pass
if checkpointing did nothing, so each test also checks what was recomputed: forward hooks on the children of
every decoder layer count the layers run again in backward (layers 0, k, 2k, ...), and a dispatch mode counts
the aten ops backward runs, so selective checkpointing must re-run the element-wise ops of full checkpointing
and none of its matmuls.
"""

from __future__ import annotations

import collections
import functools
import json
import subprocess
from dataclasses import dataclass

import pytest
import torch
from test_memory import real_batch, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from llmtune.model import apply_checkpointing, apply_peft, compile_blocks, decoder_blocks
from llmtune.recipe import Checkpointing, PeftConfig

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
    """What selective checkpointing must keep, named here rather than read from llmtune.model, so that an op
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
    """One forward/backward of a fixed packed batch; the RNG seeded just before (dropout)."""
    calls: collections.Counter = collections.Counter()
    handles = []
    if count:  # (hooks inside compiled blocks would be traced into the graph, not counted)
        for i, block in enumerate(decoder_blocks(model)):
            handles += [c.register_forward_pre_hook(lambda *_, i=i: calls.update([i])) for c in block.children()]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**real_batch(2, 32, "packed")).loss
    forward = calls.copy()
    with OpCounter() as ops:
        loss.backward()
    for h in handles:
        h.remove()
    recomputed = [i for i in sorted(calls) if calls[i] != forward[i]]
    assert all(calls[i] == 2 * forward[i] for i in recomputed), (forward, calls)  # at most once again
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.grad is not None for p in trainable.values())
    return Step(loss.detach(), {n: p.grad.detach().clone() for n, p in trainable.items()}, recomputed, ops.counts)


@functools.cache
def run(arch: str, spec: Checkpointing, dropout: float = 0.0, seed: int = 0) -> Step:
    config = DROPOUT[arch](dropout) if dropout else {}
    model = tiny_model(arch, **config)
    apply_checkpointing(model, spec)
    return step(model, seed=seed)


DROPOUT = {
    "gpt2": lambda p: {"resid_pdrop": p, "embd_pdrop": p, "attn_pdrop": p},
    "llama": lambda p: {"attention_dropout": p},
}


def assert_same(got: Step, want: Step) -> None:
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    assert got.grads.keys() == want.grads.keys()
    for name, grad in want.grads.items():
        torch.testing.assert_close(got.grads[name], grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


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


@pytest.mark.parametrize("spec", PARTIAL + SELECTIVE, ids=spec_id)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_checkpointing_gives_the_losses_and_gradients_of_none(arch, spec):
    assert_equal_to_none(arch, spec)


@pytest.mark.parametrize("spec", [Checkpointing(1), Checkpointing(2), Checkpointing(2, selective=True)], ids=spec_id)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_dropout_draws_the_same_masks_when_recomputed(arch, spec):
    """GPT-2: embedding, attention and residual dropout; Llama: attention dropout (inside sdpa). The recomputation
    must restore the RNG state of the forward, and leave it where the forward left it."""
    assert run(arch, NONE, 0.1).loss != run(arch, NONE, 0.1, seed=1).loss  # dropout is on: the seed matters
    assert_equal_to_none(arch, spec, 0.1)
