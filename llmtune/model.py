"""The causal LM: precision, loading, and the transformations `llmtune.parallelize` applies to it.

Decide the precision for this device, load the tokenizer and the model in the dtype that precision implies; the
pieces the parallelize step applies in order (checkpointing through transformers' own API, PEFT adapters,
regional compilation) are defined here, next to the model they change.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from llmtune import sequence
from llmtune.attention import attention_for
from llmtune.catalogue import MODELS, model_config_dir
from llmtune.errors import UserError
from llmtune.recipe import Checkpointing, ModelConfig, PeftConfig, Recipe, checkpointing_of

log = logging.getLogger(__name__)


class SetupError(UserError, RuntimeError):
    """The recipe asks for something this machine cannot do; raised before any model loads."""


def cpu_supports_bf16() -> bool:
    # Without native bf16 instructions (AVX512-BF16 / AMX) oneDNN emulates bf16: ~30x slower than fp32
    # on an AVX2-only CPU (benchmarks/results/measurements.md).
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def choose_precision(requested: str, device_type: str) -> tuple[str, str]:
    """The concrete precision for `requested` on this device, and why; refuses modes it cannot really run.

    Accelerate silently drops fp16 autocast on a CPU (it trains fp32 and says nothing), and CPU fp16
    matmuls run at 1-2 GFLOP/s here, so fp16 on a CPU is refused rather than quietly replaced. bf16 on a
    CPU without native bf16 runs (emulated, slowly) when asked for by name: it still saves memory, and
    `llmtune bench` shows what it costs; `auto` never picks it there.
    """
    if device_type == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
        if requested == "auto":
            return ("bf16", "auto: this GPU supports bf16") if bf16 else ("fp16", "auto: this GPU has no bf16")
        if requested in ("bf16", "bf16-true") and not bf16:
            raise SetupError(f"training.precision={requested}: this GPU has no bf16 support; use fp16 or fp32")
        return requested, "set by the recipe"
    native = device_type == "cpu" and cpu_supports_bf16()
    if requested == "auto":
        if native:
            return "bf16", "auto: this CPU has native bf16 (AVX512-BF16/AMX)"
        return "fp32", "auto: this CPU has no native bf16 (emulated bf16 runs ~30x slower than fp32)"
    if requested == "fp16":
        raise SetupError(
            f"training.precision=fp16 cannot run on {device_type}: Accelerate would silently train fp32, and"
            " CPU fp16 matmuls are ~100x slower than bf16. Use bf16 (or auto) here, fp16 on a CUDA GPU."
        )
    if requested in ("bf16", "bf16-true") and not native:
        return requested, "set by the recipe; this CPU has no native bf16, so it is emulated and much slower than fp32"
    return requested, "set by the recipe"


def resolve_precision(requested: str, device_type: str) -> str:
    return choose_precision(requested, device_type)[0]


def check_bitsandbytes_device(peft_method: str, optimizer: str, device_type: str) -> str | None:
    """What needs bitsandbytes (QLoRA's 4-bit base, 8-bit AdamW); refused on a device other than CUDA.
    The memory estimator refuses the same, in the same words, when planning for a CPU."""
    what = "peft.method=qlora" if peft_method == "qlora" else "training.optimizer=adamw_8bit"
    if (peft_method == "qlora" or optimizer == "adamw_8bit") and device_type != "cuda":
        raise SetupError(
            f"{what} needs bitsandbytes on a CUDA GPU; a CPU cannot run it. Use peft.method=lora"
            " (16-bit base weights) and training.optimizer=adamw there."
        )
    return what if peft_method == "qlora" or optimizer == "adamw_8bit" else None


OFFLOAD_NEEDS_CUDA = (
    "training.gradient_checkpointing.offload moves the inputs checkpointing saves from a GPU to host memory; on a"
    " CPU they are in host memory already (and the pinned copies need CUDA): remove offload"
)


# bitsandbytes before 0.43.2 kept each 4-bit matmul's input on its autograd node until the whole backward ended
# (MatMul4Bit's `ctx.tensors = (A, B)`, dropped by bitsandbytes PR #1270): under non-reentrant checkpointing, every
# layer's inputs, past checkpointing and past the memory plan, which models the current kernel (memory/kernels.py).
QLORA_MIN_BITSANDBYTES = (0, 43, 2)


def release(version: str) -> tuple[int, ...]:
    """A version string's release numbers: "0.44.1+cu121" -> (0, 44, 1), "0.43.2.dev0" -> (0, 43, 2)."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])


def check_requirements(recipe: Recipe, device_type: str) -> None:
    """Refuse, before any download or model load, what needs hardware or packages this machine lacks."""
    checkpointing = checkpointing_of(recipe.training.gradient_checkpointing)
    if checkpointing is not None and checkpointing.offload and device_type != "cuda":
        raise SetupError(OFFLOAD_NEEDS_CUDA)
    what = check_bitsandbytes_device(recipe.peft.method, recipe.training.optimizer, device_type)
    if what is not None and importlib.util.find_spec("bitsandbytes") is None:
        raise SetupError(f"{what} needs bitsandbytes: pip install bitsandbytes")
    if what is not None and recipe.peft.method == "qlora":
        have = importlib.metadata.version("bitsandbytes")
        if release(have) < QLORA_MIN_BITSANDBYTES:
            least = ".".join(map(str, QLORA_MIN_BITSANDBYTES))
            raise SetupError(
                f"peft.method=qlora needs bitsandbytes >= {least}, found {have}: earlier versions"
                " keep every 4-bit layer's input until backward ends, past checkpointing and the memory plan."
                " pip install -U bitsandbytes"
            )


def load_tokenizer(cfg: ModelConfig):
    source = cfg.tokenizer or cfg.name_or_path
    key = "model.tokenizer" if cfg.tokenizer else "model.name_or_path"
    path = Path(source).expanduser()
    if not path.exists() and not _HUB_ID.fullmatch(source):
        raise SetupError(f"{key}={source}: no such folder")
    if path.is_dir() and not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise SetupError(f"{key}={source}: the folder holds no tokenizer ({', '.join(_TOKENIZER_FILES)})")
    if source.lower() in MODELS and not path.exists():
        raise SetupError(f"{key}={source}: the catalogue holds only configs; name the hub id {MODELS[source.lower()]}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise SetupError(f"{key}={source}: cannot load a tokenizer: {_why(source, err)}") from None
    if tokenizer.pad_token is None:
        # Padding positions are masked out of attention and loss, so any id is safe to pad with.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def weights_signature(name_or_path: str) -> list[list[Any]]:
    """What identifies a local folder's weights without reading them: each weight file's name, size and
    modification time (a model retrained into the same folder gets new ones). Empty for a hub id, which its
    revision identifies."""
    folder = Path(name_or_path)
    if not folder.is_dir():
        return []
    files = sorted(f for pattern in ("*.safetensors", "*.bin") for f in folder.glob(pattern))
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def load_config(cfg: ModelConfig) -> PretrainedConfig:
    return resolve_config(cfg.name_or_path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)


def resolve_config(name: str, *, revision: str | None = None, trust_remote_code: bool = False) -> PretrainedConfig:
    """The config of `name`: a catalogue model (offline), a local folder or config.json file, or a hub id
    (only its config.json is fetched). Anything else is a SetupError that names `name` in one line."""
    path = Path(name).expanduser()
    # A local folder wins over a catalogue entry of the same name; a pinned revision is the hub's to answer.
    folder = model_config_dir(name) if not path.exists() and revision is None else None
    if folder is None and not path.exists() and not _HUB_ID.fullmatch(name):
        raise SetupError(f"{name}: no such folder")
    if folder is None and path.is_dir() and not (path / "config.json").is_file():
        raise SetupError(f"{name}: the folder has no config.json")
    try:
        return AutoConfig.from_pretrained(
            str(folder or name), revision=None if folder else revision, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise SetupError(f"{name}: cannot read the model's config: {_why(name, err)}") from None


# [owner/]name, as the hub spells repository ids; a missing local path of another shape (./x, /x, a/b/c) is
# refused as a missing folder without asking the hub.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]*[A-Za-z0-9_])?")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _why(name: str, err: BaseException) -> str:
    """One line for an error of transformers/huggingface_hub loading `name`."""
    text = str(err)
    if "couldn't connect" in text or "offline" in text.lower():
        return "the hub cannot be reached (offline?) and nothing is cached"
    if not Path(name).exists() and _HUB_ID.fullmatch(name):
        return f"not a local folder, and the hub has no model {name} (or it is gated: huggingface-cli login)"
    return text.strip().splitlines()[0] if text.strip() else type(err).__name__


@contextlib.contextmanager
def whole_model_init() -> Iterator[None]:
    """Initialise a model from its config whole, also under DeepSpeed ZeRO-3: with `zero3_init_flag` transformers
    builds it partition by partition (`zero.Init`), whose random weights are not the ones the seed gives under every
    other engine (the first loss differed: 5.651 against 5.7185). `prepare` then partitions the whole model."""
    from accelerate.state import AcceleratorState

    # Only where an Accelerator set the state up: constructing one here would create it (estimate, tests).
    plugin = AcceleratorState().deepspeed_plugin if AcceleratorState._shared_state else None
    if plugin is None or not plugin.is_zero3_init_enabled():
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # transformers decides on zero.Init from the config Accelerate registers (whatever the flag): unregister it.
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()  # registered again for what follows (saving gathers the partitions)


def check_attn_implementation(config: PretrainedConfig, attn: str, *, installed: bool = True) -> None:
    """Refuse, in one line, an attention implementation the model's class cannot run (Gemma-2 has no
    SDPA path: it needs logit soft-capping) or, with `installed`, that this machine lacks the package for.
    Planning for another machine passes installed=False."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    flags = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn"}
    if cls is not None and attn in flags and not getattr(cls, flags[attn], True):
        others = [a for a, f in flags.items() if a != attn and getattr(cls, f, False)]
        hint = " or ".join(["eager", *others])
        raise SetupError(f"model.attn_implementation={attn}: {cls.__name__} does not support it; use {hint}")
    if attn == "flash_attention_2" and installed and importlib.util.find_spec("flash_attn") is None:
        raise SetupError(
            "model.attn_implementation=flash_attention_2 needs the flash-attn package on a CUDA GPU; use sdpa"
        )


def load_model(
    recipe: Recipe,
    precision: str,
    config: PretrainedConfig,
    device: torch.device | None = None,
    *,
    sequence_parallel: int = 1,
) -> PreTrainedModel:
    """Load (or randomly initialise, on `device`) the model in the dtype `precision` implies, in training mode's
    config (no KV cache). Checkpointing, adapters and compilation are `llmtune.parallelize`'s. Split along the
    sequence across `sequence_parallel` processes, its attention is `llmtune.sequence.ULYSSES`."""
    cfg = recipe.model
    check_attn_implementation(config, cfg.attn_implementation)
    # Packed SFT rows: each document's causal block alone, where sdpa would build a dense block mask per row.
    attn = attention_for(
        cfg.attn_implementation, packed=recipe.data.packing, objective=recipe.training.objective, config=config
    )
    if sequence_parallel > 1:
        attn = sequence.ULYSSES
        log.info("attention: %s across %d processes (each document's causal block)", attn, sequence_parallel)
    elif attn != cfg.attn_implementation:
        log.info(
            "attention: %s, each packed document's causal block alone (eager: a dense mask)",
            attn,
        )
    # Mixed precision keeps fp32 master weights; autocast makes the bf16/fp16 copies on the fly.
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    kwargs = dict(attn_implementation=attn, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    if recipe.peft.method == "qlora":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if precision != "fp16" else torch.float16,
        )
    if cfg.random_init:
        # On the training device: a GPU initialises a 1B model in about a second, CPU cores take ~10x that.
        with torch.device(device) if device is not None else contextlib.nullcontext(), whole_model_init():
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, revision=cfg.revision, **kwargs)
    # A KV cache is useless in training, costs memory, and lets packed examples attend to each other.
    model.config.use_cache = False
    return model


def compile_blocks(model: torch.nn.Module) -> int:
    """torch.compile each repeated decoder block in place ("regional" compilation); returns how many.

    The blocks are the classes transformers never splits across devices (`_no_split_modules`, e.g.
    LlamaDecoderLayer). All blocks share one compiled graph, so compile time is that of one block, not of
    the whole model; `Module.compile` keeps module names and state-dict keys unchanged (checkpoints and
    adapters load either way), and checkpointing wraps the compiled block as it wraps an eager one. The
    loss (data-dependent chunking) and the embeddings stay eager. It pays on blocks with enough elementwise
    work, after a one-off compile (benchmarks/compile.py; figures in benchmarks/results/measurements.md).
    """
    blocks = decoder_blocks(model, purpose="training.compile", remedy="set training.compile: false")
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):  # newer torch
        # transformers >= 5.25 wraps attention in `kernels`' use_kernelized_func, which sets a module-level variable
        # in forward and resets it before returning. Inside a checkpointed block Dynamo refuses that side effect
        # (it would not be replayed on recomputation) and runs the whole block eagerly: compile did nothing. Set and
        # reset within one forward, it has nothing to replay. Global, as Dynamo reads it when it traces, in the loop.
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for block in blocks:
        block.compile()
    log.info("compiled %d %s blocks (torch.compile, one shared graph)", len(blocks), type(blocks[0]).__name__)
    return len(blocks)


def decoder_blocks(
    model: torch.nn.Module, purpose: str = "FSDP2", remedy: str = "use another launcher config"
) -> list[torch.nn.Module]:
    """The repeated decoder blocks: the classes transformers never splits across devices (`_no_split_modules`,
    e.g. LlamaDecoderLayer), also inside a peft model or a wrapper around one."""
    found = [m for m in model.modules() if getattr(m, "_no_split_modules", None)]
    names = set(found[0]._no_split_modules) if found else set()
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        name = type(found[0]).__name__ if found else type(model).__name__
        raise SetupError(f"{purpose}: found no decoder blocks in {name} (no _no_split_modules); {remedy}")
    return blocks


# Selective checkpointing keeps what is expensive to recompute -- matmuls and attention -- and recomputes the
# element-wise ops (norms, activations, rotary, residual adds), which cost memory but little time.
_KEPT_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,  # GPT-NeoX's eager attention
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _selective_policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn(selective: bool, recompute: Callable[[], Any] | None) -> Callable | None:
    """torch.utils.checkpoint's `context_fn` (forward context, recompute context): selective checkpointing's
    policy, and/or `recompute` entered around every recomputation (the memory estimator's CUDA kernels)."""
    if not selective and recompute is None:
        return None

    def contexts() -> tuple[Any, Any]:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        forward, again = create_selective_checkpoint_contexts(_selective_policy) if selective else (None, None)
        return forward or contextlib.nullcontext(), _Both(again, recompute()) if recompute else again

    return contexts


class _Both:
    """Enter two context managers (either may be None) as one."""

    def __init__(self, *contexts: Any) -> None:
        self.contexts = [c for c in contexts if c is not None]
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        for c in self.contexts:
            self.stack.enter_context(c)

    def __exit__(self, *exc: object) -> None:
        self.stack.__exit__(*exc)


def apply_checkpointing(
    model: PreTrainedModel, spec: Checkpointing, recompute: Callable[[], Any] | None = None
) -> None:
    """Non-reentrant checkpointing of decoder layers 0, k, 2k, ... (`spec.every_n_layers`) through transformers'
    API (renamed after 5.17; both names work), selective or offloaded as `spec` says. `recompute` makes a
    context entered around each recomputation. Layers not chosen keep their activations, as without it."""
    if not spec.enabled:
        return
    context_fn = _context_fn(spec.selective, recompute)
    kwargs: dict = {"use_reentrant": False} | ({"context_fn": context_fn} if context_fn else {})
    extra = {"offload": True} if spec.offload else {}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **extra)
    else:  # its name up to transformers 5.2x (5.17, our floor): the same arguments
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **extra)
    if spec.every_n_layers > 1:
        # Set here on the layers themselves: transformers' own every_n_layers is not in every version we support.
        flagged = [
            m for m in decoder_blocks(model, "checkpointing every_n_layers") if hasattr(m, "gradient_checkpointing")
        ]
        for i, layer in enumerate(flagged):
            layer.gradient_checkpointing = i % spec.every_n_layers == 0


@contextlib.contextmanager
def peft_quietly() -> Iterator[None]:
    """Wrap peft model construction: peft (0.17-0.21) reads transformers 5's deprecated `is_gradient_checkpointing`
    property, which warns once per wrapped model (a FutureWarning addressed to peft, not to our users)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def apply_peft(model: PreTrainedModel, cfg: PeftConfig, *, gradient_checkpointing: bool):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if cfg.method == "qlora" and cfg.adapter_dtype == "fp32":
        # It casts every 16-bit weight that is not 4-bit (embeddings, head, norms) to fp32 beside fp32 adapters;
        # bf16 adapters keep them bf16 (as litgpt and torchtune do), and the residual stream with them.
        model = prepare_model_for_kbit_training(
            model,
            # apply_checkpointing has already chosen the layers; peft would re-enable checkpointing on all of them.
            use_gradient_checkpointing=False,
        )
    if gradient_checkpointing and not getattr(model, "_require_grads_hook", None):
        # Frozen embeddings produce outputs that need no grad; a checkpointed block whose inputs need
        # no grad would give its adapters none ("element 0 of tensors does not require grad").
        # transformers registers this hook itself when it enables checkpointing (5.17 and 5.25 do); a model
        # handed in with checkpointing enabled some other way still needs it.
        model.enable_input_require_grads()
    lora = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        use_dora=cfg.method == "dora",
        modules_to_save=cfg.modules_to_save or None,
        task_type="CAUSAL_LM",
    )
    with peft_quietly():
        return get_peft_model(model, lora)


def cast_trained(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every trained parameter (adapters, DoRA's magnitudes, modules_to_save) to `dtype`, in place and keeping each
    parameter's identity (ties, hooks): `peft.adapter_dtype` bf16, before the optimizer is built. The memory
    estimator calls it on its fake model too."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; `parameters()` yields tied weights once."""
    params = list(model.parameters())
    return sum(numel(p) for p in params if p.requires_grad), sum(numel(p) for p in params)


def numel(p: torch.Tensor) -> int:
    """Elements of a parameter, also under DeepSpeed ZeRO-3 (which leaves an empty tensor in the module)."""
    return getattr(p, "ds_numel", p.numel())
