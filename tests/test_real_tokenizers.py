"""The fixtures of tests/real_tokenizers.py are what they claim: fast tokenizers with offsets, whose official template
renders a chat, whose markers are single special tokens at the real model's ids, and which reproduce llama.cpp's
reference tokenisations of the real vocabulary (made with the model's own tokenizer)."""

from __future__ import annotations

import pytest

from tests.real_tokenizers import (
    CHATS,
    DROPS_SYSTEM,
    END_OF_TURN,
    FAMILIES,
    NO_SYSTEM,
    STAND_IN,
    TEMPLATES,
    real_tokenizer,
    render,
)
from tests.real_tokenizers import reference_tokenisations as reference

pytestmark = [pytest.mark.slow, pytest.mark.real]

# Ids in the models' published tokenizers (what the vocab files above give; a stand-in has no real ids to check).
REAL_IDS = {
    "llama-3.1-8b-instruct": {"<|begin_of_text|>": 128000, "<|start_header_id|>": 128006, "<|eot_id|>": 128009},
    "llama-3.2-3b-instruct": {"<|end_of_text|>": 128001, "<|end_header_id|>": 128007, "<|python_tag|>": 128010},
    "qwen2.5-7b-instruct": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645},
    "qwen3": {"<|im_end|>": 151645, "<tool_call>": 151657, "<think>": 151667, "</think>": 151668},
    "qwen3.5": {"<|im_start|>": 151644, "<|im_end|>": 151645},
    "deepseek-r1-distill-qwen-32b": {"<｜end▁of▁sentence｜>": 151643, "<｜User｜>": 151644, "<｜Assistant｜>": 151645},
    "phi-3-mini-4k-instruct": {"<|endoftext|>": 32000, "<|assistant|>": 32001, "<|end|>": 32007, "<|user|>": 32010},
    "phi-3.5-mini-instruct": {"<|system|>": 32006, "<|end|>": 32007},
    "mistral-nemo-instruct-2407": {"<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4, "[TOOL_CALLS]": 9},
    "gemma-4": {"<eos>": 1, "<bos>": 2, "<|turn>": 105, "<turn|>": 106},
    "smollm2-135m-instruct": {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2},
}


def tokenizer(name):
    return real_tokenizer(name, shared=True)


@pytest.mark.parametrize("name", TEMPLATES)
def test_fixture_renders_a_chat_with_single_token_markers(name):
    family, tok = FAMILIES[name], tokenizer(name)
    assert tok.is_fast
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == (family.eos, family.bos, family.pad)
    chat = "no_system" if name in NO_SYSTEM else "system"
    if name in NO_SYSTEM:
        with pytest.raises(Exception, match="System role not supported"):
            render(tok, "system")
    text = render(tok, chat)
    for message in CHATS[chat]:
        assert message["content"].strip() in text or (message["role"] == "system" and name in DROPS_SYSTEM)
    # The end-of-turn token and every marker of the template: one id, an added token marked special.
    for token in {END_OF_TURN[name], *family.specials}:
        ids = tok.encode(token, add_special_tokens=False)
        assert len(ids) == 1, (token, ids)
        assert tok.added_tokens_decoder[ids[0]].special, token
    # Offsets point into the rendered text: each end-of-turn token spans its string (and the whitespace it eats).
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets, ids = encoded["offset_mapping"], encoded["input_ids"]
    assert len(offsets) == len(ids) and all(0 <= a <= b <= len(text) for a, b in offsets)
    eot_text = END_OF_TURN[name]
    eot = tok.convert_tokens_to_ids(eot_text)
    spans = [text[a:b] for (a, b), i in zip(offsets, ids, strict=True) if i == eot]
    assert spans and set(spans) == {eot_text} or family.rstrip and {s.rstrip() for s in spans} == {eot_text}
    # Decoding gives the text back, but where a marker swallows the whitespace after it (Phi-3's rstrip).
    assert tok.decode(ids) == text or family.rstrip
    # bos first where the model's config adds it, and nowhere else.
    assert (tok("hi").input_ids[0] == tok.bos_token_id) == family.add_bos


@pytest.mark.parametrize("name", sorted(REAL_IDS))
def test_markers_sit_at_the_real_ids(name):
    tok = tokenizer(name)
    assert {token: tok.convert_tokens_to_ids(token) for token in REAL_IDS[name]} == REAL_IDS[name]


@pytest.mark.parametrize("name", [n for n in TEMPLATES if FAMILIES[n].reference])
def test_real_vocab_reproduces_llama_cpp_reference(name):
    """The .inp/.out beside llama.cpp's vocab file: texts (emoji, CJK, whitespace runs, code) and the ids the model's
    own tokenizer gave them. Llama 3's fixture, built from llama-models' tiktoken file, answers llama-bpe's."""
    tok, pairs = tokenizer(name), reference(FAMILIES[name].reference)
    assert len(pairs) > 40
    wrong = [(text, ids) for text, ids in pairs if tok.encode(text, add_special_tokens=False) != ids]
    assert not wrong, wrong[:3]


def test_stand_ins_are_the_families_without_a_shipped_vocab():
    assert set(STAND_IN) == {"gpt-oss", "gemma-2"}
    assert not any(FAMILIES[name].reference for name in STAND_IN)
    assert set(REAL_IDS) == set(TEMPLATES) - set(STAND_IN)
