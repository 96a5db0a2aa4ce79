"""The DPO reference where and as the policy computes: on the training device, at the policy's precision, under
every engine, for a model loaded from disk into host memory (as users load theirs).

On a CPU-only host the training device is host memory too, so a tensor left there goes unseen; here training is made
to think its device is torch's slot for an out-of-tree accelerator (`privateuseone`: a device other than host memory,
as a GPU is, whose tensors keep their data on the host), and every op of the setup and the first forward is refused
if it takes tensors from two devices, as CUDA refuses it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from test_scale_out import model_dir  # noqa: F401 (a fixture: the tiny Llama of conftest, weights saved)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from transformers.integrations import hub_kernels

from llmtune.data import batch_for_step
from llmtune.data.batch import to_device
from llmtune.errors import SetupError
from llmtune.recipe import load_recipe
from llmtune.run.batches import collate_for
from llmtune.run.loop import train
from llmtune.run.setup import build


@pytest.fixture
def recipe_of(tiny_recipe, model_dir, tmp_path):  # noqa: F811 (the fixture imported above)
    """A recipe training `objective` on test_scale_out's tiny Llama saved to disk (from_pretrained loads it to host
    memory): one step of 4 rows, one a micro-batch (the reference computed a row at a time then sees the shapes of the
    step: bf16 gives bit-equal results)."""
    from test_preference import write_pairs

    pairs = write_pairs(tmp_path / "pairs.jsonl", n=16)

    def make(objective: str = "dpo", **overrides) -> Path:
        data = [{"path": str(pairs), "format": "preference"}] if objective != "sft" else None
        defaults = {
            "model__name_or_path": str(model_dir),
            "training__objective": objective,
            "training__max_steps": 1,
            "training__micro_batch_size": 1,
            "training__global_batch_size": 4,
            "data__max_length": 96,
            **({"data__train": data} if data else {}),
        }
        return tiny_recipe(**(defaults | overrides))

    return make


def first_step(output_dir: Path) -> dict:
    return next(json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if "loss" in line)


@pytest.fixture
def fsdp2_one_process(monkeypatch, tmp_path):
    """FSDP2 in this process: a one-process gloo group and the environment `accelerate launch` sets for fsdp2.yaml."""
    dist = torch.distributed
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("engine", "reference"), [("ddp", "precomputed"), ("fsdp2", "precomputed"), ("fsdp2", "copy")])
def test_dpo_starts_at_zero_rewards_and_loss_ln2_in_bf16(engine, reference, recipe_of, tmp_path, request):
    """At step 0 the policy is the reference: rewards 0, loss ln 2, at any precision. The precomputed reference ran in
    fp32 without autocast, and the copy stayed fp32 under FSDP2's bf16 weights (and DeepSpeed's)."""
    if engine == "fsdp2":
        request.getfixturevalue("fsdp2_one_process")
    recipe = recipe_of(training__precision="bf16", preference__reference=reference)
    summary = train(load_recipe(recipe))
    assert summary["engine"] == engine
    step = first_step(tmp_path / "run")
    assert step["rewards_chosen"] == step["rewards_rejected"] == 0
    assert step["loss"] == pytest.approx(math.log(2), abs=1e-7)


def test_a_frozen_copy_under_zero3_is_refused_naming_what_to_use(recipe_of, monkeypatch):
    """ZeRO-3 loads the model partition by partition: the frozen copy held empty tensors that nothing gathers."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(SetupError, match=r"preference.reference=copy .* use preference.reference=precomputed"):
        build(load_recipe(recipe_of(preference__reference="copy")))


# ---------------------------------------------------------------- placement

DEVICE = torch.device("privateuseone", 0)  # what training is told its device is (its data kept in host memory)
TRANSFERS = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}  # the ops that move data between devices


