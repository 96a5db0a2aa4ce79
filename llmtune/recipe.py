"""Recipes: typed, validated YAML that drives a run.

A recipe is data the user edits. This module turns a YAML file (plus its `base:` chain and any
`key=value` overrides from the command line) into a frozen tree of dataclasses, and refuses anything
it does not understand *before* a model is loaded: unknown keys, wrong types and bad values are all
collected and reported at once, each with the file it came from and, for typos, the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from llmtune.errors import UserError
from llmtune.units import parse_bytes

Precision = Literal["auto", "bf16", "fp16", "fp32", "bf16-true"]
COMMAND_LINE = "<command line>"


class RecipeError(UserError, ValueError):
    """Every problem found in a recipe, reported together."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def doc(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its user-facing documentation attached (rendered by `llmtune recipe-doc`)."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str = doc("Hub id (e.g. meta-llama/Llama-3.1-8B) or a local directory with config.json.")
    tokenizer: str | None = doc("Tokenizer hub id or directory; defaults to name_or_path.", None)
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = doc(
        "Attention kernel passed to transformers.", "sdpa"
    )
    experts_implementation: Literal["auto", "eager", "batched_mm", "grouped_mm"] = doc(
        "Mixture-of-experts models: the routed experts' kernel passed to transformers. auto: grouped_mm (one grouped"
        " matmul over the tokens sorted by expert) where torch runs it, under training.compile with bf16-true only;"
        " else eager (a loop over the experts hit). batched_mm copies each token's experts' weights (memory).",
        "auto",
    )
    revision: str | None = doc("Hub revision (branch, tag or commit) to load.", None)
    trust_remote_code: bool = doc("Allow custom modelling code from the hub (runs that code!).", False)
    random_init: bool = doc(
        "Initialise weights at random from the config instead of loading them (for the embedded default"
        " and tests, or when no weights ship).",
        False,
    )

    def __post_init__(self) -> None:
        # As a shell would: transformers takes `~/models/x` for a hub id and fails; a hub id never starts with `~`.
        for key in ("name_or_path", "tokenizer"):
            value = getattr(self, key)
            if isinstance(value, str) and value.startswith("~"):
                object.__setattr__(self, key, os.path.expanduser(value))


@dataclass(frozen=True)
class SourceConfig:
    path: str = doc("A local file (.jsonl/.json/.csv/.parquet/.arrow), a folder of them, or a hub dataset id.")
    format: Literal["text", "prompt_completion", "messages", "preference", "prompt"] = doc(
        "How rows are rendered: raw text, a prompt and a completion, chat turns, preference pairs (prompt,"
        " chosen, rejected: strings or chat turns; for training.objective dpo / orpo / simpo), or prompts alone (a"
        " string or chat turns; the row's other columns go to the reward functions; for training.objective grpo).",
        "prompt_completion",
    )
    fields: dict[str, str] = doc(
        "Map llmtune's field names (text / prompt / completion / messages / chosen / rejected) to this source's"
        " column names, e.g. {prompt: instruction, completion: output}; for format prompt, also the names reward"
        " functions receive, e.g. {answer: solution}.",
        factory=dict,
    )
    split: str = doc("Split to read (hub datasets and folders).", "train")
    subset: str | None = doc("Hub dataset configuration name.", None)
    weight: float = doc("Relative sampling weight when several sources are mixed.", 1.0)


@dataclass(frozen=True)
class DataConfig:
    train: list[SourceConfig] = doc("Training sources (one or more).", factory=list)
    eval: list[SourceConfig] = doc("Evaluation sources; empty means use eval_fraction of train.", factory=list)
    eval_fraction: float = doc("Fraction of train held out for eval when no eval source is given.", 0.0)
    max_length: int = doc("Longest sequence in tokens; longer examples follow `overlong`.", 512)
    packing: bool = doc(
        "Pack several examples per row (no attention across examples): no padding, more trained tokens/s.", True
    )
    train_on: Literal["completion", "all"] = doc(
        "Train only on completions / assistant turns, or on every token.", "completion"
    )
    train_reasoning: bool = doc(
        "Chats: train an assistant turn's reasoning (`reasoning_content`, or a leading <think>...</think> in its"
        " content) as the chat template renders it; false keeps it as context only.",
        True,
    )
    overlong: Literal["truncate", "drop"] = doc("What to do with examples longer than max_length.", "truncate")
    group_by_length: bool = doc("Without packing, batch similar lengths together to cut padding.", True)
    num_proc: int = doc("Worker processes for tokenisation.", 1)


