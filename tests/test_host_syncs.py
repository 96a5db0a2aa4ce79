"""The host never stalls the device: how often an optimizer step makes the host wait for the device, counted.

A GPU runs what the host has queued. An op whose result the host needs at once (`.item()`, `float()`, `bool()` or
`.tolist()` of a device tensor, a shape that depends on the data such as `nonzero` or boolean indexing, a copy to the
host, a copy from pageable host memory to the device) makes the host wait until all the work queued before it has run,
and the device then idles until the host queues more. On a CPU-only host the device is host memory too and none of
this can be told apart, so the steps run on test_placement's device (torch's `privateuseone` slot, its data in host
memory). They run in a process of their own: the autograd engine runs a backward there only once the slot is named as
a backend (`rename_privateuse1_backend`), which makes it the process's accelerator for good, and every later test of
the process would find it (FSDP2's default mesh, pinned memory).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmtune.ops.measure import PeakMemoryTracker

aten = torch.ops.aten
PROBE = "LLMTUNE_HOST_SYNCS_PROBE"  # set in the process that trains on the device: {"recipes": {...}, "out": path}
COUNTED_STEP = 2  # 0-based: after the steps whose memory is measured (0, 1), no logging, no checkpoint, no eval
# Ops that read a device tensor's values on the host: a scalar (`item`, `float`, `bool`), a size that depends on them.
DATA_DEPENDENT = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default}


def what_waits(func, args: tuple, kwargs: dict, device: torch.device) -> str | None:
    """What the op makes the host wait for on `device` (None: nothing), as CUDA runs it: a copy from the host that
    is not `non_blocking` goes through `memcpy_and_sync`."""
    if func is aten._to_copy.default:
        dst = torch.device(kwargs.get("device") or args[0].device)
        return transfer(args[0].device, dst, not kwargs.get("non_blocking", False), device)
    if func is aten.copy_.default:
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return transfer(args[1].device, args[0].device, blocking, device)
    if not any(isinstance(t, torch.Tensor) and t.device == device for t in tree_leaves((args, kwargs))):
        return None
    if func in DATA_DEPENDENT:
        return func.__name__
    if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
        i is not None and i.dtype == torch.bool for i in args[1]
    ):
        return "boolean indexing"
    return None


def transfer(src: torch.device, dst: torch.device, blocking: bool, device: torch.device) -> str | None:
    if src == device and dst.type == "cpu":
        return "copy to the host"
    if src.type == "cpu" and dst == device and blocking:
        return "blocking copy to the device"
    return None


class HostWaits(TorchDispatchMode):
    """Counts, per optimizer step (`step`, set by the loop's start of each step), what makes the host wait, and
    where: the innermost frame of llmtune's or transformers' code (a backward's ops run in the autograd engine's
    thread, under none)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device, self.step = device, -1
        self.waits: dict[int, Counter] = {}

    def record(self, what: str) -> None:
        ours = [f for f in traceback.extract_stack() if re.search(r"/(llmtune|transformers)/", f.filename)]
        where = f"{Path(ours[-1].filename).name}:{ours[-1].name}" if ours else "backward"
        self.waits.setdefault(self.step, Counter())[f"{what} in {where}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = what_waits(func, args, kwargs, self.device)
        if what is not None:
            self.record(what)
        return func(*args, **kwargs)


class Stop(Exception):
    """The counted step is over: the run ends there (its final save is not what is counted)."""


if os.environ.get(PROBE):  # only in the process that test_a_step_waits_for_the_device_at_most_twice starts
    from test_placement import DEVICE, OnDevice, on_device  # noqa: F401 (a fixture)

    @pytest.fixture
    def device_as_a_backend():
        """The slot named as a backend before test_placement's `on_device` sets it up (the autograd engine asks
        the accelerator for its streams)."""
        torch.utils.rename_privateuse1_backend("privateuseone")

    def test_count_host_waits_on_the_device(device_as_a_backend, on_device, monkeypatch):  # noqa: F811
        import llmtune.run.loop
        from llmtune.recipe import load_recipe

        probe = json.loads(os.environ[PROBE])
        real_tolist, real_set_lr = OnDevice.tolist, llmtune.run.loop.set_learning_rate
        counted = {}
        for case, recipe in probe["recipes"].items():
            waits = HostWaits(DEVICE)

            def tolist(self, waits=waits):
                waits.record("tolist")
                return real_tolist(self)

            def set_learning_rate(optimizer, recipe, step, waits=waits):
                if step > COUNTED_STEP:
                    raise Stop
                waits.step = step
                return real_set_lr(optimizer, recipe, step)

            monkeypatch.setattr(OnDevice, "tolist", tolist)
            monkeypatch.setattr(llmtune.run.loop, "set_learning_rate", set_learning_rate)
            run = llmtune.run.setup.build(load_recipe(recipe))
            with waits, pytest.raises(Stop):
                llmtune.run.loop.fit(run)
            counted[case] = {
                "micro_batches": run.plan.grad_accum_steps,
                "waits": dict(waits.waits.get(COUNTED_STEP, {})),
            }
        Path(probe["out"]).write_text(json.dumps(counted))


# ---------------------------------------------------------------- what the main suite runs

CASES = {  # name: (objective, micro-batch); each step takes 4 rows (SFT) or 4 pairs (DPO)
    "sft-4x1": ("sft", 1),
    "sft-2x2": ("sft", 2),
    "sft-1x4": ("sft", 4),
    "dpo-2x2": ("dpo", 2),
}


@pytest.fixture(scope="module")
def counted(tmp_path_factory, tiny_model_dir, tiny_data) -> dict:
    """Every case of CASES trained on the device to its counted step, in one process (~15 s on 2 cores)."""
    from conftest import write_recipe
    from test_preference import write_pairs

    folder = tmp_path_factory.mktemp("host_syncs")
    pairs = write_pairs(folder / "pairs.jsonl", n=16)
    recipes = {}
    for name, (objective, micro) in CASES.items():
        data = {"data__train": [{"path": str(pairs), "format": "preference"}]} if objective == "dpo" else {}
        (folder / name).mkdir()
        recipes[name] = str(
            write_recipe(
                folder / name / "recipe.yaml",
                tiny_model_dir,
                tiny_data,
                training__objective=objective,
                training__micro_batch_size=micro,
                training__global_batch_size=4,
                training__gradient_checkpointing=False,
                training__max_steps=COUNTED_STEP + 2,
                logging__every_n_steps=100,
                **data,
            )
        )
    out = folder / "counted.json"
    env = {**os.environ, PROBE: json.dumps({"recipes": recipes, "out": str(out)}), "OMP_NUM_THREADS": "1"}
    here = Path(__file__)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here), "-k", "count_host_waits"],
        cwd=here.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_step_waits_for_the_device_at_most_twice(counted, case):
    """A step that logs nothing waits for the device at most twice, whatever its micro-batches: its losses,
    statistics and gradient norm are read together, its counts and a stop are agreed on the host, its micro-batches
    copied without waiting. It waited 6 times plus 5 a micro-batch: the counts' round trip, the loss, the norm, the
    stop flag's round trip; each batch tensor's blocking copy, transformers' reading of packed position ids, the
    loss's `nonzero`."""
    _, micro = CASES[case]
    step = counted[case]
    assert step["micro_batches"] == 4 // micro
    assert sum(step["waits"].values()) <= 2, step["waits"]


def test_peak_memory_on_cuda_waits_for_nothing(monkeypatch):
    """The caching allocator counts on the host as the host queues each allocation, so the peak of a step needs no
    `synchronize` (the tracker called it on entry and exit, emptying the device's queue every measured step; on a
    GPU every step is measured). Faked CUDA, the real tracker."""
    synchronized = []
    for name, fake in {
        "synchronize": lambda device=None: synchronized.append(device),
        "reset_peak_memory_stats": lambda device=None: None,
        "memory_allocated": lambda device=None: 2**20,
        "max_memory_allocated": lambda device=None: 2**30,
        "max_memory_reserved": lambda device=None: 2**31,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    with PeakMemoryTracker("cuda") as tracker:
        pass
    assert (tracker.peak_bytes, tracker.peak_reserved_bytes) == (2**30, 2**31)
    assert synchronized == []
