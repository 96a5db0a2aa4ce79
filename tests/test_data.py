"""llmtune.data: sources, formats, masks, packing, length policy, bad data, mixing and batching (CPU, offline)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmtune import data as D
from llmtune.data import IGNORE, DataError, batch_for_step, collate, eval_batches, prepare_data
from llmtune.data.batch import _epoch_order
from llmtune.data.mix import mixture_counts, mixture_indices
from llmtune.data.pack import first_fit
from llmtune.data.tokenise import tokenise_source
from llmtune.recipe import DataConfig, SourceConfig

datasets.disable_progress_bars()

PC_ROWS = [{"prompt": f"What is {i} plus {i}?", "completion": f" It is {2 * i}."} for i in range(12)]
CHAT = [
    {"role": "system", "content": "Be nice."},
    {"role": "user", "content": "Hello, how are you?"},
    {"role": "assistant", "content": "I am fine, thank you."},
    {"role": "user", "content": "Tell me a story about a cat."},
    {"role": "assistant", "content": "The cat jumps over the lazy dog."},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(*sources: SourceConfig, packing: bool = False, **kw) -> DataConfig:
    # Most tests here look at examples one by one; the packing tests ask for packing.
    return DataConfig(train=list(sources), packing=packing, **kw)


def trained_ids(ids: list[int], labels: list[int]) -> list[int]:
    return [t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE]


# ---------------------------------------------------------------- sources


def _write(kind: str, folder: Path, rows: list[dict]) -> Path:
    ds = datasets.Dataset.from_list(rows)
    if kind == "jsonl":
        return write_jsonl(folder / "d.jsonl", rows)
    if kind == "json":
        (folder / "d.json").write_text(json.dumps(rows))
        return folder / "d.json"
    if kind == "csv":
        ds.to_csv(folder / "d.csv")
        return folder / "d.csv"
    if kind == "parquet":
        ds.to_parquet(folder / "d.parquet")
        return folder / "d.parquet"
    if kind == "arrow":
        ds.save_to_disk(folder / "saved")
        return next((folder / "saved").glob("*.arrow"))
    if kind == "folder":
        (folder / "dir").mkdir()
        write_jsonl(folder / "dir" / "train.jsonl", rows)
        write_jsonl(folder / "dir" / "test.jsonl", rows[:2])
        return folder / "dir"
    if kind == "save_to_disk":
        ds.save_to_disk(folder / "saved")
        return folder / "saved"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "arrow", "folder", "save_to_disk"])
def test_each_source_type_loads(kind, tmp_path, tokenizer):
    path = _write(kind, tmp_path, PC_ROWS)
    prepared = prepare_data(config(SourceConfig(path=str(path))), tokenizer, seed=0)
    assert prepared.stats.examples == len(PC_ROWS) == len(prepared.train)
    assert set(prepared.train.column_names) == {"input_ids", "labels", "length"}
    row = prepared.train[0]
    assert tokenizer.decode(trained_ids(row["input_ids"], row["labels"])) == " It is 0.</s>"


def test_csv_cells_stay_text(tmp_path, tokenizer):
    (tmp_path / "n.csv").write_text("prompt,completion\nWhat is two plus two?,4\nAnd three?,6\n")
    prepared = prepare_data(config(SourceConfig(path=str(tmp_path / "n.csv"))), tokenizer, seed=0)
    assert sorted(tokenizer.decode(trained_ids(r["input_ids"], r["labels"])) for r in prepared.train) == [
        "4</s>",
        "6</s>",
    ]


def test_text_format_trains_every_token_but_the_first_and_appends_eos(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": "The quick brown fox."}])
    src = SourceConfig(path=str(path), format="text", fields={"text": "body"})
    row = prepare_data(config(src), tokenizer, seed=0).train[0]
    assert row["input_ids"][0] == tokenizer.bos_token_id and row["input_ids"][-1] == tokenizer.eos_token_id
    assert row["labels"] == [IGNORE, *row["input_ids"][1:]]
    assert row["length"] == len(row["input_ids"])


def test_prompt_completion_masks_the_prompt_unless_train_on_all(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "pc.jsonl", PC_ROWS[:1])
    row = prepare_data(config(SourceConfig(path=str(path))), tokenizer, seed=0).train[0]
    prompt_len = len(tokenizer(PC_ROWS[0]["prompt"])["input_ids"])
    assert row["labels"][:prompt_len] == [IGNORE] * prompt_len
    assert row["labels"][prompt_len:] == row["input_ids"][prompt_len:]
    assert row["input_ids"][-1] == tokenizer.eos_token_id
    everything = prepare_data(config(SourceConfig(path=str(path)), train_on="all"), tokenizer, seed=0).train[0]
    assert everything["labels"] == [IGNORE, *everything["input_ids"][1:]]


def test_alpaca_rows_become_prompt_completion(tmp_path, tokenizer):
    rows = [
        {"instruction": "Add two and two.", "input": "", "output": "Four."},
        {"instruction": "Tell me a story.", "input": "about a cat", "output": "The cat."},
    ]
    path = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    train = prepare_data(config(SourceConfig(path=str(path))), tokenizer, seed=0).train
    by_output = {tokenizer.decode(trained_ids(r["input_ids"], r["labels"])): r for r in train}
    assert set(by_output) == {"Four.</s>", "The cat.</s>"}
    with_input = tokenizer.decode(by_output["The cat.</s>"]["input_ids"])
    assert "### Instruction:\nTell me a story.\n\n### Input:\nabout a cat\n\n### Response:\nThe cat." in with_input
    assert "### Input:" not in tokenizer.decode(by_output["Four.</s>"]["input_ids"])


def test_sharegpt_rows_render_like_messages(tmp_path, tokenizer):
    share = [
        {"from": {"user": "human", "assistant": "gpt"}.get(t["role"], t["role"]), "value": t["content"]} for t in CHAT
    ]
    a = write_jsonl(tmp_path / "share.jsonl", [{"conversations": share}])
    b = write_jsonl(tmp_path / "msgs.jsonl", [{"messages": CHAT}])
    row_a = prepare_data(config(SourceConfig(path=str(a), format="messages")), tokenizer, seed=0).train[0]
    row_b = prepare_data(config(SourceConfig(path=str(b), format="messages")), tokenizer, seed=0).train[0]
    assert row_a == row_b


def trained_spans(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The decoded stretches of consecutive trained tokens."""
    spans, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label != IGNORE:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return [tokenizer.decode(s) for s in [*spans, current] if s]


