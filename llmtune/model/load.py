"""The causal LM: precision, loading, and the transformations `llmtune.run.parallelize` applies to it.

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
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from llmtune.catalogue import MODELS, model_config_dir
from llmtune.errors import SetupError
from llmtune.model.attention import ULYSSES, attention_for
from llmtune.model.experts import run_experts_implementation
from llmtune.recipe import ModelConfig, Recipe

log = logging.getLogger(__name__)


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
    if folder is None and not path.exists():  # a hub id
        folder = _cached_config_dir(name, revision)
    try:
        return AutoConfig.from_pretrained(
            str(folder or name), revision=None if folder else revision, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise SetupError(f"{name}: cannot read the model's config: {_why(name, err)}") from None


def _cached_config_dir(name: str, revision: str | None) -> Path | None:
    """Where the hub cannot be reached (`hub_unreachable`), the snapshot in the hub's cache that holds the config of
    hub id `name`, read as a local folder: the hub's client, asked, retries for a minute and more, a warning each
    time, before it gives up. None where the hub answers: it is asked. A SetupError, at once, where it cannot be
    reached and nothing is cached: it names what llmtune plans offline."""
    from huggingface_hub import try_to_load_from_cache

    unreachable = hub_unreachable()
    if unreachable is None:
        return None
    cached = try_to_load_from_cache(name, "config.json", revision=revision)
    if isinstance(cached, str):
        return Path(cached).parent
    raise SetupError(
        f"{name}: {unreachable}, and its config is not cached; offline, name a catalogue model ({', '.join(MODELS)})"
        " or a local folder with config.json"
    )


# Seconds the hub is given to answer a connection (`hub_unreachable`): it answers in milliseconds where it can.
HUB_PROBE_SECONDS = 2


def hub_unreachable() -> str | None:
    """Why the hub cannot be asked now, in a few words: HF_HUB_OFFLINE asks for the cache alone, or the hub does not
    answer one quick connection. None where it answers, or a proxy stands between (a direct connection tells nothing
    of the proxy's way out)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "the hub cannot be reached (HF_HUB_OFFLINE is set)"
    if "https" in urllib.request.getproxies():
        return None
    hub = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((hub.hostname, hub.port or 443), timeout=HUB_PROBE_SECONDS).close()
    except OSError as err:
        return f"the hub ({hub.hostname}) cannot be reached ({err})"
    return None


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
    config (no KV cache). Checkpointing, adapters and compilation are `llmtune.run.parallelize`'s. Split along the
    sequence across `sequence_parallel` processes, its attention is `ULYSSES` (llmtune.parallel.sequence registers
    it)."""
    cfg = recipe.model
    check_attn_implementation(config, cfg.attn_implementation)
    # Packed SFT rows: each document's causal block alone, where sdpa would build a dense block mask per row.
    attn = attention_for(
        cfg.attn_implementation, packed=recipe.data.packing, objective=recipe.training.objective, config=config
    )
    if sequence_parallel > 1:
        attn = ULYSSES
        log.info("attention: %s across %d processes (each document's causal block)", attn, sequence_parallel)
    elif attn != cfg.attn_implementation:
        log.info(
            "attention: %s, each packed document's causal block alone (eager: a dense mask)",
            attn,
        )
    # Mixed precision keeps fp32 master weights; autocast makes the bf16/fp16 copies on the fly.
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    kwargs = dict(attn_implementation=attn, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    compiled = recipe.training.compiles(device.type if device is not None else "cpu")
    experts = run_experts_implementation(
        config, cfg.experts_implementation, device=device, precision=precision, compiled=compiled
    )
    if experts is not None:
        kwargs["experts_implementation"] = experts
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
