"""How the processes share the model: DDP, FSDP2 (applied here), or DeepSpeed ZeRO-2/3.

The engine is chosen the way users choose it, by the Accelerate config of the launch
(`accelerate launch --config_file recipes/accelerate/fsdp2.yaml ...`), which the launcher hands to the script
in environment variables (`ACCELERATE_USE_FSDP`, `FSDP_VERSION`, `ACCELERATE_USE_DEEPSPEED`,
`ACCELERATE_DEEPSPEED_ZERO_STAGE`); they are read once, here.

* DDP and DeepSpeed go through `Accelerator.prepare`. DeepSpeed's config gets the planned micro-batch,
  accumulation and the recipe's clipping before `prepare`; the engine then owns accumulation, clipping and
  the update (`backward`/`step` below tell it where the window ends).
* FSDP2 is applied by llmtune itself, as torchtitan's `parallelize` does: `fully_shard` each decoder block,
  then the root. Accelerate's own FSDP path would wrap the loss wrapper (no `_no_split_modules`) as one
  unit - the whole model gathered for the whole step - and it runs only on GPUs; this one runs on CPUs
  (gloo) too, so it is tested there. The root is `CausalLMWithLoss`, the module the loop calls: its
  forward gathers the embeddings, final norm and lm_head, so the chunked loss, which reads
  `lm_head.weight` outside lm_head's own forward, sees the full weight. Checkpoints are sharded with
  `torch.distributed.checkpoint`; `full_state_dict` gathers `final/`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch.nn import Module
from torch.optim import Optimizer

from llmtune.errors import SetupError
from llmtune.model.blocks import decoder_blocks

log = logging.getLogger(__name__)

Engine = Literal["ddp", "fsdp2", "zero2", "zero3"]  # "ddp" also names a single process
# The memory estimator's name for each engine's sharding (llmtune.plan.settings.SHARDINGS).
SHARDING: dict[str, str] = {"ddp": "none", "fsdp2": "fsdp", "zero2": "zero2", "zero3": "zero3"}
DCP_DIR = "sharded"  # FSDP2 checkpoints: model and optimizer shards, one file per process


_fsdp_hidden = False  # this process set ACCELERATE_USE_FSDP to false after reading FSDP2 in it (prepare_launch)


def launched_engine() -> Engine:
    """The engine the launcher's Accelerate config asks for (a plain `python` run is "ddp", one process)."""
    env = os.environ
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
        if stage not in ("2", "3"):
            raise SetupError(f"DeepSpeed zero_stage {stage or '(unset)'}: llmtune runs ZeRO stages 2 and 3")
        return "zero2" if stage == "2" else "zero3"
    fsdp = env.get("ACCELERATE_USE_FSDP", "").lower()
    if fsdp == "true" or (fsdp == "false" and _fsdp_hidden):
        if env.get("FSDP_VERSION", "1") != "2":
            raise SetupError("the launcher's FSDP config asks for FSDP1; llmtune runs FSDP2: set fsdp_version: 2")
        for key, why in (
            ("FSDP_OFFLOAD_PARAMS", "fsdp_offload_params: llmtune's FSDP2 keeps parameters on the device"),
            ("FSDP_ACTIVATION_CHECKPOINTING", "fsdp_activation_checkpointing: use training.gradient_checkpointing"),
        ):
            if env.get(key, "false").lower() == "true":
                raise SetupError(f"the launcher's FSDP config sets {why}")
        return "fsdp2"
    return "ddp"


