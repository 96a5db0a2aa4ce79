"""GRPO's sampling is the policy's own: no decoding preference of the model's card touches the scores, and a rollout
through compiled decoder blocks leaves the training steps after it compiled."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessorList

from llmtune.model.blocks import compile_blocks
from llmtune.objectives import rollouts as grpo
from llmtune.recipe import GRPOConfig

VOCAB, STOP = 64, 63


def tiny_model(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def request(cfg: GRPOConfig) -> grpo.Sampling:
    """Three prompts of two lengths (left-padded in one call), one seed each."""
    return grpo.Sampling([[1, 2, 3], [4, 5, 6, 7], [8, 9, 10]], [1, 2, 3], cfg, [STOP], 0, 8, synced=False)


def sample(model: torch.nn.Module, cfg: GRPOConfig) -> list[list[int]]:
    """Through GRPOModel's forward, as the objective samples."""
    with torch.no_grad():
        return grpo.GRPOModel(model, "chunked", cfg, "none")(sample=request(cfg))


# Qwen2.5-Instruct's generation_config.json (do_sample, repetition_penalty 1.05, temperature 0.7, top_p 0.8, top_k 20),
# and what other cards set whose "off" is None, which a passed GenerationConfig cannot say.
CARD = {
    "do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
    "no_repeat_ngram_size": 2, "min_new_tokens": 3, "bad_words_ids": [[5]], "suppress_tokens": [6],
    "sequence_bias": {(7,): -2.0}, "renormalize_logits": True, "remove_invalid_values": True,
}  # fmt: skip


@pytest.mark.parametrize("lora", [False, True])
def test_only_the_policys_sampler_touches_the_scores_whatever_the_cards_generation_config(monkeypatch, lora):
    """A model whose generation_config asks for a repetition penalty, top-k, min-p, banned and suppressed tokens...:
    the only logits processor `generate` runs while GRPO samples is GumbelSampling (the loss takes the completions
    for samples of the policy's softmax at the recipe's temperature and top_p), and the completions are those of
    the same weights with a blank generation_config. With LoRA, `generate` runs on the peft model's base model."""
    cfg = GRPOConfig(max_new_tokens=8, temperature=0.9, top_p=0.95)
    plain = sample(tiny_model(), cfg)
    model = tiny_model()
    model.generation_config = GenerationConfig(**CARD)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ran: set[str] = set()
    call = LogitsProcessorList.__call__

    def spy(self, input_ids, scores, **kwargs):
        ran.update(type(p).__name__ for p in self)
        return call(self, input_ids, scores, **kwargs)

    monkeypatch.setattr(LogitsProcessorList, "__call__", spy)
    completions = sample(model, cfg)
    assert ran == {"GumbelSampling"}
    assert completions == plain
    base = model.get_base_model() if lora else model
    assert base.generation_config.repetition_penalty == 1.05, "the card's config is the model's again after sampling"


def test_a_rollout_leaves_the_training_steps_after_it_compiled(monkeypatch):
    """Decoding through compiled blocks changes Dynamo's guards at every token (the KV cache grows): it spent the
    blocks' recompile limit, and every training step after the first rollout ran eager. Counted with a backend that
    counts its graphs' calls: a training step calls one compiled graph per block, before and after a rollout, on a
    batch of the shape trained before it and of a new one."""
    calls: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        def run(*args: object) -> object:
            calls.append(1)
            return gm.forward(*args)

        return run

    torch._dynamo.reset()  # the blocks' code object is shared with every other compiled Llama of this process
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counting))
    layers = 3
    model = tiny_model(layers)
    compile_blocks(model)
    cfg = GRPOConfig(max_new_tokens=12)
    policy = grpo.GRPOModel(model, "chunked", cfg, "none")

    def step(length: int) -> int:
        """Compiled calls in one training step on two completions of `length` tokens after a 3-token prompt."""
        rows = [
            {"input_ids": [1, 2, 3] + [k + 10] * length, "labels": [-100] * 3 + [k + 10] * length, "advantage": a}
            for k, a in enumerate([1.0, -1.0])
        ]
        before = len(calls)
        policy.train()
        policy(**grpo.collate_completions(rows, pad_token_id=0))[0].backward()
        return len(calls) - before

    try:
        assert step(5) == layers
        trained = len(calls)
        sample(model, cfg)
        assert len(calls) == trained, "the rollout runs the blocks eager: decoding compiles nothing"
        assert [step(5), step(9)] == [layers, layers]
    finally:
        torch._dynamo.reset()
