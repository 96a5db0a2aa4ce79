"""Recipes: validation before anything heavy loads, inheritance, overrides, every shipped recipe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmtune.recipe import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p for p in (ROOT / "recipes").glob("*.yaml"))


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


MINIMAL = {"model": {"name_or_path": "some/model"}, "data": {"train": [{"path": "x.jsonl"}]}}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.model.name_or_path


def test_misspelled_key_names_file_key_and_suggestion(tmp_path):
    path = write(tmp_path / "r.yaml", {**MINIMAL, "training": {"learning_rat": 1e-4}})
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    (problem,) = err.value.problems
    assert str(path) in problem
    assert "`training.learning_rat`" in problem
    assert "did you mean training.learning_rate?" in problem


def test_all_problems_reported_at_once(tmp_path):
    path = write(
        tmp_path / "r.yaml",
        {**MINIMAL, "sed": 1, "training": {"precision": "fp8", "max_steps": "ten", "gradient_checkpointing": "yes"}},
    )
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    text = str(err.value)
    assert len(err.value.problems) == 4
    assert "did you mean seed?" in text
    assert "`training.precision` must be 'auto' | 'bf16' | 'fp16' | 'fp32' | 'bf16-true', got 'fp8'" in text
    assert "`training.max_steps` must be an integer" in text
    assert "`training.gradient_checkpointing` must be true or false" in text


def test_value_rules(tmp_path):
    path = write(tmp_path / "r.yaml", {**MINIMAL, "training": {"micro_batch_size": 3, "global_batch_size": 8}})
    with pytest.raises(
        RecipeError, match=r"global_batch_size.*\(8\) must be a multiple of training.micro_batch_size \(3\)"
    ):
        load_recipe(path)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("training.weight_decay=.nan", "training.weight_decay"),
        ("data.train=[{path: x.jsonl, weight: .nan}]", "data.train[0].weight"),
        ("data.train=[{path: x.jsonl, weight: 0}]", "data.train[0].weight"),
        ("seed=-5", "seed"),
        ("training.learning_rate=.inf", "training.learning_rate"),
        ("training.weight_decay=-0.1", "training.weight_decay"),
        ("peft.rank=0", "peft.rank"),
        ("peft.dropout=.nan", "peft.dropout"),
        ("peft.dropout=1.0", "peft.dropout"),
    ],
)
def test_values_no_run_can_use_are_refused_naming_the_key(tmp_path, capsys, override, key):
    """NaN passes every `>= 0` rule (each comparison with it is false): each of these trained, or failed deep inside
    a run, before."""
    from llmtune.cli.main import main

    path = write(tmp_path / "r.yaml", MINIMAL)
    assert main(["train", "--recipe", str(path), override]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.strip()]
    assert line.startswith("llmtune: error:") and f"`{key}`" in line and "Traceback" not in err


def test_preference_beta_unset_is_the_objectives_default_and_set_is_checked(tmp_path):
    pairs = {"train": [{"path": "x.jsonl", "format": "preference"}]}

    def preference(objective: str, **keys) -> Path:
        data = pairs if objective != "sft" else MINIMAL["data"]
        recipe = {**MINIMAL, "data": data, "training": {"objective": objective}, "preference": keys}
        return write(tmp_path / f"{objective}.yaml", recipe)

    defaults = {o: load_recipe(preference(o)).preference.beta_for(o) for o in ("dpo", "orpo", "simpo")}
    assert defaults == {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0}
    assert load_recipe(preference("simpo", beta=0.1)).preference.beta_for("simpo") == 0.1  # set: kept as set
    with pytest.raises(RecipeError, match="`preference.beta` must be positive"):
        load_recipe(preference("simpo", beta=0))
    # An sft recipe.yaml saved by earlier versions lists beta: 0.1 (every key, then a fixed default): still loads.
    assert load_recipe(preference("sft", beta=0.1)).preference.beta == 0.1
    with pytest.raises(
        RecipeError, match="`preference.beta` applies to training.objective dpo / orpo / simpo, not sft"
    ):
        load_recipe(preference("sft", beta=0.5))


def test_warmup_longer_than_the_run_is_allowed_but_not_negative(tmp_path):
    path = write(tmp_path / "r.yaml", {**MINIMAL, "training": {"max_steps": 1, "warmup_steps": 20}})
    assert load_recipe(path).training.warmup_steps == 20  # a smoke run of a recipe with warmup
    with pytest.raises(RecipeError, match=r"`training.warmup_steps` must be >= 0"):
        load_recipe(path, ["training.warmup_steps=-1"])


def test_bf16_adapters_need_adapters_and_a_bf16_true_run(tmp_path):
    path = write(tmp_path / "r.yaml", {**MINIMAL, "peft": {"method": "lora", "adapter_dtype": "bf16"}})
    with pytest.raises(RecipeError, match=r"`peft.adapter_dtype` bf16 needs training.precision bf16-true, not auto"):
        load_recipe(path)
    assert load_recipe(path, ["training.precision=bf16-true"]).peft.adapter_dtype == "bf16"
    with pytest.raises(RecipeError, match=r"`peft.adapter_dtype` applies to adapters: set peft.method"):
        load_recipe(path, ["training.precision=bf16-true", "peft.method=none"])


def test_missing_required_key(tmp_path):
    path = write(tmp_path / "r.yaml", {"data": MINIMAL["data"]})
    with pytest.raises(RecipeError, match="missing required key `model`"):
        load_recipe(path)


def test_inheritance_merges_deeply_and_names_the_right_file(tmp_path):
    base = write(tmp_path / "base.yaml", {**MINIMAL, "training": {"learning_rate": 1e-4, "max_steps": 7}})
    child = write(tmp_path / "child.yaml", {"base": "base.yaml", "training": {"max_steps": 9}})
    recipe = load_recipe(child)
    assert recipe.training.max_steps == 9 and recipe.training.learning_rate == 1e-4
    assert recipe.model.name_or_path == "some/model"
    write(base, {**MINIMAL, "training": {"warmup": 3}})
    with pytest.raises(RecipeError, match=f"{base}: unknown key `training.warmup`"):
        load_recipe(child)


def test_overrides_are_typed_and_validated(tmp_path):
    path = write(tmp_path / "r.yaml", MINIMAL)
    recipe = load_recipe(path, ["training.max_steps=20", "output_dir=/tmp/x", "training.learning_rate=3e-4"])
    assert recipe.training.max_steps == 20 and recipe.output_dir == "/tmp/x"
    assert recipe.training.learning_rate == pytest.approx(3e-4)
    with pytest.raises(RecipeError, match=r"<command line>: unknown key `training.max_step` \(did you mean"):
        load_recipe(path, ["training.max_step=20"])


def test_base_loop_is_refused(tmp_path):
    write(tmp_path / "a.yaml", {"base": "b.yaml"})
    write(tmp_path / "b.yaml", {"base": "a.yaml"})
    with pytest.raises(RecipeError, match="loops back"):
        load_recipe(tmp_path / "a.yaml")


def test_cli_refuses_bad_recipe_with_exit_2_and_no_traceback(tmp_path):
    path = write(tmp_path / "r.yaml", {**MINIMAL, "trainig": {"max_steps": 3}})
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "finetune.py"), "--recipe", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and str(path) in lines[0] and "did you mean training?" in lines[0]


def test_recipe_reference_is_in_sync_with_the_code():
    from llmtune.recipe import reference

    assert reference() in (ROOT / "docs" / "recipes.md").read_text(), "run `make docs`"


def test_json_schema_is_in_sync_with_the_code():
    """docs/recipe.schema.json is what `llmtune schema` prints (`make docs` regenerates it)."""
    from llmtune.recipe import json_schema

    committed = json.loads((ROOT / "docs" / "recipe.schema.json").read_text())
    assert committed == json_schema()


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_recipe_names_and_passes_the_schema(path):
    import jsonschema

    first = path.read_text().splitlines()[0]
    schema_path = (path.parent / first.removeprefix("# yaml-language-server: $schema=")).resolve()
    assert first.startswith("# yaml-language-server: $schema=") and schema_path == ROOT / "docs" / "recipe.schema.json"
    schema = json.loads(schema_path.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize(
    "bad",
    [
        {"model": {"name_or_path": "x", "attn_implementation": "flash"}},  # not one of the choices
        {"training": {"learning_rat": 1e-4}},  # a typo: additionalProperties is false
        {"training": {"micro_batch_size": "big"}},  # an integer or auto
        {"data": {"train": [{"format": "text"}]}},  # a source needs its path
    ],
)
def test_schema_refuses_what_the_loader_refuses(bad):
    import jsonschema

    from llmtune.recipe import json_schema

    assert list(jsonschema.Draft202012Validator(json_schema()).iter_errors(bad))


def test_a_model_path_under_home_is_expanded(tmp_path):
    # transformers took `~/models/x` for a hub id: the model and tokenizer named so never loaded.
    path = tmp_path / "r.yaml"
    path.write_text("model: {name_or_path: ~/models/x, tokenizer: ~/toks/y}\ndata: {train: [{path: d.jsonl}]}\n")
    model = load_recipe(path).model
    assert model.name_or_path == str(Path.home() / "models" / "x")
    assert model.tokenizer == str(Path.home() / "toks" / "y")


def test_compile_auto_compiles_the_decoder_blocks_on_cuda_only(tmp_path, tiny_recipe, tiny_model_dir):
    """training.compile defaults to auto: the blocks compiled where the run is on CUDA (the device type faked: Module.
    compile only wraps the block; nothing compiles before a call), eager on a CPU; true / false as set."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtune.run.parallelize import adapt

    def compiled_blocks(device_type: str | None, **overrides) -> list[bool]:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
        adapt(model, load_recipe(tiny_recipe(**overrides)), device_type=device_type)
        return [block._compiled_call_impl is not None for block in model.model.layers]

    assert load_recipe(tiny_recipe()).training.compile == "auto"
    assert not any(compiled_blocks(None))  # the weights' device: this CPU
    assert not any(compiled_blocks("cpu"))
    assert all(compiled_blocks("cuda"))
    assert not any(compiled_blocks("cuda", training__compile=False))
    assert all(compiled_blocks("cpu", training__compile=True))