def prepare_launch(engine: Engine, device_type: str, timeout: float) -> dict[str, Any]:
    """Set this process up for the engine on this device, and return the Accelerator's keyword arguments that make
    the processes form a real group there, with the recipe's collective timeout (seconds)."""
    group = {"timeout": timedelta(seconds=timeout)}
    if device_type == "cpu":
        # Accelerate and transformers import DeepSpeed wherever it is installed (unwrapping a model to save it),
        # which then warns that it found no GPU ("Setting accelerator to CPU") unless told it is on a CPU.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if is_deepspeed(engine):
        if device_type != "cpu":
            return {"kwargs_handlers": [InitProcessGroupKwargs(**group)]}
        deepspeed_over_gloo()
        # DeepSpeed on CPUs: gloo, and no cpu=True (with it Accelerate drops DeepSpeed; platform notes).
        return {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo", **group)]}
    if engine == "fsdp2":
        # Sharding is applied in `shard_fsdp2`; Accelerate must only form the group (MULTI_CPU / MULTI_GPU), and
        # transformers must load the whole model on every process. The next run of the process (a launch may train
        # several) still reads FSDP2 from it (launched_engine).
        global _fsdp_hidden
        os.environ["ACCELERATE_USE_FSDP"], _fsdp_hidden = "false", True
    # Without cpu=True a CPU-only multi-process launch trains each process alone (platform notes).
    return {"cpu": device_type == "cpu", "kwargs_handlers": [InitProcessGroupKwargs(**group)]}


def engine_in_use(engine: Engine) -> Engine:
    """The engine the run trains with once the Accelerator formed the group: FSDP2 in one process without a process
    group (on CPUs) has nothing to shard across, and runs as DDP's single process."""
    if engine == "fsdp2" and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return "ddp"
    return engine


def deepspeed_over_gloo() -> None:
    """On CPUs, DeepSpeed's collectives go through gloo, as DDP's and FSDP2's do, without its shared-memory kernel.

    DeepSpeed compiles that kernel with g++ when it first forms the group (35 s on a 2-core native-bf16 EPYC, ~3 min
    on an AVX2 one; again whenever the torch version changes) to speed up all-reduce on a multi-core host: no gain
    for the toy CPU runs that test an engine's path, and a compiler a user's laptop may lack. Marking the op
    incompatible is how DeepSpeed itself skips it (`build_shm_op`); its probe result is one cached dict.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


T = TypeVar("T")


def reshards_after_forward() -> bool:
    """FSDP2's blocks free their gathered weights after forward (the launcher's `fsdp_reshard_after_forward`, on by
    default); off, each stays gathered from forward to backward: one all-gather fewer a step, for the memory."""
    return os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() != "false"


def sharding_of(engine: Engine) -> str:
    """The memory estimator's name for the launched engine's sharding (`SHARDING`; FSDP2 as it reshards)."""
    return "fsdp_no_reshard" if engine == "fsdp2" and not reshards_after_forward() else SHARDING[engine]


def decided_by_main(acc: Accelerator, decide: Callable[[], T]) -> T:
    """`decide()` on the main process only, its result sent to every process: a decision that feeds a collective (a
    plan, a cache hit, a file's content) must not come from each process's own clock or disk."""
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([decide() if acc.is_main_process else None])[0]


def weights_dtype(engine: Engine, precision: str) -> torch.dtype | None:
    """The dtype the engine casts the weights' parameters to for mixed precision (FSDP2's MixedPrecisionPolicy for its
    forward, DeepSpeed at `prepare`; both leave buffers such as rotary tables as they are); None where the weights
    compute as stored (DDP: autocast casts op by op; bf16-true and fp32)."""
    if engine == "ddp":
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def shard_fsdp2(model: torch.nn.Module, precision: str) -> None:
    """`fully_shard` every decoder block, then the root (in place); before the optimizer is built.

    Mixed precision is FSDP2's own: blocks compute in bf16/fp16 from gathered copies of the fp32 shards,
    gradients are reduced in fp32 (`MixedPrecisionPolicy`), so no autocast and no weight-copy cache.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if precision == "fp16":
        # FSDP2 with fp16 needs a sharded loss scaler that Accelerate's GradScaler is not.
        raise SetupError("training.precision=fp16 under FSDP2 is not supported; use bf16 (or fp32)")
    compute = weights_dtype("fsdp2", precision)
    # Gradients are reduced in fp32 whatever the weights' dtype, bf16-true's included (as torchtitan): a bf16 sum over
    # many processes keeps 8 mantissa bits. FSDP2 takes fp32 for fp32 weights as no cast at all.
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    blocks = decoder_blocks(model)
    for block in blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshards_after_forward())
    # The root keeps its parameters gathered after forward: backward needs them at once. Its float inputs stay as
    # given: the only ones are a preference batch's reference log-probs, which bf16 would round by up to ~0.5 (a
    # DPO logit off by beta x that); the blocks still cast what they take in.
    root_policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32, cast_forward_inputs=False)
    fully_shard(model, mp_policy=root_policy, reshard_after_forward=False)
    log.info("FSDP2: %d %s blocks and the root sharded", len(blocks), type(blocks[0]).__name__)