GENERATION_CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize("template", ["prefix-diff", "generation-tags"])
def test_multi_turn_chat_trains_only_assistant_turns(template, tmp_path, tokenizer):
    if template == "generation-tags":
        tokenizer.chat_template = GENERATION_CHATML
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    row = prepare_data(config(SourceConfig(path=str(path), format="messages")), tokenizer, seed=0).train[0]
    assert row["input_ids"] == tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    # Exactly one stretch of trained tokens per assistant turn, each its content + end of turn.
    texts = [span.strip() for span in trained_spans(tokenizer, row["input_ids"], row["labels"])]
    assert texts == [f"{t['content']}<|im_end|>" for t in CHAT if t["role"] == "assistant"]


def _gemma_style(generation_tags: bool) -> str:
    """Gemma-2's shape on the test tokenizer's turn tokens: a system turn raises, the assistant is `model`."""
    answer = "{{ message['content'] | trim + '<|im_end|>' }}"
    if generation_tags:
        answer = "{% generation %}" + answer + "{% endgeneration %}"
    return (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}"
        "{{ '<|im_start|>model\\n' }}" + answer + "{{ '\\n' }}"
        "{% else %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>model\\n' }}{% endif %}"
    )


def _turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


SYSTEM_PAIRS = {  # (the row, each side's completion turns)
    "one_turn": (
        {"prompt": CHAT[:2], "chosen": [_turn("assistant", "A story.")], "rejected": "The dog."},
        (["A story."], ["The dog."]),
    ),
    "two_turns": (
        {
            "prompt": CHAT[:2],
            "chosen": [_turn("assistant", "I am fine."), _turn("assistant", "Thank you.")],
            "rejected": [_turn("assistant", "Hello."), _turn("assistant", "The dog.")],
        },
        (["I am fine.", "Thank you."], ["Hello.", "The dog."]),
    ),
    "earlier_rounds": (
        {"prompt": CHAT[:4], "chosen": "A story.", "rejected": "The dog."},
        (["A story."], ["The dog."]),
    ),
    "shared_prefix": (
        {"chosen": [*CHAT[:2], _turn("assistant", "A story.")], "rejected": [*CHAT[:2], _turn("assistant", "No.")]},
        (["A story."], ["No."]),
    ),
}


