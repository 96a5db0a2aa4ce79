"""Every launcher config in recipes/accelerate/ trains for real: 2 CPU processes (gloo) against 1 process.

DDP, FSDP2 (applied by llmtune.parallel.engines), DeepSpeed ZeRO-2 and ZeRO-3, full fine-tuning and LoRA, each
selected as users select it (`accelerate launch --config_file recipes/accelerate/NAME.yaml`). The model is
a tiny Llama with saved weights: ZeRO-3 initialises a random model partition by partition, so only weights
loaded from disk are the same in every engine. The first ZeRO run JIT-compiles DeepSpeed's shm_comm op
(~3 minutes, cached under ~/.cache/torch_extensions).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import TEST_TAG, processes_tagged
from test_distributed import RUNS, free_port, losses
from test_resilience import PAUSING_ENTRY

from llmtune.errors import EXIT_PREEMPTED
from llmtune.recipe import load_recipe
from llmtune.run import checkpoint
from llmtune.run.loop import train
from llmtune.run.resilience import OOM_FILE

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "recipes" / "accelerate"
ENGINES = {"ddp": "ddp", "fsdp2": "fsdp2", "zero2": "deepspeed_zero2", "zero3": "deepspeed_zero3"}
STEPS = 4
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs `.[deepspeed]`")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny Llama of conftest with weights saved (seeded), tokenizer beside them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


def write_recipe(folder: Path, model_dir: Path, data: Path, method: str, engine: str = "ddp") -> Path:
    """Global batch 8 = 2 processes x micro-batch 2 x accumulation 2 (one process: accumulation 4)."""
    recipe = {
        "output_dir": str(folder / "run"),
        "seed": 0,
        "model": {"name_or_path": str(model_dir)},
        "data": {"train": [{"path": str(data)}], "max_length": 48},
        "training": {
            "precision": "fp32",
            "micro_batch_size": 2,
            "global_batch_size": 8,
            "max_steps": STEPS,
            "learning_rate": 1e-2 if method == "lora" else 1e-3,
            "warmup_steps": 1,
            # Checkpointing on (the default), except where ZeRO-3 refuses it with LoRA (launch.check_engine).
            "gradient_checkpointing": not (engine == "zero3" and method == "lora"),
        },
        "peft": {"method": method, "rank": 4},
        "logging": {"every_n_steps": 1, "progress_bar": False},
        "checkpoint": {"resume": "none", "every_n_steps": 2},
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def launch(recipe: Path, out: Path, engine: str, *extra: str, script: Path | None = None, **topology) -> list[str]:
    accelerate = Path(sys.executable).with_name("accelerate")
    config = CONFIGS / f"{topology.pop('config', ENGINES[engine])}.yaml"
    options = {"num_processes": 2, "main_process_port": free_port(), **topology}
    flags = [x for k, v in options.items() for x in (f"--{k}", str(v))]
    return [
        str(accelerate),
        "launch",
        "--config_file",
        str(config),
        *flags,
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(script or ROOT / "scripts" / "finetune.py"),
        "--recipe",
        str(recipe),
        f"output_dir={out}",
        *extra,
    ]


# LoRA on the output head too: the chunked loss reads its adapter's lora_B outside the head's forward, as it reads
# the head's weight, so under FSDP2 both must come whole from the root's unit.
HEAD_TARGETS = "peft.target_modules=[q_proj, v_proj, lm_head]"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir, tiny_data):
    """One process, in this process, per run: the run every launch must reproduce."""
    runs = {}
    for name, method, extra in (("none", "none", []), ("lora", "lora", []), ("lora-head", "lora", [HEAD_TARGETS])):
        folder = tmp_path_factory.mktemp(f"one-{name}")
        summary = train(load_recipe(write_recipe(folder, model_dir, tiny_data, method), extra))
        runs[name] = (folder / "run", summary)
    return runs


def assert_same_losses(run: Path, reference: Path, steps: int = STEPS) -> None:
    got, want = losses(run), losses(reference)
    assert sorted(got) == list(range(1, steps + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-4), (step, got, want)


def final_tensors(run: Path) -> dict:
    from safetensors.torch import load_file

    (file,) = [p for p in (run / "final").glob("*.safetensors")]
    return load_file(file)


# The fsdp2 launch's entry: what FSDP2 gathered into a full state dict (final/), per process, in each run's folder.
RECORD_GATHERED = """
import json, os
from pathlib import Path
import torch.distributed.checkpoint.state_dict as dcp_state
gather, gathered = dcp_state.get_model_state_dict, []
def recording(model, *args, **kwargs):
    state = gather(model, *args, **kwargs)
    if kwargs["options"].full_state_dict:
        gathered.extend(state)
    return state
