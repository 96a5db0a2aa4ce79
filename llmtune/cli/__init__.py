"""The commands a person types (`llmtune ...`, `scripts/finetune.py`): `main` parses and dispatches, one module per
command that has more than a few lines: `estimate`, `generate` (and chat), `bench`, `plot`, `merge`."""

from llmtune.cli.main import entry, main

__all__ = ["entry", "main"]