class OnDevice(torch.Tensor):
    """A tensor that says it is on DEVICE; its data is a host tensor (`host`), on which each op runs."""

    @staticmethod
    def __new__(cls, host: torch.Tensor):
        host = host.detach()
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            host.shape,
            strides=host.stride(),
            storage_offset=host.storage_offset(),
            dtype=host.dtype,
            device=DEVICE,
        )
        out.host = host
        return out

    def __tensor_flatten__(self):
        return ["host"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return OnDevice(inner["host"])

    __torch_function__ = torch._C._disabled_torch_function_impl

    def tolist(self):  # a copy to the host, as on CUDA (torch has no op for it that a subclass could take)
        return self.host.tolist()

    def __repr__(self) -> str:  # as torch prints a device's tensor: its values, then where it is
        return f"{self.host!r} on {self.device}"

    def untyped_storage(self):  # the data's (FSDP2 frees and reallocates a gathered parameter's storage in place)
        return self.host.untyped_storage()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return HostBackedDevice.run(func, args, kwargs or {})


class HostBackedDevice(TorchDispatchMode):
    """DEVICE without the hardware: a tensor put there (`.to(DEVICE)`, `device=DEVICE`) is an OnDevice, and each op
    runs on the host data. An op that takes tensors from two devices is refused, as CUDA refuses it (a transfer aside;
    a 0-dim host tensor is a scalar, which CUDA accepts too): a tensor left in host memory fails here as on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.on_device: set = set()  # the ops that ran on DEVICE

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {t.device for t in tensors if t.dim() > 0 or t.device.type != "cpu"}
        if func not in TRANSFERS and len(devices) > 1:
            raise RuntimeError(f"{func}: tensors on {sorted(map(str, devices))}")
        if DEVICE in devices:
            self.on_device.add(func)
        return self.run(func, args, kwargs)

    @staticmethod
    def run(func, args, kwargs):
        wrappers = {id(t.host): t for t in tree_leaves((args, kwargs)) if isinstance(t, OnDevice)}
        to_device = kwargs.get("device") is not None and torch.device(kwargs["device"]) == DEVICE
        if to_device:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        host_args, host_kwargs = tree_map(lambda t: t.host if isinstance(t, OnDevice) else t, (args, kwargs))
        out = func(*host_args, **host_kwargs)
        on_device = to_device or (
            bool(wrappers) and "device" not in kwargs and func is not torch.ops.aten.copy_.default
        )

        def wrap(t):
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in wrappers:  # in place: the same tensor
                return wrappers[id(t)]
            return OnDevice(t) if on_device else t

        return tree_map(wrap, out)


@pytest.fixture
def on_device(monkeypatch):
    """Training on DEVICE: the Accelerator says so (prepare and every `.to(acc.device)` then use it). DEVICE is torch's
    slot for an out-of-tree accelerator, set up with the placeholders torch gives for one written in Python (its
    device guard, which indexing needs, as CUDA's); once per process, as torch allows."""
    from torch.utils import backend_registration as backends

    class Backend(backends._DummyBackendModule):
        def get_amp_supported_dtype(self) -> list[torch.dtype]:  # autocast asks, also to be told it is off
            return [torch.bfloat16, torch.float16]

        Stream, Event, StreamContext = torch.cpu.Stream, torch.cpu.Event, torch.cpu.StreamContext
        current_stream, stream, synchronize = map(
            staticmethod, (torch.cpu.current_stream, torch.cpu.stream, torch.cpu.synchronize)
        )

    if not hasattr(torch, "privateuseone"):
        backends._setup_privateuseone_for_python_backend(backend_module=Backend())
    monkeypatch.setattr(Accelerator, "device", property(lambda self: DEVICE))
    # transformers (5.25; 5.17 has no such hook) has the `kernels` library choose layer implementations for the
    # model's device type (on `train()` too); it knows no such device: the host's, where the data is.
    kernelize = getattr(hub_kernels, "_kernels_kernelize", None)
    if kernelize is not None:
        monkeypatch.setattr(
            hub_kernels, "_kernels_kernelize", lambda model, device, **kw: kernelize(model, device="cpu", **kw)
        )
    # torch.tensor(data, device=...) builds its tensor below the dispatch modes, which never see it: as data made on
    # the host, then moved there.
    tensor = torch.tensor

    def tensor_on(data, *args, device=None, **kwargs):
        if device is not None and torch.device(device) == DEVICE:
            return tensor(data, *args, **kwargs).to(DEVICE)
        return tensor(data, *args, device=device, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor_on)
    mode = HostBackedDevice()
    with mode:
        yield mode


ENGINES = ("ddp", "fsdp2", "zero2", "zero3")


@pytest.fixture
def on_engine(engine, on_device, monkeypatch, tmp_path):
    """`engine` in this process (a one-process gloo group and the environment `accelerate launch` sets for its config),
    on DEVICE as it is on a GPU: FSDP2's default mesh is the machine's accelerator, DeepSpeed's is its accelerator's.
    What it takes to get there without the hardware, each a step torch or DeepSpeed takes for CUDA another way:

    * FSDP2 moves a plain parameter with `tensor.data = tensor.to(device)`, which torch refuses from host memory to a
      device outside its list of dense backends (c10 `TensorImpl::has_compatible_shallow_copy_type`: CPU, CUDA, MPS,
      HIP, XPU, HPU, MTIA): here with `torch.utils.swap_tensors`, as FSDP2 does for a parameter of a tensor subclass;
    * DeepSpeed keeps weak references to every parameter (names for its debug messages), and `swap_tensors`, the only
      way to move a parameter to a device written in Python (`Module._apply` takes it), refuses an object with one;
    * ZeRO-3 puts `torch.tensor` back to the one it found at import, before the fake device's was set.
    """
    if engine == "ddp":
        yield
        return
    dist = torch.distributed
    if engine == "fsdp2":
        from torch.distributed.fsdp._fully_shard import _fsdp_init

        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
        monkeypatch.setenv("FSDP_VERSION", "2")
        monkeypatch.setattr(torch._C, "_get_accelerator", lambda: DEVICE)
        monkeypatch.setattr(_fsdp_init, "_move_states_to_device", move_by_swapping)
    else:
        from deepspeed.accelerator import real_accelerator
        from deepspeed.runtime import engine as deepspeed_engine
        from deepspeed.runtime.zero import partition_parameters
        from deepspeed.utils import groups

        environment = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "ACCELERATE_USE_DEEPSPEED": "true"}
        for key, value in (environment | {"ACCELERATE_DEEPSPEED_ZERO_STAGE": engine[-1]}).items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(real_accelerator, "ds_accelerator", deepspeed_accelerator())
        monkeypatch.setattr(deepspeed_engine, "debug_extract_module_and_param_names", lambda model: None)
        monkeypatch.setattr(partition_parameters, "_orig_torch_tensor", torch.tensor)
        for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP"):
            monkeypatch.setattr(groups, name, None)  # the group of an earlier test, destroyed since
    AcceleratorState._reset_state(reset_partial_state=True)  # Accelerate's process-wide state: this engine's
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)


