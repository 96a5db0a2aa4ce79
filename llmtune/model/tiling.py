"""Each decoder layer's MLP computed over the sequence in tiles (ALST's tiled MLP, arXiv 2506.13996).

At long rows the MLP's [tokens, intermediate] activations dominate a layer: Llama-3.1-8B's gate, up and act*up are
3 x 14336 numbers a token against 4096 for the residual stream, and their gradients as many again in backward.
Tiled, the MLP runs on `mlp_tiles` slices of the flattened tokens, each under non-reentrant checkpointing: forward
keeps only each tile's input (a view of the MLP's input, alive anyway) and output, and backward recomputes one tile
at a time, so the intermediates exist for one tile only, in forward and in backward. The cost is one more forward
of the MLP (a third of its FLOPs again; a fifth with full checkpointing, which already recomputes it once).

Why checkpointing per tile rather than ALST's custom autograd Function (DeepSpeed's `TiledMLP`, Liger's copy), which
runs `torch.autograd.backward` per tile inside its own backward: every tile here is an ordinary node of the one
autograd graph. Each weight's gradient is the sum of its tiles' contributions, made by autograd before the
weight's AccumulateGrad runs once, so DDP's reducer and FSDP2's post-backward see one gradient a step (the Function
form fires them per tile: Liger keeps a DDP-only variant, DeepSpeed hooks ZeRO). PEFT's adapters inside the MLP,
an outer checkpoint of the decoder layer (nested non-reentrant checkpoints recompute inside the recomputation) and
Ulysses' all-to-alls (around attention, outside the MLP) compose without a line of their own here. Autograd runs
the most recently created node first, so after the concatenation's backward it finishes the last tile's chain,
recomputation included, before it starts the one before (counted in tests/test_tiling.py).

The MLP must be token-wise, each output row a function of the same input row alone: dense MLPs are, and so are
routed experts whose router decides per token. Results are those of the untiled MLP within float noise: each output
row is computed alike, but a weight's gradient sums its tiles' partial products in another order than one matmul.

Under `training.compile` the tile count is a Python int read from the row's length: each distinct count traces and
compiles the block again (8, 10 and 16 tiles took ~20 s each on a CPU), and past torch's recompile limit (8) the
block runs eagerly. Rows of one length (packed to `max_length`) compile once.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from llmtune.errors import SetupError
from llmtune.model.blocks import decoder_blocks


def mlp_tiles(tokens: int, hidden_size: int) -> int:
    """ALST's rule: tiles of at most `hidden_size` tokens, so a tile's [tile, intermediate] activation is the size of
    one of the MLP's weight matrices; 1 (not tiled) for rows no longer than the hidden size."""
    return max(1, math.ceil(tokens / hidden_size))


class TiledForward:
    """An MLP's own forward, run on the flattened tokens tile by tile, each tile checkpointed."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.forward = forward  # the MLP's bound forward: its projections are looked up at call time (PEFT's too)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        tiles = mlp_tiles(x.shape[:-1].numel(), x.shape[-1])
        if tiles == 1:  # short rows: no checkpoint frame, no RNG state kept, no concatenation
            return self.forward(x)
        flat = x.reshape(-1, x.shape[-1])
        # The RNG state is kept per tile (preserve_rng_state, the default) so that adapters' dropout recomputes the
        # same mask; 5 KB on a CPU, the generator's seed and offset on a GPU.
        out = [checkpoint(self.forward, part, use_reentrant=False) for part in flat.tensor_split(tiles)]
        if not isinstance(out[0], torch.Tensor):  # e.g. an MoE block's (hidden states, router logits)
            raise SetupError(
                f"parallel.tiled_mlp: the MLP returns {type(out[0]).__name__}, not one tensor of tokens to join;"
                " set parallel.tiled_mlp: false"
            )
        return torch.cat(out).unflatten(0, x.shape[:-1])


def tile_mlp(model: torch.nn.Module) -> int:
    """Tile the MLP (`block.mlp`) of every decoder block in place; returns how many. Idempotent.

    Only each MLP's `forward` changes (an instance attribute): module names and state-dict keys stay as they were,
    so checkpoints, adapters and FSDP2's per-block sharding see the same model. Works on any causal LM whose blocks
    `llmtune.model.blocks.decoder_blocks` finds, plain or inside a peft model, on real, meta or fake tensors: the memory
    estimator applies it to the model it traces (after `apply_checkpointing`, as `parallelize.adapt` does), and the
    tile count follows the traced length, as in training. Raises SetupError for blocks without an `mlp`.
    """
    blocks = decoder_blocks(model, purpose="parallel.tiled_mlp", remedy="set parallel.tiled_mlp: false")
    mlps = [getattr(block, "mlp", None) for block in blocks]
    if any(not isinstance(mlp, torch.nn.Module) for mlp in mlps):
        raise SetupError(
            f"parallel.tiled_mlp: {type(blocks[0]).__name__} has no `mlp` module to tile; set parallel.tiled_mlp: false"
        )
    for mlp in mlps:
        if not isinstance(mlp.forward, TiledForward):
            _check_one_input(mlp)
            mlp.forward = TiledForward(mlp.forward)
    return len(mlps)


def _check_one_input(mlp: torch.nn.Module) -> None:
    """Tiles split one tensor: an MLP whose forward needs more (a mask, routing state) cannot be tiled blindly."""
    required = [
        p
        for p in inspect.signature(mlp.forward).parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if len(required) != 1:
        names = ", ".join(p.name for p in required)
        raise SetupError(
            f"parallel.tiled_mlp: {type(mlp).__name__}.forward takes ({names}), not one tensor of tokens to split;"
            " set parallel.tiled_mlp: false"
        )
