"""The tiled MLP computes what the MLP computes, with its intermediates one tile at a time (issue 45, item 2).

One forward/backward of a tiny model (fp32, CPU, packed rows of 512 tokens, hidden 64: ALST's rule makes 8 tiles)
tiled and untiled, through `llmtune.run.parallelize.adapt` as training applies it: the loss and every gradient but the
MLP weights' are bitwise equal (each output row is computed alike); an MLP weight's gradient sums its tiles' partial
products in another order than one matmul does, so it agrees within float noise (1e-6). Equal results would also
pass if nothing were tiled, so forward pre-hooks count the calls of each MLP's first projection: once a tile in
forward and once again in backward (and again in the recomputation of a checkpointed layer).

Memory: a storage counter (llmtune.ops.measure.LiveStorageCounter) tags every tensor whose last dimension is the
MLP's intermediate width, the MLP's weights frozen (so that no weight gradient has that width), and keeps the peak
of those bytes across the step: with the decoder layers checkpointed it falls by the tile count.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from test_memory import real_batch, tiny_config
from transformers import AutoModelForCausalLM, OPTConfig

from llmtune.errors import SetupError
from llmtune.model.blocks import apply_checkpointing, decoder_blocks
from llmtune.model.tiling import mlp_tiles, tile_mlp
from llmtune.ops.measure import LiveStorageCounter, iter_baseline_tensors
from llmtune.recipe import Checkpointing, load_recipe
from llmtune.run.parallelize import adapt

SEQ = 512  # tokens of the packed row
TILES = 8  # ALST's rule at hidden 64
NONE, EVERY = Checkpointing(0), Checkpointing(1)
INTERMEDIATE = 172  # tiny_config's MLP width, which no other tensor of the model has


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Kernels of a 64-wide model are too small to share between threads (see tests/test_checkpointing.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    return model.train()


Calls = list[tuple[int, int]]  # by layer: (forward, backward) calls of the MLP's first projection


def step(model: torch.nn.Module, seq: int = SEQ) -> tuple[torch.Tensor, dict[str, torch.Tensor], Calls]:
    """Loss, gradients of the trainable parameters, and how often each layer's first MLP projection ran."""
    calls: collections.Counter = collections.Counter()
    handles = [
        next(block.mlp.children()).register_forward_pre_hook(lambda *_, i=i: calls.update([i]))
        for i, block in enumerate(decoder_blocks(model))
    ]
    model.zero_grad(set_to_none=True)
    loss = model(**real_batch(1, seq, "packed")).loss
    forward = calls.copy()
    loss.backward()
    for h in handles:
        h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, [(forward[i], calls[i] - forward[i]) for i in sorted(calls)]


def assert_same(tiled: dict[str, torch.Tensor], untiled: dict[str, torch.Tensor]) -> None:
    assert tiled.keys() == untiled.keys() and any(".mlp." in n for n in tiled)
    for name, grad in tiled.items():
        if ".mlp." in name:
            torch.testing.assert_close(grad, untiled[name], atol=1e-6, rtol=1e-6, msg=name)
        else:
            assert torch.equal(grad, untiled[name]), name


def test_alst_rule():
    assert mlp_tiles(SEQ, 64) == TILES
    assert [mlp_tiles(n, 64) for n in (1, 64, 65, 128, 129)] == [1, 1, 2, 2, 3]


@pytest.mark.parametrize("spec", [NONE, EVERY], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_full_fine_tuning_tiled_equals_untiled(arch, spec, tiny_recipe):
    recipe = load_recipe(tiny_recipe())
    loss, grads, calls = step(adapt(tiny_model(arch), recipe, spec, tiled_mlp=False))
    tiled_model = adapt(tiny_model(arch), recipe, spec, tiled_mlp=True)
    assert tile_mlp(tiled_model) == 2  # idempotent: a second call wraps nothing again
    tiled_loss, tiled_grads, tiled_calls = step(tiled_model)
    assert torch.equal(tiled_loss, loss)
    assert_same(tiled_grads, grads)
    assert calls == [(1, spec.enabled)] * 2
    # Each tile once in forward, once in its recomputation; with the layer checkpointed, again in the layer's, which
    # stops early after the last tile's input (torch's nested checkpoints recompute only what backward unpacks).
    assert tiled_calls == [(TILES, TILES + spec.enabled * (TILES - 1))] * 2


def test_lora_on_the_mlp_tiled_equals_untiled(tiny_recipe):
    """Tiling comes before PEFT in `adapt`: the adapters on gate/up/down_proj run tile by tile. Dropout 0: tiles
    draw their masks in another order than one call does (recomputation replays each tile's own, as torch keeps
    the RNG state per checkpoint)."""
    recipe = load_recipe(tiny_recipe(peft__method="lora", peft__rank=4, peft__dropout=0.0))

    def run(tiled: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], Calls]:
        model = adapt(tiny_model("llama"), recipe, EVERY, tiled_mlp=tiled)
        torch.manual_seed(1)
        with torch.no_grad():  # lora_B starts at 0, which zeroes lora_A's gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.02)
        return step(model)

    (loss, grads, _), (tiled_loss, tiled_grads, tiled_calls) = run(False), run(True)
    assert any("mlp.down_proj.lora_A" in n for n in grads) and all("lora_" in n for n in grads)
    assert torch.equal(tiled_loss, loss)
    assert_same(tiled_grads, grads)
    assert tiled_calls == [(TILES, 2 * TILES - 1)] * 2