def move_by_swapping(params: list, buffers: list, device: torch.device) -> None:
    """FSDP2's `_move_states_to_device`, each tensor swapped for its copy on `device` (the parameter object, its
    class, `requires_grad` kept)."""
    for tensor in [*params, *buffers]:
        if tensor.device == device:
            continue
        with torch.no_grad():
            moved = tensor.to(device)
            if isinstance(tensor, torch.nn.Parameter):
                moved = torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
        torch.utils.swap_tensors(tensor, moved)


def deepspeed_accelerator():
    """DeepSpeed's CPU accelerator (its streams and memory figures, no kernels to build) with DEVICE as its device."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    class OnDeviceAccelerator(CPU_Accelerator):
        def device_name(self, device_index=None) -> str:
            return DEVICE.type if device_index is None else f"{DEVICE.type}:{device_index}"

        def current_device_name(self) -> str:
            return str(DEVICE)

        def current_device(self) -> int:
            return DEVICE.index

    return OnDeviceAccelerator()


def held_on(model: torch.nn.Module) -> set[torch.device]:
    """Where the model's parameters keep their data: FSDP2's local shards, ZeRO-3's partitions, else the tensors."""
    local = (getattr(p, "ds_tensor", p.to_local() if hasattr(p, "to_local") else p) for p in model.parameters())
    return {t.device for t in local}


def engine_cases(cases: list[tuple]) -> list:
    """`cases` under every engine; ZeRO-3 refuses a frozen copy (its empty partitions): not run there."""
    return [
        pytest.param(engine, *case, id="-".join([engine, *map(str, case)]))
        for engine in ENGINES
        for case in cases
        if not (engine == "zero3" and "copy" in case)
    ]