dcp_state.get_model_state_dict = recording
def after_run(recipe):
    Path(recipe.output_dir, "gathered-" + os.environ["RANK"]).write_text(json.dumps(sorted(gathered)))
    gathered.clear()
"""


# Rewards that differ within a group whatever the (random) model says: shorter completions earn more.
GRPO_REWARDS = "def shorter(prompt, completion, **fields):\n    return -len(completion) / 10\n"


def write_grpo_recipe(folder: Path, model_dir: Path) -> Path:
    """GRPO on the saved tiny Llama: 2 prompts x 4 completions a step, 2 processes x micro-batch 2 x accumulation 1
    (one process: accumulation 2); each process samples the whole group of its own prompt."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "grpo_test_rewards.py").write_text(GRPO_REWARDS)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"tell me a story {i}"}) + "\n" for i in range(16)))
    recipe = yaml.safe_load(write_recipe(folder, model_dir, prompts, "none").read_text())
    recipe["data"] = {"train": [{"path": str(prompts), "format": "prompt"}], "max_length": 16}
    recipe["training"] |= {"objective": "grpo", "gradient_checkpointing": True, "micro_batch_size": 2}
    recipe["grpo"] = {"num_generations": 4, "max_new_tokens": 6, "rewards": [{"function": "grpo_test_rewards:shorter"}]}
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return folder / "recipe.yaml"


@dataclass
class Launch:
    runs: dict[str, Path]  # run name -> its folder
    output: str  # the launch's stdout and stderr


def then(recipe: Path, out: Path, *extra: str) -> list[str]:
    """The arguments of one more run in a launch of the RUNS entry."""
    return ["+", "--recipe", str(recipe), f"output_dir={out}", *extra]


RUNS_OF = ("none", "lora")


def launch_engine(folder: Path, engine: str, model_dir: Path, config_only: Path, data: Path) -> Launch:
    """One launch of the engine's Accelerate config training, in turn, every run the tests below check: full
    fine-tuning and LoRA; under FSDP2 bf16 too; under ZeRO-3 a random init; under DDP LoRA in bf16."""
    # Each recipe in a folder of its own: a run refuses an output_dir holding a recipe.yaml it did not write.
    recipes = {method: write_recipe(folder / f"recipe-{method}", model_dir, data, method, engine) for method in RUNS_OF}
    runs = {method: (recipe, []) for method, recipe in recipes.items()}
    if engine == "fsdp2":
        runs["bf16"] = (runs["none"][0], ["training.precision=bf16"])
        runs["lora-head"] = (runs["lora"][0], [HEAD_TARGETS])
    if engine == "zero3":
        runs["auto"] = (runs["none"][0], ["training.micro_batch_size=auto"])
        runs["random_init"] = (
            write_recipe(folder / "recipe-init", config_only, data, "none", engine),
            ["model.random_init=true"],
        )
    if engine == "ddp":
        runs["lora-bf16"] = (runs["lora"][0], ["training.precision=bf16", "training.max_steps=6"])
    runs["grpo"] = (write_grpo_recipe(folder / "grpo-recipe", model_dir), [])
    entry = folder / "entry.py"
    entry.write_text((RECORD_GATHERED if engine == "fsdp2" else "") + RUNS)
    (first, (recipe, extra)), *rest = runs.items()
    more = [arg for name, (r, e) in rest for arg in then(r, folder / name, *e)]
    cmd = launch(recipe, folder / first, engine, *extra, *more, script=entry)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder / "grpo-recipe"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Launch({name: folder / name for name in runs}, proc.stdout + proc.stderr)


