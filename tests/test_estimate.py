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
from llmtune.cli import main

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU: the plan is for it")
def test_estimate_without_a_device_plans_for_this_machines_cpu(capsys, tiny_model_dir):
    assert main(["estimate", "--model", str(tiny_model_dir), "--full", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert f"{tiny_model_dir}:" in out.splitlines()[0]
    assert "budget: this machine's CPU (no GPU here" in out and "live tensors only" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_estimate_quickstart_recipe_on_a_machine_without_gpu(capsys):
    """It used to stop with "no GPU here to read free memory from"."""
    assert main(["estimate", "--recipe", str(ROOT / "recipes" / "quickstart.yaml")]) == 0
    assert "this machine's CPU" in capsys.readouterr().out


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
