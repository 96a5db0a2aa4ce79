"""The independent CPU memory measurement of benchmarks/memory_independent.py: known answers, then one step."""

from __future__ import annotations

import torch

from benchmarks.memory import Case, configs
from benchmarks.memory_independent import allocator_peak, resident_bytes, run_case


def test_allocator_peak_known_answer():
    kept: list[torch.Tensor] = []

    def fn() -> None:
        a = torch.empty(1000, dtype=torch.float32)  # 4000
        b = torch.empty(3000, dtype=torch.uint8)  # 7000: the peak
        del a  # 3000
        kept.append(torch.empty(10, 10))  # 3400
        del b  # 400 left at the end

    assert allocator_peak(fn, baseline_bytes=100) == (7100, 500)


def test_resident_bytes_counts_views_once():
    t = torch.empty(64)
    assert resident_bytes([t, t[:8], t.view(8, 8), torch.empty(3, dtype=torch.int64)]) == 64 * 4 + 24


def test_extrapolated_estimate_close_to_allocator():
    """A 6-layer Llama (traced at 1 and 2 layers, extrapolated) vs the allocator's high-water, loosely."""
    torch.set_num_threads(1)
    cfg = configs()["llama"]
    cfg.num_hidden_layers = 6
    row = run_case(Case("llama", "padded", "hf", False, False, "fp32", micro_batch=2, seq_len=32), cfg)
    assert row["traced_layers"] == [1, 2]
    assert abs(row["rel_error"]) < 0.05, row


def test_a_checkpointed_estimate_counts_the_rng_state_each_checkpointed_layer_keeps():
    """Checkpointing keeps the CPU generator's state (5056 bytes, made outside any ATen op) per checkpointed layer
    until its recomputation: the estimate must be within less than one such state of the allocator's high-water."""
    torch.set_num_threads(1)
    cfg = configs()["llama"]
    cfg.num_hidden_layers = 6
    row = run_case(Case("llama", "padded", "hf", False, True, "fp32", micro_batch=2, seq_len=64), cfg)
    assert abs(row["measured_bytes"] - row["estimated_bytes"]) < torch.get_rng_state().numel(), row