@pytest.fixture(scope="module")
def launched(tmp_path_factory, model_dir, tiny_model_dir, tiny_data) -> Callable[[str], Launch]:
    """engine -> its one launch, made on first use and shared by the tests of this module."""
    done: dict[str, Launch] = {}

    def get(engine: str) -> Launch:
        if engine not in done:
            folder = tmp_path_factory.mktemp(engine)
            done[engine] = launch_engine(folder, engine, model_dir, tiny_model_dir, tiny_data)
        return done[engine]

    return get


@pytest.mark.parametrize(
    ("engine", "method"),
    [
        *((engine, method) for engine in ("ddp", "fsdp2") for method in ("none", "lora")),
        ("fsdp2", "lora-head"),
        *(pytest.param(e, m, marks=needs_deepspeed) for e in ("zero2", "zero3") for m in ("none", "lora")),
    ],
)
def test_two_processes_equal_one(engine, method, reference, launched):
    run = launched(engine).runs[method]
    ref_dir, ref = reference[method]
    summary = json.loads((run / "run_summary.json").read_text())
    assert (summary["engine"], summary["num_processes"], summary["grad_accum_steps"]) == (engine, 2, 2)
    assert_same_losses(run, ref_dir)
    # Exactly one update per global batch, counted in the optimizer's own state (through DeepSpeed's wrappers).
    assert summary["optimizer_updates"] == ref["optimizer_updates"] == STEPS
    share = summary["local_parameter_bytes"] / ref["local_parameter_bytes"]
    assert share == pytest.approx(0.5 if engine in ("fsdp2", "zero3") else 1.0, abs=0.03)
    # final/ is one consolidated model (or adapter) with the same weights as the one-process run's.
    got, want = final_tensors(run), final_tensors(ref_dir)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].float().sub(tensor.float()).abs().max() < 1e-4, name
    # Periodic checkpoints were written under this engine (LoRA: the adapters only).
    assert [p.name for p in checkpoint.complete_checkpoints(run)] == ["step-000002", "step-000004"]


@needs_deepspeed
@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_deepspeed_on_a_cpu_compiles_nothing(engine, launched):
    """DeepSpeed on CPUs all-reduces through gloo: its shared-memory kernel cost a g++ build on a launch's first
    run (35 s to 3 min, again after each torch upgrade) to speed up toy runs."""
    assert "shm_comm" not in launched(engine).output


@pytest.mark.parametrize(
    "engine",
    ["ddp", "fsdp2", pytest.param("zero2", marks=needs_deepspeed), pytest.param("zero3", marks=needs_deepspeed)],
)
def test_grpo_on_two_processes_equals_one(engine, launched, grpo_reference):
    """Each process samples its own prompts' groups (under FSDP2 and ZeRO-3 with the weights gathered, in lockstep),
    rewards are gathered to normalise and report them: the same completions, rewards and losses as one process."""
    run = launched(engine).runs["grpo"]
    assert_same_losses(run, grpo_reference)
    got, want = (
        [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if '"reward"' in line]
        for folder in (run, grpo_reference)
    )
    assert [m["reward"] for m in got] == pytest.approx([m["reward"] for m in want], abs=1e-6)
    assert [m["completion_length"] for m in got] == [m["completion_length"] for m in want]
    assert len({m["reward"] for m in want}) > 1, "the completions changed as the policy trained"


@pytest.fixture(scope="module")
def grpo_reference(tmp_path_factory, model_dir) -> Path:
    """The grpo run of the launches, on one process, in this process (its reward module imported from its folder)."""
    folder = tmp_path_factory.mktemp("grpo-one")
    recipe = write_grpo_recipe(folder / "grpo-recipe", model_dir)
    sys.path.insert(0, str(folder / "grpo-recipe"))
    try:
        train(load_recipe(recipe, [f"output_dir={folder / 'run'}"]))
    finally:
        sys.path.remove(str(folder / "grpo-recipe"))
    return folder / "run"


