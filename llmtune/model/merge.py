"""Merge a LoRA / DoRA run's adapter into its base model: one plain Hugging Face model folder out.

`merge_run` takes a run's `output_dir` (it reads `final/`), a `final/` folder itself, or a checkpoint
folder (`checkpoints/step-000120/`), and writes a model that plain `AutoModelForCausalLM.from_pretrained`
loads (safetensors) plus the tokenizer, atomically: everything goes to a hidden sibling folder which is
renamed into place only when complete.

Where the base weights come from:

* `final/` holds only the adapter (peft's `save_pretrained`); `adapter_config.json` names the base model
  (a hub id or a local folder), which is loaded again and must be the same weights the run trained on.
* A base with `model.random_init: true` was drawn at random from its config and exists on no disk. Drawing
  it again is not reproducible (the draw depends on the RNG state at load time, the torch version and
  the init code), so it is never re-drawn: `final/base/` is used when the run saved it there
  (`save_base_weights`), else the merge is refused with a message saying what to do instead.
* A checkpoint folder holds only the adapters (see `checkpoint.save_trainable_only`) and its
  `recipe.yaml`; the base is loaded from the recipe's `model.name_or_path` (refused for random_init).

QLoRA: `final/` merges into the base loaded in 16/32-bit (never re-quantised), which is the usual way to
ship a QLoRA model; QLoRA checkpoints are refused (merge final/).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtune.errors import UserError

if TYPE_CHECKING:
    import torch


log = logging.getLogger(__name__)


ADAPTER_CONFIG = "adapter_config.json"


BASE_DIR = "base"  # final/base/: base weights saved beside the adapter when they exist on no other disk


CHECKPOINT_STATE = "trainer_state.json"  # marks an llmtune checkpoint folder (see checkpoint.STATE_FILE)


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


# In a merged folder: written by llmtune merge, so a later merge to the same --out may replace it.
MERGE_MARKER = "llmtune_merge.json"


# torch is imported lazily: `llmtune --help` and the other subcommands should not pay for it here.
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class MergeError(UserError, ValueError):
    """The folder given cannot be merged; the message says why and what to do instead."""


def merge_run(
    run_dir: str | Path,
    out: str | Path | None = None,
    *,
    dtype: str = "auto",
    overwrite: bool = False,
    trust_remote_code: bool = False,
) -> Path:
    """Merge the adapter of `run_dir` into its base model and write the result to `out`.

    `run_dir`: a run's output_dir (uses its `final/`), a `final/` folder, or a checkpoint folder.
    `out`: defaults to `<output_dir>/merged` (`<output_dir>/merged-step-000120` for a checkpoint).
    `dtype`: `auto` keeps the base model's stored dtype; `fp32` / `bf16` / `fp16` cast the merged weights.
    `overwrite`: replace an existing `out` that an earlier `llmtune merge` did not write (never the base or the run).
    `trust_remote_code`: let a base whose config names its own modelling code run it (the caller's word only: never
    the run folder's recipe.yaml, which whoever wrote the folder controls).
    Returns `out`. Raises MergeError for anything that is not a mergeable run, or an `out` it may not replace.
    """
    if dtype != "auto" and dtype not in DTYPES:
        raise MergeError(f"dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    kind, folder = locate(Path(run_dir))
    default_out = folder.parent.parent / f"merged-{folder.name}" if kind == "checkpoint" else folder.parent / "merged"
    out = Path(out) if out is not None else default_out
    check_out(out, read_from(kind, folder), overwrite=overwrite)  # before anything loads: a refusal costs nothing
    log.info("llmtune merge %s -> %s", folder, out.resolve())
    if kind == "checkpoint":
        model, tokenizer = _merge_checkpoint(folder, dtype, trust_remote_code)
    else:
        model, tokenizer = _merge_adapter(folder, dtype, trust_remote_code)
    # The adapter model ran with use_cache=False for training; the merged model is for inference.
    model.config.use_cache = True
    _write_atomically(model, tokenizer, out)
    log.info("merged %s -> %s", folder, out)
    return out


def locate(path: Path) -> tuple[str, Path]:
    """("adapter", the folder with adapter_config.json) or ("checkpoint", the checkpoint folder)."""
    if not path.is_dir():
        raise MergeError(f"{path}: no such directory (pass a run's output_dir, its final/ or a checkpoint folder)")
    if (path / CHECKPOINT_STATE).is_file():
        return "checkpoint", path
    if (path / ADAPTER_CONFIG).is_file():
        return "adapter", path
    final = path / "final"
    if final.is_dir():
        if (final / ADAPTER_CONFIG).is_file():
            return "adapter", final
        if (final / "config.json").is_file():
            raise MergeError(_full_finetune_message(final))
        raise MergeError(f"{final}: holds neither an adapter ({ADAPTER_CONFIG}) nor a model (config.json)")
    if (path / "config.json").is_file() and any((path / w).is_file() for w in WEIGHT_FILES):
        raise MergeError(_full_finetune_message(path))
    if (path / "recipe.yaml").is_file():
        found = sorted(p.name for p in (path / "checkpoints").glob("step-*") if (p / CHECKPOINT_STATE).is_file())
        hint = f"; merge a checkpoint instead: {path / 'checkpoints' / found[-1]}" if found else ""
        raise MergeError(f"{path}: the run has no final/ (it did not finish){hint}")
    raise MergeError(f"{path}: not an llmtune run (no final/, no {ADAPTER_CONFIG}, no {CHECKPOINT_STATE})")


def _full_finetune_message(folder: Path) -> str:
    return (
        f"{folder}: a full fine-tune (peft.method=none) saves the whole model, so there is no adapter to"
        " merge; load that folder directly with AutoModelForCausalLM.from_pretrained"
    )


def _merge_adapter(adapter_dir: Path, dtype: str, trust_remote_code: bool):
    model, tokenizer = load_adapter_model(adapter_dir, dtype, trust_remote_code=trust_remote_code)
    return merged(model), tokenizer


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """peft's merge_and_unload (safe_merge: the merged weights are checked for NaN/inf before they are kept), with
    an adapted lm_head untied from the input embeddings first: merged into the one tensor both share, the adapter
    would change every input embedding too (peft warns and merges anyway). The merged model then has its own head
    and says so in its config."""
    import torch

    base = model.get_base_model()
    head, embeddings = base.get_output_embeddings(), base.get_input_embeddings()
    if hasattr(head, "lora_A") and head.weight is embeddings.weight:
        head.base_layer.weight = torch.nn.Parameter(embeddings.weight.detach().clone(), requires_grad=False)
        base.config.get_text_config().tie_word_embeddings = False
        base.config.tie_word_embeddings = False
    return model.merge_and_unload(safe_merge=True)


def load_adapter_model(adapter_dir: Path, dtype: str = "auto", *, trust_remote_code: bool = False):
    """(peft model, tokenizer) of an adapter folder (`final/`): its base loaded from where the weights really
    are (`base_source`), the adapter on top, unmerged. `dtype` and `trust_remote_code` as for `merge_run`."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmtune.model.adapters import peft_quietly

    adapter_config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    recipe = _recipe_near(adapter_dir)
    model_cfg = recipe.get("model", {}) if recipe else {}
    base = _base_source(adapter_dir, adapter_config, model_cfg)
    from_disk = base == adapter_dir / BASE_DIR
    kwargs: dict[str, Any] = {
        "dtype": "auto" if dtype == "auto" else getattr(torch, DTYPES[dtype]),
        # The caller's flag, never the folder's recipe.yaml: a shared run folder must not opt itself into running
        # the .py files it ships.
        "trust_remote_code": trust_remote_code,
    }
    if not from_disk and model_cfg.get("revision"):
        kwargs["revision"] = model_cfg["revision"]
    try:
        model = AutoModelForCausalLM.from_pretrained(str(base), **kwargs)
    except (OSError, ValueError) as err:
        refuse_remote_code(base, err)
        raise MergeError(f"cannot load the base model {base} named by {adapter_dir / ADAPTER_CONFIG}: {err}") from err
    with peft_quietly():
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    tok_dir = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        refuse_remote_code(tok_dir, err)
        raise
    return model, tokenizer


def remote_code_refusal(source: Path | str, err: BaseException) -> str | None:
    """The refusal naming the flag when transformers refused `source` for code it would have to run, else None."""
    if "trust_remote_code" not in str(err) and "contains custom code" not in str(err):
        return None
    return (
        f"{source}: loading it runs Python code that ships with the model (its config's auto_map); pass"
        " --trust-remote-code if you trust that code"
    )


def refuse_remote_code(source: Path | str, err: BaseException) -> None:
    """Raise `remote_code_refusal` as a MergeError, if it applies."""
    refusal = remote_code_refusal(source, err)
    if refusal is not None:
        raise MergeError(refusal) from None


def _recipe_near(adapter_dir: Path) -> dict[str, Any] | None:
    """The run's recipe.yaml (in output_dir, beside final/), as a mapping; None when absent."""
    import yaml

    path = adapter_dir.parent / "recipe.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def _base_source(adapter_dir: Path, adapter_config: dict[str, Any], model_cfg: dict[str, Any]) -> Path | str:
    """Where the base weights are: final/base/, else the base named in adapter_config.json."""
    if (adapter_dir / BASE_DIR / "config.json").is_file():
        return adapter_dir / BASE_DIR
    base = adapter_config.get("base_model_name_or_path")
    if not base:
        raise MergeError(f"{adapter_dir / ADAPTER_CONFIG}: names no base model (base_model_name_or_path)")
    random_init = bool(model_cfg.get("random_init"))
    no_weights = Path(base).is_dir() and not any((Path(base) / w).is_file() for w in WEIGHT_FILES)
    if random_init or no_weights:
        why = "model.random_init: true (weights drawn at random from the config)" if random_init else "no weights"
        hint = " llmtune saves final/base/ for such runs; this final/ predates that or was copied without it."
        raise MergeError(
            f"{adapter_dir}: the adapter's base model {base} has {why}, so the weights it was trained on exist on"
            f" no disk and re-drawing them is not reproducible; {adapter_dir / BASE_DIR}/ is absent.{hint}"
        )
    return base


def save_base_weights(
    peft_model: torch.nn.Module, folder: str | Path, state_dict: dict[str, Any] | None = None
) -> Path:
    """Save the frozen base weights of a peft model as a plain HF model folder (e.g. `final/base/`).

    For bases that exist on no disk (`model.random_init`). `state_dict`: the peft model's full state dict
    (e.g. gathered by `accelerator.get_state_dict` and stripped of the wrapper's `model.` prefix); by
    default the model's own. Adapter tensors are dropped and peft's wrapper names mapped back
    (`q_proj.base_layer.weight` -> `q_proj.weight`, `lm_head.original_module.weight` -> `lm_head.weight`).
    """
    base_model = peft_model.get_base_model()
    if state_dict is None:
        state_dict = peft_model.state_dict()
    weights = {}
    for key, value in state_dict.items():
        key = key.removeprefix("base_model.model.")
        if ".lora_" in key or ".modules_to_save." in key:
            continue
        weights[key.replace(".base_layer.", ".").replace(".original_module.", ".")] = value
    folder = Path(folder)
    base_model.save_pretrained(folder, state_dict=weights)
    return folder


def _merge_checkpoint(ckpt: Path, dtype: str, trust_remote_code: bool):
    import torch
    import yaml
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from llmtune.model.adapters import apply_peft
    from llmtune.model.load import load_config, load_tokenizer
    from llmtune.recipe import recipe_from_dict

    recipe = recipe_from_dict(yaml.safe_load((ckpt / "recipe.yaml").read_text()), str(ckpt / "recipe.yaml"))
    # The caller's flag replaces the checkpoint's: its recipe.yaml is the folder's word, not the user's.
    recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, trust_remote_code=trust_remote_code))
    if recipe.peft.method == "none":
        raise MergeError(_full_finetune_message(ckpt))
    if recipe.peft.method == "qlora":
        raise MergeError(
            f"{ckpt}: a QLoRA checkpoint holds 4-bit base weights; merge the run's final/ instead (the adapter is"
            " merged into the base loaded in 16/32-bit)"
        )
    weights = ckpt / "model.safetensors"
    if not weights.is_file():
        raise MergeError(f"{ckpt}: no model.safetensors (sharded FSDP checkpoints are not supported; merge final/)")
    if recipe.model.random_init:
        raise MergeError(
            f"{ckpt}: checkpoints hold only the adapters, and this run's base was drawn at random"
            " (model.random_init), so it exists on no disk; merge the run's final/ (it keeps final/base/)"
        )
    try:
        config = load_config(recipe.model)
        # fp32 for the merge itself (W + B @ A * scale without bf16 rounding in between); cast at the end.
        model = AutoModelForCausalLM.from_pretrained(
            recipe.model.name_or_path,
            revision=recipe.model.revision,
            dtype=torch.float32,
            trust_remote_code=recipe.model.trust_remote_code,
        )
    except (UserError, OSError, ValueError) as err:
        refuse_remote_code(recipe.model.name_or_path, err)
        raise
    model = apply_peft(model, recipe.peft, gradient_checkpointing=False)
    # Keys are those of the wrapped CausalLMWithLoss ("model." + peft's names).
    # Under PEFT a checkpoint holds only the trainable tensors; the frozen base came from name_or_path.
    state = {k.removeprefix("model."): v for k, v in load_file(weights).items()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k in trainable]
    if missing or unexpected:
        raise MergeError(
            f"{weights}: does not match the recipe's model + adapter (missing {missing[:3]}, unexpected"
            f" {unexpected[:3]}); was the checkpoint written by another version?"
        )
    model = merged(model)
    model.to(getattr(torch, DTYPES[dtype]) if dtype in DTYPES else _config_dtype(config))
    return model, load_tokenizer(recipe.model)


