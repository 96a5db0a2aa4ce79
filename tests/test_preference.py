"""Preference tuning (DPO/IPO, ORPO, SimPO): losses against the papers' formulas and TRL's code, packed pairs
against unpacked ones, the preference data format, the reference cache, and the loop's guarantees."""

from __future__ import annotations

import collections
import json
import random
import shutil
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import write_recipe
from transformers import AutoModelForCausalLM, LlamaConfig

import llmtune.objectives.pair_losses as P
from llmtune.data import DataError, prepare_data
from llmtune.ops.loss import LowRank
from llmtune.recipe import DataConfig, PreferenceConfig, RecipeError, SourceConfig, load_recipe

WORDS = "the quick brown fox jumps over lazy dog cat story tell me hello".split()


def write_pairs(path: Path, n: int = 48, seed: int = 0) -> Path:
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    rows = [{"prompt": text(2, 10), "chosen": " " + text(1, 6), "rejected": " " + text(1, 6)} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl")


def pair_data(path: Path, tokenizer, packing: bool, max_length: int = 96, **source):
    cfg = DataConfig(train=[SourceConfig(path=str(path), format="preference", **source)], max_length=max_length)
    return prepare_data(dataclass_replace(cfg, packing=packing), tokenizer, seed=0)


def dataclass_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def tiny_model(tokenizer, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    return AutoModelForCausalLM.from_config(config).float()


# ---------------------------------------------------------------- numerics


def test_token_logps_and_gradients_equal_log_softmax():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    upstream = torch.randn(37, dtype=torch.float64)
    for softcap in (None, 3.0):
        z = (hidden @ weight.T + bias) * 0.5
        z = softcap * torch.tanh(z / softcap) if softcap else z
        expected = z.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
        got = P.token_logps(hidden, weight, targets, bias=bias, chunk_size=8, logit_scale=0.5, softcap=softcap)
        assert torch.allclose(got.double(), expected, atol=1e-5)
        want = torch.autograd.grad((expected * upstream).sum(), (hidden, weight, bias))
        have = torch.autograd.grad((got.double() * upstream).sum(), (hidden, weight, bias))
        for a, b in zip(have, want, strict=True):
            assert torch.allclose(a, b, atol=1e-5)


def test_token_logps_with_a_lora_head_equal_log_softmax():
    """A LoRA'd lm_head: logits = h W^T + s u B^T (W frozen), with u's and B's gradients."""
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64)
    u = torch.randn(37, 3, dtype=torch.float64, requires_grad=True)
    lora_b = torch.randn(50, 3, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    upstream = torch.randn(37, dtype=torch.float64)
    expected = (hidden @ weight.T + 0.5 * u @ lora_b.T).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    got = P.token_logps(hidden, weight, targets, lora=LowRank(u, lora_b, 0.5), chunk_size=8)
    assert torch.allclose(got.double(), expected, atol=1e-5)
    want = torch.autograd.grad((expected * upstream).sum(), (hidden, u, lora_b))
    have = torch.autograd.grad((got.double() * upstream).sum(), (hidden, u, lora_b))
    for a, b in zip(have, want, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def paper_loss(objective: str, cfg: PreferenceConfig, pc, pr, rc, rr, nc, nr) -> torch.Tensor:
    """The papers' formulas, written plainly per pair (no code shared with llmtune.objectives.pair_losses)."""
    b = cfg.beta
    if objective == "dpo" and cfg.loss == "sigmoid":  # Rafailov et al. 2023, eq. 7; RPO adds alpha * NLL per token
        return -torch.log(torch.sigmoid(b * ((pc - rc) - (pr - rr)))) + cfg.nll_weight * (-pc / nc)
    if objective == "dpo":  # Azar et al. 2023, eq. 17 (h = log-ratio difference, per token as TRL does)
        h = (pc - rc) / nc - (pr - rr) / nr
        return (h - 1 / (2 * b)) ** 2 + cfg.nll_weight * (-pc / nc)
    if objective == "simpo":  # Meng et al. 2024, eq. 6
        return -torch.log(torch.sigmoid(b / nc * pc - b / nr * pr - cfg.gamma))
    # ORPO (Hong et al. 2024): L_SFT + lambda * L_OR, odds(y|x) = P / (1 - P), P = exp(mean token log-prob)
    p_c, p_r = torch.exp(pc / nc), torch.exp(pr / nr)
    odds_ratio = (p_c / (1 - p_c)) / (p_r / (1 - p_r))
    return -pc / nc - b * torch.log(torch.sigmoid(torch.log(odds_ratio)))


CASES = [
    ("dpo", PreferenceConfig(beta=0.1)),
    ("dpo", PreferenceConfig(beta=0.3, loss="ipo")),
    ("simpo", PreferenceConfig(beta=2.0, gamma=0.5)),
    ("orpo", PreferenceConfig(beta=0.2)),
    ("dpo", PreferenceConfig(beta=0.1, nll_weight=0.5)),
    ("dpo", PreferenceConfig(beta=0.3, loss="ipo", nll_weight=2.0)),
]


@pytest.mark.parametrize(("objective", "cfg"), CASES, ids=["dpo", "ipo", "simpo", "orpo", "rpo", "ipo+nll"])
def test_pair_losses_and_gradients_equal_the_papers_formulas(objective, cfg):
    torch.manual_seed(1)
    tokens = torch.randint(1, 9, (6, 2)).float()
    logps = (-torch.rand(6, 2) * 3 * tokens).requires_grad_(True)
    ref = -torch.rand(6, 2) * 3 * tokens
    loss, _, _ = P.pair_losses(objective, cfg, logps, tokens, ref)
    expected = paper_loss(objective, cfg, logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], tokens[:, 0], tokens[:, 1])
    assert torch.allclose(loss, expected, atol=1e-5)
    (got,) = torch.autograd.grad(loss.sum(), logps)
    (want,) = torch.autograd.grad(expected.sum(), logps)
    assert torch.allclose(got, want, atol=1e-5)


def test_ipo_rewards_are_the_averaged_log_ratios_its_loss_uses():
    """IPO's loss is on per-token averaged log-ratios; the rewards, the margin and the accuracy must be too. Pair
    0 is preferred per token (-0.5 > -1.5) but not in sum (-4 < -3): summed rewards would count it wrong."""
    beta = 0.3
    tokens = torch.tensor([[8.0, 2.0], [3.0, 7.0], [5.0, 5.0]])
    ref = torch.tensor([[-10.0, -6.0], [-4.0, -9.0], [-7.0, -7.0]])
    logps = ref + torch.tensor([[-4.0, -3.0], [1.5, -2.0], [0.5, 1.0]])  # the log-ratios
    loss, chosen, rejected = P.pair_losses("dpo", PreferenceConfig(beta=beta, loss="ipo"), logps, tokens, ref)
    averaged = (logps - ref) / tokens
    assert torch.allclose(chosen, beta * averaged[:, 0]) and torch.allclose(rejected, beta * averaged[:, 1])
    # The loss is a function of the reported margin alone, and is 0 where the margin is 1/2.
    assert torch.allclose(loss, ((chosen - rejected) / beta - 1 / (2 * beta)) ** 2)
    assert (chosen > rejected).tolist() == [True, True, False]
    # DPO's sigmoid loss is on summed log-ratios, and so are its rewards.
    _, chosen, rejected = P.pair_losses("dpo", PreferenceConfig(beta=beta), logps, tokens, ref)
    assert torch.allclose(chosen, beta * (logps - ref)[:, 0]) and torch.allclose(rejected, beta * (logps - ref)[:, 1])


@pytest.mark.parametrize(("objective", "beta"), [("dpo", 0.1), ("orpo", 0.1), ("simpo", 2.0)])
def test_an_unset_beta_trains_with_the_objectives_own_default(tiny_recipe, pairs_file, objective, beta):
    """One `preference.beta` key, three meanings: SimPO's scales per-token averages (the paper trains with 2-10;
    at DPO's 0.1, beta * margin is negligible beside gamma and the loss barely depends on the pair)."""
    import dataclasses

    cfg = load_recipe(preference_recipe(tiny_recipe, pairs_file, objective)).preference
    torch.manual_seed(1)
    tokens = torch.randint(1, 9, (6, 2)).float()
    logps, ref = -torch.rand(6, 2) * 3 * tokens, -torch.rand(6, 2) * 3 * tokens
    loss, _, _ = P.pair_losses(objective, cfg, logps, tokens, ref)
    pc, pr, rc, rr, nc, nr = logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], tokens[:, 0], tokens[:, 1]
    expected = paper_loss(objective, dataclasses.replace(cfg, beta=beta), pc, pr, rc, rr, nc, nr)
    assert torch.allclose(loss, expected, atol=1e-6)
    # A beta the recipe sets is the one used, whatever the objective's default.
    set_cfg = dataclasses.replace(cfg, beta=0.7)
    loss, _, _ = P.pair_losses(objective, set_cfg, logps, tokens, ref)
    assert torch.allclose(loss, paper_loss(objective, set_cfg, pc, pr, rc, rr, nc, nr), atol=1e-6)


# ---------------------------------------------------------------- against TRL (test-only dependency)


def pair_batch(tokenizer, pairs_file, n: int = 6, packed: bool = False) -> dict[str, torch.Tensor]:
    data = pair_data(pairs_file, tokenizer, packing=packed)
    rows = data.train.select(range(n)).to_list()
    return P.collate_pairs(rows, pad_token_id=tokenizer.pad_token_id, packed=packed)


def trl_layout(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our unpacked rows are chosen, rejected, chosen, ...; TRL stacks all chosen rows, then all rejected."""
    order = torch.cat([torch.arange(0, len(batch["input_ids"]), 2), torch.arange(1, len(batch["input_ids"]), 2)])
    return {
        "input_ids": batch["input_ids"][order],
        "attention_mask": batch["attention_mask"][order],
        "completion_mask": (batch["labels"][order] != -100).long(),
    }


def grads(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_same(loss_a, loss_b, grads_a, grads_b) -> None:
    assert float(loss_a.detach()) == pytest.approx(float(loss_b.detach()), abs=1e-5)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def ours(model, objective, cfg, batch, reference="none") -> torch.Tensor:
    module = P.PreferenceModel(model, "chunked", objective, cfg, reference)
    return module(**batch)[0] / P.pairs_in(batch)


def trl_dpo(model, batch, beta: float, loss_types: list[str], loss_weights: list[float]):
    """TRL's DPOTrainer loss on our batch (precomputed reference log-probs), and the metrics it logged."""
    from trl.trainer.dpo_trainer import DPOTrainer

    metrics = collections.defaultdict(lambda: collections.defaultdict(list))
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    trainer = types.SimpleNamespace(
        model=model, accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=loss_types, loss_weights=loss_weights, beta=beta,
        use_weighting=False, label_smoothing=0.0, _metrics=metrics, _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    inputs = trl_layout(batch) | {
        "ref_chosen_logps": batch["ref_logps"][:, 0],
        "ref_rejected_logps": batch["ref_logps"][:, 1],
    }
    return DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False), metrics


def dpo_batch_and_model(tokenizer, pairs_file):
    from trl.trainer.utils import add_fused_lm_head

    batch = pair_batch(tokenizer, pairs_file)
    batch["ref_logps"] = -torch.rand(P.pairs_in(batch), 2) * 20  # as a precomputed reference would give
    model = tiny_model(tokenizer)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))  # what TRL's loss reads
    return batch, model


