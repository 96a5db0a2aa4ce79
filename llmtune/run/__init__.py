"""A training run: `build` it from a recipe (llmtune.run.setup), `fit` it (llmtune.run.loop); `train` does both.

Its parts, each a module: the launch, the checkpoints and the run folder, signals and out-of-memory recovery, the
learning-rate schedule, the step's batches, evaluation, metrics and the summary."""

from llmtune.run.loop import fit, train
from llmtune.run.setup import build
from llmtune.run.state import Run

__all__ = ["Run", "build", "fit", "train"]
