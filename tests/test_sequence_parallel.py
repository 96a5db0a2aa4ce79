"""Ulysses sequence parallelism (llmtune.parallel.sequence) trains what one process trains.

ONE launch of 4 CPU processes (gloo) under FSDP2: a (data 2 x sequence 2) mesh, each packed row of 4096 tokens split
in two halves, FSDP2 sharding over all four. It runs in turn: SFT on a tiny Llama (GQA, 2 KV heads) then its resume,
SFT with LoRA on a tiny Qwen2 with one KV head (repeated to the degree) and its MLPs in sequence tiles, DPO (a
precomputed reference: forwards through the sharded module before training) and GRPO steps (sampling whole prompts,
training on shards). Each is compared with the same recipe run by one process in this process (whole rows, whole
MLPs): losses step by step, and the final weights (every gradient of the run went into them). The launch also counts
the bytes each all-to-all sends to the other processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import build_tokenizer, write_tiny_data, write_tiny_model
from test_distributed import RUNS, losses
from test_preference import write_pairs
from test_scale_out import final_tensors, launch, then, write_grpo_recipe

from llmtune.recipe import load_recipe
from llmtune.run.loop import train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROW = 4096
PROCESSES, DEGREE = 4, 2
# What the launch alone runs with: its Qwen2's MLPs in sequence tiles (llmtune.model.tiling; 32 tiles of 64 tokens a
# shard).
LAUNCH_ONLY = {"qwen2-lora": ["parallel.tiled_mlp=true"]}

# The launch's entry: every all-to-all's bytes to other processes, and the tokens of every micro-batch split, in
# training and in evaluation, per run and process.
COUNT_ALLTOALL = """
import os, json
from pathlib import Path
import torch.distributed as dist
import llmtune.run.evaluate
from llmtune.parallel import sequence
record, phase, runs = {"train": ([], []), "eval": ([], [])}, ["train"], [0]
plain_alltoall, plain_shard = dist.all_to_all_single, sequence.shard_batch
plain_evaluate = llmtune.run.evaluate.evaluate
def alltoall(output, input, *args, group=None, **kwargs):
    size = dist.get_world_size(group)
    record[phase[0]][0].append(input.numel() * input.element_size() * (size - 1) // size)
    return plain_alltoall(output, input, *args, group=group, **kwargs)
def shard(batch, group):
    record[phase[0]][1].append(batch["input_ids"].numel())
    return plain_shard(batch, group)
def evaluate(run):
    phase[0] = "eval"
    try:
        return plain_evaluate(run)
    finally:
        phase[0] = "train"
dist.all_to_all_single, sequence.shard_batch = alltoall, shard
llmtune.run.evaluate.evaluate = evaluate
def after_run(recipe):
    Path(recipe.output_dir, f"alltoall-{runs[0]}-" + os.environ["RANK"]).write_text(json.dumps(record))
    for sent, tokens in record.values():
        sent.clear(), tokens.clear()
    runs[0] += 1
"""


def recipe(folder: Path, model: Path, data: Path, data_format: str = "prompt_completion", **training) -> Path:
    """Packed rows of ROW tokens, global batch 2 (one process: micro-batch 1 x accumulation 2; the launch: 2
    data-parallel groups x 1), checkpointing on (its recomputed forward runs the all-to-alls again)."""
    text = {
        "seed": 0,
        "model": {"name_or_path": str(model)},
        "data": {"train": [{"path": str(data), "format": data_format}], "max_length": ROW, "packing": True},
        "training": {
            "precision": "fp32",
            "micro_batch_size": 1,
            "global_batch_size": 2,
            "max_steps": 2,
            "learning_rate": 1e-3,
            "warmup_steps": 1,
            "gradient_checkpointing": True,
        }
        | training,
        "logging": {"every_n_steps": 1, "progress_bar": False},
        "checkpoint": {"resume": "auto", "every_n_steps": 1},
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "recipe.yaml").write_text(yaml.safe_dump(text))
    return folder / "recipe.yaml"


def write_qwen2(folder: Path) -> Path:
    """A tiny Qwen2 (biased q/k/v projections, tied embeddings) with ONE KV head: at degree 2 it is repeated."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(folder)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=2 * ROW,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> dict[str, tuple[Path, list[str]]]:
    """run name -> (recipe, overrides): what the launch and the one-process references both run."""
    root = tmp_path_factory.mktemp("sp-inputs")
    llama = write_tiny_model(root / "llama", max_position_embeddings=2 * ROW)
    qwen = write_qwen2(root / "qwen2")
    data = write_tiny_data(root / "sft.jsonl", n=1400)  # ~6 rows of 4096 tokens packed
    pairs = write_pairs(root / "pairs.jsonl", n=700)
    grpo = write_grpo_recipe(root / "grpo", llama)
    return {
        "sft": (recipe(root / "sft", llama, data), ["data.eval_fraction=0.1"]),
        "sft-resumed": (recipe(root / "sft", llama, data), ["data.eval_fraction=0.1", "training.max_steps=3"]),
        # One step each: its final weights hold every gradient of the step.
        "qwen2-lora": (
            recipe(root / "qwen2-lora", qwen, data),
            ["peft.method=lora", "peft.rank=4", "training.max_steps=1"],
        ),
        "dpo": (recipe(root / "dpo", llama, pairs, "preference", objective="dpo"), ["training.max_steps=1"]),
        "grpo": (grpo, ["training.max_steps=1"]),
    }


@pytest.fixture(scope="module")
def launched(tmp_path_factory, recipes) -> Path:
    """The one launch: every run of `recipes` in turn, split along the sequence; the resume continues `sft`'s folder."""
    folder = tmp_path_factory.mktemp("sp-launch")
    out = {name: folder / ("sft" if name == "sft-resumed" else name) for name in recipes}
    split = {
        name: [*extra, *LAUNCH_ONLY.get(name, []), f"parallel.sequence_parallel={DEGREE}"]
        for name, (_, extra) in recipes.items()
    }
    (first, (path, _)), *rest = recipes.items()
    more = [arg for name, (r, _) in rest for arg in then(r, out[name], *split[name])]
    entry = folder / "entry.py"
    entry.write_text(COUNT_ALLTOALL + RUNS)
    cmd = launch(path, out[first], "fsdp2", *split[first], *more, script=entry, num_processes=PROCESSES)
    grpo_rewards = recipes["grpo"][0].parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(grpo_rewards), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory, recipes) -> dict[str, Path]:
    """Each run on one process, in this process, whole rows (sft: its three steps at once)."""
    folder = tmp_path_factory.mktemp("sp-one")
    runs = {}
    sys.path.insert(0, str(recipes["grpo"][0].parent))
    try:
        for name, (path, extra) in recipes.items():
            if name == "sft":
                continue
            name = "sft" if name == "sft-resumed" else name
            train(load_recipe(path, [*extra, f"output_dir={folder / name}"]))
            runs[name] = folder / name
    finally:
        sys.path.remove(str(recipes["grpo"][0].parent))
    return runs