def test_a_lora_on_the_lm_head_gives_the_models_own_loss_and_gradients(tokenizer, pairs_file):
    """The chunked log-probabilities of a peft-LoRA'd lm_head against the model's own logits ('hf')."""
    from peft import LoraConfig, get_peft_model

    batch = pair_batch(tokenizer, pairs_file)
    lora = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    model = get_peft_model(tiny_model(tokenizer), lora)
    trained = [p for p in model.parameters() if p.requires_grad]
    runs = {}
    for impl in ("chunked", "hf"):
        loss = P.PreferenceModel(model, impl, "simpo", PreferenceConfig(beta=2.0), "none")(**batch)[0]
        runs[impl] = loss, torch.autograd.grad(loss, trained)
    assert_same(runs["chunked"][0], runs["hf"][0], runs["chunked"][1], runs["hf"][1])
    assert len(trained) == 6 and all(g.abs().sum() > 0 for g in runs["chunked"][1])  # the head's adapter included


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_and_gradients_equal_trls(tokenizer, pairs_file, loss_type):
    cfg = PreferenceConfig(beta=0.2, loss=loss_type)
    batch, model = dpo_batch_and_model(tokenizer, pairs_file)
    mine = ours(model, "dpo", cfg, batch, reference="precomputed")
    mine_grads = grads(model, mine)
    theirs, metrics = trl_dpo(model, batch, cfg.beta, [loss_type], [1.0])
    assert_same(mine, theirs, mine_grads, grads(model, theirs))
    assert metrics["train"]["rewards/margins"], "TRL's metrics ran too (the whole loss path was exercised)"