@pytest.mark.parametrize("generation_tags", [False, True], ids=["located", "generation-tags"])
@pytest.mark.parametrize("layout", list(SYSTEM_PAIRS))
def test_pairs_on_a_template_that_refuses_a_system_turn_train_exactly_the_completions(
    tmp_path, tokenizer, layout, generation_tags
):
    # Folding the system turn into the first user turn moves every later turn one place back: the completion's
    # first turn must still be the first trained (it was skipped, or nothing was trained and the pair refused).
    tokenizer.chat_template = _gemma_style(generation_tags)
    row, completions = SYSTEM_PAIRS[layout]
    path = write_jsonl(tmp_path / "pairs.jsonl", [row])
    (example,) = prepare_data(config(SourceConfig(path=str(path), format="preference")), tokenizer, seed=0).train
    split = example["position_ids"].index(0, 1)
    sides = ((0, split), (split, example["length"]))
    for (a, b), turns in zip(sides, completions, strict=True):
        spans = trained_spans(tokenizer, example["input_ids"][a:b], example["labels"][a:b])
        assert spans == [f"{content}<|im_end|>" for content in turns]


@pytest.mark.parametrize("generation_tags", [False, True], ids=["located", "generation-tags"])
def test_a_chat_on_a_template_that_refuses_a_system_turn_trains_every_answer(tmp_path, tokenizer, generation_tags):
    tokenizer.chat_template = _gemma_style(generation_tags)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    row = prepare_data(config(SourceConfig(path=str(path), format="messages")), tokenizer, seed=0).train[0]
    folded = [_turn("user", f"{CHAT[0]['content']}\n\n{CHAT[1]['content']}"), *CHAT[2:]]
    assert row["input_ids"] == tokenizer.apply_chat_template(folded, tokenize=True, return_dict=True)["input_ids"]
    spans = trained_spans(tokenizer, row["input_ids"], row["labels"])
    assert spans == [f"{t['content']}<|im_end|>" for t in CHAT if t["role"] == "assistant"]


def test_missing_chat_template_falls_back_to_chatml_with_a_warning(tmp_path, tokenizer, caplog):
    tokenizer.chat_template = None
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    with caplog.at_level(logging.WARNING, logger="llmtune.data"):
        prepare_data(config(SourceConfig(path=str(path), format="messages")), tokenizer, seed=0)
    assert "no chat template" in caplog.text
    assert tokenizer.chat_template == D.CHATML_TEMPLATE


# ---------------------------------------------------------------- bad data


def _error(tmp_path, tokenizer, rows_or_text, src_kw=None, **cfg_kw) -> str:
    path = tmp_path / "bad.jsonl"
    if isinstance(rows_or_text, str):
        path.write_text(rows_or_text)
    else:
        write_jsonl(path, rows_or_text)
    with pytest.raises(DataError) as err:
        prepare_data(config(SourceConfig(path=str(path), **(src_kw or {})), **cfg_kw), tokenizer, seed=0)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    return message


