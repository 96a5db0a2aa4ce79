"""The errors llmtune raises on purpose, and the exit status each ends a command with.

Every module's own error class (RecipeError, DataError, SetupError, ...) derives from one of the two bases
here, so `llmtune.cli.main.main` maps them by their base, never by a list to keep in step with the modules.
This module imports nothing: any module may raise these without an import circle.
"""

from __future__ import annotations

EXIT_FAILED = 1  # the run itself failed (repeated non-finite losses, out of memory at micro-batch 1)
EXIT_USAGE = 2  # the user asked for something wrong or impossible: fix the recipe, data or flags and run again
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on a signal or out of memory; the same command resumes


class LlmtuneError(Exception):
    """An error llmtune raised on purpose: one line for the user, no traceback."""

    exit_code = EXIT_FAILED
    prefix = "error"  # the CLI prints "llmtune: <prefix>: <message>"


class UserError(LlmtuneError):
    """A bad recipe, bad data, or a request this machine cannot run: nothing was trained yet."""

    exit_code = EXIT_USAGE


class RunFailed(LlmtuneError):
    """The run started and cannot go on; the last good checkpoint is kept."""

    exit_code = EXIT_FAILED
    prefix = "training stopped"


class NothingToDo(LlmtuneError):
    """The command asks for what is already there (a complete run): nothing was changed."""

    exit_code = 0
    prefix = "nothing to do"


class SetupError(UserError, RuntimeError):
    """The recipe asks for something this machine cannot do; raised before any model loads."""
