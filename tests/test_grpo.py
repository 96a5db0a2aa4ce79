"""GRPO: the losses against TRL 1.16's own code, the sampler, rewards that fail, and whole runs (resume, LoRA with
its KL reference, a reward that never varies)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import grpo_vs_trl
from benchmarks.grpo_vs_trl import compare, with_trl_head
from llmtune.data import IGNORE
from llmtune.objectives import rollouts as grpo
from llmtune.recipe import GRPOConfig, RewardConfig, load_recipe
from llmtune.run.loop import train

# ---------------------------------------------------------------- helpers


def tiny_model(tokenizer, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def completions_batch(tokenizer, group: int = 4, prompts: int = 2, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """Prompt + completion rows of varied lengths (as a rollout makes them), with rewards that differ in a group."""
    g = torch.Generator().manual_seed(seed)
    rows, rewards = [], []
    for p in range(prompts):
        prompt = tokenizer(f"tell me a story {p}")["input_ids"]
        for k in range(group):
            completion = torch.randint(10, len(tokenizer), (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
            rows.append(
                {"input_ids": prompt + completion.tolist(), "labels": [IGNORE] * len(prompt) + completion.tolist()}
            )
            rewards.append(float(k % 3 == 0) + 0.1 * p)
    return rows, torch.tensor(rewards)


# ---------------------------------------------------------------- numerics against TRL


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
def test_losses_kl_and_clipping_equal_trls(tokenizer, loss):
    """Fixed completions, rewards and old log-probs far enough from the policy's that both clips act: the loss, its
    gradients, the KL and the clipped share equal TRL's, for each loss type (temperature 0.7 and clip-higher on).
    `compare` is what benchmarks/grpo_vs_trl.py reports on the quickstart model's own completions."""
    cfg = GRPOConfig(loss=loss, beta=0.04, epsilon=0.2, epsilon_high=0.28, temperature=0.7, max_new_tokens=8)
    rows, rewards = completions_batch(tokenizer)
    advantages, _ = grpo.group_advantages(rewards, 4, "group")
    batch = grpo.collate_completions(
        [r | {"advantage": a} for r, a in zip(rows, advantages.tolist(), strict=True)], pad_token_id=0
    )
    model = with_trl_head(tiny_model(tokenizer), cfg)
    reference = tiny_model(tokenizer, seed=1)  # its log-probs come from our code on both sides
    with torch.no_grad():
        current = grpo.GRPOModel(model, "chunked", cfg, "none")(**batch, logps_only=True)
    batch["old_logps"] = current + torch.linspace(-0.5, 0.5, len(current))  # ratios from 0.6 to 1.6: both clips
    r = compare(model, reference, batch, cfg)
    assert r["loss"][0] == pytest.approx(r["loss"][1], abs=1e-5)
    assert r["grad_norm"][0] > 0 and r["grad_max_abs_diff"] < 1e-5
    assert 0 < r["clip_ratio"][0] < 1 and r["clip_ratio"][0] == pytest.approx(r["clip_ratio"][1], abs=1e-6)
    assert r["kl"][0] > 0 and r["kl"][0] == pytest.approx(r["kl"][1], rel=1e-5)