def _config_dtype(config: Any) -> torch.dtype:
    import torch

    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) else torch.float32


def read_from(kind: str, folder: Path) -> list[Path]:
    """The local folders a merge of `folder` reads: the adapter or checkpoint, its run, and its base where that is a
    folder (final/base/, the adapter config's base, the recipe's model)."""
    import yaml

    run = folder.parent.parent if kind == "checkpoint" else folder.parent
    paths = [folder, run, folder / BASE_DIR]
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        paths.append(Path(json.loads((folder / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]))
    with contextlib.suppress(OSError, yaml.YAMLError, AttributeError, TypeError):
        recipe = folder / "recipe.yaml" if kind == "checkpoint" else run / "recipe.yaml"
        paths.append(Path(yaml.safe_load(recipe.read_text())["model"]["name_or_path"]))
    return [p for p in paths if p.is_dir()]


def check_out(out: Path, sources: list[Path], *, overwrite: bool) -> None:
    """Refuse an `out` that is a folder the merge reads, or holds one (replaced, the base would lose the weights the
    adapter was trained on; the run, its final/); or any existing folder an earlier `llmtune merge` did not write
    (MERGE_MARKER), unless `overwrite`."""
    target = out.resolve()
    for source in sources:
        if target == source.resolve() or target in source.resolve().parents:
            raise MergeError(f"--out {out}: would replace {source}, which this merge reads; choose another --out")
    if overwrite or not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not (out / MERGE_MARKER).is_file():
        raise MergeError(
            f"--out {out}: exists and was not written by llmtune merge; choose another --out, or pass --overwrite to"
            " replace it"
        )


def _write_atomically(model: torch.nn.Module, tokenizer: Any, out: Path) -> None:
    """Write to a hidden sibling, then rename; an older merge at `out` is replaced only once the new one is whole."""
    from llmtune.files import replace_dir

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left over from a merge that was killed
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / MERGE_MARKER).write_text(json.dumps({"written_by": "llmtune merge"}) + "\n")
    replace_dir(tmp, out)
