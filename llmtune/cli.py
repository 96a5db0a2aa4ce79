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

    from llmtune.merge import add_merge_parser

    add_merge_parser(sub)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the user asked for something wrong or impossible (exit 2, no traceback)."""
    from llmtune.checkpoint import ResumeError
    from llmtune.data import DataError
    from llmtune.metrics import TrackerError
    from llmtune.model import SetupError
    from llmtune.recipe import RecipeError
    from llmtune.train import PlanError

    return RecipeError, DataError, SetupError, ResumeError, TrackerError, PlanError


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