def test_dpo_with_nll_weight_equals_trls_rpo_pair_by_pair(tokenizer, pairs_file):
    """RPO: TRL's rpo_alpha is loss_type [sigmoid, sft] weighted [1, alpha]. TRL averages the NLL over the chosen
    tokens of its whole batch, llmtune per pair (then over pairs): the two agree on a batch of one pair, so TRL is
    run pair by pair and its losses averaged."""
    cfg = PreferenceConfig(beta=0.2, nll_weight=0.7)
    batch, model = dpo_batch_and_model(tokenizer, pairs_file)
    mine = ours(model, "dpo", cfg, batch, reference="precomputed")
    mine_grads = grads(model, mine)
    plain = ours(model, "dpo", PreferenceConfig(beta=0.2), batch, reference="precomputed")
    assert float(mine.detach()) > float(plain.detach()) + 0.1, "the NLL term is there"
    pairs = len(batch["pair_ids"])
    each = []
    for k in range(pairs):
        one = {key: batch[key][2 * k : 2 * k + 2] for key in ("input_ids", "attention_mask", "labels")}
        one["ref_logps"] = batch["ref_logps"][k : k + 1]
        each.append(trl_dpo(model, one, cfg.beta, ["sigmoid", "sft"], [1.0, cfg.nll_weight])[0])
    theirs = torch.stack(each).mean()
    assert_same(mine, theirs, mine_grads, grads(model, theirs))


