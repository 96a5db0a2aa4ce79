"""What a new user tripped on in `llmtune estimate` (issue 55): times printed from nominal rates, a card's budget that
left out the CUDA context, a traceback for a global batch the processes do not divide (and, in `train`, the same
refusal once per process), a minute's wait on an unreachable hub, and engine rows whose reasons were not theirs."""

from __future__ import annotations

import json
import socket

import pytest
from huggingface_hub import constants

from llmtune.catalogue import GPUS, MODELS
from llmtune.catalogue.gpus import datasheet_bandwidth, datasheet_peak_flops
from llmtune.cli.main import main
from llmtune.model.load import resolve_config
from llmtune.plan.budget import planning_target
from llmtune.plan.planning import (
    PlanError,
    check_engine,
    plan_engines,
    plan_recipe,
    rows_per_process,
    runnable_recipe,
)
from llmtune.plan.timing import datasheet_rates
from llmtune.recipe import Checkpointing, load_recipe
from llmtune.units import format_bytes

# The one catalogued card without a published 16-bit tensor-core peak: AWS's A10G (NVIDIA publishes no datasheet for
# it; the A10's 125 TFLOP/s is another card's). Its plans print no time.
UNPUBLISHED = {"a10g"}


@pytest.mark.parametrize("card", sorted(GPUS))
def test_every_catalogued_card_has_its_datasheet_rates_but_the_one_nvidia_does_not_publish(card):
    rates = datasheet_rates(card, "bf16")
    assert (rates is None) == (card in UNPUBLISHED)
    assert datasheet_bandwidth(card) is not None  # every card's memory bandwidth is published


def test_a_catalogue_name_or_alias_takes_its_own_cards_figures():
    """The tables match the name a card reports: a catalogue name used to match another card's row (h100-94gb, the
    H100 NVL, took the SXM's) or none (the alias 4090)."""
    assert datasheet_bandwidth("h100-94gb") == datasheet_bandwidth("NVIDIA H100 NVL") == 3.9e12
    assert datasheet_peak_flops("h100-94gb") == 835.5e12
    alias, name = datasheet_rates("4090", "bf16"), datasheet_rates("rtx-4090", "bf16")
    assert alias is not None and alias.flops_per_s == name.flops_per_s and alias.bytes_per_s == name.bytes_per_s
    assert datasheet_peak_flops("a10g") is None and datasheet_peak_flops("NVIDIA A10") == 125e12


def _no_time_printed(out: str) -> None:
    how = next(line for line in out.splitlines() if line.startswith("how: "))
    assert " s (" not in how and "tokens/s" not in out, out  # the tables rank as "x fastest"
    (why,) = [line for line in out.splitlines() if line.startswith("time: not predicted: ")]
    assert "the memory and the micro-batch stand" in why


