"""`llmtune` command line: train, data, estimate, bench, plot, merge, generate, chat, schema.

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

from llmtune.cli.args import recipe_args
from llmtune.cli.bench import add_bench_parser
from llmtune.cli.estimate import add_estimate_parser
from llmtune.cli.generate import add_generate_parsers
from llmtune.cli.merge import add_merge_parser
from llmtune.cli.plot import add_plot_parser
from llmtune.errors import EXIT_PREEMPTED, EXIT_USAGE, LlmtuneError


def setup_logging() -> None:
    # Only the main process speaks at INFO; the others report warnings and errors.
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for name, quiet in _QUIET.items():
        if quiet not in logging.getLogger(name).filters:  # main() may run several times in one process
            logging.getLogger(name).addFilter(quiet)
    if not sys.stderr.isatty() and "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ:  # a user's setting decides
        # Where no bar can be drawn (a log file, a CI log), transformers' and datasets' bars (loading and writing
        # weights, downloads, maps) are lines of carriage-return fragments, as llmtune's own bar is not drawn there.
        import datasets
        import transformers

        transformers.utils.logging.disable_progress_bar()  # the hub's bars too
        datasets.disable_progress_bars()


def _drop(*fragments: str) -> Callable[[logging.LogRecord], bool]:
    return lambda record: not any(fragment in record.getMessage() for fragment in fragments)


# Third-party log lines that say nothing to a user of a normal run, each dropped by its exact wording:
_QUIET = {
    # transformers 5 asks the authors of Phi-3/3.5's published config.json (rope `original_max_position_embeddings`
    # without `factor`) to update it; the user who plans or trains that model can do nothing about it.
    "transformers.modeling_rope_utils": _drop("rope_parameters['original_max_position_embeddings']"),
    # Tied weights (lm_head = embed_tokens) are one tensor under two names: a checkpoint stores it once and
    # accelerate's load_state (safetensors.torch.load_model) restores both names, as the message itself expects.
    "accelerate.utils.other": _drop("Removed shared tensor"),
    # Accelerate names each file a checkpoint writes or reads ("Model weights saved in .../model.safetensors": four
    # lines or more a checkpoint); llmtune's own line names the checkpoint ("saved checkpoint", "resumed from").
    # "Could not load random states" stays: a resume that cannot restore dropout's and sampling's RNG says so.
    "accelerate.accelerator": _drop("Saving current state to ", "Loading states from ", " custom states"),
    "accelerate.checkpointing": _drop(" saved in ", " loaded successfully"),
}


def cmd_train(args: argparse.Namespace) -> int:
    from llmtune.recipe import load_recipe
    from llmtune.run.loop import train

    try:
        summary = train(load_recipe(args.recipe, args.overrides))
    finally:
        # Also after a refusal or a failure: torch asks for the group to be ended before exit (a refused 2-process
        # ZeRO-2 resume once exited -6, SIGABRT, instead of 2 without it; not reproduced since).
        end_process_group()
    return EXIT_PREEMPTED if "preempted_at_step" in summary else 0


def end_process_group() -> None:
    """The launch's process group outlives each run (a launch may train several recipes); the process ends it,
    as torch asks before exit."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def cmd_data(args: argparse.Namespace) -> int:
    from llmtune.data import prepare_data, render_report, report_json
    from llmtune.model.load import load_tokenizer
    from llmtune.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    tokenizer = load_tokenizer(recipe.model)
    data = prepare_data(recipe.data, tokenizer, seed=recipe.seed)
    if args.json:
        print(json.dumps(report_json(data, args.show)))
    else:
        print(render_report(data, tokenizer, args.show))
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from llmtune.recipe import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmtune", description="Fine-tune causal LMs from a recipe.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a recipe (also: accelerate launch scripts/finetune.py)")
    recipe_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("data", help="show rendered examples with trained tokens marked, and data statistics")
    recipe_args(p)
    p.add_argument("--show", type=int, default=3, help="examples to show")
    p.add_argument("--json", action="store_true", help="print one JSON object (rows and stats)")
    p.set_defaults(func=cmd_data)

    add_estimate_parser(
        sub.add_parser("estimate", help="predict peak training memory and the micro-batch that fits (no weights)")
    )

    add_generate_parsers(sub)

    p = sub.add_parser("schema", help="print the JSON Schema of recipe files (docs/recipe.schema.json)")
    p.set_defaults(func=cmd_schema)

    add_bench_parser(sub)
    add_plot_parser(sub)
    add_merge_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except LlmtuneError as err:  # a user's mistake (exit 2) or a run that failed (exit 1): one line, no traceback
        if _says_it(err):
            print(f"llmtune: {err.prefix}: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("llmtune: interrupted", file=sys.stderr)
        return 130


def _says_it(err: LlmtuneError) -> bool:
    """Whether this process prints `err`. A mistake in the recipe or the request (exit 2) is refused alike by every
    process of a launch: the first process of each node says it (once on one node; a node's own missing file is
    still said there), the others exit 2 quietly rather than repeat it under the launcher's banner. A failure
    (exit 1) may be one process's own (its out of memory): each says its own."""
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    return err.exit_code != EXIT_USAGE or local_rank == 0


def entry() -> None:
    sys.exit(main())