def test_simpo_loss_and_gradients_equal_trls(tokenizer, pairs_file):
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    cfg = PreferenceConfig(beta=2.0, gamma=0.6)
    batch = pair_batch(tokenizer, pairs_file)
    model = tiny_model(tokenizer)
    mine = ours(model, "simpo", cfg, batch)
    mine_grads = grads(model, mine)

    trl = trl_layout(batch)
    labels = trl["input_ids"].masked_fill(trl["completion_mask"] == 0, -100)
    logits = model(input_ids=trl["input_ids"], attention_mask=trl["attention_mask"]).logits
    logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    chosen, rejected = logps.chunk(2)
    trainer = types.SimpleNamespace(
        alpha=0.0, loss_type="simpo", simpo_gamma=cfg.gamma, beta=cfg.beta, label_smoothing=0.0,
        accelerator=types.SimpleNamespace(device=torch.device("cpu")),
    )  # fmt: skip
    losses, _, _ = CPOTrainer.cpo_loss(trainer, chosen, rejected)  # cpo_alpha=0: SimPO has no SFT term
    theirs = losses.mean()
    assert_same(mine, theirs, mine_grads, grads(model, theirs))


def test_orpo_odds_ratio_term_and_gradients_equal_trls(tokenizer, pairs_file):
    """TRL's ORPO adds the NLL averaged over the chosen rows' prompt AND completion tokens of the batch; llmtune
    (as the paper's L_SFT and llmtune's loss-on-completions rule) averages the completion's NLL per pair. So the
    odds-ratio term is compared with TRL's `odds_ratio_loss`, and the NLL term with the per-pair formula."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    cfg = PreferenceConfig(beta=0.3)
    batch = pair_batch(tokenizer, pairs_file)
    model = tiny_model(tokenizer)
    mine = ours(model, "orpo", cfg, batch)
    mine_grads = grads(model, mine)

    trl = trl_layout(batch)
    labels = trl["input_ids"].masked_fill(trl["completion_mask"] == 0, -100)
    logits = model(input_ids=trl["input_ids"], attention_mask=trl["attention_mask"]).logits
    chosen, rejected = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True).chunk(2)
    trainer = types.SimpleNamespace(beta=cfg.beta, accelerator=types.SimpleNamespace(device=torch.device("cpu")))
    odds_ratio, _, _, _, _ = ORPOTrainer.odds_ratio_loss(trainer, chosen, rejected)
    nll = -CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True).chunk(2)[0]
    theirs = (nll - odds_ratio).mean()
    assert_same(mine, theirs, mine_grads, grads(model, theirs))


# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_packed_pairs_give_the_unpacked_loss_and_gradients(tokenizer, pairs_file, objective):
    cfg = PreferenceConfig()
    packed_data = pair_data(pairs_file, tokenizer, packing=True)
    unpacked_data = pair_data(pairs_file, tokenizer, packing=False)
    rows = packed_data.train.select(range(3)).to_list()
    packed = P.collate_pairs(rows, pad_token_id=tokenizer.pad_token_id, packed=True)
    assert packed["input_ids"].shape[0] == 3 and P.pairs_in(packed) > 3  # several pairs per row
    # The same pairs, unpacked: find each packed pair's rows among the unpacked examples by their tokens.
    by_tokens = {tuple(e["input_ids"]): e for e in unpacked_data.train.to_list()}
    examples = []
    for row in rows:
        spans = P.sequences_of(row)
        for (a, _), (_, d) in zip(spans[0::2], spans[1::2], strict=True):
            examples.append(by_tokens[tuple(row["input_ids"][a:d])])
    unpacked = P.collate_pairs(examples, pad_token_id=tokenizer.pad_token_id, packed=False)
    assert packed["input_ids"].numel() < unpacked["input_ids"].numel()  # less padding
    model = tiny_model(tokenizer)
    ref = -torch.rand(P.pairs_in(packed), 2) * 20
    reference = "precomputed" if objective == "dpo" else "none"
    a = ours(model, objective, cfg, packed | {"ref_logps": ref}, reference)
    grads_a = grads(model, a)
    b = ours(model, objective, cfg, unpacked | {"ref_logps": ref}, reference)
    assert_same(a, b, grads_a, grads(model, b))


# ---------------------------------------------------------------- data


def trained_text(tokenizer, row: dict, side: int) -> str:
    a, b = P.sequences_of(row)[side]
    return tokenizer.decode(
        [t for t, label in zip(row["input_ids"][a:b], row["labels"][a:b], strict=True) if label != -100]
    )


LAYOUTS = {
    "strings": ({"prompt": "tell me", "chosen": " a story", "rejected": " the dog"}, {}),
    "alpaca": ({"instruction": "tell me", "input": "the cat", "chosen": " a story", "rejected": " the dog"}, {}),
    "chat_prompt": (
        {
            "prompt": [{"role": "user", "content": "tell me"}],
            "chosen": [{"role": "assistant", "content": "a story"}],
            "rejected": "the dog",
        },
        {},
    ),
    "shared_prefix": (
        {
            "chosen": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "a story"}],
            "rejected": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the dog"}],
        },
        {},
    ),
    "sharegpt": (
        {
            "conversations": [{"from": "human", "value": "tell me"}],
            "chosen": {"from": "gpt", "value": "a story"},
            "rejected": {"from": "gpt", "value": "the dog"},
        },
        {},
    ),
    "mapped": (
        {"q": "tell me", "good": " a story", "bad": " the dog"},
        {"prompt": "q", "chosen": "good", "rejected": "bad"},
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_preference_layouts_train_only_the_completions(tmp_path, tokenizer, layout):
    row, fields = LAYOUTS[layout]
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(row) + "\n")
    data = pair_data(path, tokenizer, packing=False, max_length=1024, fields=fields)
    (example,) = data.train.to_list()
    chosen, rejected = trained_text(tokenizer, example, 0), trained_text(tokenizer, example, 1)
    assert "a story" in chosen and "dog" not in chosen and "tell" not in chosen and "hello" not in chosen
    assert "the dog" in rejected and "story" not in rejected
    assert chosen.endswith(("</s>", "<|im_end|>\n", "<|im_end|>"))  # trained to stop


BROKEN = [
    ({"prompt": "a", "chosen": "b"}, "row 2: field `rejected`: missing or null"),
    ({"prompt": "a", "chosen": 3, "rejected": "c"}, "row 2: field `chosen`: must be a string or chat turns"),
    ({"prompt": "a", "chosen": "  ", "rejected": "c"}, "row 2: field `chosen`: is empty"),
    (
        {"chosen": [{"role": "user", "content": "x"}], "rejected": [{"role": "user", "content": "y"}]},
        "row 2: field `chosen`: no `prompt` and the two conversations share no first turn",
    ),
    ({"prompt": "a", "chosen": [{"role": "bot", "content": "x"}], "rejected": "c"}, "row 2: field `chosen`: turn 0"),
]


@pytest.mark.parametrize(("bad", "message"), BROKEN)
def test_a_broken_pair_names_file_row_and_field(tmp_path, tokenizer, bad, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        json.dumps({"prompt": "tell me", "chosen": " yes", "rejected": " no"}) + "\n" + json.dumps(bad) + "\n"
    )
    with pytest.raises(DataError, match=f"^{path}: " + message.replace("`", ".").replace("(", ".").replace(")", ".")):
        pair_data(path, tokenizer, packing=False)


def test_a_broken_pair_stops_train_with_exit_2(tiny_recipe, tmp_path, capsys):
    from llmtune.cli.main import main

    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    recipe = tiny_recipe(training__objective="dpo", data__train=[{"path": str(path), "format": "preference"}])
    assert main(["train", "--recipe", str(recipe)]) == 2
    assert f"{path}: row 1: field `rejected`: missing" in capsys.readouterr().err


def test_llmtune_data_show_prints_pairs(tiny_recipe, pairs_file, capsys):
    from llmtune.cli.main import main

    recipe = tiny_recipe(training__objective="dpo", data__train=[{"path": str(pairs_file), "format": "preference"}])
    assert main(["data", "--recipe", str(recipe), "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert "next example" in out and out.count("[[") >= 2  # chosen and rejected, each with trained tokens


def test_overlong_pairs_are_truncated_per_sequence(tmp_path, tokenizer):
    path = tmp_path / "pairs.jsonl"
    long = " ".join(["hello"] * 40)
    path.write_text(json.dumps({"prompt": "tell me", "chosen": " " + long, "rejected": " the dog"}) + "\n")
    data = pair_data(path, tokenizer, packing=False, max_length=32)
    (example,) = data.train.to_list()
    (a, b), (c, d) = P.sequences_of(example)
    assert b - a == 16 and d - c < 16 and data.stats.truncated == 1


# ---------------------------------------------------------------- recipe


def test_a_key_of_another_objective_is_refused_naming_the_objective(tiny_recipe, pairs_file):
    recipe = tiny_recipe(preference__gamma=1.0, preference__loss="ipo")
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe)
    text = str(err.value)
    assert "`preference.gamma` applies to training.objective simpo, not sft" in text
    assert "`preference.loss` applies to training.objective dpo, not sft" in text
    pairs = [{"path": str(pairs_file), "format": "preference"}]
    with pytest.raises(RecipeError, match="training.objective dpo needs format: preference"):
        load_recipe(tiny_recipe(training__objective="dpo"))
    with pytest.raises(RecipeError, match="adapter_disabled needs LoRA"):
        load_recipe(tiny_recipe(training__objective="dpo", data__train=pairs, preference__reference="adapter_disabled"))
    with pytest.raises(RecipeError, match="`preference.nll_weight` applies to training.objective dpo, not orpo"):
        load_recipe(tiny_recipe(training__objective="orpo", data__train=pairs, preference__nll_weight=1.0))
    with pytest.raises(RecipeError, match="`preference.nll_weight` must be >= 0"):
        load_recipe(tiny_recipe(training__objective="dpo", data__train=pairs, preference__nll_weight=-1.0))
    assert load_recipe(tiny_recipe(training__objective="simpo", data__train=pairs, preference__gamma=1.0))
    assert load_recipe(tiny_recipe(training__objective="dpo", data__train=pairs, preference__nll_weight=1.0))


# ---------------------------------------------------------------- the loop


def preference_recipe(tiny_recipe, pairs_file, objective: str = "dpo", **overrides) -> Path:
    pairs = [{"path": str(pairs_file), "format": "preference"}]
    return tiny_recipe(training__objective=objective, data__train=pairs, data__max_length=96, **overrides)


def run_losses(output_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def train_recipe(path: Path, *overrides: str) -> dict:
    from llmtune.run.loop import train

    return train(load_recipe(path, list(overrides)))


def test_precomputed_reference_is_computed_once_then_reused(tiny_recipe, pairs_file, tmp_path, monkeypatch):
    recipe = preference_recipe(tiny_recipe, pairs_file, training__max_steps=3)
    train_recipe(recipe)
    run = tmp_path / "run"
    (cache,) = (run / "reference").glob("reference-*.json")
    first = run_losses(run)

    def never(*args, **kwargs):
        raise AssertionError("the cached reference log-probs were computed again")

    monkeypatch.setattr(P, "compute_reference", never)
    train_recipe(recipe, "overwrite=true")  # a second run over the same model, data and settings, in the same folder
    assert run_losses(run) == pytest.approx(first, rel=1e-6)
    # Other data is another key: computed anew, beside the first.
    monkeypatch.undo()
    other = write_pairs(tmp_path / "other.jsonl", seed=1)
    train_recipe(recipe, f"data.train=[{{path: {other}, format: preference}}]", f"output_dir={tmp_path / 'run2'}")
    assert len(list((tmp_path / "run2" / "reference").glob("reference-*.json"))) == 1


def test_a_base_retrained_into_the_same_folder_is_a_new_reference(tiny_recipe, tiny_model_dir, pairs_file, tmp_path):
    """The reference cache's key holds the base folder's weight files: DPO after retraining the same folder used to
    reuse the log-probs of the old weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    base = tmp_path / "base"

    def save_base(seed: int) -> None:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir)).save_pretrained(base)

    save_base(0)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(base)
    recipe = preference_recipe(tiny_recipe, pairs_file, training__max_steps=1)
    from_disk = [f"model.name_or_path={base}", "checkpoint.resume=none"]
    train_recipe(recipe, *from_disk)
    save_base(1)  # retrained: other weights in the same files
    train_recipe(recipe, *from_disk, "overwrite=true")
    assert len(list((tmp_path / "run" / "reference").glob("reference-*.json"))) == 2


