"""LoRA / DoRA end to end on a tiny Llama with real saved base weights: training through the real loop,
trainable-parameter counts, gradients under checkpointing, adapter-only outputs, merging, and the
refusals (QLoRA / 8-bit Adam / fp16 on a CPU) that must come before any model loads."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from llmtune.cli.main import main
from llmtune.cli.merge import add_merge_parser
from llmtune.data import batch_for_step, collate
from llmtune.model.adapters import count_parameters
from llmtune.model.merge import MergeError, merge_run, save_base_weights
from llmtune.recipe import load_recipe
from llmtune.run.loop import fit
from llmtune.run.setup import build

ROOT = Path(__file__).resolve().parents[1]
RANK = 4
STEPS = 10
LLAMA_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without CUDA")


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny Llama of conftest with its weights saved (the adapter's base must exist on disk to merge)."""
    folder = tmp_path_factory.mktemp("tiny_base")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, folder / f.name)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    return folder


def write_recipe(folder: Path, base: str | Path, data: Path, **overrides) -> Path:
    """A tiny adapter run; keyword arguments are `section__key` overrides."""
    recipe = {
        "output_dir": str(folder / "run"),
        "seed": 0,
        "model": {"name_or_path": str(base)},
        "data": {"train": [{"path": str(data)}], "max_length": 48},
        "training": {
            "precision": "fp32",
            "micro_batch_size": 8,
            "global_batch_size": 8,
            "max_steps": STEPS,
            "learning_rate": 1e-2,  # high, so that 10 steps visibly lower the loss of a rank-4 adapter
            "warmup_steps": 0,
            "lr_schedule": "constant",
        },
        # Steps < 3 are always measured; measuring every step slows a CPU step down.
        "logging": {"every_n_steps": STEPS, "progress_bar": False},
        "checkpoint": {"resume": "none", "every_n_steps": STEPS},
        "peft": {"method": "lora", "rank": RANK, "alpha": 2.0 * RANK},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        recipe.setdefault(section, {})[key] = value
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, base_dir, tiny_data):
    """Trained runs shared by the tests of this module: trained(method, checkpointing, precision) -> (run, summary)."""
    cache: dict[tuple, tuple] = {}

    def get(method: str, checkpointing: bool, precision: str):
        key = (method, checkpointing, precision)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{method}-{'ckpt' if checkpointing else 'nockpt'}-{precision}")
            recipe = write_recipe(
                folder,
                base_dir,
                tiny_data,
                peft__method=method,
                training__precision=precision,
                training__gradient_checkpointing=checkpointing,
            )
            run = build(load_recipe(recipe))
            cache[key] = (run, fit(run))
        return cache[key]

    return get


def decoder_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """Every linear layer inside the decoder blocks (what `target_modules: all-linear` adapts; not lm_head)."""
    return [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]


def expected_adapter_params(config, rank: int, dora: bool) -> int:
    """r*(in+out) per adapted linear (A: r x in, B: out x r), plus DoRA's magnitude vector (out) per linear."""
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
    return sum(rank * (m.in_features + m.out_features) + (m.out_features if dora else 0) for m in decoder_linears(base))


def peft_model(run):
    return run.accelerator.unwrap_model(run.model).model


def first_batch_loss(run) -> float:
    """Loss per trained token of the run's step-1 batch under the current weights (dropout off)."""
    examples = batch_for_step(
        run.data.train, step=0, global_batch_size=run.recipe.training.global_batch_size, seed=run.recipe.seed,
        rank=0, world_size=1, group_by_length=run.recipe.data.group_by_length,
    )  # fmt: skip
    batch = collate(examples, pad_token_id=run.tokenizer.pad_token_id, packed=run.data.packed)
    run.model.eval()
    with torch.no_grad():
        loss = float(run.model(**batch)) / int((batch["labels"][:, 1:] != -100).sum())
    run.model.train()
    return loss


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m["loss"] for m in map(json.loads, lines) if "loss" in m]


def logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