@pytest.mark.parametrize("engine", ["fsdp2", *(pytest.param(e, marks=needs_deepspeed) for e in ("zero2", "zero3"))])
def test_a_lora_resume_checks_the_adapter_names_in_every_engines_format(launched, reference, engine):
    """A LoRA checkpoint loads non-strictly (it holds no frozen base), so a resume compares its tensor names with what
    trains and refuses a renamed adapter (test_resilience). DeepSpeed and FSDP2 write formats of their own, where the
    check used to find no names and let a renamed adapter start fresh: their names must be those Accelerate writes."""
    step = Path("checkpoints") / "step-000002"
    want = checkpoint.saved_tensor_names(reference["lora"][0] / step)
    assert want and all("lora_" in name for name in want), want
    assert checkpoint.saved_tensor_names(launched(engine).runs["lora"] / step) == want


def test_fsdp2_saves_lora_adapters_without_gathering_the_frozen_base(launched):
    """final/ of a LoRA run under FSDP2 holds the adapters: only they are gathered (a 70B base gathered whole to
    save them took ~140 GB of host RAM). test_two_processes_equal_one checks the saved adapters' values."""
    run = launched("fsdp2").runs["lora"]
    gathered = {rank: json.loads((run / f"gathered-{rank}").read_text()) for rank in ("0", "1")}
    assert gathered["0"] and not gathered["1"]  # cpu_offload: the main process receives it, the other nothing
    assert all("lora_" in name for name in gathered["0"]), gathered["0"]
    assert (run / "final" / "adapter_model.safetensors").is_file()


@needs_deepspeed
def test_zero3_starts_a_random_init_from_the_seeds_weights(launched, tmp_path):
    """ZeRO-3's zero3_init_flag initialised a model built from its config partition by partition: other weights
    than the seed gives one process and every other engine (first loss 5.651 against 5.7185 on the quickstart)."""
    run = launched("zero3").runs["random_init"]
    train(load_recipe(run / "recipe.yaml", [f"output_dir={tmp_path / 'one'}"]))
    assert_same_losses(run, tmp_path / "one")


@needs_deepspeed
def test_zero3_plans_an_auto_micro_batch(launched):
    """The main process plans alone (the others wait for its plan): the models it builds to time and trace the step
    must not go through ZeRO-3's zero.Init, whose partitioning collectives the others never join (gloo aborted on a
    size mismatch)."""
    summary = json.loads((launched("zero3").runs["auto"] / "run_summary.json").read_text())
    assert summary["engine"] == "zero3" and summary["memory_plan"]["source"] == "planner"


def test_fsdp2_bf16_through_its_mixed_precision_policy(reference, launched, tmp_path):
    """bf16 under FSDP2 is FSDP2's MixedPrecisionPolicy (bf16 compute from gathered shards, fp32 reduction), not
    autocast: it must still train as one process under autocast does, to bf16's precision."""
    run = launched("fsdp2").runs["bf16"]
    one = train(load_recipe(run / "recipe.yaml", [f"output_dir={tmp_path / 'one'}"]))
    summary = json.loads((run / "run_summary.json").read_text())
    assert (summary["engine"], summary["precision"], one["precision"]) == ("fsdp2", "bf16", "bf16")
    got, want = losses(run), losses(tmp_path / "one")
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-3), step
    fp32 = losses(reference["none"][0])  # and it did compute in bf16: the losses are not fp32's
    assert max(abs(got[step] - fp32[step]) for step in fp32) > 1e-5