@pytest.mark.parametrize(
    ("reference", "twin", "peft"),
    [("copy", "precomputed", "none"), ("adapter_disabled", "precomputed", "lora")],
)
def test_every_reference_gives_the_same_training(tiny_recipe, pairs_file, tmp_path, reference, twin, peft):
    """The reference is the starting model however it is obtained: a frozen copy, the base with adapters
    off, or log-probs computed before training — so the losses agree step by step."""
    recipe = preference_recipe(tiny_recipe, pairs_file, training__max_steps=3, peft__method=peft)
    train_recipe(recipe, f"preference.reference={reference}", f"output_dir={tmp_path / 'a'}")
    train_recipe(recipe, f"preference.reference={twin}", f"output_dir={tmp_path / 'b'}")
    a, b = run_losses(tmp_path / "a"), run_losses(tmp_path / "b")
    assert a == pytest.approx(b, rel=1e-5) and a[0] == pytest.approx(0.6931, abs=1e-3)  # log 2: policy = reference


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_reference_free_objectives_train_and_log_preference_metrics(tiny_recipe, pairs_file, tmp_path, objective):
    recipe = preference_recipe(tiny_recipe, pairs_file, objective, training__max_steps=3)
    summary = train_recipe(recipe)
    assert not (tmp_path / "run" / "reference").exists()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    for r in steps:
        assert r["reward_margin"] == pytest.approx(r["rewards_chosen"] - r["rewards_rejected"])
        assert 0 <= r["preference_accuracy"] <= 1
    assert Path(summary["final_dir"], "config.json").exists()
    if objective == "orpo":  # `llmtune plot` draws the rewards and the accuracy (one objective is enough)
        from llmtune.cli.plot import plot_run

        assert plot_run(tmp_path / "run")[0].stat().st_size > 0