def configure_deepspeed(
    acc: Accelerator, micro_batch_size: int, grad_accum_steps: int, max_grad_norm: float, hidden_size: int
) -> None:
    """Give the DeepSpeed engine the memory plan and the recipe's clipping before `prepare`.

    Accelerate would otherwise refuse "auto" micro-batches without a dataloader and clip at 1.0.
    Bucket sizes not set in the config follow the model, as Accelerate's "auto" does: DeepSpeed's
    defaults (5e8-element fp32 buckets: 1.9 GiB per process) are sized for large models on GPUs, and its
    persistence threshold (1e5 elements) would leave a small model's weights whole under ZeRO-3.
    """
    cfg = acc.state.deepspeed_plugin.deepspeed_config
    zero = cfg.setdefault("zero_optimization", {})
    for key, size in (
        ("reduce_bucket_size", hidden_size * hidden_size),
        ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
        ("stage3_param_persistence_threshold", 10 * hidden_size),
    ):
        if zero.get(key, "auto") == "auto":
            zero[key] = size
    cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    cfg["gradient_accumulation_steps"] = grad_accum_steps
    cfg["train_batch_size"] = micro_batch_size * grad_accum_steps * acc.num_processes
    cfg["gradient_clipping"] = max_grad_norm  # 0 turns clipping off, as in the recipe
    acc.gradient_accumulation_steps = grad_accum_steps


def is_deepspeed(engine: Engine) -> bool:
    return engine in ("zero2", "zero3")


@contextlib.contextmanager
def micro_step(acc: Accelerator, engine: Engine, model: torch.nn.Module, last: bool) -> Iterator[None]:
    """Around one micro-batch's forward and backward: gradients are synchronised on the window's last only.

    DDP skips its all-reduce (`no_sync`); DeepSpeed is told where its accumulation boundary is (it then
    updates inside the last backward, before the loop sees the window's loss: under DeepSpeed a non-finite
    loss is counted but not kept out of the update, except by fp16's own loss scaler). FSDP2
    reduce-scatters every micro-batch into the sharded gradients: skipping that would keep whole
    unsharded gradients alive (DDP's memory), which is what sharding is for.
    """
    if is_deepspeed(engine):
        acc.sync_gradients = last  # Accelerate's backward then runs the engine's step only at the boundary
        yield
        return
    with contextlib.nullcontext() if last or engine == "fsdp2" else acc.no_sync(model):
        yield


def backward(acc: Accelerator, engine: Engine, loss: torch.Tensor) -> None:
    # The loop normalises the loss by the window's tokens itself; DeepSpeed would divide by accumulation again.
    acc.backward(loss, **({"scale_wrt_gas": False} if is_deepspeed(engine) else {}))


def can_redo_step(acc: Accelerator, engine: Engine) -> bool:
    """Whether a window that ran out of memory in a forward or backward can be redone in place, smaller: with
    several processes the others may wait in a collective this one will never join; DeepSpeed keeps the window's
    gradients in its own partitioned buffers, which its Accelerate wrapper's `zero_grad` (a no-op) does not clear,
    and steps inside the last backward: a redone step would add the failed window's partial gradients to its own
    (measured: another update than the step asked for)."""
    return acc.num_processes == 1 and not is_deepspeed(engine)


def skips_nonfinite_updates(acc: Accelerator, engine: Engine) -> bool:
    """Whether the update keeps inf/nan gradients out of the weights itself: fp16's loss scaler skips such an
    update; DeepSpeed stepped in its backward already (its own scaler, under fp16)."""
    return acc.scaler is not None or is_deepspeed(engine)


