"""The planner models both phases of a grpo step (issue 29, point 3): the training step on prompt + completion rows,
and the generation that samples them, whose rows per `generate` call it chooses within the budget.

Tolerances: the training step is traced on fake tensors as for SFT and is exact to the byte on CPU (TOL 1%, as
tests/test_memory.py). The generation phase is a closed form (llmtune.plan.generation); against the live tensors
of real CPU `generate` calls (the growth above the resident state) it is over by 0.01-0.06% in the cases below and
+1.2% for LoRA under autocast: the tests allow [0, +3%]. Seen outside them: +0.3% with 24 new tokens, +1.2% with 96
(the ids' copies), +4.4% for a prefill peak under autocast (the cast cache still filling: the last layer's and the
head's casts come after it), +7% with eager attention, and -0.06% (1.2 KB) for LoRA under autocast at a sampling
peak.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import planner_rates
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessorList

from llmtune.cli.main import main
from llmtune.data import IGNORE
from llmtune.objectives.rollouts import GRPOModel, GumbelSampling, collate_completions
from llmtune.ops.measure import PeakMemoryTracker
from llmtune.plan import BatchPlan, estimate, estimate_settings, plan_for_budget, training_rows
from llmtune.plan.estimate import LoraSpec
from llmtune.plan.from_recipe import with_generation
from llmtune.plan.generation import (
    DecoderShape,
    GenerationEstimate,
    generation_peak,
    generation_resident,
    generation_widths,
    kv_cache_bytes,
    plan_generation_rows,
    values_stay_16_bit,
)
from llmtune.recipe import (
    DataConfig,
    GRPOConfig,
    MemoryConfig,
    ModelConfig,
    Recipe,
    SourceConfig,
    TrainingConfig,
)

TOL = 0.01  # the training step (as tests/test_memory.py)
GENERATION_OVER = 0.03  # the generation phase: predicted growth within [measured, measured x 1.03]
RATES = planner_rates()


def tiny(vocab: int = 512, intermediate: int = 128, **kw) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **kw,
    )


def grpo_recipe(max_length: int = 48, max_new_tokens: int = 32, **training) -> Recipe:
    training = {"objective": "grpo", "precision": "fp32", "global_batch_size": 16, **training}
    return Recipe(
        model=ModelConfig(name_or_path="tiny"),
        data=DataConfig(train=[SourceConfig(path="p.jsonl", format="prompt")], max_length=max_length, packing=True),
        training=TrainingConfig(**training),
        grpo=GRPOConfig(num_generations=4, max_new_tokens=max_new_tokens),
    )


# ---------------------------------------------------------------- the training phase


def test_grpo_trains_prompt_plus_completion_rows_padded_with_only_the_completion_trained():
    """Rows of max_length + max_new_tokens, padded though data.packing is on, max_new_tokens of them trained; the
    prompts' own trained fraction (0: no prompt token is trained, what training passes) bounds nothing."""
    recipe = grpo_recipe(max_length=48, max_new_tokens=32)
    assert training_rows(recipe, trained_fraction=0.0) == training_rows(recipe)
    rows = training_rows(recipe)
    assert (rows.seq_len, rows.layout, rows.trained_fraction) == (80, "padded", 32 / 80)
    settings = estimate_settings(recipe, loss="chunked", device="cpu", trained_fraction=0.0)
    assert (settings["layout"], settings["trained_fraction"], settings["objective"]) == ("padded", 0.4, "grpo")
    sft = Recipe(ModelConfig("tiny"), data=DataConfig(max_length=48, packing=True), training=TrainingConfig())
    assert (training_rows(sft, 0.25).seq_len, training_rows(sft, 0.25).layout) == (48, "packed")
    assert training_rows(sft, 0.0).trained_fraction == 1 / 48  # at least one token, as before