def test_dpo_in_bf16_with_checkpointing_trains(tiny_recipe, pairs_file, tmp_path):
    recipe = preference_recipe(
        tiny_recipe,
        pairs_file,
        training__max_steps=2,
        training__precision="bf16",
        training__gradient_checkpointing=True,
    )
    summary = train_recipe(recipe)
    assert summary["precision"] == "bf16" and summary["gradient_checkpointing"]
    assert all(torch.isfinite(torch.tensor(loss)) for loss in run_losses(tmp_path / "run"))


@pytest.mark.slow
def test_dpo_resumes_exactly_after_sigkill(tiny_recipe, pairs_file, tmp_path):
    from test_resilience import PAUSING_ENTRY, entry, losses_by_step, start_and_kill_when

    from llmtune.run import checkpoint

    recipe = preference_recipe(tiny_recipe, pairs_file, training__max_steps=6, checkpoint__every_n_steps=2)
    train_recipe(recipe, f"output_dir={tmp_path / 'ref'}")  # uninterrupted, in this process
    reference = losses_by_step(tmp_path / "ref")
    run = tmp_path / "killed"
    entry_file = tmp_path / "pausing_entry.py"
    entry_file.write_text(PAUSING_ENTRY)
    cmd = [sys.executable, str(entry_file), "--recipe", str(recipe), f"output_dir={run}"]
    start_and_kill_when(cmd, run / "checkpoints" / "step-000004" / checkpoint.STATE_FILE, {"PAUSE_STEP": "4"})
    cache = list((run / "reference").glob("reference-*.json"))
    stamp = cache[0].stat().st_mtime_ns
    subprocess.run(entry(recipe, f"output_dir={run}", "checkpoint.resume=auto"), check=True, capture_output=True)
    resumed = losses_by_step(run)
    assert sorted(resumed) == list(range(1, 7))
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-6), step
    assert cache[0].stat().st_mtime_ns == stamp  # the resume read the reference cache, it did not recompute it


