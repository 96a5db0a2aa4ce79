"""Benchmark the causal-LM loss: transformers' ForCausalLMLoss vs llmtune's chunked_cross_entropy.

For each (N tokens, V vocab, precision) it times one forward+backward of the lm_head matmul plus the
loss, and counts the peak bytes of live tensors allocated during it (a TorchDispatchMode counter, so
it is the CPU tensor peak, not an allocator figure). Both implementations get the same fp32 hidden
[N, h] and lm_head weight [V, h] (both requiring grad); "bf16" is bf16 autocast, as in mixed-precision
training. "ckpt" is the alternative design: torch.utils.checkpoint around each chunk's logits+loss
(recomputes the chunk's logits in backward). `--lora-rank R` puts a LoRA of rank R on the lm_head of both
(weight frozen, A and B trained; hf adds it as peft's forward does, chunked through `LowRank`), without "ckpt".

    .venv/bin/python -m benchmarks.loss                 # the full grid: 18 min on 2 busy cores (load ~8)
    .venv/bin/python -m benchmarks.loss --tokens 2048   # ~2-3 min subset
    .venv/bin/python -m benchmarks.loss --tokens 2048 --lora-rank 16   # -> loss_cpu_lora_head.json
    .venv/bin/python -m benchmarks.loss --head-traffic  # -> loss_head_traffic.json, seconds

`--head-traffic` runs no matmul: it traces one forward+backward of the chunked loss on fake tensors at Llama-3.2-1B's
head (vocab 128256, hidden 2048) over 8 x 2048 packed tokens, bf16 autocast, and counts what a GPU pays for there
(`HeadTraffic`): how often the head weight is read, what is allocated at its size, the host syncs; at the chunk each
rule gives (the CPU's, the H100's and H200's plans).

The N=8192, V=128256 cell alone is ~3/4 of the full run: 3 matmuls of 2*N*V*h = 1 TFLOP each per
implementation, at ~60 GFLOP/s fp32 on 2 cores.

Writes benchmarks/results/loss_cpu.json (loss_cpu_lora_head.json with --lora-rank, loss_head_traffic.json with
--head-traffic).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from transformers.loss.loss_utils import ForCausalLMLoss

from benchmarks import RESULTS
from llmtune.ops.loss import LowRank, chunked_cross_entropy, loss_rows
from llmtune.ops.measure import PeakMemoryTracker

OUTPUT = RESULTS / "loss_cpu.json"
# Ops that make the host wait for the device: a value read back, or an output whose size depends on the data.
HOST_SYNCS = frozenset(
    {torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.item, torch.ops.aten.is_nonzero}
)


class HeadTraffic(TorchDispatchMode):
    """What a step does with the lm_head `weight` and with the host, op by op: `reads`, the ops that read the weight
    (or a cast copy of it, the matmuls' operand under autocast); `allocated`, the dtypes of the tensors allocated
    with the weight's shape (V x h); `syncs`, the host synchronisations (`HOST_SYNCS`), those in the
    forward of `decoder` (transformers' mask creation, not the loss's) left out. Works on fake tensors."""

    def __init__(self, weight: torch.Tensor, decoder: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.weight_storages = {_storage(weight)}
        self.shape = weight.shape
        self.reads = 0
        self.allocated: list[torch.dtype] = []
        self.syncs: list[str] = []
        self.in_decoder = False
        self.hooks = []
        if decoder is not None:
            self.hooks = [
                decoder.register_forward_pre_hook(lambda *_: setattr(self, "in_decoder", True)),
                decoder.register_forward_hook(lambda *_: setattr(self, "in_decoder", False)),
            ]

    def __exit__(self, *exc: object) -> None:
        for hook in self.hooks:
            hook.remove()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket in HOST_SYNCS and not self.in_decoder:
            self.syncs.append(str(func))
        if func.is_view or func.namespace == "prim":  # views and metadata (a fake tensor's device) read nothing
            return out
        inputs = {_storage(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if inputs & self.weight_storages:
            self.reads += 1
            if func._overloadpacket is torch.ops.aten._to_copy:  # the cast copy is what the matmuls read
                self.weight_storages.add(_storage(out))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.shape == self.shape and _storage(t) not in inputs:
                self.allocated.append(t.dtype)
        return out


def _storage(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def hf_loss(hidden, weight, labels, chunk_size, lora=None):
    logits = F.linear(hidden, weight)  # the model's lm_head
    if lora is not None:  # peft's forward: base + lora_B(lora_A(x)) * scaling
        a, b, scaling = lora
        logits = logits + F.linear(F.linear(hidden, a), b) * scaling
    return ForCausalLMLoss(logits, None, weight.shape[0], num_items_in_batch=torch.ones(()), shift_labels=labels)


def chunked_loss(hidden, weight, labels, chunk_size, lora=None):
    low_rank = None if lora is None else LowRank(F.linear(hidden, lora[0]), lora[1], lora[2])
    return chunked_cross_entropy(hidden, weight, labels, lora=low_rank, chunk_size=chunk_size)


def _chunk_ce(h, w, target):
    return F.cross_entropy(F.linear(h, w).float(), target, reduction="sum")


def ckpt_loss(hidden, weight, labels, chunk_size):
    total = torch.zeros(())
    for start in range(0, hidden.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        total = total + checkpoint(_chunk_ce, hidden[sl], weight, labels[sl], use_reentrant=False)
    return total


IMPLS = {"hf": hf_loss, "chunked": chunked_loss, "ckpt": ckpt_loss}


def run_one(impl, n, v, h, precision, chunk_size, lora_rank=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * h**-0.5).requires_grad_(not lora_rank)
    labels = torch.randint(0, v, (n,), generator=g)
    lora = None
    if lora_rank:  # B nonzero (a trained adapter), scaling alpha / r with alpha = 2r
        a = (torch.randn(lora_rank, h, generator=g) * h**-0.5).requires_grad_(True)
        b = (torch.randn(v, lora_rank, generator=g) * lora_rank**-0.5).requires_grad_(True)
        lora = (a, b, 2.0)
    with PeakMemoryTracker("cpu", baseline=[hidden, weight, labels, *(lora or ())[:2]]) as counter:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = IMPLS[impl](hidden, weight, labels, chunk_size, *([lora] if lora else []))
        loss.backward()
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_bytes": counter.peak_bytes - counter.entry_bytes, "loss": loss.item()}


def head_traffic(chunk: int, rows: int = 8, length: int = 2048, vocab: int = 128256, hidden: int = 2048) -> dict:
    """`HeadTraffic` of the chunked loss at `chunk` rows, traced on fake tensors: `rows` x `length` packed tokens,
    each row's last without a target, bf16 autocast, the head weight trained."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    labels = torch.ones(rows, length, dtype=torch.long)
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    trained = loss_rows(labels)  # on the host, as collation finds them
    with FakeTensorMode() as fake:
        h = torch.empty(rows * length, hidden, requires_grad=True)
        w = torch.empty(vocab, hidden, requires_grad=True)
        targets, trained_fake = fake.from_tensor(targets), fake.from_tensor(trained)
        with torch.autocast("cpu", dtype=torch.bfloat16), HeadTraffic(w) as traffic:
            chunked_cross_entropy(h, w, targets, rows=trained_fake, chunk_size=chunk).backward()
    return {
        "chunk_rows": chunk,
        "trained_tokens": trained.numel(),
        "chunks": -(-trained.numel() // chunk),
        "head_weight_reads": traffic.reads,
        "weight_sized_allocations": [str(d) for d in traffic.allocated],
        "host_syncs": traffic.syncs,
    }


def head_traffic_main() -> None:
    """`--head-traffic`: `head_traffic` at the chunk of each rule, written to loss_head_traffic.json."""
    from transformers import LlamaConfig

    from llmtune.catalogue import gpu_memory
    from llmtune.plan import loss_chunk_rows, planning_target

    config = LlamaConfig(vocab_size=128256, hidden_size=2048)  # Llama-3.2-1B's head
    rules = {"cpu (what every device ran before)": loss_chunk_rows(config, device="cpu", gpu=None, budget_bytes=None)}
    for card in ("h100-80gb", "h200"):
        budget = planning_target(device_memory=None, gpu=card, device=None).budget_bytes
        rules[f"{card} plan ({gpu_memory(card) // 2**30} GiB card)"] = loss_chunk_rows(
            config, device="cuda", gpu=card, budget_bytes=budget
        )
    rows = []
    for rule, chunk in rules.items():
        rows.append({"rule": rule, **head_traffic(chunk)})
        r = rows[-1]
        print(f"{rule:>40}: {chunk:>5} rows, {r['chunks']:>4} chunks, head weight read {r['head_weight_reads']:>4}x,"
              f" V x h allocated {r['weight_sized_allocations']}, host syncs {r['host_syncs']}")  # fmt: skip
    meta = {
        "command": "python -m benchmarks.loss --head-traffic",
        "torch": torch.__version__,
        "note": "traced on fake tensors (no matmul runs): counts, not times. On a CPU the V x h weight gradient's"
        " 16-bit product is made in blocks no larger than the chunk's gradient, V x h where the chunk has at least"
        " hidden rows; on CUDA it is accumulated by a matmul that writes fp32 (no product), which no CPU runs.",
    }
    out = RESULTS / "loss_head_traffic.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--chunks", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument(
        "--sweep-max-nv",
        type=int,
        default=8192 * 32000,
        help="above this N*V run only hf and chunk size --main-chunk (keeps the default run to minutes)",
    )
    p.add_argument("--main-chunk", type=int, default=1024)
    p.add_argument("--ckpt-chunk", type=int, default=1024, help="chunk size of the checkpoint design; 0: skip")
    p.add_argument("--ckpt-max-tokens", type=int, default=2048, help="run the checkpoint design up to this N")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA of this rank on the lm_head of both (no ckpt)")
    p.add_argument("--out", type=Path, default=None, help=f"default {OUTPUT.name} (loss_cpu_lora_head.json with LoRA)")
    p.add_argument("--head-traffic", action="store_true", help="only the head's traffic per rule (fake tensors)")
    args = p.parse_args(argv)
    if args.head_traffic:
        head_traffic_main()
        return
    args.out = args.out or (OUTPUT.with_name("loss_cpu_lora_head.json") if args.lora_rank else OUTPUT)

    rows = []
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    cols = ("N", 5), ("V", 6), ("prec", 4), ("impl", 13), ("sec", 7), ("x hf", 6), ("peak MiB", 9), ("x hf", 6)
    print(" ".join(f"{name:>{width}}" for name, width in cols), f"{'loss rel':>9}")
    for n in args.tokens:
        for v in args.vocab:
            for precision in args.precision:
                chunks = args.chunks if n * v <= args.sweep_max_nv else [args.main_chunk]
                plan = [("hf", 0)] + [("chunked", c) for c in chunks]
                if args.ckpt_chunk and n <= args.ckpt_max_tokens and not args.lora_rank:
                    plan.append(("ckpt", args.ckpt_chunk))
                base = None
                for impl, chunk in plan:
                    r = run_one(impl, n, v, args.hidden, precision, chunk, args.lora_rank)
                    base = base or r
                    row = {
                        "tokens": n,
                        "vocab": v,
                        "hidden": args.hidden,
                        "precision": precision,
                        "impl": impl,
                        "chunk_size": chunk or None,
                        "lora_rank": args.lora_rank,
                        **r,
                        "time_vs_hf": r["seconds"] / base["seconds"],
                        "peak_vs_hf": r["peak_bytes"] / base["peak_bytes"],
                        "peak_bytes_per_NV": r["peak_bytes"] / (n * v),
                        "loss_rel_diff_vs_hf": abs(r["loss"] - base["loss"]) / abs(base["loss"]),
                    }
                    rows.append(row)
                    name = impl if not chunk else f"{impl}-{chunk}"
                    print(
                        f"{n:>5} {v:>6} {precision:>4} {name:>13} {r['seconds']:>7.2f} {row['time_vs_hf']:>6.2f} "
                        f"{r['peak_bytes'] / 2**20:>9.1f} {row['peak_vs_hf']:>6.3f} {row['loss_rel_diff_vs_hf']:>9.1e}",
                        flush=True,
                    )
    meta = {
        "command": " ".join(["python -m benchmarks.loss", *(argv if argv is not None else sys.argv[1:])]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "total_seconds": time.perf_counter() - t0,
        "note": "one run per row (no repeats); times are noisy when the machine is shared (see loadavg)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out} in {meta['total_seconds']:.0f} s")


if __name__ == "__main__":
    main()
