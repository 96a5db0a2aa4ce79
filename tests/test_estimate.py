"""`llmtune estimate` without a recipe: the model catalogue, --gpu cards, this machine's device, clean output."""

from __future__ import annotations

import fnmatch
import json
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmtune.catalogue import CATALOGUE_DIR, GPUS, MODELS, gpu_memory
from llmtune.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
# The plans these tests make on this machine's CPU are compared with each other and with a choice: its rates fixed,
# not measured, or a host whose load changes between two estimates plans two micro-batches (issue 54).
pytestmark = pytest.mark.usefixtures("fixed_rates")

# Parameter counts published on each model's hub page (safetensors "Model size"): a config with a wrong
# width, depth, vocabulary or tying gives another count.
PUBLISHED_PARAMETERS = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-32b": 32_763_876_352,
    "qwen3-8b": 8_190_735_360,
    "mistral-7b": 7_248_023_552,
    "gemma-2-9b": 9_241_705_984,
    "phi-3.5-mini": 3_821_079_552,
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_catalogue_configs_are_the_published_models(name):
    config = AutoConfig.from_pretrained(CATALOGUE_DIR / name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[name]


def test_catalogue_ships_as_package_data():
    """A non-editable install only carries files that pyproject's package-data names."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["llmtune.catalogue"]
    files = [p.relative_to(CATALOGUE_DIR).as_posix() for p in CATALOGUE_DIR.rglob("*.json")]
    assert sorted(f.split("/")[0] for f in files) == sorted(MODELS)
    assert all(any(fnmatch.fnmatch(f, pattern) for pattern in patterns) for f in files)


def test_gpu_names():
    assert gpu_memory("H100 80GB") == gpu_memory("h100-80gb") == GPUS["h100-80gb"]
    assert gpu_memory("RTX 4090") == GPUS["rtx-4090"] and gpu_memory("A10G") == GPUS["a10g"]


def test_estimate_a_model_folder_for_a_card_without_warnings(tiny_model_dir, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["estimate", "--model", str(tiny_model_dir), "--lora", "--gpu", "l4", "--seq-len", "64", "--json"])
    assert code == 0
    assert [str(w.message) for w in caught] == []
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cuda" and out["budget_from"].startswith("--gpu l4")
    assert out["estimate"]["settings"]["precision"] == "bf16-true" and out["estimate"]["settings"]["lora"]["rank"] == 16
    assert out["micro_batch_size"] == 32 and out["budget_bytes"] < GPUS["l4"]


@pytest.mark.slow
def test_estimate_a_model_with_bf16_adapters_and_refuse_them_where_nothing_is_bf16_true(tiny_model_dir, capsys):
    """--adapter-dtype (the recipe's peft.adapter_dtype) reaches the plan; without adapters, or on a CPU (no
    bf16-true there), it is refused with exit status 2 and the reason."""
    args = ["estimate", "--model", str(tiny_model_dir), "--gpu", "l4", "--seq-len", "64", "--json"]
    assert main([*args, "--adapter-dtype", "bf16"]) == 0
    settings = json.loads(capsys.readouterr().out)["estimate"]["settings"]
    assert settings["lora"]["dtype"] == "bf16" and settings["optimizer"] == "adamw_bf16"
    for refused in (["--full"], ["--device", "cpu", "--device-memory", "8GiB"]):
        model = ["estimate", "--model", str(tiny_model_dir), "--adapter-dtype", "bf16", *refused]
        assert main(model if "--device" in refused else [*model, "--gpu", "l4"]) == 2
        assert "--adapter-dtype bf16 needs adapters (--lora, --qlora) planned for a GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU: the plan is for it")
def test_estimate_without_a_device_plans_for_this_machines_cpu(capsys, tiny_model_dir):
    assert main(["estimate", "--model", str(tiny_model_dir), "--full", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert f"{tiny_model_dir}:" in out.splitlines()[0]
    assert "budget: this machine's CPU (no GPU here" in out and "live tensors only" in out


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_estimate_quickstart_recipe_on_a_machine_without_gpu(capsys):
    """It used to stop with "no GPU here to read free memory from"."""
    assert main(["estimate", "--recipe", str(ROOT / "recipes" / "quickstart.yaml")]) == 0
    assert "this machine's CPU" in capsys.readouterr().out


@pytest.mark.slow
def test_a_fixed_micro_batch_is_estimated_as_given_with_whether_it_fits(capsys):
    """`--device-memory` used to replace the recipe's micro-batch with the largest that fits."""
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    args = ["estimate", "--recipe", recipe, "training.micro_batch_size=1", "--device", "cpu"]
    assert main([*args, "--device-memory", "24GiB", "--json"]) == 0
    roomy = json.loads(capsys.readouterr().out)
    assert roomy["micro_batch_size"] == 1 and roomy["source"] == "recipe" and roomy["fits"] is True
    assert main([*args, "--device-memory", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 1 x" in out and "DOES NOT FIT" in out


@pytest.mark.slow
def test_the_recipes_adapter_dtype_reaches_the_estimate(tiny_recipe, capsys):
    """`llmtune estimate --recipe` plans the adapters in the dtype training gives them (`peft.adapter_dtype`):
    bf16 adapters keep bf16 inputs and states, so the same step peaks lower, and AdamW is BF16AdamW."""
    recipe = tiny_recipe(training__precision="bf16-true", peft__method="lora", training__micro_batch_size=4)

    def planned(adapter_dtype: str) -> dict:
        args = ["--json", "--device", "cpu", "--device-memory", "24GiB", f"peft.adapter_dtype={adapter_dtype}"]
        return _estimate_json(capsys, recipe, *args)

    fp32, bf16 = planned("fp32"), planned("bf16")
    assert main(["estimate", "--recipe", str(recipe), "--device", "cpu", "peft.adapter_dtype=bf16"]) == 0
    out = capsys.readouterr().out
    assert ", LoRA r=16 (bf16 adapters)" in out, out
    assert (fp32["estimate"]["settings"]["optimizer"], bf16["estimate"]["settings"]["optimizer"]) == (
        "adamw_fused",
        "adamw_bf16",
    )
    assert bf16["predicted_peak_bytes"] < fp32["predicted_peak_bytes"]


@pytest.mark.parametrize("sdpa", ["as installed", "patched out"])
def test_a_model_without_sdpa_is_planned_with_eager_attention(tmp_path, capsys, monkeypatch, sdpa):
    """Gemma-2 has an SDPA path in transformers 5.17 (our floor) and none in 5.25: the plan follows the class's own
    flag, so CI's two environments test both sides; patched out, the eager side is tested on any version."""
    from transformers import Gemma2Config
    from transformers.models.gemma2.modeling_gemma2 import Gemma2PreTrainedModel

    if sdpa == "patched out":
        monkeypatch.setattr(Gemma2PreTrainedModel, "_supports_sdpa", False)  # the model class and its decoder
    Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=512,
    ).save_pretrained(tmp_path)  # fmt: skip
    assert main(["estimate", "--model", str(tmp_path), "--gpu", "l4", "--seq-len", "64", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["estimate"]["settings"]["attn_implementation"]
    assert planned == ("sdpa" if Gemma2PreTrainedModel._supports_sdpa else "eager")


# ---------------------------------------------------------------- `--recipe` reads the recipe's data


@pytest.fixture(scope="module")
def wide_vocab_model(tmp_path_factory) -> Path:
    """The tiny model with a 32,000-token vocabulary (ids past the tokenizer's never occur): its logits weigh enough
    at the peak for the data's trained share to move the plan (the tiny model's 400 do not)."""
    from conftest import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("wide_vocab"), vocab_size=32_000)


def _estimate_json(capsys, recipe: Path, *args: str) -> dict:
    assert main(["estimate", "--recipe", str(recipe), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _wide_recipe(tmp_path: Path, model: Path, data: Path, **overrides) -> Path:
    from conftest import write_recipe

    settings = {"training__micro_batch_size": "auto", "training__loss": "chunked"} | overrides
    return write_recipe(tmp_path / "recipe.yaml", model, data, **settings)


@pytest.fixture
def peaks(tmp_path, capsys, wide_vocab_model, tiny_data) -> dict[str, int]:
    """The predicted peaks of micro-batch 2 with the data's trained share (~58% of a row) and with every token
    trained, and a budget between them: with the data micro-batch 2 fits, without only 1 (4 and 8 fit in neither:
    the time model would rank them within ~2% of each other, a measured rate's noise)."""
    recipe = _wide_recipe(tmp_path, wide_vocab_model, tiny_data, training__micro_batch_size=2)
    cpu = ["--device", "cpu", "--device-memory", "1GiB"]
    with_data = _estimate_json(capsys, recipe, *cpu)["predicted_peak_bytes"]
    bound = _estimate_json(capsys, recipe, *cpu, "--no-data")["predicted_peak_bytes"]
    return {"with_data": with_data, "bound": bound, "budget": (with_data + bound) // 2}


@pytest.mark.skipif(torch.cuda.is_available(), reason="training would plan for the GPU, the budget is a CPU's")
def test_estimate_plans_what_training_plans_on_the_recipes_data(tmp_path, capsys, wide_vocab_model, tiny_data, peaks):
    """It used to plan every token as trained (1.0) where training plans the data's densest row: +8% at the median
    of real runs. Training's plan is `build`'s (its `plan_run`, before any step)."""
    from llmtune.recipe import load_recipe
    from llmtune.run.setup import build

    recipe = _wide_recipe(tmp_path, wide_vocab_model, tiny_data, memory__budget=str(peaks["budget"]))
    estimated = _estimate_json(capsys, recipe)
    run = build(load_recipe(recipe))
    assert estimated["micro_batch_size"] == run.plan.micro_batch_size == 2
    assert estimated["grad_accum_steps"] == run.plan.grad_accum_steps
    assert estimated["checkpointing"] == run.plan.state()["checkpointing"]
    assert estimated["predicted_peak_bytes"] == run.plan.predicted_peak_bytes == peaks["with_data"]
    data = estimated["data"]
    assert data["read"] and data["whole"] and data["rows_read"] == 96
    assert data["trained_fraction"] == data["max_trained_fraction"] == run.data.stats.max_trained_fraction < 1
    assert data["trained_fraction_from"] == "the data"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the budget is a CPU's")
def test_no_data_plans_the_bound_as_estimate_did_before(tmp_path, capsys, wide_vocab_model, tiny_data, peaks):
    from llmtune.model.load import resolve_config
    from llmtune.plan.planning import plan_recipe
    from llmtune.recipe import load_recipe

    assert peaks["bound"] > peaks["with_data"]  # the same micro-batch
    recipe = _wide_recipe(tmp_path, wide_vocab_model, tiny_data, memory__budget=str(peaks["budget"]))
    with_data = _estimate_json(capsys, recipe)
    bound = _estimate_json(capsys, recipe, "--no-data")
    assert bound["data"] == {
        "read": False, "why": "--no-data", "trained_fraction": 1.0, "trained_fraction_from": "the bound"
    }  # fmt: skip
    assert (bound["micro_batch_size"], with_data["micro_batch_size"]) == (1, 2)
    before, _ = plan_recipe(  # the call `llmtune estimate` made before it read data: no trained_fraction
        load_recipe(recipe), resolve_config(str(wide_vocab_model)), device="cpu", budget_bytes=peaks["budget"],
        num_processes=1,
    )  # fmt: skip
    assert (bound["micro_batch_size"], bound["predicted_peak_bytes"]) == (
        before.micro_batch_size,
        before.predicted_peak_bytes,
    )
    assert main(["estimate", "--recipe", str(recipe), "--no-data"]) == 0
    assert "data: not read (--no-data): planned with 100.0% of each row's tokens trained" in capsys.readouterr().out


def test_unreadable_data_is_said_and_planned_as_the_bound(tmp_path, capsys, tiny_model_dir):
    """The plan does not need the data to exist (a card is sized before the data is written, on a machine without
    it): the reason is printed and the bound planned, exit 0. `llmtune data` and `train` refuse such data (exit 2)."""
    from conftest import write_recipe

    missing = tmp_path / "not-written-yet.jsonl"
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_model_dir, missing, training__micro_batch_size="auto")
    cpu = ["--device", "cpu", "--device-memory", "1GiB"]
    assert main(["estimate", "--recipe", str(recipe), *cpu]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("data: "))
    assert line == f"data: not read ({missing}: no such file or folder): planned with 100.0% of each row's tokens " \
        "trained (every token, the bound)"  # fmt: skip
    unread, bound = _estimate_json(capsys, recipe, *cpu), _estimate_json(capsys, recipe, *cpu, "--no-data")
    assert unread["data"]["read"] is False and unread["data"]["trained_fraction"] == 1.0
    assert unread["predicted_peak_bytes"] == bound["predicted_peak_bytes"]


def test_a_hub_dataset_out_of_reach_is_not_waited_for(tmp_path, capsys, tiny_model_dir, monkeypatch):
    """Offline, the hub's client retries for a minute and more before it fails: the estimate asks once, briefly,
    and plans the bound. The hub here is a local port nobody listens on (tests never reach the real one)."""
    import socket

    from conftest import write_recipe
    from huggingface_hub import constants

    with socket.socket() as s:  # a port free now, closed when the estimate knocks
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_model_dir, "nobody-here/no-such-dataset")
    data = _estimate_json(capsys, recipe, "--device", "cpu", "--device-memory", "1GiB")["data"]
    assert data["read"] is False and data["why"].startswith("nobody-here/no-such-dataset: ")


def test_model_without_recipe_reads_no_data(capsys, tiny_model_dir):
    args = ["estimate", "--model", str(tiny_model_dir), "--gpu", "l4", "--seq-len", "64"]
    assert main([*args, "--json"]) == 0
    assert "data" not in json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert "data:" not in capsys.readouterr().out


def test_estimate_answers_how_long_rows_are_split_and_what_would_fit_where_none_do(tiny_recipe, capsys):
    """Issue 45: on 2 processes, a budget under whole rows' peak but over a half row's is answered with rows split
    across both (`how`); on 1 process the same budget does not fit, and the error names the degree that would."""
    recipe = tiny_recipe(**{"data__max_length": 256, "training__micro_batch_size": 1})
    cpu = ["--no-data", "--device", "cpu", "--sharding", "none", "training.global_batch_size=2"]

    def peak(degree: int, processes: int = 2) -> int:
        args = [*cpu, "--device-memory", "1GiB", "--num-processes", str(processes), "--sequence-parallel", str(degree)]
        return _estimate_json(capsys, recipe, *args)["predicted_peak_bytes"]

    # Micro-batch 1, every layer recomputed (the recipe's): the least memory; 1 process keeps no DDP buckets.
    whole, half = min(peak(1), peak(1, processes=1)), peak(2)
    assert half < whole
    budget = (whole + half) // 2
    planned = [*cpu, "training.micro_batch_size=auto", "--tiled-mlp", "off", "--device-memory", str(budget)]
    answer = _estimate_json(capsys, recipe, *planned, "--num-processes", "2")["how"]
    assert answer["sequence_parallel"] == 2 and answer["tokens_per_process"] == 128 and answer["fits"]
    assert answer["micro_batch_size"] * answer["grad_accum_steps"] == 2  # the global batch, on 1 data-parallel process
    assert answer["predicted_peak_bytes"] <= budget and answer["predicted_step_seconds"] > 0
    assert main(["estimate", "--recipe", str(recipe), *planned, "--num-processes", "1"]) == 2
    assert "sequence parallel 2 on 2 processes (128 tokens a process" in capsys.readouterr().err
