"""`llmtune` command line: train, estimate, data, bench, plot, merge.

User mistakes (a bad recipe, bad data, a request this machine cannot run) print one clear message and
exit with status 2 — never a traceback. A run stopped by a signal after checkpointing exits 75.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable

EXIT_USAGE = 2


def _setup_logging() -> None:
    # Only the main process speaks at INFO; the others report warnings and errors.
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", required=True, help="recipe YAML file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.max_steps=20 output_dir=/tmp/x")


def cmd_train(args: argparse.Namespace) -> int:
    from llmtune.recipe import load_recipe
    from llmtune.train import EXIT_PREEMPTED, train

    summary = train(load_recipe(args.recipe, args.overrides))
    return EXIT_PREEMPTED if "preempted_at_step" in summary else 0


def cmd_data(args: argparse.Namespace) -> int:
    from llmtune.data import prepare_data, render_report, report_json
    from llmtune.model import load_tokenizer
    from llmtune.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    tokenizer = load_tokenizer(recipe.model)
    data = prepare_data(recipe.data, tokenizer, seed=recipe.seed)
    if args.json:
        print(json.dumps(report_json(data, args.show)))
    else:
        print(render_report(data, tokenizer, args.show))
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from llmtune.loss import resolve_loss_impl
    from llmtune.memory.estimate import format_bytes, parse_bytes
    from llmtune.memory.plan import default_budget, estimate_settings, format_plan, plan_for_budget
    from llmtune.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    config = AutoConfig.from_pretrained(args.config or recipe.model.name_or_path, revision=recipe.model.revision)
    settings = estimate_settings(
        recipe,
        loss=resolve_loss_impl(recipe.training.loss, config),
        device=args.device,
        sharding=args.sharding,
    )
    if args.device_memory:
        budget = parse_bytes(args.device_memory)
    elif recipe.memory.budget != "auto":
        budget = parse_bytes(recipe.memory.budget)
    elif args.device == "cuda" and not torch_cuda_available():
        raise EstimateError(
            "no GPU here to read free memory from: say how much the target has, e.g. --device-memory 80GiB"
        )
    else:
        budget = default_budget(args.device)
    plan = plan_for_budget(recipe, config, settings, budget_bytes=budget, num_processes=args.num_processes)
    if args.plot:
        from llmtune.plot import plot_estimate

        plot_estimate(recipe, config, settings, plan, args.num_processes, args.plot)
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        print(format_plan(plan, title=f"{recipe.model.name_or_path}: {format_bytes(budget)} budget per process"))
    return 0


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class EstimateError(ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmtune", description="Fine-tune causal LMs from a recipe.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a recipe (also: accelerate launch scripts/finetune.py)")
    _recipe_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("data", help="show rendered examples with trained tokens marked, and data statistics")
    _recipe_args(p)
    p.add_argument("--show", type=int, default=3, help="examples to show")
    p.add_argument("--json", action="store_true", help="print one JSON object (rows and stats)")
    p.set_defaults(func=cmd_data)

    p = sub.add_parser("estimate", help="predict peak training memory and the micro-batch that fits (no weights)")
    _recipe_args(p)
    p.add_argument("--device-memory", help="memory per device to plan for, e.g. 80GiB (default: memory.budget)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="the device the run will use")
    p.add_argument("--num-processes", type=int, default=1, help="processes (GPUs) the run will use")
    p.add_argument("--sharding", choices=["none", "fsdp", "zero2", "zero3"], default="none")
    p.add_argument("--config", help="a folder or file with the model's config.json (else model.name_or_path)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", help="write a PNG of the breakdown against micro-batch size")
    p.set_defaults(func=cmd_estimate)

    from llmtune.bench import add_bench_parser
    from llmtune.merge import add_merge_parser
    from llmtune.plot import add_plot_parser

    add_bench_parser(sub)
    add_plot_parser(sub)
    add_merge_parser(sub)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the user asked for something wrong or impossible (exit 2, no traceback)."""
    from llmtune.checkpoint import ResumeError
    from llmtune.data import DataError
    from llmtune.memory.plan import MemoryPlanError
    from llmtune.metrics import TrackerError
    from llmtune.model import SetupError
    from llmtune.recipe import RecipeError
    from llmtune.train import PlanError

    return RecipeError, DataError, SetupError, ResumeError, TrackerError, PlanError, MemoryPlanError, EstimateError


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging()
    func: Callable[[argparse.Namespace], int] = args.func
    from llmtune.train import TrainingError

    try:
        return func(args)
    except user_errors() as err:
        print(f"llmtune: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingError as err:
        print(f"llmtune: training stopped: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("llmtune: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    sys.exit(main())