def test_bad_data_missing_field(tmp_path, tokenizer):
    msg = _error(tmp_path, tokenizer, [{"prompt": "a", "answer": "b"}])
    assert "row 1" in msg and "`completion`" in msg and "missing" in msg and "answer" in msg


def test_bad_data_misnamed_field_mapping(tmp_path, tokenizer):
    msg = _error(tmp_path, tokenizer, PC_ROWS, {"fields": {"completion": "output"}})
    assert "row 1" in msg and "`output`" in msg and "missing" in msg


def test_bad_data_null_in_one_row(tmp_path, tokenizer):
    rows = [*PC_ROWS[:3], {"prompt": "a"}]
    msg = _error(tmp_path, tokenizer, rows)
    assert "row 4" in msg and "`completion`" in msg and "null" in msg


def test_bad_data_wrong_type(tmp_path, tokenizer):
    rows = [*PC_ROWS[:2], {"prompt": "a", "completion": 7}]
    msg = _error(tmp_path, tokenizer, rows)
    assert "row 3" in msg and "`completion`" in msg and "string" in msg


def test_bad_data_empty_file(tmp_path, tokenizer):
    msg = _error(tmp_path, tokenizer, "")
    assert "row 1" in msg and "empty" in msg


def test_bad_data_unreadable_file(tmp_path, tokenizer):
    msg = _error(tmp_path, tokenizer, json.dumps(PC_ROWS[0]) + "\n{not json\n")
    assert "row 2" in msg and "not valid JSON" in msg


def test_bad_data_zero_trained_tokens(tmp_path, tokenizer):
    no_answer = [{"messages": [{"role": "user", "content": "Hello"}]}]
    msg = _error(tmp_path, tokenizer, no_answer, {"format": "messages"})
    assert "row 1" in msg and "`messages`" in msg and "zero trained tokens" in msg


def test_bad_data_empty_completion(tmp_path, tokenizer):
    msg = _error(tmp_path, tokenizer, [*PC_ROWS[:1], {"prompt": "a", "completion": " "}])
    assert "row 2" in msg and "`completion`" in msg and "empty" in msg


def test_bad_data_unknown_role(tmp_path, tokenizer):
    rows = [{"messages": [{"role": "robot", "content": "Hello"}]}]
    msg = _error(tmp_path, tokenizer, rows, {"format": "messages"})
    assert "row 1" in msg and "`messages`" in msg and "robot" in msg


def test_bad_data_missing_path(tmp_path, tokenizer):
    with pytest.raises(DataError, match="no such file"):
        prepare_data(config(SourceConfig(path=str(tmp_path / "nope.jsonl"))), tokenizer, seed=0)


def test_bad_data_error_surfaces_from_worker_processes(tmp_path, tokenizer):
    rows = [*PC_ROWS, {"prompt": "a", "completion": 7}]
    msg = _error(tmp_path, tokenizer, rows, num_proc=2)
    assert f"row {len(rows)}" in msg and "`completion`" in msg


# ---------------------------------------------------------------- length policy