def test_a_card_without_published_rates_is_planned_without_a_time(tiny_model_dir, capsys):
    """`--gpu a10g`, the README's example, printed a step of 3,228.7 s from nominal rates."""
    args = ["estimate", "--model", str(tiny_model_dir), "--lora", "--gpu", "a10g", "--seq-len", "64"]
    assert main(args) == 0
    out = capsys.readouterr().out
    _no_time_printed(out)
    assert "--gpu a10g has no published datasheet peak" in out
    assert main([*args, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["how"]["predicted_step_seconds"] is None and answer["how"]["predicted_tokens_per_s"] is None
    assert answer["predicted_tokens_per_s"] is None and answer["time_not_predicted"].startswith("--gpu a10g")
    assert answer["micro_batch_size"] and answer["fits"]  # the plan itself stands


def test_a_card_with_rates_is_timed(tiny_model_dir, capsys):
    assert main(["estimate", "--model", str(tiny_model_dir), "--lora", "--gpu", "l4", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s a process)" in out and "time: not predicted" not in out


def test_device_memory_alone_is_planned_as_a_card_of_that_size_without_a_time(tiny_model_dir, capsys, monkeypatch):
    """`--device-memory 24GiB` (no --gpu, no GPU here) was planned with the whole 24 GiB, where `--gpu rtx-4090`
    takes the CUDA context, 10% and 512 MiB off, and printed a time from nominal rates."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    size = f"{GPUS['rtx-4090'] // 2**20}MiB"
    card = planning_target(device_memory=size, gpu=None, device=None)
    named = planning_target(device_memory=None, gpu="rtx-4090", device=None)
    assert (card.device, card.budget_bytes) == ("cuda", named.budget_bytes) and named.budget_bytes < GPUS["rtx-4090"]
    assert card.why.startswith(f"--device-memory {size}: ") and "less the CUDA context" in card.why
    assert planning_target(device_memory=size, gpu=None, device="cpu").budget_bytes == GPUS["rtx-4090"]
    assert (
        main(["estimate", "--model", str(tiny_model_dir), "--lora", "--device-memory", "2GiB", "--seq-len", "64"]) == 0
    )
    out = capsys.readouterr().out
    _no_time_printed(out)
    assert "no GPU here to measure and no card named" in out


def _refused(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


def test_estimate_refuses_a_global_batch_the_processes_do_not_divide_in_one_line(tiny_recipe, capsys):
    """It was a ValueError's traceback from deep in the planner."""
    cpu = ["--no-data", "--device", "cpu", "--device-memory", "1GiB", "--num-processes", "8"]
    recipe = str(tiny_recipe(training__micro_batch_size="auto", training__global_batch_size=4))
    err = _refused(capsys, ["estimate", "--recipe", recipe, *cpu])
    (line,) = err.splitlines()
    assert line.startswith("llmtune: error: training.global_batch_size=4 is not divisible by the 8 data-parallel")
    assert line.endswith("nearest valid: 8")
    err = _refused(capsys, ["estimate", "--recipe", recipe, *cpu, "training.global_batch_size=12"])
    assert err.strip().endswith("nearest valid: 8 or 16")


def test_the_nearest_global_batches_are_the_multiples_of_the_data_parallel_processes():
    assert rows_per_process(16, 8, 2) == 4  # 4 data-parallel processes, sequence-parallel pairs
    with pytest.raises(PlanError, match=r"the 4 data-parallel processes \(8 processes, sequence_parallel 2\); nearest"
                       r" valid: 8 or 12$"):  # fmt: skip
        rows_per_process(10, 8, 2)


def test_a_refusal_is_said_by_the_first_process_alone_and_every_process_exits_2(tiny_recipe, capsys, monkeypatch):
    """Under a launcher every process refuses the same recipe: each printed it, under torchrun's ChildFailedError
    banner. A failure of one process (exit 1) is still said by the process it happened to."""
    from llmtune.cli import estimate
    from llmtune.plan.planning import TrainingError

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cpu = ["--no-data", "--device", "cpu", "--device-memory", "1GiB", "--num-processes", "8"]
    argv = ["estimate", "--recipe", str(tiny_recipe(training__global_batch_size=4, training__micro_batch_size=4)), *cpu]
    monkeypatch.setenv("RANK", "1")
    assert _refused(capsys, argv) == ""
    monkeypatch.setenv("RANK", "0")
    assert "nearest valid: 8" in _refused(capsys, argv)

    def fails(args):
        raise TrainingError("out of memory at micro-batch 1")

    monkeypatch.setattr(estimate, "cmd_estimate", fails)
    monkeypatch.setenv("RANK", "1")
    assert main(argv) == 1
    assert "out of memory at micro-batch 1" in capsys.readouterr().err


@pytest.fixture
def hub_unreachable(monkeypatch):
    """The hub at a local port nobody listens on (tests never reach the real one), and every connection this
    process opens, recorded: the probe's should be the only one."""
    with socket.socket() as s:  # a port free now, closed when the probe knocks
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for proxy in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    connections: list[object] = []
    connect = socket.socket.connect

    def recorded(self, address):
        connections.append(address)
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", recorded)
    return connections, port


def _says_what_it_knows_offline(err: str, name: str) -> None:
    (line,) = err.splitlines()
    assert line.startswith(f"llmtune: error: {name}: the hub") and "cannot be reached" in line
    assert all(model in line for model in MODELS) and line.endswith("or a local folder with config.json")


def test_an_unreachable_hub_id_is_refused_at_once_with_what_is_known_offline(hub_unreachable, capsys):
    """It took 27-50 s and 22 warnings (the hub client's retries) before a clear error; `--model mixtral-8x7b` did not
    say which names work offline."""
    connections, port = hub_unreachable
    err = _refused(capsys, ["estimate", "--model", "nobody-here/mixtral-8x7b"])
    _says_what_it_knows_offline(err, "nobody-here/mixtral-8x7b")
    assert connections == [("127.0.0.1", port)]  # the probe, once; the hub's client never asked


def test_hf_hub_offline_refuses_an_uncached_hub_id_without_a_connection(monkeypatch, capsys):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(socket.socket, "connect", lambda *a: pytest.fail("a connection was opened"))
    err = _refused(capsys, ["estimate", "--model", "mixtral-8x7b"])
    _says_what_it_knows_offline(err, "mixtral-8x7b")
    assert "HF_HUB_OFFLINE" in err


def test_a_cached_config_is_read_while_the_hub_cannot_be_reached(hub_unreachable, tmp_path, monkeypatch):
    """Out of reach, the hub's cache still answers, at once, as HF_HUB_OFFLINE would."""
    from transformers import LlamaConfig

    connections, _ = hub_unreachable
    repo, commit = tmp_path / "models--some-org--cached-model", "0" * 40
    LlamaConfig(hidden_size=64, num_hidden_layers=3).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_config("some-org/cached-model").num_hidden_layers == 3
    assert len(connections) == 1  # the probe


def _engines(recipe_path, config, budget: int) -> dict:
    recipe = load_recipe(recipe_path)
    return {c.sharding: c for c in plan_engines(recipe, config, device="cpu", num_processes=2, budget_bytes=budget)}


def test_zero3_with_lora_and_checkpointing_left_to_the_planner_is_planned_without_it(
    tiny_recipe, tiny_model_dir, fixed_rates
):
    """The ZeRO-3 row said "LoRA + gradient checkpointing under ZeRO-3 fails" for a recipe whose checkpointing was the
    planner's to choose (auto), beside plans that checkpointed nothing: ZeRO-3 is planned without it. A recipe that
    fixes recomputation is refused, with that reason."""
    config = resolve_config(str(tiny_model_dir))
    lora = dict(training__micro_batch_size="auto", peft__method="lora")
    auto = _engines(tiny_recipe(**lora, training__gradient_checkpointing="auto"), config, 2**34)["zero3"]
    assert auto.plan is not None and auto.plan.fits and not auto.plan.checkpointing.enabled and auto.why == ""
    fixed = _engines(tiny_recipe(**lora, training__gradient_checkpointing=True), config, 2**34)["zero3"]
    assert fixed.plan is None and fixed.why.startswith("LoRA + gradient checkpointing under DeepSpeed ZeRO-3 fails")
    # Where nothing fits without checkpointing, the row says it was planned without it.
    tight = _engines(tiny_recipe(**lora, training__gradient_checkpointing="auto"), config, 2**20)["zero3"]
    assert tight.plan is None and tight.why.startswith("without checkpointing (LoRA under ZeRO-3): ")
    # Training plans the same way (`plan_run` plans through `plan_recipe`), and launches it (`check_engine`).
    recipe = load_recipe(tiny_recipe(**lora, training__gradient_checkpointing="auto"))
    plan, _ = plan_recipe(recipe, config, device="cpu", budget_bytes=2**34, num_processes=2, sharding="zero3")
    assert not plan.checkpointing.enabled
    assert runnable_recipe(recipe, "zero3").parallel.tiled_mlp is False  # its tiles are checkpointed too
    assert runnable_recipe(recipe, "fsdp") is recipe
    from llmtune.objectives import objective_for

    check_engine(recipe, "zero3", objective_for(recipe))
    off = load_recipe(tiny_recipe(**lora, training__gradient_checkpointing={"every_n_layers": 0}))
    assert off.training.gradient_checkpointing == Checkpointing(0)
    check_engine(off, "zero3", objective_for(off))  # checkpoints nothing: it used to be refused all the same


def test_an_engine_whose_model_states_alone_are_over_the_budget_says_so_not_the_split(
    tiny_recipe, tiny_model_dir, fixed_rates
):
    """A DDP row for Qwen2.5-7B (full) said "(1024 a process: sequence parallel 2)": the split its smallest step was
    weighed at, which changes nothing of the weights, gradients and optimizer states DDP keeps whole. Engines whose
    states fit keep the smallest step's peak, split and all, as their reason."""
    config = resolve_config(str(tiny_model_dir))
    recipe = tiny_recipe(
        training__micro_batch_size="auto", training__gradient_checkpointing="auto", parallel__sequence_parallel=2
    )
    roomy = _engines(recipe, config, 2**34)
    states = sum(roomy["none"].plan.estimate.breakdown.get(tag, 0) for tag in ("weights", "optimizer_states"))
    tight = _engines(recipe, config, int(0.9 * states))
    ddp, zero2 = tight["none"], tight["zero2"]
    assert ddp.plan is None and zero2.plan is None
    first = ddp.why.split(". ")[0]
    assert first.startswith("weights, gradients and optimizer states alone take") and "over the budget" in first
    assert "sequence parallel" not in first
    assert "sequence parallel 2" in zero2.why.split(". ")[0]  # ZeRO-2 shards its states: the step's peak applies


def test_a_fixed_micro_batch_over_the_budget_is_said_in_its_own_numbers(tiny_recipe, tiny_model_dir, fixed_rates):
    """A recipe's own micro-batch is planned as given, fitting or not: its row said only "over the budget"."""
    config = resolve_config(str(tiny_model_dir))
    rows = _engines(tiny_recipe(training__micro_batch_size=8, training__global_batch_size=16), config, 2**20)
    for c in rows.values():
        assert c.plan is not None and not c.plan.fits
        assert c.why == (
            f"the recipe's micro-batch 8 peaks at {format_bytes(c.plan.predicted_peak_bytes)}, over the budget of"
            " 1.00 MiB"
        )