@dataclass(frozen=True)
class Checkpointing:
    every_n_layers: int = doc(
        "Recompute decoder layers 0, k, 2k, ... in backward (transformers' every_n_layers); 1: every layer; 0: none.", 1
    )
    selective: bool = doc(
        "In a recomputed layer, keep the outputs of matmuls and attention and recompute only the element-wise ops"
        " (norms, activations, residual adds): more memory than full recomputation, little recompute time.",
        False,
    )
    offload: bool = doc(
        "CUDA only: hold the recomputed layers' saved inputs in pinned host memory (copied back in backward).", False
    )

    @property
    def enabled(self) -> bool:
        return self.every_n_layers > 0

    def describe(self, num_layers: int | None = None) -> str:
        """In words, e.g. "every 2nd layer (8 of 16), selective" or "off"."""
        k = self.every_n_layers
        if k == 0:
            return "off"
        which = "every layer" if k == 1 else f"every {_ordinal(k)} layer"
        if num_layers and k > 1:
            which += f" ({checkpointed_layers(k, num_layers)} of {num_layers})"
        return which + (", selective" if self.selective else "") + (", offloaded" if self.offload else "")


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def checkpointed_layers(every_n_layers: int, num_layers: int) -> int:
    """Layers recomputed when every `every_n_layers`-th is (0, k, 2k, ...)."""
    return 0 if every_n_layers == 0 else -(-num_layers // every_n_layers)


CHECKPOINTING_WORDS = {True: Checkpointing(1), False: Checkpointing(0), "selective": Checkpointing(1, selective=True)}


def checkpointing_of(value: bool | str | Checkpointing) -> Checkpointing | None:
    """`training.gradient_checkpointing` as a `Checkpointing`; None for `auto` (the planner chooses)."""
    if isinstance(value, Checkpointing):
        return value
    return None if value == "auto" else CHECKPOINTING_WORDS[value]


@dataclass(frozen=True)
class TrainingConfig:
    precision: Precision = doc(
        "bf16 / fp16: mixed precision (fp32 master weights, autocast; fp16 adds dynamic loss scaling);"
        " bf16-true: weights in bf16, no autocast, updates kept by stochastic rounding (llmtune.ops.optim); fp32;"
        " auto: bf16 where the device runs it natively (CUDA, CPUs with AVX512-BF16/AMX), else fp16 on CUDA,"
        " else fp32; the setup log says which and why.",
        "auto",
    )
    tf32: bool | Literal["auto"] = doc(
        "Run fp32 matmuls on TF32 tensor cores (CUDA, Ampere and newer; torch.backends.cuda.matmul.allow_tf32): about"
        " 7x fp32's speed with a 10-bit mantissa, as the HF Trainer's `tf32=True` and nanoGPT run. auto: on where the"
        " run is on CUDA (fp32 recipes and the fp32 matmuls of mixed precision), off elsewhere (a CPU has no TF32);"
        " false: PyTorch's default, full fp32 matmuls.",
        "auto",
    )
    gradient_checkpointing: bool | Literal["auto", "selective"] | Checkpointing = doc(
        "Recompute activations in backward, saving memory for time. auto: the planner picks the fastest setting"
        " that fits the memory budget (with the micro-batch); true / false: every layer / none; selective: every"
        " layer, keeping matmul outputs; or a mapping {every_n_layers: k, selective: ..., offload: ...}.",
        "auto",
    )
    micro_batch_size: int | Literal["auto"] = doc(
        "Examples per forward pass per process; `auto` lets the memory planner choose.", "auto"
    )
    global_batch_size: int = doc("Examples per optimizer step over all processes and accumulation.", 32)
    max_steps: int = doc("Optimizer steps to run.", 100)
    learning_rate: float = doc("Peak learning rate.", 2e-5)
    lr_schedule: Literal["cosine", "linear", "constant"] = doc("Decay after warmup.", "cosine")
    warmup_steps: int = doc("Linear warmup steps.", 0)
    min_lr_ratio: float = doc("Final learning rate as a fraction of the peak (cosine and linear).", 0.0)
    weight_decay: float = doc("AdamW weight decay (not applied to biases and norms).", 0.0)
    adam_betas: list[float] = doc("AdamW betas.", factory=lambda: [0.9, 0.999])
    max_grad_norm: float = doc("Clip the global gradient norm to this; 0 disables clipping.", 1.0)
    optimizer: Literal["adamw", "adamw_8bit"] = doc("Optimizer; adamw_8bit needs bitsandbytes on CUDA.", "adamw")
    loss: Literal["auto", "hf", "chunked"] = doc(
        "Cross-entropy implementation: the model's own (full fp32 logits) or chunked (never holds all"
        " logits); auto picks chunked where the model allows it.",
        "auto",
    )
    eval_every_n_steps: int = doc("Evaluate every N steps (0: only at the end) when there is eval data.", 0)
    max_nonfinite_steps: int = doc("Stop after this many consecutive non-finite losses.", 3)
    objective: Literal["sft", "dpo", "orpo", "simpo", "grpo"] = doc(
        "sft: next-token loss on the trained tokens; dpo (and IPO via preference.loss), orpo, simpo: preference"
        " tuning on pairs (data format `preference`, settings under `preference:`), loss averaged over pairs;"
        " grpo: online RL on the policy's own completions of prompts (data format `prompt`, settings under `grpo:`;"
        " global_batch_size and micro_batch_size count completions).",
        "sft",
    )
    compile: bool | Literal["auto"] = doc(
        "torch.compile each decoder block (one shared graph; it composes with checkpointing and FSDP2): Inductor fuses"
        " each block's norms, RoPE, SwiGLU and casts into a few kernels, after a one-off compile in the first steps."
        " auto: on CUDA; off on a CPU, where compiling needs a C++ toolchain and pays little (on this project's CPUs"
        " 1.15x on a 46M Llama after ~20 s of compiling, 0.73x on the 3M quickstart: benchmarks/results/"
        "measurements.md). On CPU, memory figures are those of the eager step (Dynamo steps aside while measured).",
        "auto",
    )

    def compiles(self, device_type: str) -> bool:
        """Whether the decoder blocks are compiled on `device_type` ("cuda", "cpu", ...): `compile`, auto resolved."""
        return device_type == "cuda" if self.compile == "auto" else self.compile

    def tf32_on(self, device_type: str) -> bool:
        """Whether fp32 matmuls run on TF32 on `device_type`: `tf32`, auto resolved (on for CUDA)."""
        return device_type == "cuda" if self.tf32 == "auto" else self.tf32


@dataclass(frozen=True)
class MemoryConfig:
    budget: str = doc(
        "Memory a process may use for training: `auto` (free device memory less a safety margin) or a"
        " size like `20GiB`.",
        "auto",
    )
    expandable_segments: bool = doc(
        "On CUDA, let the caching allocator grow its segments rather than cut new ones"
        " (expandable_segments:True): less fragmentation, so more of the budget holds tensors. A setting"
        " already in PYTORCH_CUDA_ALLOC_CONF wins.",
        True,
    )


@dataclass(frozen=True)
class CheckpointConfig:
    every_n_steps: int = doc("Save a resumable checkpoint every N steps; 0 disables.", 0)
    keep_last: int = doc(
        "Checkpoints of this run's lineage to keep (the oldest pruned after a new one is complete); checkpoints of"
        " another branch (newer steps left behind by a resume from an older checkpoint) are never pruned.",
        2,
    )
    resume: str = doc(
        "`auto` (the newest written complete checkpoint in output_dir), `none`, or a checkpoint path.", "auto"
    )
    trust: bool = doc(
        "Resume a checkpoint that another user wrote (its manifest names another uid, or its files are another"
        " user's). A resume unpickles some of its files (docs/training.md, which files are code), so it is refused"
        " unless this is true.",
        False,
    )


@dataclass(frozen=True)
class LoggingConfig:
    every_n_steps: int = doc("Print a line every N steps, its loss and reward averaged over them.", 10)
    report_to: list[str] = doc("Accelerate trackers: tensorboard, wandb, mlflow, trackio.", factory=list)
    progress_bar: bool = doc(
        "Show a progress bar on the main process where stderr is a terminal; a log file or CI log gets the step lines"
        " alone.",
        True,
    )


@dataclass(frozen=True)
class PeftConfig:
    method: Literal["none", "lora", "dora", "qlora"] = doc("Parameter-efficient method; none trains all.", "none")
    rank: int = doc("Adapter rank r.", 16)
    alpha: float = doc("Adapter scaling alpha.", 32.0)
    dropout: float = doc("Dropout on the adapter input.", 0.0)
    target_modules: list[str] | Literal["all-linear"] = doc(
        "Module names to adapt; all-linear adapts every linear layer of the decoder.", "all-linear"
    )
    modules_to_save: list[str] = doc(
        "Modules trained fully alongside adapters (e.g. embed_tokens, lm_head).", factory=list
    )
    adapter_dtype: Literal["fp32", "bf16"] = doc(
        "The trained parameters' dtype. fp32: peft's default, also under a bf16 base. bf16 (training.precision"
        " bf16-true only): as litgpt's and torchtune's bf16 runs train them; each adapter then computes on its bf16"
        " input instead of an fp32 copy (Llama-3.1-8B, every linear layer, 2048 tokens: a third less activation"
        " memory, by the estimate), and BF16AdamW keeps the updates by stochastic rounding. Under qlora, bf16 also"
        " keeps the base's non-4-bit weights (embeddings, head, norms) in bf16, which peft's"
        " prepare_model_for_kbit_training casts to fp32 beside fp32 adapters.",
        "fp32",
    )


# preference.beta where a recipe leaves it unset: each method's own value. One key, three meanings: SimPO's beta
# scales a per-token average log-probability (Meng et al. 2024 train with 2.0-10, their code defaults to 2.0; at
# 0.1, TRL's CPO default, beta * margin stays far below gamma); DPO's KL strength and ORPO's lambda are 0.1.
DEFAULT_BETA = {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0}
# What recipe.yaml files saved before beta's default depended on the objective list for it, sft runs included.
_LEGACY_BETA = 0.1


@dataclass(frozen=True)
class PreferenceConfig:
    beta: float | None = doc(
        "dpo: the KL strength (IPO: its tau); simpo: the reward scale; orpo: the odds-ratio weight lambda. Unset"
        " (null): the objective's own default, 0.1 for dpo and orpo, 2.0 for simpo (SimPO's: the paper trains with"
        " 2.0-10; with gamma's default 0.5, gamma/beta is 0.25 as in SimPO's code, set gamma 1.0 for 0.5).",
        None,
    )
    loss: Literal["sigmoid", "ipo"] = doc(
        "dpo only: sigmoid (DPO) or ipo (IPO: squared loss on length-averaged log-ratios).", "sigmoid"
    )
    gamma: float = doc("simpo only: the target reward margin gamma.", 0.5)
    reference: Literal["auto", "adapter_disabled", "copy", "precomputed"] = doc(
        "dpo only: the reference model. adapter_disabled: the base under LoRA (no second copy); copy: a frozen"
        " copy of the starting weights; precomputed: reference log-probabilities computed once before training and"
        " cached in output_dir (reused on resume and by later runs); auto: adapter_disabled under LoRA, else"
        " precomputed.",
        "auto",
    )
    nll_weight: float = doc(
        "dpo only: alpha of RPO (Pang et al. 2024; TRL's rpo_alpha): alpha times the chosen answer's NLL per token"
        " is added to each pair's loss, against DPO's habit of lowering the chosen answers too while it widens the"
        " margin.",
        0.0,
    )

    def beta_for(self, objective: str) -> float:
        """The beta `objective` trains with: the recipe's, else the objective's default (DEFAULT_BETA)."""
        return DEFAULT_BETA[objective] if self.beta is None else self.beta


# Keys of `preference:` and the objectives they belong to (a key set for another objective is refused).
PREFERENCE_KEYS = {
    "beta": ("dpo", "orpo", "simpo"),
    "loss": ("dpo",),
    "gamma": ("simpo",),
    "reference": ("dpo",),
    "nll_weight": ("dpo",),
}


@dataclass(frozen=True)
class RewardConfig:
    function: str = doc(
        "`module:function` called with prompt=, completion= and the row's other fields as keywords; returns a"
        " number. llmtune.rewards:exact_match ships (completion == the row's `answer`, spaces stripped)."
    )
    weight: float = doc("Its weight in the summed reward.", 1.0)


@dataclass(frozen=True)
class GRPOConfig:
    num_generations: int = doc("Completions sampled per prompt (the group whose rewards are compared).", 8)
    max_new_tokens: int = doc("Longest completion; a prompt may take data.max_length tokens on top.", 256)
    temperature: float = doc("Sampling temperature (the loss's log-probabilities use the same, as TRL's).", 1.0)
    top_p: float = doc("Nucleus sampling: keep the smallest set of tokens with this much probability.", 1.0)
    beta: float = doc(
        "KL to the reference (the starting weights: adapters off under LoRA, else a frozen copy); 0: no reference.",
        0.0,
    )
    epsilon: float = doc("Lower clip of the probability ratio: 1 - epsilon.", 0.2)
    epsilon_high: float | None = doc(
        "Upper clip: 1 + epsilon_high (DAPO's clip-higher uses 0.28); null: epsilon.", None
    )
    loss: Literal["grpo", "dr_grpo", "dapo"] = doc(
        "Averaging: grpo per completion then over completions; dr_grpo over completions x max_new_tokens;"
        " dapo over the completion tokens of the global batch (TRL's default).",
        "dapo",
    )
    scale_rewards: Literal["group", "batch", "none"] = doc(
        "Divide advantages by the std of rewards in the group, in the global batch, or not at all (Dr. GRPO).", "group"
    )
    num_iterations: int = doc("Optimizer steps per batch of completions (their old log-probs are kept).", 1)
    rewards: list[RewardConfig] = doc(
        "Reward functions, summed by weight.", factory=lambda: [RewardConfig("llmtune.rewards:exact_match")]
    )


@dataclass(frozen=True)
class DistributedConfig:
    timeout: float = doc(
        "Seconds a process waits in a collective for the others before the run fails (torch's process-group timeout;"
        " torch's own defaults are 10 min for NCCL, 30 for gloo). Raise it when one process alone does long work the"
        " others wait for (tokenising a large dataset, writing a large checkpoint). 1800: the HF Trainer's default.",
        1800.0,
    )


@dataclass(frozen=True)
class ParallelConfig:
    sequence_parallel: int | Literal["auto"] = doc(
        "Processes each packed row is split across along the sequence (Ulysses: all-to-all before and after"
        " attention; docs/long-context.md). auto: the planner's choice among the degrees that divide the process"
        " count and the model's heads and keep a group on one node (1 where whole rows fit); N: that degree (a group"
        " spanning nodes is timed over the network).",
        "auto",
    )
    tiled_mlp: bool | Literal["auto"] = doc(
        "Compute each decoder MLP in sequence tiles, recomputed in backward, so its [tokens, intermediate]"
        " activations exist one tile at a time (ALST's tiled MLP). auto: the planner's choice, where long rows need"
        " it.",
        "auto",
    )


@dataclass(frozen=True)
class Recipe:
    model: ModelConfig = doc("The causal LM and its tokenizer.")
    data: DataConfig = doc("Where the examples come from and how they become tokens.", factory=DataConfig)
    output_dir: str = doc(
        "Where recipe.yaml, metrics.jsonl, checkpoints/ and final/ go (`~` is expanded).", "runs/default"
    )
    overwrite: bool = doc(
        "Let a new run write into an output_dir that holds a finished run (final/) or files no llmtune run wrote,"
        " replacing its final/, metrics.jsonl and recipe.yaml (and, with checkpoint.resume none, pruning its"
        " checkpoints as this run's). Without it such a folder is refused; resuming a checkpoint needs no overwrite.",
        False,
    )
    seed: int = doc("Seed for initialisation, data order and dropout.", 42)
    training: TrainingConfig = doc("The optimisation.", factory=TrainingConfig)
    memory: MemoryConfig = doc("Memory planning.", factory=MemoryConfig)
    checkpoint: CheckpointConfig = doc("Checkpoints and resume.", factory=CheckpointConfig)
    logging: LoggingConfig = doc("Metrics and trackers.", factory=LoggingConfig)
    peft: PeftConfig = doc("LoRA / DoRA / QLoRA adapters.", factory=PeftConfig)
    preference: PreferenceConfig = doc(
        "Preference tuning settings (training.objective dpo / orpo / simpo).", factory=PreferenceConfig
    )
    grpo: GRPOConfig = doc("Online RL settings (training.objective grpo).", factory=GRPOConfig)
    distributed: DistributedConfig = doc("Several processes (launched by accelerate).", factory=DistributedConfig)
    parallel: ParallelConfig = doc("How a row's work is split: across processes, and in tiles.", factory=ParallelConfig)

    def __post_init__(self) -> None:
        # As a shell would: left alone, `~/runs/x` made a folder named `~` in the working directory.
        object.__setattr__(self, "output_dir", os.path.expanduser(self.output_dir))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """Read `path`, follow its `base:` chain, apply dotted overrides, validate. Raises RecipeError."""
    raw, origins = _read_with_bases(Path(path), seen=())
    problems: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            problems.append(f"{COMMAND_LINE}: override {item!r} is not of the form key.sub=value")
            continue
        _set_dotted(raw, key.strip(), yaml.safe_load(value) if value.strip() else None)
        origins[key.strip()] = COMMAND_LINE
    recipe = _build(Recipe, raw, "", origins, str(path), problems)
    if not problems:
        problems += [f"{origins.get(key, str(path))}: {why}" for key, why in _check_values(recipe)]
    if problems:
        raise RecipeError(problems)
    return recipe


def recipe_from_dict(data: dict[str, Any], source: str = "<dict>") -> Recipe:
    """Validate an already-parsed mapping (e.g. the recipe.yaml saved in a checkpoint)."""
    problems: list[str] = []
    recipe = _build(Recipe, data, "", {}, source, problems)
    if not problems:
        problems += [f"{source}: {why}" for _, why in _check_values(recipe)]
    if problems:
        raise RecipeError(problems)
    return recipe


def reference() -> str:
    """Markdown table of every recipe key, its type, default and documentation (docs/recipes.md)."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
            nested = tp if dataclasses.is_dataclass(tp) else item if dataclasses.is_dataclass(item) else None
            if f.default is not dataclasses.MISSING:
                default = yaml.safe_dump(f.default, default_flow_style=True).strip().removesuffix("...").strip()
            elif f.default_factory is not dataclasses.MISSING and not nested:
                default = yaml.safe_dump(_plain(f.default_factory()), default_flow_style=True).strip()
            else:
                default = "required" if f.default_factory is dataclasses.MISSING else ""
            kind = "list of mappings" if item and nested else "mapping" if nested else _describe(tp).replace("|", "\\|")
            lines.append(
                f"| `{prefix}{f.name}` | {kind} | {'`' + default + '`' if default else ''} | {f.metadata['doc']} |"
            )
            if nested:
                walk(nested, f"{prefix}{f.name}{'[]' if item else ''}.")

    walk(Recipe, "")
    return "\n".join(lines) + "\n"


# YAML 1.1 (PyYAML) reads 1e-4 (no dot) as a string; the loader accepts it as a number, so the schema does too.
_FLOAT_STRING = r"^[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$"


def json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a recipe file, generated from the dataclasses above (`llmtune schema`).

    Editors use it (the `# yaml-language-server: $schema=...` line of the shipped recipes) to complete keys and
    flag typos as you type; `load_recipe` stays the authority (it also checks values the types cannot express).
    """

    def of_type(tp: Any) -> dict[str, Any]:
        origin = typing.get_origin(tp)
        if dataclasses.is_dataclass(tp):
            return of_dataclass(tp)
        if origin in (Union, types.UnionType):
            return {"anyOf": [of_type(a) for a in typing.get_args(tp)]}
        if origin is Literal:
            return {"enum": list(typing.get_args(tp))}
        if origin is list:
            return {"type": "array", "items": of_type(typing.get_args(tp)[0])}
        if origin is dict:
            return {"type": "object", "additionalProperties": {"type": "string"}}
        if tp is float:
            return {"anyOf": [{"type": "number"}, {"type": "string", "pattern": _FLOAT_STRING}]}
        names = {int: "integer", str: "string", bool: "boolean", type(None): "null"}
        return {"type": names[tp]}

    def of_dataclass(cls: type) -> dict[str, Any]:
        hints = typing.get_type_hints(cls)
        properties, required = {}, []
        for f in dataclasses.fields(cls):
            prop = {"description": f.metadata["doc"], **of_type(hints[f.name])}
            if f.default is not dataclasses.MISSING:
                prop["default"] = f.default
            elif f.default_factory is not dataclasses.MISSING and not dataclasses.is_dataclass(hints[f.name]):
                prop["default"] = _plain(f.default_factory())
            elif f.default_factory is dataclasses.MISSING:
                required.append(f.name)
            properties[f.name] = prop
        out = {"type": "object", "properties": properties, "additionalProperties": False}
        return out | ({"required": required} if required else {})

    root = of_dataclass(Recipe)
    # `base:` is read before validation (a recipe inherits from another), so it is no dataclass field.
    root["properties"]["base"] = {"description": "Recipe file this one inherits from.", "type": "string"}
    # A recipe with a `base:` may leave required keys to its base.
    root.pop("required")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "llmtune recipe",
        "description": "Generated from llmtune/recipe.py by `llmtune schema`; see docs/recipes.md.",
        **root,
    }


