"""A deep model's step from traces of a few layers: every segment's peak, and the work, is affine in the layer
count (each layer adds the same weights, states and kept activations), so two short traces fix it exactly."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from llmtune.plan.allocator import LARGE_BUFFER
from llmtune.plan.counter import SegmentPeak
from llmtune.plan.settings import Settings
from llmtune.plan.timing import Work
from llmtune.plan.trace import Trace
from llmtune.recipe import Checkpointing, checkpointed_layers


def traces_needed(config: Any, s: Settings, max_traced_layers: int) -> tuple[str, list[tuple[int, Settings]]]:
    """How the step of `config` is traced: whole when short; else at 1 and 2 layer-kind periods, extrapolated
    linearly in the layer count; every k-th layer of a deep model recomputed, from the traces of none and of
    every layer (`assemble`). Returns the kind and the (layers, settings) traces it takes."""
    layers, period = int(config.num_hidden_layers), layer_period(config)
    if layers <= max_traced_layers * period or layers % period:
        return "whole", [(layers, s)]
    short = (period, 2 * period)
    if 0 < checkpointed_layers(s.checkpointing.every_n_layers, layers) < layers:
        every = replace(s, checkpointing=replace(s.checkpointing, every_n_layers=1))
        none = replace(s, checkpointing=Checkpointing(0))
        return "partial", [(n, every) for n in short] + [(n, none) for n in short]
    return "extrapolated", [(n, s) for n in short]


def assemble(kind: str, traces: list[Trace], config: Any, s: Settings) -> Trace:
    """The step of `config` from the traces `traces_needed` listed for `kind`."""
    layers, p, cuda = int(config.num_hidden_layers), layer_period(config), s.device == "cuda"
    if kind == "whole":
        return traces[0]
    if kind == "extrapolated":
        return extrapolate(traces[0], p, traces[1], 2 * p, layers, cuda)
    # Every k-th layer recomputed: per layer, the memory and the work of a recomputed layer and of a kept one are
    # affine in the number of each, so the step is every layer recomputed at `recomputed` layers, plus none at
    # `layers`, less none at `recomputed`. The recomputation of the last recomputed layer is thereby counted as if
    # every layer's activations were kept meanwhile, which over-states the peak by a part of one layer's
    # activations (2.1-2.4% on a 6-layer model; tests/test_memory.py bounds it).
    fa, fb, na, nb = traces
    recomputed = checkpointed_layers(s.checkpointing.every_n_layers, layers)
    return combine(
        [extrapolate(fa, p, fb, 2 * p, recomputed, cuda), extrapolate(na, p, nb, 2 * p, layers, cuda)],
        [extrapolate(na, p, nb, 2 * p, recomputed, cuda)],
    )


def extrapolate(a: Trace, la: int, b: Trace, lb: int, layers: int, cuda: bool) -> Trace:
    """Every segment's peak is affine in the layer count (each layer adds the same weights,
    states and kept activations), so two traces fix it. Middle layers are skipped: their
    peaks lie between the first and last layer's."""

    def line(x: float, y: float) -> int:
        return int(round(x + (y - x) * (layers - la) / (lb - la)))

    segments = {}
    for name in a.segments.keys() & b.segments.keys():
        if name.endswith("_mid"):
            continue
        sa, sb = a.segments[name], b.segments[name]
        tags = sa.by_tag.keys() | sb.by_tag.keys()
        by_tag = {t: line(sa.by_tag.get(t, 0), sb.by_tag.get(t, 0)) for t in tags}
        segments[name] = SegmentPeak(line(sa.bytes, sb.bytes), by_tag, sa.phase)
    totals = {k: line(a.totals[k], b.totals[k]) for k in a.totals}
    x = (layers - la) / (lb - la)
    work, update = a.work + (b.work - a.work) * x, a.optimizer_work + (b.optimizer_work - a.optimizer_work) * x
    # Rounding to allocator pages and fragmentation are not a per-layer cost: the larger of the two, plus
    # one large-pool page for the rounding of the extrapolated peak (CUDA's caching allocator; a CPU has none).
    overhead = max(a.reserved_overhead, b.reserved_overhead) + (LARGE_BUFFER if cuda else 0)
    return Trace(segments, totals, work, update, overhead)


def combine(plus: list[Trace], minus: list[Trace]) -> Trace:
    """Segment by segment, tag by tag: the sum of `plus` less the sum of `minus` (segments all of them have)."""
    signs = [(t, 1) for t in plus] + [(t, -1) for t in minus]
    names = set.intersection(*(set(t.segments) for t, _ in signs))
    segments = {}
    for name in names:
        parts = [(t.segments[name], sign) for t, sign in signs]
        tags = set().union(*(p.by_tag for p, _ in parts))
        by_tag = {tag: sum(sign * p.by_tag.get(tag, 0) for p, sign in parts) for tag in tags}
        segments[name] = SegmentPeak(sum(sign * p.bytes for p, sign in parts), by_tag, parts[0][0].phase)
    work, update = Work(), Work()
    for t, sign in signs:
        work, update = work + t.work * sign, update + t.optimizer_work * sign
    totals = {k: sum(sign * t.totals[k] for t, sign in signs) for k in plus[0].totals}
    return Trace(segments, totals, work, update, max(t.reserved_overhead for t in plus))


def layer_period(config: Any) -> int:
    """Length of the repeating unit of layer kinds (Gemma2 alternates sliding/full: 2)."""
    kinds = list(getattr(config, "layer_types", None) or [])
    for p in range(1, len(kinds) + 1):
        if all(kinds[i] == kinds[i % p] for i in range(len(kinds))):
            return p
    return 1


def with_layers(config: Any, n: int) -> Any:
    """`config` cut to its first `n` layers."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = n
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:n]
    return cfg