def test_the_grpo_step_estimate_matches_a_real_step():
    """GRPOModel on completions as collate_completions pads them: the traced estimate equals the measured step. Each
    completion is max_new_tokens long (the most trained tokens); the last prompt is 8 tokens short, so there is a
    padding mask, as in almost every batch of completions (the estimate cannot see that a fake mask is all ones)."""
    cfg, micro, prompt, new = tiny(), 2, 48, 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.config.use_cache = False
    module = GRPOModel(model, "chunked", GRPOConfig(), "none")
    g = torch.Generator().manual_seed(0)
    examples = []
    for length in (prompt, prompt - 8):
        ids = torch.randint(1, cfg.vocab_size, (length + new,), generator=g).tolist()
        examples.append({"input_ids": ids, "labels": [IGNORE] * length + ids[length:], "advantage": 0.5})
    batch = collate_completions(examples, pad_token_id=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()

    def step() -> None:
        module(**batch)[0].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with PeakMemoryTracker("cpu", baseline=[model, opt]) as tracker:
        step()
        tracker.reset_peak()
        step()
    predicted = estimate(
        cfg, micro_batch_size=micro, seq_len=prompt + new, precision="fp32", gradient_checkpointing=False,
        loss="chunked", objective="grpo", layout="padded", device="cpu", trained_fraction=new / (prompt + new),
    ).peak_bytes  # fmt: skip
    assert abs(predicted / tracker.peak_bytes - 1) <= TOL, (predicted, tracker.peak_bytes)


def test_the_planner_plans_the_training_step_at_the_rows_grpo_trains():
    plan = plan_for_budget(
        grpo_recipe(micro_batch_size=2, gradient_checkpointing=False),
        tiny(),
        estimate_settings(grpo_recipe(), loss="chunked", device="cpu"),
        budget_bytes=2**30,
        num_processes=2,
        rates=RATES,
    )
    s = plan.estimate.settings
    assert (s["seq_len"], s["layout"], s["trained_fraction"]) == (80, "padded", 0.4)
    assert (plan.micro_batch_size, plan.grad_accum_steps) == (2, 4)  # 16 completions over 2 processes


# ---------------------------------------------------------------- the generation phase: the model


def test_generation_peak_worked_example_llama3_8b_shape():
    """A Llama-3-8B-shaped config, 16 rows, 512-token prompts, 256 new tokens, bf16 weights (2 bytes everywhere).

    KV cache per token and row: 2 (K, V) x 32 layers x 8 kv heads x 128 x 2 bytes = 131072 bytes (128 KiB).
    prefill: 16 x 512 tokens cached = 1 GiB; the last layer's MLP holds per token 3 x 14336 x 2 = 86016 bytes
    (attention's (4 x 32 + 2 x 8) x 128 x 2 = 36864 is less) beside (4 x 4096 + 2 x 128) x 2 = 33280 of the
    residual stream: 119296 x 8192 tokens = 977 MB.
    last sampling step: 767 tokens cached (the 256th token is never fed back) = 1.50 GiB; logits 16 x 128256 at
    2 (the model's) + 24 (fp32 buffers) bytes = 53 MB.
    ids: input_ids and the mask, int64, each copied by cat: 4 x 16 x 768 x 8 = 393216."""
    cfg = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256,
    )  # fmt: skip
    est = generation_peak(
        cfg, rows=16, prompt_tokens=512, max_new_tokens=256, resident_bytes=16 * 10**9, precision="bf16-true"
    )
    per_token = 2 * 32 * 8 * 128 * 2
    assert per_token == 131072
    assert kv_cache_bytes(DecoderShape.of(cfg), generation_widths("bf16-true"), 16, 767) == 767 * 16 * per_token
    assert est.peak_phase == "prefill"
    assert est.breakdown == {
        "resident": 16 * 10**9,
        "kv_cache": 512 * 16 * per_token,  # 1073741824
        "activations": 16 * 512 * (3 * 14336 * 2 + (4 * 4096 + 2 * 128) * 2),  # 977272832
        "ids": 4 * 16 * 768 * 8,
    }
    assert est.peak_bytes == 16 * 10**9 + 1_073_741_824 + 977_272_832 + 393_216
    # Short prompts: the last sampling step peaks, with the cache at 64 + 256 - 1 tokens (its decode forward holds
    # one layer's old key beside the cache, 1/64 of it = 10 MB, and 8 bytes a logit of the step before: 29 MB).
    short = generation_peak(cfg, rows=16, prompt_tokens=64, max_new_tokens=256, precision="bf16-true")
    assert short.peak_phase == "sampling"
    # The sampler's int32 token ids (its noise's counters), 4 bytes a vocabulary entry, live for the call.
    assert short.breakdown == {"resident": 0, "kv_cache": 319 * 16 * per_token, "logits_and_sampling": 16 * 128256 * 26,
                               "noise_counters": 4 * 128256, "ids": 4 * 16 * 320 * 8}  # fmt: skip
    # 1024 new tokens: that old key (36 MB) and the decode forward's 54 MB overtake sampling's 53 MB.
    assert generation_peak(cfg, rows=16, prompt_tokens=64, max_new_tokens=1024).peak_phase == "decode forward"