def test_recipe_decides_when_adapt_is_not_told(tiny_recipe):
    def tiled(**overrides) -> Calls:
        return step(adapt(tiny_model("llama"), load_recipe(tiny_recipe(**overrides)), NONE))[2]

    assert tiled() == [(1, 0)] * 2  # auto: the planner's to decide; without a plan, off
    assert tiled(parallel__tiled_mlp=True) == [(TILES, TILES)] * 2


def test_short_rows_run_the_mlp_as_it_is():
    model = tiny_model("llama")
    tile_mlp(model)
    assert step(model, seq=64)[2] == [(1, 0)] * 2  # 64 tokens at hidden 64: one tile, no checkpoint


def test_a_copy_tiles_its_own_mlp():
    """A DPO reference is a deepcopy of the policy (objectives.base.frozen_copy): its tiled forward must call its
    own projections, not the policy's, which go on training."""
    model = tiny_model("llama")
    tile_mlp(model)
    loss = step(model)[0]
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for block in decoder_blocks(model):
            block.mlp.down_proj.weight.zero_()
    assert torch.equal(step(copied)[0], loss)
    assert not torch.equal(step(model)[0], loss)


class IntermediateCounter(LiveStorageCounter):
    """Live storages as LiveStorageCounter counts them, those of the MLP's intermediate width tagged apart, with
    the peak of that tag alone."""

    def __init__(self) -> None:
        super().__init__()
        self.intermediate_peak = 0

    def register(self, t: torch.Tensor, tag: str | None = None) -> None:
        wide = tag is None and isinstance(t, torch.Tensor) and t.ndim > 0 and t.shape[-1] == INTERMEDIATE
        super().register(t, "intermediate" if wide else tag)

    def _add(self, tag: str, nbytes: int) -> None:
        super()._add(tag, nbytes)
        self.intermediate_peak = max(self.intermediate_peak, int(self._by_tag.get("intermediate", 0)))


def intermediate_peak(spec: Checkpointing, tiled: bool) -> int:
    model = tiny_model("llama")
    apply_checkpointing(model, spec)
    if tiled:
        tile_mlp(model)
    for name, p in model.named_parameters():
        if ".mlp." in name:  # frozen: down_proj's weight gradient would have the intermediate's width too
            p.requires_grad_(False)
    counter = IntermediateCounter()
    for tag, t in iter_baseline_tensors([model]):
        counter.register(t, tag)
    batch = real_batch(1, SEQ, "packed")
    with counter:
        model(**batch).loss.backward()
    return counter.intermediate_peak


def test_intermediate_peak_falls_by_the_tile_count():
    """Checkpointed layers: one layer's gate, up, act and act*up with their gradients, untiled (6 x 512 x 172 x 4
    bytes), one tile's tiled. Without checkpointing the untiled forward keeps every layer's, so it falls further."""
    row = SEQ * INTERMEDIATE * 4  # one [tokens, intermediate] fp32 tensor
    checkpointed, checkpointed_tiled = intermediate_peak(EVERY, False), intermediate_peak(EVERY, True)
    assert checkpointed >= 4 * row
    assert checkpointed / checkpointed_tiled == pytest.approx(TILES, rel=0.05)
    assert intermediate_peak(NONE, False) / intermediate_peak(NONE, True) >= TILES


def test_refuses_blocks_without_an_mlp():
    opt = OPTConfig(hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    model = AutoModelForCausalLM.from_config(opt)
    with pytest.raises(SetupError, match=r"OPTDecoderLayer has no `mlp`.*parallel.tiled_mlp: false"):
        tile_mlp(model)
