"""What a run optimises, behind one small protocol: the loop (llmtune.run.loop) calls these and never asks which.

An objective says
* `module`: the torch module the loop trains, whose forward returns [loss summed over units, *stats summed] (or
  the summed loss alone); it wraps the causal LM before any engine (DDP, FSDP2, DeepSpeed) wraps it. `Objective`
  gives it to the classes that subclass it: their `wrap` of the model and its frozen reference (a copy of the
  model where `reference` is copy; the memory estimator passes one it built, and a chunk size);
* `collate`: how examples become one micro-batch;
* `longest_example`: an example as long as the rows go, as `collate` takes it (what the memory estimator collates);
* `units`: what the loss is averaged over in a batch (SFT: trained tokens; preference: pairs);
* `metrics`: its own metrics.jsonl values from the summed stats of a step;
* `check_engine`: what it refuses under an engine, before anything loads;
* `attach`: what must run on the prepared module before the first update (DPO's precomputed reference);
* `draw`: which data step, and how many of its rows, an optimizer step takes (GRPO: prompts, num_iterations steps
  on each batch);
* `rollout`: the rows a step trains on, made from the rows drawn (GRPO: the policy's completions, rewarded);
  `FromData` gives both for objectives that train on their data's rows as they are.

A new objective is a new module here with a class that has these, and a line in `registry.objective_named` (and
in `registry.reference_for` where it has a reference).
"""

from __future__ import annotations

from llmtune.objectives.base import AttachContext, Objective, trained_tokens
from llmtune.objectives.registry import objective_for, objective_named, reference_for

__all__ = ["AttachContext", "Objective", "objective_for", "objective_named", "reference_for", "trained_tokens"]