@pytest.mark.parametrize(
    ("engine", "objective", "reference", "method"),
    engine_cases(
        [
            ("sft", "none", "none"),
            ("orpo", "none", "none"),
            ("simpo", "none", "none"),
            ("dpo", "precomputed", "none"),
            ("dpo", "copy", "none"),
            ("dpo", "adapter_disabled", "lora"),
        ]
    ),
)
def test_setup_and_first_step_run_on_the_training_device(
    engine, objective, reference, method, recipe_of, on_device, on_engine
):
    """A model loaded from disk into host memory, trained on another device: the precomputed reference ran before
    `prepare` moved the model (host weights, device batch) and the frozen copy was never moved."""
    overrides = {"preference__reference": reference} if objective == "dpo" else {}
    if engine == "zero3" and method == "lora":  # refused with checkpointing (launch.check_engine)
        overrides["training__gradient_checkpointing"] = False
    run = build(load_recipe(recipe_of(objective, peft__method=method, **overrides)))
    assert run.engine == engine
    examples = batch_for_step(
        run.data.train, step=0, global_batch_size=4, seed=0, rank=0, world_size=1, group_by_length=False
    )
    # The first micro-batch's forward as train_step runs it (the copy's first, under no_grad). Not its backward: the
    # autograd engine wants the device's streams, which torch's Python-side placeholders do not give.
    batch = to_device(collate_for(run, examples[:1]), DEVICE)  # a packed batch's document lengths are ints
    assert run.model(**batch).device == DEVICE
    assert held_on(run.model) == {DEVICE}
    assert torch.ops.aten.embedding.default in on_device.on_device  # the forwards ran there
    if reference == "copy":
        assert held_on(run.model._reference_model[0]) == {DEVICE}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs `.[deepspeed]`")
def test_zero3_dpo_computes_the_precomputed_reference_through_the_sharded_model(recipe_of, tmp_path):
    """ZeRO-3 loads the model partition by partition: the reference forward ran before `prepare`, on empty partitions.
    Through the engine it gathers them, at the engine's bf16: step 0 then has rewards 0 and loss ln 2."""
    from test_scale_out import launch

    recipe = recipe_of(training__precision="bf16", training__gradient_checkpointing=False)
    proc = subprocess.run(launch(recipe, tmp_path / "run", "zero3"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "run_summary.json").read_text())["engine"] == "zero3"
    step = first_step(tmp_path / "run")
    assert step["rewards_chosen"] == step["rewards_rejected"] == 0
    assert step["loss"] == pytest.approx(math.log(2), abs=1e-7)


@pytest.mark.parametrize(
    ("engine", "reference", "beta", "method"),
    engine_cases([("none", 0.0, "none"), ("copy", 0.04, "none"), ("adapter_disabled", 0.04, "lora")]),
)
def test_grpo_samples_and_trains_on_the_training_device(
    engine, reference, beta, method, recipe_of, on_device, on_engine, tmp_path
):
    """GRPO's setup, its first batch's sampling (generate with a KV cache, through the prepared module), the old
    log-probs kept for num_iterations > 1, and the first forward on the completions, on the training device: with
    no reference, a frozen copy (full fine-tuning) or the adapters switched off (LoRA)."""
    from test_grpo import write_prompts

    prompts = write_prompts(tmp_path / "prompts.jsonl", n=8)
    recipe = recipe_of(
        "grpo",
        data__train=[{"path": str(prompts), "format": "prompt", "fields": {"prompt": "question"}}],
        data__max_length=16,
        training__gradient_checkpointing=False,
        training__micro_batch_size=4,
        training__global_batch_size=4,
        peft__method=method,
        grpo={
            "num_generations": 2,
            "max_new_tokens": 4,
            "beta": beta,
            "num_iterations": 2,  # the old log-probs too, through the prepared module
            "rewards": [{"function": "llmtune.rewards:exact_match"}],
        },
    )
    run = build(load_recipe(recipe))
    assert (run.engine, run.objective.reference) == (engine, reference)
    examples = batch_for_step(
        run.data.train, step=0, global_batch_size=2, seed=0, rank=0, world_size=1, group_by_length=False
    )
    rows = run.objective.rollout(examples, 0)
    assert len(rows) == 4 and torch.ops.aten.embedding.default in on_device.on_device  # sampled there
    batch = {k: v.to(DEVICE) for k, v in collate_for(run, rows).items()}
    assert run.model(**batch).device == DEVICE
    assert held_on(run.model) == {DEVICE}
