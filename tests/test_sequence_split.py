"""What a process of a sequence group receives (llmtune.parallel.sequence.shard_batch) and what a split refuses, in one
process.
Training split along the sequence is compared with one process in tests/test_sequence_parallel.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from llmtune.data import IGNORE, collate
from llmtune.data.batch import with_documents
from llmtune.errors import UserError
from llmtune.ops.loss import loss_rows
from llmtune.parallel.sequence import SequenceGroup, kv_for_degree, refusal, shard_batch
from llmtune.plan.planning import fixed_degree
from llmtune.recipe import load_recipe


def packed_batch() -> dict:
    """Two rows of 12 tokens: documents of 5 and 4 tokens then padding; 7 and 5."""
    rows = [
        {"input_ids": list(range(1, 10)), "labels": [IGNORE, 2, 3, 4, 5, IGNORE, 7, 8, 9],
         "position_ids": [0, 1, 2, 3, 4, 0, 1, 2, 3]},
        {"input_ids": list(range(20, 32)), "labels": list(range(20, 32)), "position_ids": [*range(7), *range(5)]},
    ]  # fmt: skip
    batch = collate(rows, pad_token_id=0, packed=True, pad_to_multiple_of=4)
    batch["loss_rows"] = loss_rows(batch["labels"])
    return with_documents(batch)


@pytest.mark.parametrize("degree", [2, 4])
def test_the_shards_of_a_packed_batch_are_its_tokens_with_their_targets_and_whole_documents(degree):
    batch = packed_batch()
    shards = [shard_batch(batch, SequenceGroup(degree, rank)) for rank in range(degree)]
    joined = {k: torch.cat([s[k] for s in shards], dim=1) for k in ("input_ids", "position_ids", "shift_labels")}
    assert torch.equal(joined["input_ids"], batch["input_ids"])
    assert torch.equal(joined["position_ids"], batch["position_ids"])  # global: rotary embeddings see true positions
    # Shifted before the split: the last token of a shard predicts the next shard's first.
    assert torch.equal(joined["shift_labels"][:, :-1], batch["labels"][:, 1:])
    assert (joined["shift_labels"][:, -1] == IGNORE).all()
    for s in shards:
        assert "labels" not in s and "attention_mask" not in s
        assert torch.equal(s["cu_seq_lens_q"], batch["cu_seq_lens_q"])  # the whole rows' documents
        assert s["max_length_q"] == batch["max_length_q"]
        trained = (s["shift_labels"] != IGNORE).reshape(-1).nonzero().squeeze(1)
        assert torch.equal(s["loss_rows"], trained)
    # Every trained target is in exactly one shard.
    assert sum(len(s["loss_rows"]) for s in shards) == len(batch["loss_rows"])


def test_an_unpacked_batch_becomes_one_document_a_row_without_its_mask():
    rows = [{"input_ids": [1, 2, 3], "labels": [IGNORE, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8, 9], "labels": [4] * 6}]
    batch = collate(rows, pad_token_id=0, packed=False, pad_to_multiple_of=2)
    shard = shard_batch(batch, SequenceGroup(2, 1))
    assert "attention_mask" not in shard
    assert shard["position_ids"].tolist() == [[3, 4, 5], [3, 4, 5]]
    assert shard["cu_seq_lens_q"].tolist() == [0, 6, 12]  # a row's right padding after its tokens, in its document


def test_rows_that_do_not_split_evenly_are_refused():
    batch = collate([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}], pad_token_id=0, packed=False)
    with pytest.raises(ValueError, match="3 tokens do not split across 2 processes"):
        shard_batch(batch, SequenceGroup(2, 0))


def test_kv_heads_are_repeated_to_the_degree_in_their_query_groups():
    kv = torch.arange(2.0).view(1, 2, 1, 1)  # KV heads 0 and 1
    assert kv_for_degree(kv, 2) is kv
    # 8 query heads in 2 groups of 4 (heads 0-3 read KV 0); on 4 processes each holds 2 query heads and their KV head.
    assert kv_for_degree(kv, 4).flatten().tolist() == [0, 0, 1, 1]


def test_a_degree_the_heads_do_not_divide_is_refused(tmp_path):
    config = LlamaConfig(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    assert refusal(config, 2) is None
    assert refusal(config, 4) == "its 6 attention heads do not divide by 4 processes"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: {name_or_path: x}\ndata: {train: [{path: x.jsonl}]}\n")
    with pytest.raises(UserError, match="sequence_parallel=4: its 6 attention heads do not divide by 4"):
        fixed_degree(load_recipe(recipe, ["parallel.sequence_parallel=4"]), config, 4)
    with pytest.raises(UserError, match="sequence_parallel=3 does not divide the 4 process"):
        fixed_degree(load_recipe(recipe, ["parallel.sequence_parallel=3"]), config, 4)


@pytest.mark.parametrize(("max_length", "degree"), [(2050, 4), (2048, 3), (96, 1), (96, 2)])
@pytest.mark.parametrize("objective", ["sft", "simpo"])
def test_a_compiled_run_collates_packed_rows_to_the_width_the_estimator_traces(tmp_path, max_length, degree, objective):
    """Under compile every packed micro-batch has one width: max_length rounded up to the degree (2050 at 4: 2052, not
    lcm's 4100), which is the width `llmtune.plan.step.micro_batch` traces, shard for shard."""
    from llmtune.objectives import objective_named
    from llmtune.plan.settings import Settings
    from llmtune.plan.step import micro_batch
    from llmtune.recipe import Checkpointing
    from llmtune.run.batches import collate_for

    path = tmp_path / "recipe.yaml"
    path.write_text("model: {name_or_path: x}\ndata: {train: [{path: x.jsonl}]}\n")
    recipe = load_recipe(path, [f"data.max_length={max_length}", "training.compile=true"])
    run = SimpleNamespace(
        recipe=recipe,
        data=SimpleNamespace(packed=True),
        accelerator=SimpleNamespace(device=torch.device("cpu")),
        objective=objective_named(objective),
        tokenizer=SimpleNamespace(pad_token_id=0),
        sequence=SequenceGroup(degree),
    )
    rows = [run.objective.longest_example(n, True) for n in (max_length - 1, max_length // 2)]  # rows first-fit left
    collated = collate_for(run, rows)["input_ids"]
    assert collated.shape[1] == -(-max_length // degree) * degree
    s = Settings(
        micro_batch_size=2, seq_len=max_length, precision="bf16", checkpointing=Checkpointing(0), chunk_size=64,
        objective=objective, num_processes=degree, sequence_parallel=degree,
    )  # fmt: skip
    traced = micro_batch(objective_named(objective), s)["input_ids"]
    assert shard_batch(collate_for(run, rows), SequenceGroup(degree))["input_ids"].shape == traced.shape