def _plain(value: Any) -> Any:
    """A default as YAML and JSON write it: dataclasses (grpo.rewards' items) as mappings."""
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return [_plain(v) for v in value] if isinstance(value, list) else value


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)


def _read_with_bases(path: Path, seen: tuple[Path, ...]) -> tuple[dict[str, Any], dict[str, str]]:
    """Deep-merge a recipe over its `base:` (relative to the recipe's folder); track each key's file."""
    if path.is_dir():
        raise RecipeError([f"{path}: is a folder, not a recipe file"])
    if not path.is_file():
        raise RecipeError([f"{path}: recipe file not found"])
    if path.resolve() in seen:
        raise RecipeError([f"{path}: `base:` chain loops back to itself"])
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8")) or {}
    except OSError as err:
        raise RecipeError([f"{path}: cannot read: {err.strerror}"]) from None
    except UnicodeDecodeError as err:
        raise RecipeError([f"{path}: not UTF-8 text (byte {err.start}): is it a recipe YAML file?"]) from None
    except yaml.YAMLError as err:
        raise RecipeError([f"{path}: not valid YAML: {' '.join(str(err).split())}"]) from None
    if not isinstance(data, dict):
        raise RecipeError([f"{path}: a recipe must be a mapping of keys, got {type(data).__name__}"])
    base = data.pop("base", None)
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    if base is not None:
        merged, origins = _read_with_bases(path.parent / str(base), seen + (path.resolve(),))
    _deep_merge(merged, data)
    for key in _dotted_keys(data):
        origins[key] = str(path)
    return merged, origins


