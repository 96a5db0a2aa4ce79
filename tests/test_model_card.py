"""`final/README.md`: llmtune's model card, for full fine-tunes and adapters: what the run knows (base model, method,
data, steps, eval loss, the recipe), Hub metadata, and a "How to load" snippet that loads the model as written."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import yaml
from conftest import write_recipe
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from llmtune.recipe import load_recipe
from llmtune.run.loop import fit
from llmtune.run.model_card import front_matter, how_to_load
from llmtune.run.setup import build


def trained_card(recipe: Path) -> tuple[str, dict, Path]:
    """Train `recipe`; its final/README.md, run summary and final/."""
    summary = fit(build(load_recipe(recipe)))
    final = Path(summary["final_dir"])
    return (final / "README.md").read_text(), summary, final


def load_as_the_card_says(card: str, final: Path, moved: Path):
    """Copy final/ to `moved` (as a user who downloads or moves it), and run the card's python block with its path
    changed to there: the model it loads."""
    shutil.copytree(final, moved)
    (code,) = re.findall(r"```python\n(.*?)```", card, re.S)
    assert code.count(f'"{final}"') == 1, code  # the one path a user changes
    scope: dict = {}
    exec(code.replace(f'"{final}"', f'"{moved}"'), scope)  # noqa: S102 (the card's own snippet, run as a user would)
    return scope["model"], scope["tokenizer"]


def says_what_the_run_knows(card: str, summary: dict, base: Path) -> dict:
    """The checks both kinds of card pass; the card's Hub metadata."""
    assert "More Information Needed" not in card
    meta = ModelCard(card).data.to_dict()  # what the Hub reads
    assert "llmtune" in meta["tags"] and meta["pipeline_tag"] == "text-generation"
    assert "base_model" not in meta  # a local base: not a Hub id
    assert f"`{base}`" in card
    assert f"| steps | {summary['steps']} optimizer steps, {summary['trained_tokens']} trained tokens |" in card
    assert f"| eval loss | {summary['eval_loss']:.4f} " in card
    assert "| global batch | 8 examples (micro-batch 4 x accumulation 2 x 1 process) |" in card
    # The recipe itself, resolved: the same as recipe.yaml beside final/.
    (block,) = re.findall(r"```yaml\n(.*?)```", card, re.S)
    assert yaml.safe_load(block) == yaml.safe_load((Path(summary["final_dir"]).parent / "recipe.yaml").read_text())
    return meta


def recipe_for(tmp_path: Path, model: Path, data: Path, **overrides) -> Path:
    return write_recipe(
        tmp_path / "recipe.yaml",
        model,
        data,
        training__max_steps=2,
        training__gradient_checkpointing=False,
        data__eval_fraction=0.25,
        **overrides,
    )


def test_a_full_fine_tune_card_loads_with_transformers(tmp_path, tiny_model_dir, tiny_data):
    card, summary, final = trained_card(recipe_for(tmp_path, tiny_model_dir, tiny_data))
    meta = says_what_the_run_knows(card, summary, tiny_model_dir.resolve())
    assert meta["library_name"] == "transformers" and "full fine-tune: every weight trained" in card
    model, tokenizer = load_as_the_card_says(card, final, tmp_path / "moved")
    saved = load_file(final / "model.safetensors")
    assert saved and all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert tokenizer("hello").input_ids


def test_a_lora_card_loads_with_peft_on_its_base(tmp_path, tiny_model_dir, tiny_data):
    from peft import PeftModel

    recipe = recipe_for(tmp_path, tiny_model_dir, tiny_data, peft__method="lora", peft__rank=4)
    card, summary, final = trained_card(recipe)
    meta = says_what_the_run_knows(card, summary, tiny_model_dir.resolve())
    assert meta["library_name"] == "peft" and "lora" in meta["tags"]
    assert "LoRA: rank 4, alpha 32, dropout 0, on every linear layer of the decoder" in card
    assert f"llmtune merge --run {final.parent}" in card
    model, _ = load_as_the_card_says(card, final, tmp_path / "moved")
    assert isinstance(model, PeftModel)
    loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    saved = load_file(final / "adapter_model.safetensors")
    assert saved.keys() == loaded.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())


def test_a_random_init_adapter_card_loads_the_base_saved_beside_it(tmp_path, tiny_model_dir, tiny_data):
    """Random base weights exist only in final/base/: the snippet loads them from there, wherever final/ is."""
    recipe = recipe_for(tmp_path, tiny_model_dir, tiny_data, peft__method="lora", model__random_init=True)
    card, _, final = trained_card(recipe)
    assert "adapter on random weights with the architecture of" in card and "More Information Needed" not in card
    model, _ = load_as_the_card_says(card, final, tmp_path / "moved")
    base = load_file(final / "base" / "model.safetensors")
    loaded = model.get_base_model().state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(loaded[name.replace("q_proj.", "q_proj.base_layer.")], base[name])


def test_hub_ids_go_in_the_metadata_and_the_snippet_names_the_revision(tmp_path):
    recipe = load_recipe(
        write_recipe(
            tmp_path / "recipe.yaml",
            Path("HuggingFaceTB/SmolLM2-135M"),
            Path("HuggingFaceH4/no_robots"),
            model__revision="v1",
            peft__method="qlora",
        )
    )
    meta = ModelCard(front_matter(recipe)).data.to_dict()
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M" and meta["library_name"] == "peft"
    assert meta["datasets"] == ["HuggingFaceH4/no_robots"] and meta["tags"] == ["llmtune", "sft", "qlora"]
    snippet = how_to_load(recipe, tmp_path / "run" / "final")
    assert 'AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M", revision="v1")' in snippet
    assert "BitsAndBytesConfig(load_in_4bit=True" in snippet