def clip_grad_norm(acc: Accelerator, engine: Engine, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to the recipe's norm; returns the norm before clipping, on the device (read with the step's other figures:
    `float()` here would wait for the device). With clipping off (max_norm <= 0) the norm is still measured: a
    non-finite one keeps the update out of the weights (train_step). DeepSpeed reports nan then."""
    if is_deepspeed(engine):
        # The engine clipped (config `gradient_clipping`) and stepped at the boundary; it reports the norm, a tensor
        # (read by the engine itself, not Accelerate's wrapper, whose `.item()` waits) or a float (`full` writes it
        # on the device as a kernel's argument, where a tensor made from it would be a copy that waits).
        norm = acc.deepspeed_engine_wrapped.engine.get_global_grad_norm()
        if isinstance(norm, torch.Tensor):
            return norm.detach().float().reshape(())
        return torch.full((), math.nan if norm is None else float(norm), device=acc.device)
    if max_norm <= 0:
        max_norm = math.inf
    if engine == "fsdp2":
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        # A DTensor with a partial (per-shard) norm: full_tensor() all-reduces it to the global norm.
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), max_norm, norm)
        return norm
    return acc.clip_grad_norm_(model.parameters(), max_norm)


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> torch.Tensor | None:
    """Step. Under fp16's loss scaler, returns [the scale the step ran at, 1 where the scaler skipped the update for
    inf/nan gradients] on the device, for the step's one read (`get_scale()` before and after would each wait for
    the device); None without a scaler (`step_was_skipped` then tells DeepSpeed's own skips).

    Accelerate's `optimizer_step_was_skipped` misses a skip for fused optimizers: GradScaler hands them the inf flag
    and the fused kernel skips internally, so the step still counts as taken. The scaler lowers its scale exactly
    when it found inf/nan (it only ever grows otherwise), so the scale tells.
    """
    if scaler is None or not scaler.is_enabled():
        optimizer.step()
        return None
    # The scale tensor `get_scale()` reads (it exists once `scale` has scaled a loss); `update` changes it in place.
    before = scaler._get_scale_async().clone()
    optimizer.step()
    return torch.stack([before, (scaler._get_scale_async() < before).float()])


def step_was_skipped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether DeepSpeed's engine skipped the update it took in the window's last backward (its own loss scaler):
    Accelerate's flag, on the host."""
    return bool(getattr(optimizer, "step_was_skipped", False))


def host_group(acc: Accelerator, timeout_s: float) -> Any:
    """The processes' group over host memory (gloo) for the small agreements the loop makes every step (the window's
    token counts, a stop): summed there they never wait on the device, where the same sum costs a copy of host ints
    to the device and one back, each waiting for every kernel queued before it. None in one process (nothing to
    agree on). A collective: every process calls it, in the same order (`llmtune.run.launch.launch`)."""
    if acc.num_processes == 1:
        return None
    return torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def sum_on_host(values: list[int], group: Any) -> list[int]:
    """`values` summed over the processes of `host_group` (None: this process's own)."""
    if group is None:
        return values
    summed = torch.tensor(values, dtype=torch.int64)
    torch.distributed.all_reduce(summed, group=group)
    return summed.tolist()


def close_host_group(group: Any) -> None:
    """The group's resources freed when its run ends (a launch may train several recipes)."""
    if group is not None and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group(group)


def full_state_dict(
    acc: Accelerator, engine: Engine, model: torch.nn.Module, trainable_only: bool = False
) -> dict[str, Any] | None:
    """The whole model's weights on the main process (every process must call this); with `trainable_only`, the
    trained ones only (adapters: under FSDP2 a frozen 70B base gathered to save them took ~140 GB of host RAM)."""
    if engine == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        return get_model_state_dict(model, options=options)
    return acc.get_state_dict(model)


def local_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this process holds: its shards under FSDP2 / ZeRO-3, everything otherwise."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor holds its shard
        # ZeRO-3 leaves an empty tensor in the module; this process's partition is `ds_tensor`.
        local = getattr(p, "ds_tensor", local)
        total += local.numel() * local.element_size()
    return total


def optimizer_updates(optimizer: torch.optim.Optimizer) -> int:
    """Updates the innermost torch optimizer has applied (its AdamW `step` state), through Accelerate's and
    DeepSpeed's wrappers: what really happened, whatever the loop believes it asked for."""
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    steps = [int(state["step"]) for state in inner.state.values() if "step" in state]
    return max(steps, default=0)


# ---------------------------------------------------------------- FSDP2 checkpoints (torch.distributed.checkpoint)


def _dcp_options(trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Under PEFT only what trains is saved, as for the other engines (checkpoint.save_trainable_only).
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def save_state(acc: Accelerator, folder: Path, engine: Engine, model: Module, opt: Optimizer, peft: bool) -> None:
    """Model, optimizer, scaler and RNG states into `folder` (all processes): FSDP2's model and optimizer as shards
    (`sharded/`), the rest through Accelerate. Under PEFT only what trains is saved: DeepSpeed leaves the frozen base
    out itself, the other engines through `checkpoint.save_trainable_only`."""
    if engine == "fsdp2":
        _save_sharded(model, opt, folder, peft)
    kwargs = {"exclude_frozen_parameters": peft} if is_deepspeed(engine) else {}
    acc.save_state(str(folder), **kwargs)


def load_state(acc: Accelerator, folder: Path, engine: Engine, model: Module, opt: Optimizer, peft: bool) -> None:
    """What `save_state` wrote, in place; not strict under PEFT, whose checkpoints hold no frozen base."""
    if engine == "fsdp2":
        _load_sharded(model, opt, folder, peft)
    strict = {"load_module_strict" if is_deepspeed(engine) else "strict": not peft}
    acc.load_state(str(folder), **strict)


def _save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, trainable_only: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_dcp_options(trainable_only))
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder / DCP_DIR))


def _load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, trainable_only: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = _dcp_options(trainable_only)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(folder / DCP_DIR))  # in place, into this process's shards
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options
    )