def flatten(data: dict[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Nested mapping -> {dotted.key: leaf value}."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}{sep}", sep))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _deep_merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def _dotted_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        if isinstance(value, dict):
            keys += _dotted_keys(value, dotted + ".")
    return keys


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        if not isinstance(data.get(part), dict):
            data[part] = {}
        data = data[part]
    data[last] = value


# ---------------------------------------------------------------- validation


def _build(cls: type, data: Any, prefix: str, origins: dict[str, str], default_file: str, problems: list[str]) -> Any:
    """Build dataclass `cls` from `data`, appending every problem (with file and dotted key) to `problems`."""

    def where(key: str) -> str:
        return origins.get(key, origins.get(key.rsplit(".", 1)[0], default_file))

    if not isinstance(data, dict):
        problems.append(f"{where(prefix.rstrip('.'))}: `{prefix.rstrip('.')}` must be a mapping, got {data!r}")
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            valid = [f"{prefix}{name}" for name in fields]
            close = difflib.get_close_matches(dotted, valid, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else f" (valid keys here: {', '.join(valid)})"
            problems.append(f"{where(dotted)}: unknown key `{dotted}`{hint}")
            continue
        kwargs[key] = _convert(hints[key], value, dotted, where, origins, default_file, problems)
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(f"{default_file}: missing required key `{prefix}{name}` ({f.metadata.get('doc', '')})")
    if any(p for p in problems):
        return None
    return cls(**kwargs)


def _convert(tp: Any, value: Any, dotted: str, where, origins, default_file, problems) -> Any:
    """Check `value` against the annotation `tp`; coerce ints to floats; recurse into dataclasses."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, dotted + ".", origins, default_file, problems)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            attempt: list[str] = []
            result = _convert(option, value, dotted, where, origins, default_file, attempt)
            if not attempt:
                return result
        problems.append(f"{where(dotted)}: `{dotted}` must be {_describe(tp)}, got {value!r}")
        return None
    if origin is Literal:
        if value not in typing.get_args(tp):
            problems.append(f"{where(dotted)}: `{dotted}` must be {_describe(tp)}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            problems.append(f"{where(dotted)}: `{dotted}` must be a list, got {value!r}")
            return None
        return [
            _convert(item_tp, v, f"{dotted}[{i}]", where, origins, default_file, problems) for i, v in enumerate(value)
        ]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            problems.append(f"{where(dotted)}: `{dotted}` must be a mapping of names to names, got {value!r}")
        return value
    if tp is float:
        number = _as_float(value)
        if number is not None:
            # No rule below can refuse NaN (every comparison with it is false), and no float key means infinity.
            if not math.isfinite(number):
                problems.append(f"{where(dotted)}: `{dotted}` must be a finite number, got {value!r}")
            return number
    if tp is type(None) and value is None:
        return None
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        problems.append(f"{where(dotted)}: `{dotted}` must be {_describe(tp)}, got {value!r}")
    return value


def _as_float(value: Any) -> float | None:
    """`value` as a float key reads it (ints, floats, and strings YAML left unread), or None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:  # YAML reads 1e-4 (no dot) as a string; accept it as the number it obviously is.
            return float(value)
        except ValueError:
            return None
    return None


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping of " + ", ".join(f.name for f in dataclasses.fields(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


_Need = Callable[[bool, str, str], None]


def _check_values(r: Recipe) -> list[tuple[str, str]]:
    """Value rules that types alone cannot express, as (dotted key, message)."""
    problems: list[tuple[str, str]] = []

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            problems.append((key, f"`{key}` {why}"))

    _check_run(r, need)
    _check_training(r.training, need)
    _check_peft(r, need)
    return problems + _check_objective(r) + _check_grpo(r) + _check_budget(r)


def _check_run(r: Recipe, need: _Need) -> None:
    need(bool(r.data.train), "data.train", "must name at least one source")
    for split in ("train", "eval"):
        for i, src in enumerate(getattr(r.data, split)):
            need(src.weight > 0, f"data.{split}[{i}].weight", f"must be positive, got {src.weight}")
    # random, numpy and torch all take it: numpy only in [0, 2**32).
    need(0 <= r.seed < 2**32, "seed", f"must be in [0, 2**32), got {r.seed}")
    need(r.data.max_length > 0, "data.max_length", "must be positive")
    need(0.0 <= r.data.eval_fraction < 1.0, "data.eval_fraction", "must be in [0, 1)")
    need(0 < r.distributed.timeout < math.inf, "distributed.timeout", "must be a positive number of seconds")
    sp = r.parallel.sequence_parallel
    need(sp == "auto" or (type(sp) is int and sp >= 1), "parallel.sequence_parallel", f"must be auto or >= 1, got {sp}")
    need(r.checkpoint.every_n_steps >= 0, "checkpoint.every_n_steps", "must be >= 0")
    need(r.checkpoint.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
    need(r.logging.every_n_steps >= 1, "logging.every_n_steps", "must be >= 1")


def _check_training(t: TrainingConfig, need: _Need) -> None:
    need(t.global_batch_size > 0, "training.global_batch_size", "must be positive")
    need(t.max_steps > 0, "training.max_steps", "must be positive")
    need(t.learning_rate > 0, "training.learning_rate", "must be positive")
    # A warmup longer than the run is allowed (smoke runs: max_steps=1): the rate never reaches its peak.
    need(t.warmup_steps >= 0, "training.warmup_steps", "must be >= 0")
    need(0.0 <= t.min_lr_ratio <= 1.0, "training.min_lr_ratio", "must be in [0, 1]")
    betas_ok = len(t.adam_betas) == 2 and all(0 <= b < 1 for b in t.adam_betas)
    need(betas_ok, "training.adam_betas", "must be two numbers in [0, 1)")
    need(t.max_grad_norm >= 0, "training.max_grad_norm", "must be >= 0")
    need(t.weight_decay >= 0, "training.weight_decay", "must be >= 0")
    if isinstance(t.gradient_checkpointing, Checkpointing):
        every = t.gradient_checkpointing.every_n_layers
        need(every >= 0, "training.gradient_checkpointing", "every_n_layers must be >= 0")
    need(t.max_nonfinite_steps >= 1, "training.max_nonfinite_steps", "must be >= 1")
    if isinstance(t.micro_batch_size, int):
        need(t.micro_batch_size > 0, "training.micro_batch_size", "must be positive or auto")
        need(
            t.micro_batch_size <= 0 or t.global_batch_size % t.micro_batch_size == 0,
            "training.global_batch_size",
            f"({t.global_batch_size}) must be a multiple of training.micro_batch_size ({t.micro_batch_size})",
        )


def _check_peft(r: Recipe, need: _Need) -> None:
    need(r.peft.rank >= 1, "peft.rank", f"must be >= 1, got {r.peft.rank}")
    need(0 <= r.peft.dropout < 1, "peft.dropout", f"must be in [0, 1), got {r.peft.dropout}")
    if r.peft.adapter_dtype == "bf16":
        need(r.peft.method != "none", "peft.adapter_dtype", "applies to adapters: set peft.method")
        need(
            r.training.precision == "bf16-true",
            "peft.adapter_dtype",
            f"bf16 needs training.precision bf16-true, not {r.training.precision}: mixed precision trains fp32 weights",
        )


def _check_budget(r: Recipe) -> list[tuple[str, str]]:
    if r.memory.budget == "auto":
        return []
    try:
        parse_bytes(r.memory.budget)
    except ValueError:
        return [("memory.budget", f"`memory.budget` must be auto or a size like 20GiB, got {r.memory.budget!r}")]
    return []


def _check_grpo(r: Recipe) -> list[tuple[str, str]]:
    """`grpo:` keys set without objective grpo, and values no sampler or loss accepts."""
    g, problems = r.grpo, []
    if r.training.objective != "grpo":
        changed = [k for k in dataclasses.asdict(g) if getattr(g, k) != getattr(GRPOConfig(), k)]
        return [
            (f"grpo.{k}", f"`grpo.{k}` applies to training.objective grpo, not {r.training.objective}") for k in changed
        ]

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            problems.append((key, f"`{key}` {why}"))

    need(g.num_generations >= 2, "grpo.num_generations", "must be >= 2 (a group compares its completions)")
    need(
        r.training.global_batch_size % g.num_generations == 0,
        "training.global_batch_size",
        f"({r.training.global_batch_size}) counts completions: it must be a multiple of grpo.num_generations"
        f" ({g.num_generations})",
    )
    need(g.max_new_tokens > 0, "grpo.max_new_tokens", "must be positive")
    need(g.temperature > 0, "grpo.temperature", "must be positive")
    need(0 < g.top_p <= 1, "grpo.top_p", "must be in (0, 1]")
    need(g.beta >= 0, "grpo.beta", "must be >= 0")
    need(0 <= g.epsilon < 1, "grpo.epsilon", "must be in [0, 1)")
    need(g.epsilon_high is None or g.epsilon_high >= 0, "grpo.epsilon_high", "must be >= 0")
    need(g.num_iterations >= 1, "grpo.num_iterations", "must be >= 1")
    need(bool(g.rewards), "grpo.rewards", "must name at least one reward function")
    for i, reward in enumerate(g.rewards):
        need(":" in reward.function, f"grpo.rewards[{i}].function", f"must be module:function, got {reward.function!r}")
    every = r.checkpoint.every_n_steps
    need(
        every % g.num_iterations == 0,
        "checkpoint.every_n_steps",
        f"({every}) must be a multiple of grpo.num_iterations ({g.num_iterations}): a checkpoint inside a batch of"
        " completions would resume with completions sampled again from other weights",
    )
    need(
        not r.data.eval and r.data.eval_fraction == 0,
        "data.eval",
        "is not read by grpo (its metrics are the rewards of each step): leave data.eval and data.eval_fraction unset",
    )
    return problems


def _check_objective(r: Recipe) -> list[tuple[str, str]]:
    """The objective, its data and its `preference:` keys agree: a key of another objective names the one it needs.

    A key counts as set when it differs from its default: a saved recipe.yaml lists every key.
    """
    objective, p, problems = r.training.objective, r.preference, []
    for key, owners in PREFERENCE_KEYS.items():
        value = getattr(p, key)
        legacy = key == "beta" and value == _LEGACY_BETA
        if value != getattr(PreferenceConfig(), key) and not legacy and objective not in owners:
            problems.append(
                (
                    f"preference.{key}",
                    f"`preference.{key}` applies to training.objective {' / '.join(owners)}, not {objective}",
                )
            )
    wanted = {"sft": None, "grpo": "prompt"}.get(objective, "preference")
    for split in ("train", "eval"):
        for i, src in enumerate(getattr(r.data, split)):
            ok = src.format == wanted if wanted else src.format not in ("preference", "prompt")
            if not ok:
                need = f"format: {wanted}" if wanted else "an sft format (not preference or prompt)"
                problems.append(
                    (
                        f"data.{split}",
                        f"`data.{split}[{i}].format` is {src.format!r}: training.objective {objective} needs {need}",
                    )
                )
    if p.beta is not None and p.beta <= 0:
        problems.append(("preference.beta", "`preference.beta` must be positive"))
    if p.nll_weight < 0:
        problems.append(("preference.nll_weight", "`preference.nll_weight` must be >= 0"))
    if p.reference == "adapter_disabled" and r.peft.method == "none":
        problems.append(
            (
                "preference.reference",
                "`preference.reference` adapter_disabled needs LoRA (peft.method); use copy or precomputed",
            )
        )
    return problems