def test_overlong_truncate_and_drop_are_counted(tmp_path, tokenizer):
    rows = [{"text": "The quick brown fox jumps over the lazy dog. " * n} for n in (1, 1, 8, 8, 8)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    src = SourceConfig(path=str(path), format="text")
    cut = prepare_data(config(src, max_length=20), tokenizer, seed=0)
    assert (cut.stats.truncated, cut.stats.dropped, cut.stats.examples) == (3, 0, 5)
    assert max(cut.train["length"]) == 20
    dropped = prepare_data(config(src, max_length=20, overlong="drop"), tokenizer, seed=0)
    assert (dropped.stats.truncated, dropped.stats.dropped, dropped.stats.examples) == (0, 3, 2)
    assert dropped.stats.drop_reasons == {"overlong": 3}


def test_truncation_that_leaves_nothing_trained_drops_and_counts(tmp_path, tokenizer):
    rows = [*PC_ROWS[:2], {"prompt": "Tell me a story about a cat. " * 10, "completion": " The cat."}]
    prepared = prepare_data(
        config(SourceConfig(path=str(write_jsonl(tmp_path / "p.jsonl", rows))), max_length=16), tokenizer, seed=0
    )
    assert prepared.stats.examples == 2 and prepared.stats.truncated == 1
    assert prepared.stats.drop_reasons == {"no_trained_tokens_after_truncation": 1}


# ---------------------------------------------------------------- splitting and mixing


def test_eval_fraction_split_is_deterministic_and_disjoint(tmp_path, tokenizer):
    rows = [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(40)]
    src = SourceConfig(path=str(write_jsonl(tmp_path / "p.jsonl", rows)))
    a = prepare_data(config(src, eval_fraction=0.25), tokenizer, seed=3)
    b = prepare_data(config(src, eval_fraction=0.25), tokenizer, seed=3)
    c = prepare_data(config(src, eval_fraction=0.25), tokenizer, seed=4)
    assert len(a.eval) == 10 and len(a.train) == 30
    ids = lambda d: sorted(tuple(r) for r in d["input_ids"])  # noqa: E731
    assert ids(a.eval) == ids(b.eval) and ids(a.eval) != ids(c.eval)
    assert not set(ids(a.eval)) & set(ids(a.train))
    assert len(set(ids(a.eval)) | set(ids(a.train))) == 40


def test_eval_source_is_used_as_given(tmp_path, tokenizer):
    train = SourceConfig(path=str(write_jsonl(tmp_path / "a.jsonl", PC_ROWS)))
    held = SourceConfig(path=str(write_jsonl(tmp_path / "b.jsonl", PC_ROWS[:3])))
    prepared = prepare_data(config(train, eval=[held], eval_fraction=0.5), tokenizer, seed=0)
    assert len(prepared.train) == len(PC_ROWS) and len(prepared.eval) == 3


def test_mixture_counts_follow_the_weights():
    assert mixture_counts([100, 100], [3.0, 1.0]) == [150, 50]
    assert mixture_counts([10, 990], [1.0, 1.0]) == [500, 500]
    assert sum(mixture_counts([7, 11, 13], [0.2, 0.3, 0.5])) == 31
    assert mixture_counts([5], [9.0]) == [5]
    rows = mixture_indices(10, 25, seed=[0])
    assert Counter(Counter(rows.tolist()).values()) == {3: 5, 2: 5}  # two full passes, then 5 distinct rows


def test_mixture_of_sources_contributes_in_proportion(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "A?", "completion": f" a{i}"} for i in range(30)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "B?", "completion": f" b{i}"} for i in range(10)])
    cfg = config(SourceConfig(path=str(a), weight=1.0), SourceConfig(path=str(b), weight=3.0))
    prepared = prepare_data(cfg, tokenizer, seed=0)
    assert prepared.stats.per_source == {str(a): 10, str(b): 30}
    texts = Counter(tokenizer.decode(r[:3]) for r in prepared.train["input_ids"])
    assert texts == {"<s>A?": 10, "<s>B?": 30}
    again = prepare_data(cfg, tokenizer, seed=0)
    assert again.train["input_ids"] == prepared.train["input_ids"]


# ---------------------------------------------------------------- packing


def test_first_fit_packs_every_example_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, size=500)
    rows = first_fit(lengths, 64)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[row]) <= 64 for row in rows)
    assert len(rows) < 1.15 * lengths.sum() / 64 + 1  # first-fit stays near the lower bound