def test_mixed_precision_caches_fp32_keys_and_16_bit_values():
    """Under autocast the keys leave rotary in fp32 (the cos/sin tables follow the fp32 residual stream), the values
    stay bf16: what a real cache holds."""
    model = LlamaForCausalLM(tiny()).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = model(torch.zeros((1, 4), dtype=torch.long), use_cache=True).past_key_values
    w = generation_widths("bf16")
    assert (cache.layers[0].keys.element_size(), cache.layers[0].values.element_size()) == (w.key, w.value)
    assert w.key == 4 and w.value == (2 if values_stay_16_bit() else 4)
    assert generation_widths("bf16", "fsdp") == generation_widths("bf16-true") == generation_widths("fp16", "zero2")


def test_decoder_shape_defaults_and_composite_configs():
    """head_dim absent: hidden / heads; num_key_value_heads absent: heads; a composite config's text config."""
    text = SimpleNamespace(
        hidden_size=256, num_attention_heads=8, num_hidden_layers=3, intermediate_size=512, vocab_size=1000
    )
    shape = DecoderShape.of(text)
    assert (shape.head_dim, shape.kv_heads) == (32, 8)
    assert DecoderShape.of(SimpleNamespace(get_text_config=lambda: text)) == shape


def _measured_generate(
    cfg: LlamaConfig, folder, *, rows: int, prompt: int, new: int, precision: str, top_p: float, lora: str | None
):
    """(live tensor bytes at entry, peak) of one `generate` call as llmtune.objectives.rollouts.sample makes it: no
    padding,
    greedy decoding of Gumbel-noised scores, under no_grad (and autocast for mixed precision). The stop id is one no
    sample can draw, so every call makes all `new` tokens."""
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    if lora:
        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.eval()
    inputs = torch.randint(10, cfg.vocab_size, (rows, prompt), generator=torch.Generator().manual_seed(0))
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=[cfg.vocab_size + 7], pad_token_id=0)
    sampling = LogitsProcessorList([GumbelSampling(range(rows), temperature=0.7, top_p=top_p)])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with torch.no_grad(), autocast, PeakMemoryTracker("cpu", baseline=[model]) as tracker:
        out = model.generate(
            inputs, attention_mask=torch.ones_like(inputs), generation_config=config, logits_processor=sampling
        )
    assert out.shape == (rows, prompt + new)
    # Autocast's cache of the bf16 casts of the weights that require grad lives for the call (what
    # `generation_resident` adds to the training trace's states): every linear weight, or the adapters'.
    trained = [p for p in model.parameters() if p.requires_grad]
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    cast = 2 * sum(p.numel() for p in (trained if lora else weights))
    return tracker.entry_bytes + (cast if precision == "bf16" else 0), tracker.peak_bytes


