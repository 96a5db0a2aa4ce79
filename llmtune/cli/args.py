"""Arguments several commands take, and their types."""

from __future__ import annotations

import argparse


def recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", required=True, help="recipe YAML file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.max_steps=20 output_dir=/tmp/x")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def degree(text: str) -> int | str:
    return "auto" if text == "auto" else positive_int(text)
