"""Shared fixtures: a tokenizer built offline (nothing comes from the hub), tiny runs, and a guard that no process a
test started outlives it."""

from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from llmtune.plan.timing import Rates

# Long one-process modules that `make test` runs in its second lane, with the real-model tests (`-m "real or
# beside"`): the first lane holds the multi-process launches, which want both cores once the floor suite (CI) is done;
# alone it ran ~15 min while the second lane ended after ~6 (CI, 2 cores). The sequence-parallel launch (~50 s) took
# test_resilience and test_out_of_memory (~95 s of one-process runs) to the second lane: the two lanes then took
# 13 min 12 s and 11 min 8 s (CI, fresh clone at 347c765; with test_train moved too, 13 min 36 s and 12 min 11 s).
# With the asset cache cold, as on a fresh CI machine, they took 13 min 25 s and 11 min 14 s at fd5348e: test_preference
# (~57 s, its launches last in the lane) moved to the second.
BESIDE = {
    "tests/test_gpu_check.py",
    "tests/test_bench.py",
    "tests/test_planner.py",
    "tests/test_memory.py",
    "tests/test_engines.py",
    "tests/test_estimate.py",
    "tests/test_resilience.py",
    "tests/test_out_of_memory.py",
    "tests/test_preference.py",
}


def pytest_collection_modifyitems(config, items) -> None:
    """Modules that launch several processes run last, each module whole (its module fixtures are made once): CI runs
    the floor suite beside this one on 2 cores, one-process tests pair with it, and the launches of 2 processes have
    both cores once it has finished. Tests marked `gpu` show what only a CUDA GPU can (benchmarks/gpu_check.py runs
    them there)."""
    import torch

    launching = {item.nodeid.split("::")[0] for item in items if "multiprocess" in item.keywords}
    items.sort(key=lambda item: item.nodeid.split("::")[0] in launching)  # stable: each module's own order stays
    for item in items:
        if item.nodeid.split("::")[0] in BESIDE:
            item.add_marker(pytest.mark.beside)

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (benchmarks/gpu_check.py runs these on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Every process a test starts inherits this variable with the test's own value (launched workers too, which
# torch's launcher puts in sessions of their own, out of reach of the launcher's process group).
TEST_TAG = "LLMTUNE_TEST_TAG"
_tags = itertools.count()


def processes_tagged(tag: str) -> dict[int, str]:
    """{pid: command line} of the live processes whose environment holds TEST_TAG=tag."""
    found, needle = {}, f"{TEST_TAG}={tag}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not ours
            continue
    return found


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """A test that leaves a process behind fails, and the process is killed: the workers of a SIGKILLed launch kept
    training in the background and took CPU from the tests after them."""
    tag = f"{os.getpid()}-{next(_tags)}"
    os.environ[TEST_TAG] = tag
    yield
    left = processes_tagged(tag) if Path("/proc").is_dir() else {}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        pytest.fail(f"processes outlived the test (killed now): {left}")


CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is two plus two? Two plus two is four.",
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\n### Input:\n### Response:\nuser assistant system",
    "Hello, how are you? I am fine, thank you. Tell me a story about a cat.",
] * 20


def build_tokenizer(folder: Path, chat_template: str | None = CHATML):
    """A byte-level BPE (~400 tokens, BOS added) trained on a few strings, saved and reloaded via AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    return folder


@pytest.fixture
def tokenizer(tokenizer_dir):
    """A fresh copy per test (tests may set a chat template on it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


# ---------------------------------------------------------------- tiny runs (training-loop tests)


def write_tiny_model(folder: Path, **config) -> Path:
    """A tiny Llama saved as a user's checkpoint is: tokenizer, config and weights (seeded), which runs load back
    through `from_pretrained`, as users do (recipes that test `model.random_init` set it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(folder)
    defaults = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    llama = LlamaConfig(**{"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, **defaults, **config})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(llama).save_pretrained(folder)
    return folder


def write_tiny_data(path: Path, n: int = 96) -> Path:
    """Prompt/completion rows of varied length, so padding and token-normalised loss matter."""
    import json
    import random

    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog cat story tell me hello".split()
    rows = []
    for _ in range(n):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))
        completion = " " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))
        rows.append({"prompt": prompt, "completion": completion})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    return write_tiny_data(tmp_path_factory.mktemp("tiny_data") / "train.jsonl")


def write_recipe(path: Path, model_dir: Path, data: Path, **overrides) -> Path:
    """A recipe for a tiny run written to `path`; keyword arguments are dotted overrides (`training__max_steps=2`)."""
    import yaml

    recipe = {
        "output_dir": str(path.parent / "run"),
        "seed": 0,
        "model": {"name_or_path": str(model_dir)},
        "data": {"train": [{"path": str(data)}], "max_length": 48},
        "training": {
            "precision": "fp32",
            "gradient_checkpointing": True,  # fixed, as most tests check other things; tests of `auto` set it
            "micro_batch_size": 4,
            "global_batch_size": 8,
            "max_steps": 4,
            "learning_rate": 1e-3,
            "warmup_steps": 1,
        },
        "logging": {"every_n_steps": 1, "progress_bar": False},
        "checkpoint": {"resume": "none"},
    }
    for dotted, value in overrides.items():
        *parents, last = dotted.split("__")
        node = recipe
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture
def tiny_recipe(tmp_path, tiny_model_dir, tiny_data):
    """Write a recipe for a tiny run (tmp_path/recipe.yaml, output in tmp_path/run); keyword arguments are dotted
    overrides merged into it."""
    return lambda **overrides: write_recipe(tmp_path / "recipe.yaml", tiny_model_dir, tiny_data, **overrides)


def planner_rates() -> Rates:
    """The time model's rates a test plans with (`llmtune.plan.timing.Rates`): fixed, the planner's choice depends
    on the traced work only, the same on every machine and at any load."""
    from llmtune.plan.timing import Rates

    return Rates(flops_per_s=1e11, bytes_per_s=2e10, seconds_per_op=2e-5, source="test")


@pytest.fixture
def fixed_rates(monkeypatch) -> Rates:
    """This machine's rates fixed (`planner_rates`) for a test whose plans are made on its CPU (`llmtune estimate
    --device cpu`, `plan_recipe`, a run's `plan_run`) and compared with each other or with a choice: measured, they
    move with the host's load between two plans of one test (issue 54: two estimates of one recipe, one call apart,
    planned different peaks on a busy 2-core host). Tests of the measurement call `measure_rates` itself."""
    from llmtune.plan import timing

    rates = planner_rates()
    monkeypatch.setattr(timing, "measure_rates", lambda *args, **kwargs: rates)
    return rates
