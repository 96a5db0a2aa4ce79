"""`llmtune estimate`: will this recipe (or model) fit on that card, how fast, and with which micro-batch,
checkpointing,
engine and sequence split; no GPU and no weights needed (llmtune.plan)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from llmtune.cli.args import degree, positive_int
from llmtune.errors import LlmtuneError


def cmd_estimate(args: argparse.Namespace) -> int:
    from llmtune.model.load import resolve_config
    from llmtune.plan.planning import fixed_degree, format_engines, format_how, how, plan_recipe, rows_per_process
    from llmtune.plan.report import forecasts
    from llmtune.units import parse_bytes

    recipe, target = _estimate_target(args)
    recipe = _with_split(recipe, args)
    model = recipe.model
    config = resolve_config(args.config or model.name_or_path, revision=model.revision)
    # Refused as training refuses it (`plan_run`), before the data is read.
    rows_per_process(
        recipe.training.global_batch_size, args.num_processes, fixed_degree(recipe, config, args.num_processes)
    )
    fraction, data = _plan_data(recipe, args) if args.recipe else (1.0, None)
    where = dict(device=target.device, budget_bytes=target.budget_bytes, num_processes=args.num_processes)
    if args.host_memory:  # a node's, shared by its processes (at most 8 GPUs a node)
        where["host_bytes"] = parse_bytes(args.host_memory) // min(args.num_processes, 8)
    where |= dict(trained_fraction=fraction, gpu=args.gpu)
    engines = _ranked_engines(recipe, config, args, where)
    if engines:  # the fastest engine's plan, as ranked
        plan, settings = engines[0].plan, engines[0].settings
    else:
        sharding = "none" if args.sharding == "auto" else args.sharding
        plan, settings = plan_recipe(recipe, config, **where, sharding=sharding)
    if data is not None:
        data |= _planned_share(data, settings["trained_fraction"], recipe.training.objective)
    if args.plot:
        from llmtune.cli.plot import plot_estimate

        plot_estimate(plan, f"{model.name_or_path}: memory against speed", args.plot)
    answer = how(plan, engines[0].engine if engines else None)
    untimed = None if forecasts(plan) else _why_no_time(args, target.device, settings["precision"])
    if args.json:
        facts = {"device": target.device, "budget_from": target.why} | ({"data": data} if data else {})
        ranked = {"engines": [c.to_dict() for c in engines]} if engines else {}
        timed = {"predicted_tokens_per_s": None, "time_not_predicted": untimed} if untimed else {}
        print(json.dumps(plan.to_dict() | facts | ranked | {"how": answer} | timed))
    else:
        _print_estimate(plan, target, model.name_or_path, data, args.plot)
        if engines:
            print("\n".join(format_engines(engines)))
        print("\n" + format_how(answer, target.budget_bytes))
        if untimed:
            print(f"time: not predicted: {untimed}")
    return 0


def _why_no_time(args: argparse.Namespace, device: str, precision: str) -> str:
    """Why the plan's speeds only rank its candidates (nominal rates): what it is for has no rates to time it with."""
    if args.gpu:
        what = f"--gpu {args.gpu} has no published datasheet peak for {precision} matmuls"
    elif device == "cuda":
        what = "no GPU here to measure and no card named (--gpu NAME times with its datasheet)"
    else:
        what = "a CPU planned for on a machine with a GPU, which is what this machine measures"
    return f"{what}; the memory and the micro-batch stand, the speeds above only rank the candidates"


def _with_split(recipe: Any, args: argparse.Namespace) -> Any:
    """The recipe with --sequence-parallel and --tiled-mlp in place of its `parallel` keys, where given."""
    from dataclasses import replace

    changes = {}
    if args.sequence_parallel is not None:
        changes["sequence_parallel"] = args.sequence_parallel
    if args.tiled_mlp is not None:
        changes["tiled_mlp"] = {"on": True, "off": False}.get(args.tiled_mlp, args.tiled_mlp)
    return replace(recipe, parallel=replace(recipe.parallel, **changes)) if changes else recipe


def _ranked_engines(recipe: Any, config: Any, args: argparse.Namespace, kwargs: dict[str, Any]) -> list[Any]:
    """`--sharding auto` over several processes: every engine's plan, fastest that fits first (`plan_engines`); the
    error of each where none fits. Otherwise none: the flag's engine is planned alone."""
    from llmtune.plan import MemoryPlanError
    from llmtune.plan.planning import plan_engines

    if args.sharding != "auto" or args.num_processes < 2:
        return []
    engines = plan_engines(recipe, config, **kwargs)
    if engines[0].plan is None:
        raise MemoryPlanError(
            f"no engine fits {args.num_processes} processes: " + "; ".join(f"{c.engine}: {c.why}" for c in engines)
        )
    return engines