@pytest.mark.parametrize("name", ["sft", "qwen2-lora", "dpo", "grpo"])
def test_sequence_parallel_trains_what_one_process_trains(name, launched, reference):
    run = launched / name
    summary = json.loads((run / "run_summary.json").read_text())
    assert (summary["engine"], summary["num_processes"], summary["sequence_parallel"]) == ("fsdp2", 4, 2)
    got, want = losses(run), losses(reference[name])
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-4), (step, got, want)
    weights, expected = final_tensors(run), final_tensors(reference[name])
    assert weights.keys() == expected.keys()
    for key, tensor in expected.items():
        assert weights[key].float().sub(tensor.float()).abs().max() < 1e-4, key


def test_the_resume_continues_from_the_newest_checkpoint_and_evaluates_as_one_process(launched, reference):
    """The second sft run found step 2 in the folder and trained step 3 only (its losses are compared above); its
    evaluation at the end, on split rows too, gives one process's eval loss."""
    log = [json.loads(line) for line in (launched / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3]
    got, want = (
        json.loads((run / "run_summary.json").read_text())["eval_loss"] for run in (launched / "sft", reference["sft"])
    )
    assert got == pytest.approx(want, abs=1e-5) and want > 0


def test_the_alltoall_bytes_equal_their_closed_form(launched, recipes):
    """Per micro-batch and layer: q, k, v and the attention output in forward, again in the checkpointed layer's
    recomputed forward, and their gradients in backward: 3 x `alltoall_bytes_per_layer`, on every process; an
    evaluation's forward, once."""
    from transformers import AutoConfig

    from llmtune.parallel.sequence import alltoall_bytes_per_layer

    config = AutoConfig.from_pretrained(recipes["sft"][0].parent.parent / "llama")
    layers = config.num_hidden_layers
    for rank in range(PROCESSES):
        record = json.loads((launched / "sft" / f"alltoall-0-{rank}").read_text())
        for phase, passes, micro_batches in (("train", 3, 2), ("eval", 1, 1)):  # two steps, one eval batch
            sent, tokens = record[phase]  # a packed row may be short of ROW: the tokens each time
            assert len(tokens) == micro_batches
            assert len(sent) == micro_batches * layers * passes * 4  # four tensors a pass
            assert sum(sent) == sum(passes * layers * alltoall_bytes_per_layer(config, n, DEGREE, 4) for n in tokens)