def test_packed_rows_hold_whole_examples_with_restarting_positions(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", PC_ROWS)
    plain = prepare_data(config(SourceConfig(path=str(path))), tokenizer, seed=0)
    packed = prepare_data(config(SourceConfig(path=str(path)), max_length=64, packing=True), tokenizer, seed=0)
    assert packed.packed and len(packed.train) < len(plain.train)
    assert packed.stats.tokens == sum(packed.train["length"]) == plain.stats.tokens
    examples = []
    for row in packed.train:
        assert len(row["input_ids"]) <= 64 and row["position_ids"][0] == 0
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for s, e in zip(starts, starts[1:], strict=False):
            assert row["position_ids"][s:e] == list(range(e - s)) and row["labels"][s] == IGNORE
            examples.append((tuple(row["input_ids"][s:e]), tuple(row["labels"][s:e])))
    assert sorted(examples) == sorted(
        zip(map(tuple, plain.train["input_ids"]), map(tuple, plain.train["labels"]), strict=True)
    )


def _summed_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(**batch, use_cache=False).logits.float()
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_batch_loss_equals_examples_one_by_one(attn, tmp_path, tokenizer):
    transformers = pytest.importorskip("transformers")
    rows = [
        {"prompt": "Tell me a story" + " about a cat" * (i % 4), "completion": " The cat." * (1 + i % 3)}
        for i in range(10)
    ]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    packed = prepare_data(config(SourceConfig(path=str(path)), max_length=96, packing=True), tokenizer, seed=0)
    assert any(0 in r["position_ids"][1:] for r in packed.train)  # at least one row holds several examples
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float().eval()
    batch = collate(list(packed.train), pad_token_id=tokenizer.pad_token_id, packed=True)
    assert "attention_mask" not in batch
    with torch.no_grad():
        together = _summed_loss(model, batch)
        alone = sum(
            _summed_loss(model, collate([{"input_ids": ids, "labels": labels}], pad_token_id=0, packed=False))
            for ids, labels in zip(*_unpack(packed.train), strict=True)
        )
        # Control: the same rows without restarting positions let attention cross examples.
        leaky = dict(batch, position_ids=torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"]))
        crossed = _summed_loss(model, leaky)
    assert torch.allclose(together, alone, rtol=0, atol=1e-4), (together.item(), alone.item())
    assert abs(crossed - alone) > 1e-2


def _unpack(data) -> tuple[list[list[int]], list[list[int]]]:
    ids, labels = [], []
    for row in data:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for s, e in zip(starts, starts[1:], strict=False):
            ids.append(row["input_ids"][s:e])
            labels.append(row["labels"][s:e])
    return ids, labels


# ---------------------------------------------------------------- batching


def _toy(n: int) -> datasets.Dataset:
    lengths = [1 + (i * 7919) % 37 for i in range(n)]
    return datasets.Dataset.from_dict(
        {
            "input_ids": [[i] * n for i, n in enumerate(lengths)],
            "labels": [[i] * n for i, n in enumerate(lengths)],
            "length": lengths,
        }
    )


def _ids(rows: list[dict]) -> list[int]:
    return [r["input_ids"][0] for r in rows]


@pytest.mark.parametrize("group", [False, True])
def test_batch_for_step_covers_an_epoch_disjointly_across_ranks(group):
    data, gbs, world = _toy(50), 8, 4
    steps = len(data) // gbs
    seen = []
    for step in range(steps):
        per_rank = [
            _ids(
                batch_for_step(
                    data, step=step, global_batch_size=gbs, seed=1, rank=r, world_size=world, group_by_length=group
                )
            )
            for r in range(world)
        ]
        assert all(len(p) == gbs // world for p in per_rank)
        flat = [i for p in per_rank for i in p]
        assert len(set(flat)) == gbs
        seen += flat
    assert len(seen) == len(set(seen)) == steps * gbs  # no repeats within the epoch, tail of 2 left out
    next_epoch = [
        i
        for step in range(steps, 2 * steps)
        for r in range(world)
        for i in _ids(
            batch_for_step(
                data, step=step, global_batch_size=gbs, seed=1, rank=r, world_size=world, group_by_length=group
            )
        )
    ]
    assert len(set(next_epoch)) == steps * gbs and next_epoch != seen


def test_batch_for_step_is_deterministic_and_starts_anywhere():
    data = _toy(50)
    kw = {"global_batch_size": 8, "seed": 5, "rank": 1, "world_size": 2, "group_by_length": True}
    in_order = [_ids(batch_for_step(data, step=s, **kw)) for s in range(20)]
    _epoch_order.cache_clear()
    assert _ids(batch_for_step(data, step=17, **kw)) == in_order[17]
    assert [_ids(batch_for_step(data, step=s, **kw)) for s in reversed(range(20))] == in_order[::-1]
    other_seed = dict(kw, seed=6)
    assert _ids(batch_for_step(data, step=0, **other_seed)) != in_order[0]


def test_group_by_length_deals_similar_lengths_and_sorts_each_process():
    data = _toy(64)
    kw = {"step": 3, "global_batch_size": 16, "seed": 0, "world_size": 2}
    grouped = [batch_for_step(data, rank=r, group_by_length=True, **kw) for r in range(2)]
    plain = [batch_for_step(data, rank=r, group_by_length=False, **kw) for r in range(2)]
    assert sorted(_ids(grouped[0] + grouped[1])) == sorted(_ids(plain[0] + plain[1]))
    for rows in grouped:
        lengths = [r["length"] for r in rows]
        assert lengths == sorted(lengths, reverse=True)
    # Dealt strided from one sorted list: rank 0's i-th example is never shorter than rank 1's.
    assert all(a["length"] >= b["length"] for a, b in zip(*grouped, strict=True))


def test_batch_for_step_refuses_bad_shapes():
    with pytest.raises(ValueError, match="divisible"):
        batch_for_step(_toy(10), step=0, global_batch_size=3, seed=0, rank=0, world_size=2, group_by_length=False)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        batch_for_step(_toy(4), step=0, global_batch_size=8, seed=0, rank=0, world_size=1, group_by_length=False)


def test_collate_pads_right_and_masks_padding():
    rows = [{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}, {"input_ids": [8], "labels": [IGNORE]}]
    batch = collate(rows, pad_token_id=0, packed=False)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [IGNORE, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert collate(rows, pad_token_id=0, packed=False, pad_to_multiple_of=4)["input_ids"].shape == (2, 4)


def test_collate_packed_gives_position_ids_and_no_attention_mask():
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [IGNORE, 6, IGNORE, 8], "position_ids": [0, 1, 0, 1]},
        {"input_ids": [9, 10], "labels": [IGNORE, 10], "position_ids": [0, 1]},
    ]
    batch = collate(rows, pad_token_id=0, packed=True)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 0, 1]]  # padding is a block of its own
    assert batch["labels"][1, 2:].tolist() == [IGNORE, IGNORE]