def _estimate_target(args: argparse.Namespace) -> tuple[Any, Any]:
    """The recipe `llmtune estimate` plans (the given one, or `recipe_for_model`'s for --model) and the device and
    budget it plans for (`planning_target`); a mistake in the flags is a MemoryPlanError."""
    from llmtune.model.load import resolve_config
    from llmtune.plan import MemoryPlanError, planning_target, recipe_for_model
    from llmtune.recipe import load_recipe

    if args.model is not None and (args.recipe or args.overrides or args.config or args.no_data):
        raise MemoryPlanError("--model plans without a recipe: leave out --recipe, --config, --no-data and overrides")
    if args.model is None and (args.method or args.seq_len or args.adapter_dtype):
        raise MemoryPlanError(
            "--lora/--qlora/--full, --seq-len and --adapter-dtype go with --model (a recipe sets them itself)"
        )
    if args.model is None and not args.recipe:
        raise MemoryPlanError("say what to plan: --model NAME_OR_DIR, or --recipe R")
    recipe = load_recipe(args.recipe, args.overrides) if args.recipe else None
    target = planning_target(
        device_memory=args.device_memory,
        gpu=args.gpu,
        device=args.device,
        recipe_budget=recipe.memory.budget if recipe else "auto",
    )
    if recipe is None:
        config = resolve_config(args.model)
        recipe = recipe_for_model(
            args.model,
            config,
            method=args.method or "lora",
            seq_len=args.seq_len or 2048,
            device=target.device,
            adapter_dtype=args.adapter_dtype or "fp32",
        )
        # recipe_for_model chooses bf16-true for adapters on a GPU only; the recipe key's own rule (recipe.py).
        if recipe.peft.adapter_dtype == "bf16" and recipe.training.precision != "bf16-true":
            raise MemoryPlanError("--adapter-dtype bf16 needs adapters (--lora, --qlora) planned for a GPU (bf16-true)")
    return recipe, target


# `llmtune estimate --recipe` prepares at most this many rows of each source, as training prepares them: enough
# rows for the densest one's trained share to show (quickstart's 6,000 are read whole, in about a second), where
# the whole of a large hub dataset would take minutes to tokenise. Training reads every row: a denser row further
# in can raise its plan (--no-data plans the bound, every token trained).
ESTIMATE_DATA_ROWS = 10_000


def _plan_data(recipe: Any, args: argparse.Namespace) -> tuple[float, dict[str, Any]]:
    """The share of a row's tokens the plan takes as trained: the recipe's data's `DataStats.max_trained_fraction`,
    as training computes it (on at most ESTIMATE_DATA_ROWS rows of each source), and what was read; 1.0, the bound,
    where the data was not read (--no-data, or why it could not be)."""
    from llmtune.data import prepare_data
    from llmtune.model.load import load_tokenizer

    why = "--no-data" if args.no_data else _hub_unreachable(recipe)
    if why is None:
        try:
            tokenizer = load_tokenizer(recipe.model)
            prepared = prepare_data(recipe.data, tokenizer, seed=recipe.seed, first_rows=ESTIMATE_DATA_ROWS)
        except LlmtuneError as err:
            why = str(err)
    if why is not None:
        return 1.0, {"read": False, "why": why}
    stats, evaluation = prepared.stats, prepared.eval_stats.source_rows if prepared.eval_stats else 0
    return stats.max_trained_fraction, {
        "read": True,
        "rows_read": stats.source_rows + evaluation,
        "row_limit": ESTIMATE_DATA_ROWS,  # per source
        # Each split's sources together under the limit: all read; else one may have rows past it, not read.
        "whole": max(stats.source_rows, evaluation) < ESTIMATE_DATA_ROWS,
        "examples": stats.examples,
        "max_length": stats.max_length,
        "max_trained_fraction": stats.max_trained_fraction,
    }


def _planned_share(data: dict[str, Any], share: float, objective: str) -> dict[str, Any]:
    """The share of a row's tokens the planner took as trained, and whence: the data's, the bound (data not read),
    or grpo's completions, which training plans whatever the data (`training_rows`)."""
    whence = "grpo's completions" if objective == "grpo" else "the data" if data["read"] else "the bound"
    return {"trained_fraction": share, "trained_fraction_from": whence}


def _hub_unreachable(recipe: Any) -> str | None:
    """Why the recipe's tokenizer or data, where a hub id names them, cannot be read now: the hub does not answer a
    quick connection (`hub_unreachable`). None where every name is local, the hub answers, a proxy stands between, or
    HF_HUB_OFFLINE asks for the cache alone (which is quick)."""
    from pathlib import Path

    from huggingface_hub import constants

    from llmtune.data.load import on_hub
    from llmtune.model.load import hub_unreachable

    tokenizer = recipe.model.tokenizer or recipe.model.name_or_path
    names = [tokenizer] if not Path(tokenizer).expanduser().exists() else []
    names += [s.path for s in (*recipe.data.train, *recipe.data.eval) if on_hub(s.path)]
    if not names or constants.HF_HUB_OFFLINE:
        return None
    why = hub_unreachable()
    return None if why is None else f"{', '.join(names)}: {why}; HF_HUB_OFFLINE=1 reads the cache"


