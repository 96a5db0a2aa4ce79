"""`llmtune merge`: the command line of llmtune.model.merge."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmtune.model.merge import DTYPES, MergeError, merge_run


def add_merge_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `llmtune merge --run DIR [--out DIR] [--dtype auto|fp32|bf16|fp16]`."""
    p = sub.add_parser("merge", help="merge a LoRA/DoRA run's adapter into its base model (a plain HF model folder)")
    p.add_argument("--run", required=True, type=Path, help="a run's output_dir (uses final/), final/, or a checkpoint")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: OUTPUT_DIR/merged)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto keeps the base's stored dtype")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a base model that ships its own Python code run it (never taken from the run's recipe.yaml)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out that llmtune merge did not write (never the base or the run it reads)",
    )
    p.set_defaults(func=cmd_merge)
    return p


def cmd_merge(args: argparse.Namespace) -> int:
    try:
        out = merge_run(
            args.run, args.out, dtype=args.dtype, overwrite=args.overwrite, trust_remote_code=args.trust_remote_code
        )
    except MergeError as err:
        sys.stderr.write(f"llmtune: error: {err}\n")
        return 2
    sys.stdout.write(f"{out}\n")
    return 0