def test_the_trl_benchmark_runs_on_a_saved_model(tokenizer, tmp_path):
    """`python -m benchmarks.grpo_vs_trl` end to end on a saved toy (its figures come from the quickstart model)."""
    folder = tmp_path / "model"
    tiny_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "grpo_vs_trl.json"
    result = grpo_vs_trl.main(["--model", str(folder), "--prompts", "2", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result and result["rollout"]["completions"] == 16
    for r in result["losses"].values():
        assert r["loss"][0] == pytest.approx(r["loss"][1], abs=1e-6) and r["grad_max_abs_diff"] < 1e-5


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls(scale):
    """TRL 1.16 (_generate_and_score_completions, sum_then_normalize): reward less the group mean, over the std of the
    group or the batch (TRL's nanstd, Bessel-corrected) + 1e-4. Its lines, with its nanstd, on rewards with ties and
    an all-equal group."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, -1.0, 0.0, 3.0])
    mine, group_std = grpo.group_advantages(rewards, 4, scale)
    mean = torch.nanmean(rewards.view(-1, 4), dim=1).repeat_interleave(4)
    std = (
        nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4)
        if scale != "batch"
        else nanstd(rewards).expand_as(rewards)
    )
    theirs = rewards - mean
    if scale != "none":
        theirs = theirs / (std + 1e-4)
    assert torch.allclose(mine, theirs, atol=1e-6)
    assert group_std[4:8].eq(0).all() and mine[4:8].eq(0).all(), "an all-equal group has no signal"


# ---------------------------------------------------------------- sampling


def test_gumbel_sampling_draws_from_the_tempered_nucleus():
    """Over 4000 draws with seeds of their own, each token's frequency is its probability under softmax(logits / T)
    restricted to the top-p nucleus (renormalised); tokens outside it never come."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -3.0]])
    temperature, top_p = 0.8, 0.9
    draws = torch.tensor(
        [int(grpo.GumbelSampling([s], temperature, top_p)(None, logits).argmax()) for s in range(4000)]
    )
    probs = (logits[0] / temperature).softmax(-1)
    nucleus = probs.cumsum(-1) - probs < top_p  # tokens sorted by probability already: the smallest set over top_p
    expected = torch.where(nucleus, probs, 0) / probs[nucleus].sum()
    observed = torch.bincount(draws, minlength=5).float() / len(draws)
    assert observed[~nucleus].eq(0).all()
    # 4 binomial standard errors at 4000 draws: a wrong temperature or a missing renormalisation is several times that
    assert torch.all((observed - expected).abs() <= 4 * (expected * (1 - expected) / len(draws)).sqrt() + 1e-9)


def test_a_completion_is_the_same_whatever_the_rest_of_its_batch(tokenizer):
    """Seeded per completion: sampled with other rows around it (another process count, another generation batch),
    a completion is unchanged."""
    model = tiny_model(tokenizer)
    prompt = tokenizer("tell me a story")["input_ids"]
    cfg = GRPOConfig(max_new_tokens=6)
    stop = [tokenizer.eos_token_id]
    alone = grpo.generate_completions(model, grpo.Sampling([prompt], [7], cfg, stop, 0, batch_rows=8, synced=False))
    crowd = grpo.generate_completions(
        model, grpo.Sampling([prompt] * 4, [1, 2, 7, 3], cfg, stop, 0, batch_rows=8, synced=False)
    )
    assert crowd[2] == alone[0]
    assert len({tuple(c) for c in crowd}) > 1, "other seeds give other completions"


def test_sampling_noise_is_drawn_where_the_scores_are_with_no_copy_per_token():
    """Scores on another device (meta: shapes only): after the call's first token, whose row keys travel once, the
    sampler makes no tensor on the host, so no per-token host draw nor host-to-device copy."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostTensors(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(
                isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in torch.utils._pytree.tree_leaves(out)
            ):
                self.ops.append(str(func))
            return out

    sampler = grpo.GumbelSampling(range(4), temperature=0.7, top_p=0.9)
    scores = torch.empty(4, 1000, device="meta")
    sampler(None, scores)
    with HostTensors() as host:
        for _ in range(3):
            assert sampler(None, scores).device.type == "meta"
    assert host.ops == []


def test_one_generate_call_samples_prompts_of_every_length_each_as_alone(tokenizer):
    """Prompts of four lengths in one `generate` call (left-padded; one call per length before): each row's tokens
    are those it samples alone, with its seed."""
    model = tiny_model(tokenizer)
    prompts = [tokenizer(t)["input_ids"] for t in ("hi", "tell me a story", "a b", "tell me a long story now")]
    assert len({len(p) for p in prompts}) == 4
    cfg, stop = GRPOConfig(max_new_tokens=6), [tokenizer.eos_token_id]
    calls = []
    generate = model.generate
    model.generate = lambda *a, **k: calls.append(1) or generate(*a, **k)
    together = grpo.generate_completions(model, grpo.Sampling(prompts, [5, 6, 7, 8], cfg, stop, 0, 8, synced=False))
    assert len(calls) == 1
    alone = [
        grpo.generate_completions(model, grpo.Sampling([p], [seed], cfg, stop, 0, 8, synced=False))[0]
        for p, seed in zip(prompts, [5, 6, 7, 8], strict=True)
    ]
    assert together == alone
    assert len({tuple(c) for c in together}) > 1


FSDP2_ROLLOUT = """
import json, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from transformers import LlamaConfig, LlamaForCausalLM
from llmtune.objectives import rollouts as grpo
from llmtune.recipe import GRPOConfig

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
model = LlamaForCausalLM(config).eval()
alone = LlamaForCausalLM(config).eval()
alone.load_state_dict(model.state_dict())
wrapped = grpo.GRPOModel(model, "chunked", GRPOConfig(), "none")
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(wrapped)
gathers = []
counted = _fsdp_param_group.foreach_all_gather
_fsdp_param_group.foreach_all_gather = lambda *a, **k: gathers.append(1) or counted(*a, **k)
prompts = [[3 + rank, 4, 5], [6, 7 + rank, 8, 9, 10]]  # each process its own prompts
out = {}
for new in (1, 2, 9):  # the first leaves the root gathered, as FSDP2 leaves a root after a no-grad forward
    gathers.clear()
    sample = grpo.Sampling(prompts, [rank, 10 + rank], GRPOConfig(max_new_tokens=new), [99], 0, 8, synced=False)
    with torch.no_grad():
        sharded = wrapped(sample=sample)
    out[new] = {"gathers": len(gathers), "same": sharded == grpo.generate_completions(alone, sample),
                "lengths": [len(c) for c in sharded]}
out["resharded"] = all(isinstance(p, DTensor) for p in model.model.layers.parameters())
with open(sys.argv[1] + f".{rank}", "w") as f:
    json.dump(out, f)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp2_rollouts_gather_the_weights_once_whatever_the_completion_length(tmp_path):
    """Two gloo processes, a tiny Llama sharded by FSDP2 (blocks, then the root): a rollout all-gathers each sharded
    block once, for 2 new tokens as for 9 (every block at every token before, and synced forwards), samples what
    the unsharded model samples, and leaves the blocks sharded (the root stays gathered after a no-grad forward, as
    FSDP2 keeps a root until backward)."""
    import subprocess
    import sys

    script = tmp_path / "rollout.py"
    script.write_text(FSDP2_ROLLOUT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
               str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        out = json.loads((tmp_path / f"out.{rank}").read_text())
        assert out["2"]["lengths"] == [2, 2] and out["9"]["lengths"] == [9, 9]
        assert out["2"]["gathers"] == out["9"]["gathers"] == 2, out  # each block once
        assert out["2"]["same"] and out["9"]["same"]
        assert out["resharded"]


# ---------------------------------------------------------------- rewards


def test_reward_functions_that_fail_stop_with_one_line_naming_them(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def boom(prompt, completion, **f):\n    raise ValueError('no digits')\n"
        "def text(prompt, completion, **f):\n    return 'high'\n"
        "def nan(prompt, completion, **f):\n    return float('nan')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    row = {"input_ids": [1, 2], "fields": json.dumps({"prompt": "What is 2 + 2?", "answer": "4"})}
    with pytest.raises(grpo.RewardError, match=r"my_rewards:missing.*not found in module 'my_rewards'"):
        grpo.load_rewards([RewardConfig("my_rewards:missing")])
    with pytest.raises(grpo.RewardError, match=r"cannot import module 'no_such_module'"):
        grpo.load_rewards([RewardConfig("no_such_module:f")])
    for name, message in [("boom", "raised ValueError: no digits"), ("text", "returned 'high' \\(str\\), not a finite"),
                          ("nan", "returned nan")]:  # fmt: skip
        rewards = grpo.load_rewards([RewardConfig(f"my_rewards:{name}")])
        with pytest.raises(grpo.RewardError, match=rf"reward my_rewards:{name} .*What is 2 \+ 2\?.*{message}"):
            grpo.score(rewards, [row], [" 5"], step=3)


def test_exact_match_reads_the_answer_field():
    from llmtune.rewards import exact_match

    assert exact_match(prompt="What is 2 + 2?", completion=" 4 ", answer="4") == 1.0
    assert exact_match(prompt="What is 2 + 2?", completion=" 5", answer=4) == 0.0
    with pytest.raises(KeyError, match="fields: {answer: <column>}"):
        exact_match(prompt="q", completion="4", solution="4")


# ---------------------------------------------------------------- whole runs


def write_prompts(path, n: int = 32):
    rows = [{"question": f"tell me a story {i} the fox", "answer": "the"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


REWARDS = (
    "def length(prompt, completion, **fields):\n    return -len(completion) / 10\n"
    "def needs_solution(prompt, completion, solution, **fields):\n    return 1.0\n"
)


@pytest.fixture
def grpo_recipe(tmp_path, tiny_model_dir, monkeypatch):
    """A grpo recipe on the tiny model (random weights) and prompts whose rewards prefer short completions."""
    from conftest import write_recipe

    (tmp_path / "grpo_rewards.py").write_text(REWARDS + "def same(prompt, completion, **fields):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = write_prompts(tmp_path / "prompts.jsonl")

    def make(name: str = "recipe.yaml", **overrides):
        overrides = {
            "data__train": [{"path": str(data), "format": "prompt", "fields": {"prompt": "question"}}],
            "data__max_length": 16,
            "training__objective": "grpo",
            "training__gradient_checkpointing": False,
            "training__micro_batch_size": 8,
            "training__global_batch_size": 16,
            "training__learning_rate": 1e-2,
            "grpo": {"num_generations": 4, "max_new_tokens": 6, "rewards": [{"function": "grpo_rewards:length"}]},
        } | overrides
        return load_recipe(write_recipe(tmp_path / name, tiny_model_dir, data, **overrides))

    return make


def metrics_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.mark.slow
def test_a_run_resumes_exactly_and_reports_its_rewards(grpo_recipe, tmp_path):
    """4 steps straight, and 2 steps then a resume for 2 more (sampling seeded from the step): the same losses and
    rewards; the rewards, lengths and clipped share are logged each step."""
    whole = grpo_recipe(output_dir=str(tmp_path / "whole"), checkpoint={"every_n_steps": 2, "resume": "none"})
    train(whole)
    first = grpo_recipe(output_dir=str(tmp_path / "part"), checkpoint={"every_n_steps": 2, "resume": "none"},
                        training__max_steps=2)  # fmt: skip
    train(first)
    train(grpo_recipe(output_dir=str(tmp_path / "part"), checkpoint={"every_n_steps": 2, "resume": "auto"}))
    a, b = metrics_of(tmp_path / "whole"), metrics_of(tmp_path / "part")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "reward", "completion_length", "rewards/grpo_rewards:length/mean"):
            assert x[key] == pytest.approx(y[key], abs=1e-6), (key, x["step"])
    assert all(0 < m["completion_length"] <= 6 and m["clip_ratio"] == 0 for m in a)  # one update per batch: no clip
    assert {"reward_std", "frac_reward_zero_std", "completions_clipped", "generation_peak_bytes"} <= set(a[0])
    from llmtune.cli.plot import plot_run

    assert plot_run(tmp_path / "whole")[0].stat().st_size > 0  # with the rewards' panels


@pytest.mark.slow
def test_lora_with_a_kl_reference_and_several_iterations_per_batch(grpo_recipe, tmp_path):
    """LoRA, beta > 0 (the reference: adapters off) and num_iterations 2: at step 1 the policy is the reference
    (KL 0) and the ratios are 1 (nothing clipped); the second step on the same completions moves both."""
    recipe = grpo_recipe(
        peft={"method": "lora", "rank": 4, "alpha": 8},
        grpo={"num_generations": 4, "max_new_tokens": 6, "beta": 0.1, "num_iterations": 2, "epsilon": 0.01,
              "rewards": [{"function": "grpo_rewards:length"}]},
        training__learning_rate=5e-2, training__max_steps=2,
    )  # fmt: skip
    train(recipe)
    m = metrics_of(tmp_path / "run")
    assert m[0]["kl"] == pytest.approx(0, abs=1e-7) and m[0]["clip_ratio"] == 0
    assert m[1]["kl"] > 0 and m[1]["clip_ratio"] > 0
    assert m[0]["reward"] == m[1]["reward"], "the second step trains on the first step's completions"


@pytest.mark.slow
def test_a_reward_that_never_varies_is_warned_about(grpo_recipe, caplog):
    same = {"num_generations": 4, "max_new_tokens": 4, "rewards": [{"function": "grpo_rewards:same"}]}
    recipe = grpo_recipe(grpo=same, training__max_steps=5)
    with caplog.at_level("WARNING"):
        train(recipe)
    assert any("grpo_rewards:same gave every completion of the first 5 batches the same value" in r.message
               for r in caplog.records)  # fmt: skip


def test_a_reward_that_fails_mid_run_stops_it_naming_the_function_and_the_prompt(grpo_recipe, tmp_path):
    """The prompts have no `solution` column: the first batch's rewards stop the run with a user error (exit 2 from
    the CLI), before any update."""
    fails = [{"function": "grpo_rewards:needs_solution"}]
    recipe = grpo_recipe(grpo={"num_generations": 4, "max_new_tokens": 3, "rewards": fails})
    said = r"reward grpo_rewards:needs_solution on the completion .* of prompt 'tell me a story \d+ the fox' \(step 1\)"
    with pytest.raises(grpo.RewardError, match=said + r": raised TypeError: .*solution") as err:
        train(recipe)
    assert err.value.exit_code == 2
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_grpo_recipes_are_checked_before_anything_loads(grpo_recipe):
    from llmtune.recipe import RecipeError

    with pytest.raises(RecipeError, match="counts completions: it must be a multiple of grpo.num_generations"):
        grpo_recipe(training__global_batch_size=10)
    with pytest.raises(RecipeError, match="must be a multiple of grpo.num_iterations"):
        grpo_recipe(grpo={"num_iterations": 2}, checkpoint={"every_n_steps": 3})
    with pytest.raises(RecipeError, match="training.objective grpo needs format: prompt"):
        grpo_recipe(data__train=[{"path": "x.jsonl", "format": "prompt_completion"}])