def _print_estimate(plan: Any, target: Any, name: str, data: dict[str, Any] | None, plot: str | None) -> None:
    from llmtune.plan import format_plan
    from llmtune.units import format_bytes

    print(format_plan(plan, title=f"{_model_title(name)}: {format_bytes(target.budget_bytes)} budget per process"))
    print(f"budget: {target.why}")
    if data is not None:
        print(f"data: {_data_line(data)}")
    if plot:
        print(f"plot: {plot}")


# `_planned_share`'s whence -> its words in the plan's data line.
_SHARE_FROM = {
    "the data": "the data's densest row; --no-data would plan every token, the bound",
    "the bound": "every token, the bound",
    "grpo's completions": "grpo: each row's completion, whatever the data",
}


def _data_line(data: dict[str, Any]) -> str:
    """What `llmtune estimate` read of the recipe's data, and the trained share it planned with, in one line."""
    why = _SHARE_FROM[data["trained_fraction_from"]]
    planned = f"planned with {data['trained_fraction']:.1%} of each row's tokens trained ({why})"
    if not data["read"]:
        return f"not read ({data['why']}): {planned}"
    if data["whole"]:
        read = f"all {data['rows_read']:,} rows read"
    else:
        limit, rows = data["row_limit"], data["rows_read"]
        read = f"the first {limit:,} rows of each source read ({rows:,} rows; training reads all)"
    densest = f"the densest row trains {data['max_trained_fraction']:.1%} of {data['max_length']} tokens"
    return f"{read} and prepared as training prepares them; {densest}: {planned}"


def _model_title(name: str) -> str:
    from llmtune.catalogue import MODELS

    return f"{MODELS[name.lower()]} (catalogue: {name.lower()})" if name.lower() in MODELS else name


def add_estimate_parser(p: argparse.ArgumentParser) -> None:
    from llmtune.catalogue import GPUS, MODELS

    p.add_argument("--recipe", help="recipe YAML file (or plan a model without one: --model)")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the recipe, e.g. data.max_length=4096")
    p.add_argument("--model", help=f"plan without a recipe: a folder, a hub id, or offline: {', '.join(MODELS)}")
    method = p.add_mutually_exclusive_group()
    for flag, what in (("lora", "LoRA adapters (the default)"), ("qlora", "QLoRA"), ("full", "full fine-tune")):
        method.add_argument(f"--{flag}", dest="method", action="store_const", const=flag, help=f"with --model: {what}")
    p.add_argument("--seq-len", type=positive_int, help="with --model: tokens per example (default 2048)")
    p.add_argument(
        "--adapter-dtype",
        choices=["fp32", "bf16"],
        help="with --model: the adapters' dtype, as the recipe key peft.adapter_dtype (default fp32, peft's)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--device-memory",
        help="a device's memory, e.g. 24GiB: a CUDA card's, less the CUDA context, 10%% and 512 MiB as --gpu takes"
        " them (--device cpu: all of it)",
    )
    where.add_argument("--gpu", help=f"plan for a known card: {', '.join(GPUS)}")
    p.add_argument("--device", choices=["cuda", "cpu"], help="the kind of device (default: this machine's)")
    p.add_argument("--num-processes", type=positive_int, default=1, help="processes (GPUs) the run will use")
    p.add_argument(
        "--sharding",
        choices=["auto", "none", "fsdp", "fsdp_no_reshard", "zero2", "zero3"],
        default="auto",
        help="the engine's sharding (none: DDP; fsdp: FSDP2; fsdp_no_reshard: FSDP2 keeping blocks gathered to"
        " backward; zero2/zero3: DeepSpeed); auto: with several processes, plan each and take the fastest that fits",
    )
    p.add_argument(
        "--sequence-parallel",
        type=degree,
        help="processes each row is split across (Ulysses), as the recipe key parallel.sequence_parallel: auto (the"
        " planner weighs every degree that divides --num-processes and the model's heads and keeps a group on one"
        " node of 8) or N",
    )
    p.add_argument(
        "--tiled-mlp",
        choices=["auto", "on", "off"],
        help="the decoder MLPs in sequence tiles, as parallel.tiled_mlp (auto: where nothing fits without)",
    )
    p.add_argument(
        "--host-memory",
        help="a node's host memory, e.g. 256GiB: activation offloading must pin no more (default: not checked)",
    )
    p.add_argument("--config", help="with --recipe: a folder or file with the model's config.json")
    p.add_argument(
        "--no-data",
        action="store_true",
        help="with --recipe: do not read its data; plan every token as trained (the upper bound)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", help="write a PNG of the breakdown against micro-batch size")
    p.set_defaults(func=cmd_estimate)
