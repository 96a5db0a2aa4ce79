"""The grace a signal gives before the watchdog exits (llmtune.run.preemption): a whole step's time, its rollout
included, and for the first step, which nothing has timed yet, the process group's own timeout. Timed on a clock the
test moves, never on the host's."""

from __future__ import annotations

import time
from types import SimpleNamespace

import llmtune.run.loop as loop_module
from llmtune.recipe import load_recipe
from llmtune.run.loop import fit
from llmtune.run.preemption import SIGNAL_GRACE_S, Preemption
from llmtune.run.setup import build


def test_the_grace_is_the_first_steps_timeout_until_a_step_is_timed_then_3x_the_longest_step():
    preemption = Preemption(first_grace_s=1800.0)
    assert preemption.grace_s == 1800.0  # a first step's compilation or generation may take any time
    preemption.timed(10.0)
    assert preemption.grace_s == SIGNAL_GRACE_S
    preemption.timed(40.0)
    preemption.timed(5.0)
    assert preemption.grace_s == 120.0


def test_a_slow_rollout_counts_in_the_grace_a_signal_gives(tiny_recipe, monkeypatch):
    """The first step's batches take 100 s (a GRPO rollout's generation, on the loop's clock): a signal in the next
    step's rollout must give 3x that. The grace used to start after the batches, so a slow rollout met the watchdog's
    exit before its step's boundary; and the first step had the 60 s default."""
    recipe = load_recipe(tiny_recipe(training__max_steps=2))
    moved = {"s": 0.0}
    monkeypatch.setattr(loop_module, "time", SimpleNamespace(perf_counter=lambda: time.perf_counter() + moved["s"]))
    real = loop_module.batches_for

    def slow_rollout(run, ahead, step):
        moved["s"] += 100.0 if step == 0 else 0.0
        return real(run, ahead, step)

    monkeypatch.setattr(loop_module, "batches_for", slow_rollout)
    seen: list[tuple[Preemption, float]] = []

    class Recorded(Preemption):
        def __enter__(self) -> Preemption:
            seen.append((self, self.grace_s))
            return super().__enter__()

    monkeypatch.setattr(loop_module, "Preemption", Recorded)
    fit(build(recipe))
    ((preemption, first),) = seen
    assert first == recipe.distributed.timeout
    assert preemption.grace_s >= 300.0