@pytest.mark.parametrize(
    "case",
    [
        # The last sampling step peaks: the KV cache and the logits' buffers (vocabulary 2048).
        dict(vocab=2048, intermediate=128, rows=8, prompt=16, new=12, precision="fp32", top_p=1.0),
        # The prefill peaks: a wide MLP over 8 x 64 prompt tokens.
        dict(vocab=256, intermediate=1024, rows=8, prompt=64, new=4, precision="fp32", top_p=1.0),
        # top-p's sort, 16-bit weights.
        dict(vocab=2048, intermediate=128, rows=8, prompt=16, new=12, precision="bf16-true", top_p=0.9),
        # autocast: fp32 keys, bf16 values and logits, the cast cache resident.
        dict(vocab=2048, intermediate=128, rows=8, prompt=16, new=12, precision="bf16", top_p=1.0),
        # LoRA: a fourth MLP intermediate (the adapter's output beside the base's); under autocast the frozen weights
        # cast op by op.
        dict(vocab=256, intermediate=1024, rows=8, prompt=64, new=4, precision="fp32", top_p=1.0, lora="lora"),
        dict(vocab=256, intermediate=1024, rows=8, prompt=64, new=4, precision="bf16", top_p=1.0, lora="lora"),
    ],
    ids=["sampling", "prefill", "top-p-bf16-true", "autocast", "lora-prefill", "lora-autocast"],
)
def test_generation_peak_against_a_real_generate_call(tmp_path, case):
    cfg = tiny(case.pop("vocab"), case.pop("intermediate"))
    case.setdefault("lora", None)
    resident, peak = _measured_generate(cfg, tmp_path, **case)
    est = generation_peak(
        cfg, rows=case["rows"], prompt_tokens=case["prompt"], max_new_tokens=case["new"], resident_bytes=resident,
        precision=case["precision"], top_p=case["top_p"], lora=case["lora"],
    )  # fmt: skip
    over = (est.peak_bytes - resident) / (peak - resident) - 1
    # The model follows transformers 5.25's generate; 5.17's (the floor) held up to 5.6% more in these calls
    # (measured in CI's floor suite), which the model does not reproduce.
    low = 0 if values_stay_16_bit() else -0.06
    assert low <= over <= GENERATION_OVER, (
        f"predicted {est.peak_bytes} ({est.peak_phase}) vs measured {peak}: {over:+.2%}"
    )


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_resident_state_is_what_training_keeps_between_steps(lora):
    """Weights and optimizer states (gradients are freed before the rollout); in mixed precision also autocast's
    cache of the casts of the weights that require grad: all the step's weight copies, or the adapters' alone (the
    step's copies of the frozen base, kept for backward, are cast op by op in generation)."""
    kw = dict(
        micro_batch_size=1, seq_len=64, precision="bf16", gradient_checkpointing=False, device="cpu", loss="chunked",
        objective="grpo", layout="padded", lora=LoraSpec() if lora else None,
    )  # fmt: skip
    est = estimate(tiny(), **kw, reference="adapter_disabled" if lora else "none")
    b = est.breakdown
    if lora:  # the policy's forward after the reference's keeps its activations as such, not under the head's tag
        plain = estimate(tiny(), **kw).breakdown["activations"]
        assert b["activations"] == pytest.approx(plain, rel=0.01)
    states = b["weights"] + b["optimizer_states"]
    copies = 2 * est.totals["trainable_parameters"] if lora else b["autocast_weight_copies"]
    assert b["autocast_weight_copies"] > 0 and copies > 0
    assert generation_resident(est) == states + copies


# ---------------------------------------------------------------- the generation phase: the rows a call takes


def test_generation_rows_are_the_most_whole_groups_that_fit():
    def peak_of(rows: int) -> GenerationEstimate:  # 100 bytes resident, 10 a row
        return GenerationEstimate(rows, 100 + 10 * rows, "sampling", {}, 8, 8)

    def rows(budget, group=4, per_process=16):
        return plan_generation_rows(peak_of, group=group, per_process=per_process, budget_bytes=budget)[0]

    assert rows(10**6) == 16
    assert rows(100 + 10 * 15) == 12  # 15 rows would fit, but 12 is the most whole groups
    assert rows(100 + 10 * 8) == 8
    assert rows(100 + 10 * 3) == 3  # not even one group: fewer rows a call
    assert rows(50) == 1  # nothing fits: one row, over the budget
    assert rows(None) == 16  # no budget: all of a process's completions at once
    assert rows(100 + 10 * 6, group=8, per_process=6) == 6