# Process 1 does not see the reference cache (another node's disk, a shared one that lags).
BLIND_TO_THE_CACHE = """
import os, pathlib
seen = pathlib.Path.is_file
pathlib.Path.is_file = lambda p: seen(p) and not (os.environ["RANK"] == "1" and p.name.startswith("reference-"))
"""
# The dtype of the reference log-probs each process's PreferenceModel receives, in dtype-RANK of the run's folder.
RECORD_REFERENCE_DTYPE = """
import os
from pathlib import Path
import llmtune.objectives.pair_losses as P
forward, dtypes = P.PreferenceModel.forward, set()
def recording(self, *args, **kwargs):
    if kwargs.get("ref_logps") is not None:
        dtypes.add(str(kwargs["ref_logps"].dtype))
    return forward(self, *args, **kwargs)
P.PreferenceModel.forward = recording
def after_run(recipe):
    Path(recipe.output_dir, "dtype-" + os.environ["RANK"]).write_text(" ".join(sorted(dtypes)))
    dtypes.clear()
"""


@dataclass
class PreferenceLaunch:
    folder: Path  # each run's recipe is folder/NAME.yaml, its output folder/NAME
    output: str  # the launch's stdout and stderr


@pytest.fixture(scope="module")
def dpo_launched(tmp_path_factory, tiny_model_dir, pairs_file) -> Callable[[str], PreferenceLaunch]:
    """engine -> its one 2-process DPO launch (made on first use), training in turn "equal" (micro-batch 2, 3 steps)
    and, under DDP, "blind" (a reference cache that process 1 cannot see, copied from the one-process run
    "blind-one"), under FSDP2, "bf16" (1 step), each recording the dtype of the reference log-probs it received."""
    from test_distributed import ROOT, RUNS, launch

    from llmtune.run.loop import train

    done: dict[str, PreferenceLaunch] = {}
    data = {"data__train": [{"path": str(pairs_file), "format": "preference"}], "data__max_length": 96}

    def recipe(folder: Path, name: str, **overrides) -> list[str]:
        path = write_recipe(folder / f"{name}.yaml", tiny_model_dir, pairs_file, training__objective="dpo", **data,
                            training__micro_batch_size=2, **overrides)  # fmt: skip
        return ["--recipe", str(path), f"output_dir={folder / name}"]

    def get(engine: str) -> PreferenceLaunch:
        if engine in done:
            return done[engine]
        folder = tmp_path_factory.mktemp(f"dpo-{engine}")
        runs = [recipe(folder, "equal", training__max_steps=3)]
        if engine == "ddp":
            runs.append(recipe(folder, "blind", training__max_steps=2))
            train(load_recipe(folder / "blind.yaml", [f"output_dir={folder / 'blind-one'}"]))
            shutil.copytree(folder / "blind-one" / "reference", folder / "blind" / "reference")
        else:
            runs.append(recipe(folder, "bf16", training__max_steps=1, training__precision="bf16"))
        entry = folder / "entry.py"
        entry.write_text((BLIND_TO_THE_CACHE if engine == "ddp" else "") + RECORD_REFERENCE_DTYPE + RUNS)
        config = ROOT / "recipes" / "accelerate" / "fsdp2.yaml" if engine == "fsdp2" else None
        (_, first, out), *rest = runs
        cmd = launch(Path(first), out, *(arg for run in rest for arg in ("+", *run)), config=config, script=entry)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        done[engine] = PreferenceLaunch(folder, proc.stdout + proc.stderr)
        return done[engine]

    return get


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_dpo_on_two_processes_equals_one(dpo_launched, tmp_path, engine):
    from test_distributed import losses

    folder = dpo_launched(engine).folder
    one = train_recipe(folder / "equal.yaml", f"output_dir={tmp_path / 'one'}")
    summary = json.loads((folder / "equal" / "run_summary.json").read_text())
    assert (summary["engine"], summary["num_processes"], summary["micro_batch_size"]) == (engine, 2, 2)
    assert summary["grad_accum_steps"] == 2 and summary["trained_tokens"] == one["trained_tokens"]
    single, several = losses(tmp_path / "one"), losses(folder / "equal")
    for step in single:
        assert several[step] == pytest.approx(single[step], rel=1e-4), step
    # The reference cache was computed by both processes, each for its share, into the same values.
    (a,) = (tmp_path / "one" / "reference").glob("*.json")
    (b,) = (folder / "equal" / "reference").glob("*.json")
    assert a.name == b.name
    flat_a, flat_b = ([v for row in json.loads(f.read_text()) for v in row] for f in (a, b))
    assert flat_a == pytest.approx(flat_b, abs=1e-4)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_reference_cache_one_process_cannot_see_is_read_once_and_shared(dpo_launched):
    """A cache hit is decided by the main process and its values sent to all: a process that missed the file alone
    computed alone and waited in collectives the others never joined."""
    launched = dpo_launched("ddp")
    assert "reference log-probs: reusing" in launched.output
    assert run_losses(launched.folder / "blind") == pytest.approx(run_losses(launched.folder / "blind-one"), rel=1e-4)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp2_in_bf16_hands_the_reference_log_probs_over_in_fp32(dpo_launched):
    """FSDP2's root policy cast every float input to bf16: reference log-probs of -150.37 arrived as -150.0."""
    run = dpo_launched("fsdp2").folder / "bf16"
    summary = json.loads((run / "run_summary.json").read_text())
    assert (summary["engine"], summary["precision"]) == ("fsdp2", "bf16")
    assert [(run / f"dtype-{rank}").read_text() for rank in ("0", "1")] == ["torch.float32", "torch.float32"]