def test_lora_with_checkpointing_in_bf16_under_ddp(launched):
    run = launched("ddp").runs["lora-bf16"]
    summary = json.loads((run / "run_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["precision"] == "bf16" and summary["gradient_checkpointing"]
    loss = losses(run)
    assert loss[6] < loss[1]
    assert (run / "final" / "adapter_model.safetensors").exists()


def kill_after_checkpoint(cmd: list[str], ready: Path, timeout: float = 300) -> None:
    """Start a launch whose workers sleep once `ready` exists (PAUSING_ENTRY), then SIGKILL them all."""
    proc = subprocess.Popen(
        cmd, env={**os.environ, "PAUSE_STEP": "2"}, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + timeout
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, f"{ready} never appeared"
            time.sleep(0.2)
        time.sleep(0.5)
    finally:
        # The launcher and both workers, as a node failure would: torch's launcher starts each worker in a session
        # of its own, so killing the launcher's group leaves them running (and training on, after their pause).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kill_and_reap(processes_tagged(os.environ[TEST_TAG]))


def alive(pid: int) -> bool:
    """Running (a zombie, killed and not yet reaped by its adopter, has no environment left)."""
    try:
        return bool(Path(f"/proc/{pid}/environ").read_bytes())
    except OSError:
        return False


def kill_and_reap(pids: Iterable[int], timeout: float = 30) -> None:
    """SIGKILL `pids` and wait until none of them is left (they are not our children: poll /proc)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(map(alive, pids)):
        assert time.monotonic() < deadline, f"processes {pids} outlived SIGKILL"
        time.sleep(0.1)


@pytest.mark.parametrize("engine,method", [("fsdp2", "lora"), pytest.param("zero3", "none", marks=needs_deepspeed)])
def test_sigkill_and_resume(engine, method, reference, model_dir, tiny_data, tmp_path):
    recipe = write_recipe(tmp_path, model_dir, tiny_data, method, engine)
    run = tmp_path / "run"
    entry = tmp_path / "pausing_entry.py"
    entry.write_text(PAUSING_ENTRY)
    kill_after_checkpoint(
        launch(recipe, run, engine, script=entry), run / "checkpoints" / "step-000002" / "recipe.yaml"
    )
    assert not (run / "final").exists()
    if engine == "fsdp2":  # sharded: one file per process
        assert len(list((run / "checkpoints" / "step-000002" / "sharded").glob("*.distcp"))) == 2
    proc = subprocess.run(
        launch(recipe, run, engine, "checkpoint.resume=auto"), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stderr
    assert_same_losses(run, reference[method][0])
    assert json.loads((run / "run_summary.json").read_text())["optimizer_updates"] == STEPS


# Raises an out-of-memory error on process 1 only, in its 5th backward (step 3's first micro-batch) or its
# 3rd optimizer step, after the checkpoint of step 2.
OOM_ENTRY = """
import os, sys, torch
import llmtune.parallel.engines, llmtune.run.loop
from llmtune.cli.main import main

where, calls = os.environ["INJECT_OOM"], {"n": 0}
def failing(real, at):
    def call(*args, **kwargs):
        calls["n"] += 1
        if os.environ["RANK"] == "1" and calls["n"] == at:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return real(*args, **kwargs)
    return call
if where == "backward":
    llmtune.parallel.engines.backward = failing(llmtune.parallel.engines.backward, 5)
else:
    llmtune.parallel.engines.optimizer_step = failing(llmtune.parallel.engines.optimizer_step, 3)
sys.exit(main(["train", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("engine,where", [("ddp", "backward"), ("fsdp2", "optimizer")])
def test_out_of_memory_on_one_process_stops_all_then_resumes_smaller(
    engine, where, reference, model_dir, tiny_data, tmp_path
):
    recipe = write_recipe(tmp_path, model_dir, tiny_data, "none", engine)
    run = tmp_path / "run"
    entry = tmp_path / "oom_entry.py"
    entry.write_text(OOM_ENTRY)
    cmd = launch(recipe, run, engine, script=entry)
    # The launcher reports process 1's own exit (75), not a collective's timeout (30 min: past this hang guard).
    proc = subprocess.run(cmd, env={**os.environ, "INJECT_OOM": where}, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"exitcode  : {EXIT_PREEMPTED}" in proc.stderr, proc.stderr[-4000:]
    assert "process 1: out of memory" in proc.stderr
    assert json.loads((run / OOM_FILE).read_text())["micro_batch_size"] == 1
    assert max(losses(run)) <= 3 and not (run / "final").exists()
    if where == "backward":  # the same command continues from step 2 with the smaller micro-batch
        proc = subprocess.run(
            launch(recipe, run, engine, "checkpoint.resume=auto"), capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        summary = json.loads((run / "run_summary.json").read_text())
        assert (summary["micro_batch_size"], summary["grad_accum_steps"]) == (1, 4)
        assert_same_losses(run, reference["none"][0])


# Each process writes the plan it trains to plan-RANK.json in the run's folder.
RECORD_PLANS = """
import json, os
from pathlib import Path
import llmtune.run.loop
fit = llmtune.run.loop.fit
def record_plan(run):
    Path(run.recipe.output_dir).mkdir(parents=True, exist_ok=True)
    Path(run.recipe.output_dir, f"plan-{os.environ['RANK']}.json").write_text(json.dumps(run.plan.to_dict()))
    return fit(run)
llmtune.run.loop.fit = record_plan
"""
# Two clocks that rank the candidates in opposite orders: on rank 0 small micro-batches run fastest (the FLOP rate
# falls with the rows), on rank 1 large ones (every op costs a second), as a loaded host and an idle one disagree.
SKEWED_CLOCKS = """
import llmtune.plan.timing
from llmtune.plan.timing import Rates
rates = {
    "0": Rates(1e11, 2e10, 1e-9, "rank 0's clock", flops_by_rows=((48, 1e12), (192, 1e8))),
    "1": Rates(1e11, 2e10, 1.0, "rank 1's clock"),
}[os.environ["RANK"]]
llmtune.plan.timing.measure_rates = lambda *args, **kwargs: rates
"""
# Process 1 does not see the out-of-memory file (another node's disk, a shared one that lags).
UNSEEN_FILE = """
import pathlib
seen = pathlib.Path.is_file
pathlib.Path.is_file = lambda path: seen(path) and not (os.environ["RANK"] == "1" and path.name == "out_of_memory.json")
"""


@pytest.fixture(scope="module")
def disagreeing(tmp_path_factory, model_dir, tiny_data) -> Path:
    """One DDP launch whose processes disagree (skewed clocks, an unseen file), training two runs: "auto", planned
    by `auto`, and "oom_file", whose folder holds an earlier run's out-of-memory file. Each records its plans."""
    folder = tmp_path_factory.mktemp("disagreeing")
    recipe = write_recipe(folder, model_dir, tiny_data, "none")
    (folder / "oom_file").mkdir()
    (folder / "oom_file" / OOM_FILE).write_text(json.dumps({"micro_batch_size": 1, "where": "forward/backward"}))
    entry = folder / "disagreeing_entry.py"
    entry.write_text(RECORD_PLANS + SKEWED_CLOCKS + UNSEEN_FILE + RUNS)
    auto = ["training.micro_batch_size=auto", "training.gradient_checkpointing=auto"]
    cmd = launch(recipe, folder / "auto", "ddp", *auto, *then(recipe, folder / "oom_file"), script=entry)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder


def plans(run: Path) -> list[dict]:
    return [json.loads((run / f"plan-{rank}.json").read_text()) for rank in (0, 1)]


def test_processes_whose_clocks_disagree_train_one_plan(disagreeing):
    """`auto` plans rank candidates by timings that differ between processes: each must train the plan the main
    process chose (planning on each process's own clock trained two plans, and half such launches hung)."""
    planned = plans(disagreeing / "auto")
    assert planned[0] == planned[1] and planned[0]["micro_batch_size"] == 1, planned  # rank 0's clock: micro 1
    assert "rank 0's clock" in json.dumps(planned[0])


def test_an_out_of_memory_file_one_process_cannot_see_shrinks_every_process(disagreeing):
    """The micro-batch an earlier out-of-memory stop asked for is read once and shared: a process whose disk does not
    show the file trains the same plan as the one that reads it."""
    planned = plans(disagreeing / "oom_file")
    assert [(p["micro_batch_size"], p["grad_accum_steps"]) for p in planned] == [(1, 4), (1, 4)], planned


def test_two_machines_on_localhost_train_together(reference, model_dir, tiny_data, tmp_path):
    """recipes/accelerate/multinode.yaml, one process per "machine", both on 127.0.0.1 (a shared disk)."""
    recipe = write_recipe(tmp_path, model_dir, tiny_data, "none")
    port = free_port()
    machines = [
        subprocess.Popen(
            launch(
                recipe,
                tmp_path / "run",
                "ddp",
                config="multinode",
                num_machines=2,
                machine_rank=rank,
                main_process_ip="127.0.0.1",
                main_process_port=port,
            ),
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for machine in machines:
        _, err = machine.communicate(timeout=600)
        assert machine.returncode == 0, err[-4000:]
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert (summary["num_processes"], summary["grad_accum_steps"]) == (2, 2)
    assert_same_losses(tmp_path / "run", reference["none"][0])