def test_the_planner_chooses_the_generation_rows_within_the_budget():
    """The step fixed by the recipe (micro-batch 1, no checkpointing), the budget set to what 8 rows of generation
    take: 2 groups a call, of the 16 completions."""
    cfg = tiny()
    recipe = grpo_recipe(max_length=128, max_new_tokens=16, micro_batch_size=1, gradient_checkpointing=False)
    settings = estimate_settings(recipe, loss="chunked", device="cpu")

    def plan(budget: int) -> BatchPlan:
        return plan_for_budget(recipe, cfg, settings, budget_bytes=budget, num_processes=1, rates=RATES)

    roomy = plan(2**30)
    assert roomy.generation_rows == 16 and roomy.generation.rows == 16 and roomy.fits
    resident = roomy.generation.breakdown["resident"]
    assert resident == roomy.estimate.breakdown["weights"] + roomy.estimate.breakdown["optimizer_states"]

    def generation(rows: int) -> int:
        return generation_peak(cfg, rows=rows, prompt_tokens=128, max_new_tokens=16, resident_bytes=resident).peak_bytes

    budget = max(generation(8), roomy.predicted_peak_bytes)
    assert generation(12) > budget, "the case needs a budget that 12 rows exceed"
    tight = plan(budget)
    assert (tight.generation_rows, tight.generation.peak_bytes) == (8, generation(8))
    assert tight.micro_batch_size == 1 and tight.fits
    # Without a budget (`with_generation` given none): all of a process's completions in one call.
    assert with_generation(tight, recipe, cfg, None).generation_rows == 16


@pytest.mark.usefixtures("fixed_rates")
def test_a_fixed_grpo_step_still_plans_its_generation_rows():
    """plan_run: a recipe that fixes the micro-batch and the checkpointing is planned against its budget all the
    same under grpo (its generation rows are the planner's); SFT's stays unplanned."""
    from accelerate import Accelerator

    from llmtune.plan.planning import plan_run

    acc = Accelerator(cpu=True)
    recipe = grpo_recipe(micro_batch_size=2, gradient_checkpointing=True)
    recipe = replace(recipe, memory=MemoryConfig(budget="1GiB"))
    plan = plan_run(recipe, tiny(), "fp32", acc, "ddp")
    assert (plan.source, plan.micro_batch_size, plan.generation_rows) == ("recipe", 2, 16)
    sft = replace(recipe, training=TrainingConfig(precision="fp32", micro_batch_size=2, gradient_checkpointing=True))
    assert plan_run(sft, tiny(), "fp32", acc, "ddp").generation_rows == 0


def test_the_plan_state_round_trips_with_generation_rows_and_reads_older_checkpoints():
    plan = BatchPlan(2, 4, generation_rows=8, generation=GenerationEstimate(8, 10, "prefill", {"kv_cache": 10}, 4, 4))
    state = json.loads(json.dumps(plan.state()))  # as trainer_state.json keeps it
    assert "generation" not in state and state["generation_rows"] == 8
    assert BatchPlan.from_state(state) == plan
    older = {k: v for k, v in state.items() if k != "generation_rows"}  # saved before the field existed
    assert BatchPlan.from_state(older).generation_rows == 0
    assert plan.to_dict()["generation"]["peak_phase"] == "prefill"


# ---------------------------------------------------------------- llmtune estimate


@pytest.mark.usefixtures("fixed_rates")
def test_estimate_shows_the_generation_phase_beside_the_training_step(tmp_path, tiny_model_dir, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "what is two plus two?", "answer": "4"}) + "\n")
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(
        json.dumps(
            {
                "model": {"name_or_path": str(tiny_model_dir)},
                "data": {"train": [{"path": str(prompts), "format": "prompt"}], "max_length": 48},
                "training": {"objective": "grpo", "precision": "fp32", "global_batch_size": 16,
                             "micro_batch_size": 4, "gradient_checkpointing": True},
                "grpo": {"num_generations": 4, "max_new_tokens": 32},
            }
        )
    )  # fmt: skip
    args = ["estimate", "--recipe", str(recipe), "--device", "cpu", "--device-memory", "64MiB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "micro-batch 4 x 80 tokens" in out and "grpo on prompt + completion rows" in out
    assert "generation (grpo): 16 rows a generate call, prompts of up to 48 tokens + 32 new" in out
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["generation_rows"] == 16 and report["generation"]["rows"] == 16
    assert report["generation"]["peak_bytes"] <= report["budget_bytes"]