def test_pairs_without_trained_tokens_add_nothing(tokenizer, pairs_file):
    """eval_batches tops a short shard up with a copy of row 0 whose labels are all -100: it must add no loss
    and no pair, as a filler row adds no token to SFT's loss."""
    data = pair_data(pairs_file, tokenizer, packing=True)
    rows = data.train.select(range(2)).to_list()
    filler = dict(rows[0], labels=[-100] * len(rows[0]["labels"]))
    model = tiny_model(tokenizer)
    module = P.PreferenceModel(model, "chunked", "orpo", PreferenceConfig(), "none")
    plain = P.collate_pairs(rows, pad_token_id=tokenizer.pad_token_id, packed=True)
    padded = P.collate_pairs([*rows, filler], pad_token_id=tokenizer.pad_token_id, packed=True)
    assert P.pairs_in(padded) == P.pairs_in(plain)
    assert torch.allclose(module(**padded), module(**plain), atol=1e-5)


# ---------------------------------------------------------------- the demo's on-policy pairs


def test_on_policy_pairs_reject_the_models_own_wrong_answers(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    from make_quickstart_dpo_pairs import select_pairs

    rows = [{"prompt": f"What is {i} + 1?\nAnswer:", "completion": f" {i + 1}"} for i in range(5)]
    greedy = [" 9", " 2", "", " 4", " 5"]
    sampled = [" 8", " 7", " 6", " 4 ", ""]
    assert select_pairs(rows, greedy, sampled) == [
        {"prompt": rows[0]["prompt"], "chosen": " 1", "rejected": " 9"},  # wrong greedily: that answer, not a sample
        {"prompt": rows[1]["prompt"], "chosen": " 2", "rejected": " 7"},  # right greedily: its wrong sample
    ]  # 2: no answer to reject; 3: sampled right too (spaces aside, as scored); 4: an empty sample
    assert select_pairs(rows, greedy) == select_pairs(rows, greedy, sampled)[:1]


def test_on_policy_pair_script_rejects_what_the_model_answers(tmp_path):
    """End to end on a small random model with the quickstart tokenizer: every pair's rejected answer is the one
    `answer` (as eval_accuracy.py) gets from the model, its chosen the training question's own answer."""
    from transformers import AutoTokenizer

    from llmtune.cli.generate import Sampling, answer
    from llmtune.data import render_prompt

    root = Path(__file__).resolve().parents[1]
    tokenizer = AutoTokenizer.from_pretrained(root / "assets" / "quickstart" / "model")
    model = tiny_model(tokenizer)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp_path / "sft")
    tokenizer.save_pretrained(tmp_path / "sft")
    out = tmp_path / "pairs.jsonl"
    script = root / "scripts" / "make_quickstart_dpo_pairs.py"
    cmd = [sys.executable, str(script), "--model", str(tmp_path / "sft"), "--out", str(out), "--questions", "12"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=root)
    pairs = [json.loads(line) for line in out.read_text().splitlines()]
    questions = [json.loads(line) for line in (root / "assets/quickstart/train.jsonl").read_text().splitlines()[:12]]
    model.eval()
    said = {
        q["prompt"]: answer(model, tokenizer, render_prompt(q["prompt"], tokenizer), Sampling(max_new_tokens=n + 2))
        for q in questions
        for n in [len(tokenizer(q["completion"], add_special_tokens=False).input_ids)]
    }
    gold = {q["prompt"]: q["completion"] for q in questions}
    wrong = [p for p, a in said.items() if a.strip() and a.strip() != gold[p].strip()]
    assert wrong, "a random model answers wrongly: the comparison below is not empty"
    assert pairs == [{"prompt": p, "chosen": gold[p], "rejected": said[p]} for p in wrong]