def test_eval_batches_shard_disjointly_with_equal_batch_counts():
    data, world = _toy(11), 3
    shards = [list(eval_batches(data, batch_size=2, rank=r, world_size=world)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1
    real = [r["input_ids"][0] for s in shards for b in s for r in b if any(lab != IGNORE for lab in r["labels"])]
    assert sorted(real) == list(range(11))
    fillers = [r for s in shards for b in s for r in b if all(lab == IGNORE for lab in r["labels"])]
    assert len(fillers) == 3 * 4 - 11


# ---------------------------------------------------------------- caching, reports


def test_tokenisation_is_cached_by_fingerprint(tmp_path, tokenizer):
    cfg = config(SourceConfig(path=str(write_jsonl(tmp_path / "p.jsonl", PC_ROWS))))
    first = tokenise_source(cfg.train[0], cfg, tokenizer)
    second = tokenise_source(cfg.train[0], cfg, tokenizer)
    assert first.data._fingerprint == second.data._fingerprint
    assert first.data.cache_files and first.data.cache_files == second.data.cache_files


def test_main_process_first_wraps_loading(tmp_path, tokenizer):
    entered = []

    class Recorder:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    cfg = config(SourceConfig(path=str(write_jsonl(tmp_path / "p.jsonl", PC_ROWS))))
    prepare_data(cfg, tokenizer, seed=0, main_process_first=Recorder)
    assert entered == [True]


def test_render_report_marks_trained_tokens_and_report_json_is_serialisable(tmp_path, tokenizer):
    cfg = config(SourceConfig(path=str(write_jsonl(tmp_path / "p.jsonl", PC_ROWS))), packing=True, max_length=64)
    prepared = prepare_data(cfg, tokenizer, seed=0)
    text = D.render_report(prepared, tokenizer, 2, color=False)
    assert "[[ It is" in text and "next example" in text and "trained_tokens" in text
    assert "\x1b[32m" in D.render_report(prepared, tokenizer, 1, color=True)
    report = json.loads(json.dumps(D.report_json(prepared, 2)))
    assert len(report["rows"]) == 2 and set(report["rows"][0]) == {"input_ids", "labels", "position_ids"}
    assert report["stats"]["examples"] == len(PC_ROWS)


def test_a_template_that_raises_names_the_row(tmp_path, tokenizer):
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    msg = _error(tmp_path, tokenizer, [{"messages": CHAT}], {"format": "messages"})
    assert "row 1" in msg and "`messages`" in msg and "roles must alternate" in msg


def test_a_template_that_rewrites_an_answer_is_refused_naming_the_turn(tmp_path, tokenizer):
    # Trimming is followed; a template that changes the text itself leaves nothing to locate the answer by.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] | upper if m['role'] =="
        " 'assistant' else m['content']) + '<|im_end|>\\n' }}{% endfor %}"
    )
    msg = _error(tmp_path, tokenizer, [{"messages": CHAT}], {"format": "messages"})
    assert "row 1" in msg and "turn 2" in msg and "cannot be located" in msg


def test_a_template_that_renders_only_the_last_turn_trains_what_it_renders(tmp_path, tokenizer):
    # Like templates that drop earlier reasoning, history is rendered differently from the last turn: what is
    # rendered of an assistant turn is trained, nothing else.
    tokenizer.chat_template = (
        "{{ '<|im_start|>' + messages[-1]['role'] + '\\n' + messages[-1]['content'] + '<|im_end|>\\n' }}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    row = prepare_data(config(SourceConfig(path=str(path), format="messages")), tokenizer, seed=0).train[0]
    assert tokenizer.decode(trained_ids(row["input_ids"], row["labels"])) == CHAT[-1]["content"] + "<|im_end|>"


def test_a_prompt_column_named_like_a_reward_keyword_is_refused(tmp_path, tokenizer):
    # Reward functions are called with prompt= and completion=: a column `completion` collided at step 1.
    rows = [{"prompt": "What is 2+2?", "completion": "4"}]
    msg = _error(tmp_path, tokenizer, rows, {"format": "prompt"})
    assert "row 1" in msg and "field `completion`" in msg and "fields:" in msg
    path = write_jsonl(tmp_path / "renamed.jsonl", rows)
    renamed = SourceConfig(path=str(path), format="prompt", fields={"reference": "completion"})
    row = prepare_data(config(renamed), tokenizer, seed=0).train[0]
    assert json.loads(row["fields"])["reference"] == "4"


def test_hub_ids_go_through_load_dataset(monkeypatch, tokenizer):
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kw):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(PC_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    src = SourceConfig(path="someorg/some-dataset", subset="clean", split="train[:10%]")
    prepared = prepare_data(config(src), tokenizer, seed=0)
    assert calls == [("someorg/some-dataset", "clean", "train[:10%]")]
    assert prepared.stats.examples == len(PC_ROWS)


def test_packed_eval_split_and_chat_report(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}] * 8)
    cfg = config(SourceConfig(path=str(path), format="messages"), packing=True, max_length=128, eval_fraction=0.25)
    prepared = prepare_data(cfg, tokenizer, seed=0)
    assert "position_ids" in prepared.eval.column_names
    assert prepared.eval_stats.examples == 2 and prepared.stats.examples == 6
    text = D.render_report(prepared, tokenizer, 1, color=False)
    assert "[[I am fine, thank you.<|im_end|>" in text and "[[Hello" not in text