# ---------------------------------------------------------------- training


MATRIX = [
    pytest.param("lora", True, "bf16", id="lora-ckpt-bf16"),
    pytest.param("dora", True, "fp32", id="dora-ckpt-fp32"),
    pytest.param("lora", True, "fp32", id="lora-ckpt-fp32", marks=pytest.mark.slow),
    pytest.param("lora", False, "fp32", id="lora-nockpt-fp32", marks=pytest.mark.slow),
    pytest.param("lora", False, "bf16", id="lora-nockpt-bf16", marks=pytest.mark.slow),
    pytest.param("dora", True, "bf16", id="dora-ckpt-bf16", marks=pytest.mark.slow),
    pytest.param("dora", False, "fp32", id="dora-nockpt-fp32", marks=pytest.mark.slow),
    pytest.param("dora", False, "bf16", id="dora-nockpt-bf16", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("method", "checkpointing", "precision"), MATRIX)
def test_adapters_train_only_their_parameters(trained, base_dir, method, checkpointing, precision):
    run, summary = trained(method, checkpointing, precision)
    assert (summary["precision"], summary["gradient_checkpointing"]) == (precision, checkpointing)
    model = peft_model(run)

    expected = expected_adapter_params(AutoConfig.from_pretrained(base_dir), RANK, dora=method == "dora")
    trainable, total = count_parameters(model)
    assert trainable == expected == model.get_nb_trainable_parameters()[0]
    assert total - trainable == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(base_dir).parameters())
    # The optimizer holds exactly the adapter tensors: no frozen base weight, none missing.
    in_optimizer = {id(p) for group in run.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}
    # Mixed precision keeps fp32 master weights for the adapters (autocast makes the bf16 copies).
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)

    seen = losses(Path(run.recipe.output_dir))
    assert len(seen) == STEPS and all(torch.isfinite(torch.tensor(seen)))
    # The adapters learned: step 1's batch, whose loss step 1 logged before any update, now scores lower.
    # (Later steps' losses are on other batches: too noisy to compare at this size.)
    assert first_batch_loss(run) < seen[0] - 0.2, seen


def test_final_holds_the_adapter_only(trained, base_dir):
    run, summary = trained("lora", True, "bf16")
    final = Path(summary["final_dir"])
    files = {p.name for p in final.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= files
    assert not files & {"model.safetensors", "pytorch_model.bin", "config.json"}
    adapter_bytes = (final / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes < (base_dir / "model.safetensors").stat().st_size / 5
    adapter_config = json.loads((final / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base_dir) and adapter_config["r"] == RANK


@pytest.mark.parametrize("adapter_dtype", ["fp32", "bf16"])
def test_bf16_true_keeps_adapters_in_fp32_unless_asked_for_bf16(tmp_path, base_dir, tiny_data, adapter_dtype):
    """bf16-true stores the frozen base in bf16; the adapters train in fp32 (peft's autocast_adapter_dtype), or in
    bf16 with `peft.adapter_dtype` bf16, then under BF16AdamW (stochastic rounding) and saved as bf16."""
    from llmtune.ops.optim import BF16AdamW

    recipe = write_recipe(
        tmp_path, base_dir, tiny_data, training__precision="bf16-true", peft__adapter_dtype=adapter_dtype
    )
    run = build(load_recipe(recipe))
    model = peft_model(run)
    assert model.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16
    trainable = [p for p in model.parameters() if p.requires_grad]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[adapter_dtype]
    assert trainable and all(p.dtype == dtype for p in trainable)
    optimizer = getattr(run.optimizer, "optimizer", run.optimizer)  # accelerate's wrapper holds it
    assert isinstance(optimizer, BF16AdamW) == (adapter_dtype == "bf16")


@pytest.mark.parametrize("adapter_dtype", ["fp32", "bf16"])
def test_qlora_upcasts_the_base_beside_fp32_adapters_only(tmp_path, base_dir, tiny_data, adapter_dtype):
    """peft's prepare_model_for_kbit_training, whose fp32 upcast of every weight that is not 4-bit suits fp32
    adapters, runs beside them only; bf16 adapters keep the base bf16. (The 4-bit load needs CUDA: the base here is
    the bf16 model it wraps, whose linear layers would be 4-bit.)"""
    from llmtune.run.parallelize import adapt

    recipe = load_recipe(
        write_recipe(
            tmp_path,
            base_dir,
            tiny_data,
            training__precision="bf16-true",
            peft__method="qlora",
            peft__adapter_dtype=adapter_dtype,
        )  # fmt: skip
    )
    model = adapt(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16), recipe)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[adapter_dtype]
    assert {p.dtype for p in model.parameters()} == {dtype}


# ---------------------------------------------------------------- gradients under checkpointing


def adapter_grads(run, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Gradients of the adapter weights after one forward/backward of a fixed batch through the wrapped model."""
    model = peft_model(run)
    if state is not None:
        model.load_state_dict(state, strict=False)
    batch = collate(
        [run.data.train[i] for i in range(8)], pad_token_id=run.tokenizer.pad_token_id, packed=run.data.packed
    )
    run.model.train()
    run.model.zero_grad(set_to_none=True)
    run.model(**batch).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_checkpointing_gives_every_layer_the_same_adapter_grads(tmp_path, base_dir, tiny_data, method):
    """The classic silent failure: under checkpointing, frozen embeddings feed blocks that need no grad and
    early layers' adapters get none. Every adapter must get the gradient it gets without checkpointing."""
    runs = {}
    for ckpt in (False, True):
        recipe = write_recipe(
            tmp_path / str(ckpt), base_dir, tiny_data, peft__method=method, training__gradient_checkpointing=ckpt
        )
        runs[ckpt] = build(load_recipe(recipe))
    model_on = peft_model(runs[True])
    # Every decoder layer recomputed (the flag transformers' checkpointing sets on each, 5.17 and 5.25 alike).
    layers = [m for m in model_on.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert layers and all(layer.gradient_checkpointing for layer in layers)
    # lora_B starts at 0, which zeroes lora_A's gradient; give B values so that both get one.
    torch.manual_seed(0)
    state = {
        n: (torch.randn_like(p) * 0.01 if "lora_B" in n else p.detach().clone())
        for n, p in model_on.named_parameters()
        if p.requires_grad
    }
    with_ckpt, without = adapter_grads(runs[True], state), adapter_grads(runs[False], state)
    assert with_ckpt.keys() == without.keys() == state.keys()
    kinds = {"lora_A", "lora_B"} | ({"lora_magnitude_vector"} if method == "dora" else set())
    for i in range(model_on.config.num_hidden_layers):
        names = [n for n in with_ckpt if f".layers.{i}." in n]
        # all-linear: every projection of every block, each with all its adapter tensors
        assert {(n.split(".")[-4], n.split(".")[-3]) for n in names} == {(m, k) for m in LLAMA_LINEARS for k in kinds}
        for n in names:
            assert with_ckpt[n].abs().sum() > 0, f"{n}: zero gradient under checkpointing"
            torch.testing.assert_close(with_ckpt[n], without[n], rtol=1e-4, atol=1e-6, msg=n)


# ---------------------------------------------------------------- merging


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_merged_model_has_the_adapter_models_logits(trained, tmp_path, method):
    run, summary = trained(method, True, "fp32")
    out = merge_run(Path(run.recipe.output_dir), tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert type(merged).__name__ == "LlamaForCausalLM" and merged.config.use_cache
    assert not any("lora" in n for n in merged.state_dict())
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    adapter_model = peft_model(run)
    vocab = merged.config.vocab_size
    expected = logits(adapter_model, vocab)
    torch.testing.assert_close(logits(merged, vocab), expected, rtol=0, atol=1e-4)
    with adapter_model.disable_adapter():  # not vacuous: the adapter changed the model
        assert (logits(adapter_model, vocab) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("head", ["adapted", "whole"])
def test_the_lm_head_trains_under_the_chunked_loss_and_merges(tmp_path, base_dir, tiny_data, head):
    """`lm_head` in target_modules (LoRA on it) or in modules_to_save (trained whole): `loss: auto` keeps the chunked
    loss, the head learns, and the merged model gives the adapter model's logits."""
    keys = (
        {"peft__target_modules": ["q_proj", "lm_head"]} if head == "adapted" else {"peft__modules_to_save": ["lm_head"]}
    )
    run = build(load_recipe(write_recipe(tmp_path, base_dir, tiny_data, training__max_steps=3, **keys)))
    assert run.accelerator.unwrap_model(run.model).impl == "chunked"
    fit(run)
    model = peft_model(run)
    trained = {n for n, p in model.named_parameters() if p.requires_grad and "lm_head" in n}
    assert trained == (
        {f"base_model.model.lm_head.lora_{ab}.default.weight" for ab in "AB"}
        if head == "adapted"
        else {"base_model.model.lm_head.modules_to_save.default.weight"}
    )
    vocab = model.config.vocab_size
    with model.disable_adapter():
        base_logits = logits(model, vocab)
    torch.testing.assert_close(base_logits, logits(AutoModelForCausalLM.from_pretrained(base_dir), vocab))
    lm_head = model.base_model.model.lm_head  # the head itself learned: lora_B starts at zero, the copy at the base
    moved = lm_head.lora_B["default"].weight if head == "adapted" else lm_head.weight - lm_head.original_module.weight
    assert moved.abs().max() > 1e-3
    from safetensors.torch import load_file

    saved = load_file(Path(run.recipe.output_dir) / "final" / "adapter_model.safetensors")
    # The trained tensors alone: peft's "auto" would add the adapted head's frozen base weight (V x h)
    assert len(saved) == sum(p.requires_grad for p in model.parameters()) and not any("base_layer" in k for k in saved)
    merged = AutoModelForCausalLM.from_pretrained(merge_run(Path(run.recipe.output_dir), tmp_path / "merged"))
    expected = logits(model, vocab)
    torch.testing.assert_close(logits(merged, vocab), expected, rtol=0, atol=1e-4)
    assert (expected - base_logits).abs().max() > 1e-2  # not vacuous: training changed the model


def test_merging_an_adapted_head_unties_it_from_the_embeddings(tmp_path):
    """A tied model (Gemma, Qwen2-0.5B, Llama-3.2-1B) with LoRA on lm_head: merged into the tensor the head shares
    with the input embeddings, the adapter would change every token's embedding too."""
    from conftest import write_tiny_model
    from peft import LoraConfig, get_peft_model

    base = write_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    lora = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
    model.save_pretrained(tmp_path / "final", save_embedding_layers=False)
    vocab = model.config.vocab_size
    expected = logits(model, vocab)
    merged = AutoModelForCausalLM.from_pretrained(merge_run(tmp_path / "final", tmp_path / "merged"))
    torch.testing.assert_close(logits(merged, vocab), expected, rtol=0, atol=1e-4)
    assert not merged.config.tie_word_embeddings
    original = AutoModelForCausalLM.from_pretrained(base).get_input_embeddings().weight
    assert torch.equal(merged.get_input_embeddings().weight, original)


def test_merge_cli_default_out_and_rerun(trained, tmp_path, capsys):
    run, _ = trained("lora", True, "fp32")
    run_dir = tmp_path / "copy"
    shutil.copytree(run.recipe.output_dir, run_dir)
    parser = argparse.ArgumentParser()
    add_merge_parser(parser.add_subparsers(dest="command", required=True))
    for _ in range(2):  # a second merge replaces the first
        args = parser.parse_args(["merge", "--run", str(run_dir)])
        assert args.func(args) == 0
    assert capsys.readouterr().out.strip().endswith(str(run_dir / "merged"))
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith((".", "merged"))) == ["merged"]
    AutoModelForCausalLM.from_pretrained(run_dir / "merged")


def test_merge_from_checkpoint_matches_final(trained, tmp_path):
    run, _ = trained("lora", True, "fp32")
    ckpt = Path(run.recipe.output_dir) / "checkpoints" / f"step-{STEPS:06d}"
    out = merge_run(ckpt, tmp_path / "from-ckpt")
    merged = AutoModelForCausalLM.from_pretrained(out)
    vocab = merged.config.vocab_size
    torch.testing.assert_close(logits(merged, vocab), logits(peft_model(run), vocab), rtol=0, atol=1e-4)


def fake_random_init_run(run, folder: Path) -> Path:
    """A copy of a run as if its base had been random_init: the adapter's base has a config and no weights."""
    shutil.copytree(Path(run.recipe.output_dir) / "final", folder / "final")
    recipe = yaml.safe_load((Path(run.recipe.output_dir) / "recipe.yaml").read_text())
    config_only = folder / "config-only"
    config_only.mkdir()
    LlamaConfig.from_pretrained(recipe["model"]["name_or_path"]).save_pretrained(config_only)
    recipe["model"] = {**recipe["model"], "name_or_path": str(config_only), "random_init": True}
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    adapter_config = json.loads((folder / "final" / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = str(config_only)
    (folder / "final" / "adapter_config.json").write_text(json.dumps(adapter_config))
    return folder


def test_merge_refuses_a_random_init_base_and_uses_saved_base_weights(trained, tmp_path):
    run, _ = trained("lora", True, "fp32")
    folder = fake_random_init_run(run, tmp_path)
    with pytest.raises(MergeError, match="random_init.*exist on\\s+no disk"):
        merge_run(folder)
    # With the base weights saved beside the adapter (what save_final should do for random_init), it merges.
    save_base_weights(peft_model(run), folder / "final" / "base")
    base_only = AutoModelForCausalLM.from_pretrained(folder / "final" / "base")
    assert not any("lora" in n or "base_layer" in n for n in base_only.state_dict())
    merged = AutoModelForCausalLM.from_pretrained(merge_run(folder))
    vocab = merged.config.vocab_size
    torch.testing.assert_close(logits(merged, vocab), logits(peft_model(run), vocab), rtol=0, atol=1e-4)


def test_merge_errors_are_clear(tmp_path, base_dir):
    with pytest.raises(MergeError, match="no such directory"):
        merge_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MergeError, match="not an llmtune run"):
        merge_run(tmp_path / "empty")
    shutil.copytree(base_dir, tmp_path / "full" / "final")  # what a full fine-tune's final/ looks like
    with pytest.raises(MergeError, match="full fine-tune.*no adapter to\\s+merge"):
        merge_run(tmp_path / "full")
    parser = argparse.ArgumentParser()
    add_merge_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["merge", "--run", str(tmp_path / "full")])
    assert args.func(args) == 2


# ---------------------------------------------------------------- refusals before any model loads


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if the run gets as far as loading a tokenizer, a config or a model: transformers' own loaders,
    whichever llmtune module calls them."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    def refuse(*args, **kwargs):
        raise AssertionError("a model/tokenizer load was attempted before the refusal")

    for auto, loader in (
        (AutoTokenizer, "from_pretrained"),
        (AutoConfig, "from_pretrained"),
        (AutoModelForCausalLM, "from_pretrained"),
        (AutoModelForCausalLM, "from_config"),
    ):
        monkeypatch.setattr(auto, loader, refuse)


@NO_CUDA
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"peft__method": "qlora"}, "peft.method=qlora needs bitsandbytes on a CUDA GPU"),
        ({"training__optimizer": "adamw_8bit"}, "training.optimizer=adamw_8bit needs bitsandbytes on a CUDA GPU"),
        ({"training__precision": "fp16"}, "fp16 cannot run on cpu"),
    ],
    ids=["qlora", "adamw_8bit", "fp16"],
)
def test_cpu_refusals_exit_2_before_loading(tmp_path, tiny_data, capsys, no_loading, overrides, message):
    recipe = write_recipe(tmp_path, "no-such-org/no-such-model-7b", tiny_data, **overrides)
    assert main(["train", "--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(("installed", "refused"), [("0.42.0", True), ("0.43.2", False), ("0.45.5+cu124", False)])
def test_qlora_refuses_a_bitsandbytes_that_keeps_every_4bit_input(
    tmp_path, base_dir, tiny_data, monkeypatch, installed, refused
):
    """bitsandbytes before 0.43.2 keeps each 4-bit matmul's input until backward ends (its PR #1270): past
    checkpointing and past the plan. A CUDA launch is refused before anything loads. The installed package is faked
    here (bitsandbytes needs CUDA): its version is the subject."""
    import importlib.metadata
    import importlib.util

    from llmtune.errors import SetupError
    from llmtune.model.precision import check_requirements

    find_spec, version = importlib.util.find_spec, importlib.metadata.version
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "bitsandbytes" else find_spec(name, *a)
    )
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: installed if name == "bitsandbytes" else version(name)
    )
    recipe = load_recipe(write_recipe(tmp_path, base_dir, tiny_data, peft__method="qlora"))
    if refused:
        with pytest.raises(SetupError, match=r"bitsandbytes >= 0\.43\.2, found 0\.42\.0: earlier versions keep"):
            check_requirements(recipe, "cuda")
    else:
        check_requirements(recipe, "cuda")  # passes
    adamw_8bit = load_recipe(write_recipe(tmp_path, base_dir, tiny_data, training__optimizer="adamw_8bit"))
    check_requirements(adamw_8bit, "cuda")  # 8-bit AdamW has no such input to keep


# ---------------------------------------------------------------- the shipped LoRA recipe


def test_llama3_8b_lora_recipe_validates_and_counts():
    recipe = load_recipe(ROOT / "recipes" / "llama3-8b-lora.yaml")
    assert recipe.model.name_or_path == "meta-llama/Llama-3.1-8B" and recipe.peft.method == "lora"
    config = AutoConfig.from_pretrained(ROOT / "llmtune" / "catalogue" / "llama-3.1-8b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Llama-3.1-8B's published count
    # rank 16, all-linear: 32 layers x 16 x (q 8192 + k 5120 + v 5120 + o 8192 + 3 x 18432) = 41.9M
    assert expected_adapter_params(config, recipe.peft.rank, dora=False) == 41_943_040


def test_merge_never_replaces_its_base_nor_a_folder_it_did_not_write(trained, tmp_path, base_dir, capsys):
    """`--out` used to replace any folder with a config.json, the base the adapter was trained on included."""

    def files(folder: Path) -> dict[str, bytes]:
        return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}

    run, _ = trained("lora", True, "fp32")
    run_dir = Path(run.recipe.output_dir)
    base_before = files(base_dir)
    parser = argparse.ArgumentParser()
    add_merge_parser(parser.add_subparsers(dest="command", required=True))
    for out in (base_dir, run_dir, run_dir / "final"):  # what the merge reads: refused, even with --overwrite
        for flags in ([], ["--overwrite"]):
            args = parser.parse_args(["merge", "--run", str(run_dir), "--out", str(out), *flags])
            assert args.func(args) == 2
            assert "which this merge reads" in capsys.readouterr().err
    assert files(base_dir) == base_before

    theirs = tmp_path / "someone-elses-model"
    shutil.copytree(base_dir, theirs)
    argv = ["merge", "--run", str(run_dir), "--out", str(theirs)]
    args = parser.parse_args(argv)
    assert args.func(args) == 2
    assert "not written by llmtune merge" in capsys.readouterr().err and files(theirs) == base_before
    args = parser.parse_args([*argv, "--overwrite"])
    assert args.func(args) == 0 and (theirs / "llmtune_merge.json").is_file()
    args = parser.parse_args(argv)  # now a merge's own folder: a later merge replaces it unasked
    assert args.func(args) == 0
