"""Checkpoints that are either whole or absent.

Layout: `output_dir/checkpoints/step-000120/` holds Accelerate's state (model or adapter, optimizer,
loss scaler, every process's RNG states; the learning rate is a function of the step) plus `trainer_state.json`
(step, data position, memory plan, counters) and `recipe.yaml`. Under FSDP2 the model and optimizer are in
`sharded/` instead, one file per process (`torch.distributed.checkpoint`); DeepSpeed writes its own per-process
files through Accelerate. A checkpoint is written under a hidden temporary name and
renamed only when complete, so a process killed mid-save leaves the previous one untouched; old ones
are pruned only after the new one is in place. `final/` is written the same way.

Order is the order of writing, not of steps: a run resumed from an older checkpoint (step 100 while an abandoned
step 200 is there) writes step 110 after step 200. Each checkpoint's state records its `serial` (one more than
any checkpoint already in the folder) and its `lineage` (the checkpoints the run that wrote it descends from):
`resume: auto` takes the newest written, and `keep_last` prunes only the run's own lineage, never another branch.

Whole means every file: once all processes have written theirs, each lists the files it sees (its own among them,
whatever another node's directory cache shows), and the main process writes them all with their sizes in
`manifest.json`, last (atomically), before the folder is renamed into place. A checkpoint is
sound only when its manifest is there and every file it names has that size: a partly copied folder, or one missing
a process's `random_states_1.pkl`, is not resumed; `resume: auto` falls back to the newest sound one, saying which it
skipped and why.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import gather_object

from llmtune.errors import LlmtuneError, NothingToDo, RunFailed, UserError
from llmtune.files import replace_dir
from llmtune.parallel import engines
from llmtune.recipe import Recipe, flatten

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"  # {"files": {relative path: bytes}} of every other file; written last
STEP_NAME = re.compile(r"step-(\d+)")
# In final/: how the run's prompts reached the model (data.render.prompt_layout), so generate and eval prompt alike.
PROMPT_LAYOUT_FILE = "prompt_layout.json"
# Changing these mid-run would make the resumed run a different run; everything else is allowed.
CONTINUITY_KEYS = ("model", "data", "seed", "peft", "training.global_batch_size", "training.optimizer")


class ResumeError(UserError, RuntimeError):
    """The recipe asks to resume what cannot be resumed (not a checkpoint, or a different run)."""


class SaveError(RunFailed, RuntimeError):
    """A checkpoint or final/ could not be written (a full disk, a quota): the run stops, the last whole one kept."""


def write_failure(err: BaseException) -> bool:
    """Whether `err` is a failed write (a full disk, a quota, a file size limit): an OSError, or the same reported by
    safetensors' writer or torch's zip writer, which raise types of their own."""
    text = str(err)
    return isinstance(err, OSError) or any(s in text for s in ("I/O error", "failed writing file", "file write failed"))


@contextmanager
def writing(accelerator: Accelerator, tmp: Path, what: str, output_dir: str | Path) -> Iterator[None]:
    """Around the write of `tmp`: a failed write stops the run in one line naming what is kept, the half-written
    folder removed (it only takes space; it was never in place)."""
    try:
        yield
    except Exception as err:
        if not write_failure(err):
            raise
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        why = err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[0][:200]
        kept = complete_checkpoints(output_dir)
        newest = f"the last whole checkpoint, {kept[-1]}, is kept" if kept else "there is no earlier checkpoint"
        raise SaveError(
            f"could not write {what} ({why}); {newest}. Free space, then run the same command with"
            " checkpoint.resume=auto"
        ) from None


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_of(path: Path) -> int | None:
    """The step in a checkpoint's name `step-000120`; None for any other name (a user's `step-000120.bak`)."""
    match = STEP_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """Folders named `step-N`, sound or not, in the order they were written, oldest first. Temporaries (leading dot)
    and other names are skipped."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if step_of(p) is not None and p.is_dir()), key=written)


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Sound checkpoints (`unsound` finds nothing wrong) in the order they were written, oldest first."""
    return [p for p in checkpoint_folders(output_dir) if unsound(p) is None]


def file_sizes(folder: Path) -> dict[str, int]:
    """Every file of `folder` this process sees, by its path there, with its size (the manifest aside)."""
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST_FILE
    }


def write_manifest(folder: Path, reports: list[dict[str, int]]) -> None:
    """List every file of `folder` with its size in MANIFEST_FILE, atomically: its presence says the rest is whole.
    It also names its writer (uid and host): a resume of another user's checkpoint must be asked for (`foreign`).

    `reports`: each process's `file_sizes` of the folder. On storage shared by several
    nodes that caches directories, one node's listing may miss a file another node wrote, or see it at an older size,
    never its writer's: the manifest holds every file any process saw, at the largest size seen (a checkpoint's
    files are written once, in a fresh folder: they only grow)."""
    files: dict[str, int] = {}
    for report in reports:
        for name, size in report.items():
            files[name] = max(size, files.get(name, 0))
    writer = {"uid": os.getuid(), "host": socket.gethostname()}
    tmp = folder / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps({"writer": writer, "files": dict(sorted(files.items()))}, indent=1) + "\n")
    os.replace(tmp, folder / MANIFEST_FILE)


def unsound(path: Path) -> str | None:
    """Why `path` is not a whole checkpoint (in words), or None when its manifest and every file it names agree."""
    try:
        files = json.loads((path / MANIFEST_FILE).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST_FILE} (its save did not finish, or it was copied without it)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST_FILE} cannot be read ({err})"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size}"
    return None


def foreign(path: Path) -> str | None:
    """Who other than this user wrote the checkpoint at `path` (in words), or None: the writer its manifest names, or
    the owner of any of its files (a checkpoint from before writers were recorded, or one another user put here)."""
    me = os.getuid()
    try:
        writer = json.loads((path / MANIFEST_FILE).read_text()).get("writer", {})
    except (OSError, ValueError, AttributeError):
        writer = {}
    if isinstance(writer, dict) and writer.get("uid", me) != me:
        return f"uid {writer.get('uid')} on host {writer.get('host')}, by its manifest"
    owners = {p.stat().st_uid for p in [path, *path.rglob("*")]} - {me}
    return f"uid {min(owners)}, who owns its files" if owners else None


def written(path: Path) -> tuple[int, int]:
    """Sort key in the order of writing: the checkpoint's serial, then its step (checkpoints saved before serials
    count as serial 0: they were written in step order)."""
    try:
        serial = int(saved_state(path).get("serial", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        serial = 0
    return serial, step_of(path) or 0


def lineage_of(path: Path, output_dir: str | Path) -> list[str]:
    """The checkpoints of `output_dir` that a run resumed from `path` descends from, `path` last: what its own
    pruning may delete. A checkpoint saved before lineages were recorded descends from every one of its folder with a
    smaller step (such runs never branched: they pruned by step)."""
    step = step_of(path)
    if path.parent.resolve() != checkpoints_root(output_dir).resolve() or step is None:
        return []  # another run's checkpoint: nothing in this output_dir descends from it
    recorded = saved_state(path).get("lineage")
    if recorded is None:
        recorded = [p.name for p in complete_checkpoints(output_dir) if (step_of(p) or 0) < step]
    return [*recorded, path.name]


def resolve_resume(output_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint `resume` names: `auto`, the newest written sound one (each newer one skipped is logged with
    why); a path, that one if sound."""
    if resume == "none":
        return None
    if resume == "auto":
        for path in reversed(checkpoint_folders(output_dir)):
            why = unsound(path)
            if why is None:
                return path
            log.warning("resume: skipping %s: %s", path, why)
        return None
    path = Path(resume)
    why = unsound(path) if path.is_dir() else "no such folder"
    if why is not None:
        raise ResumeError(f"checkpoint.resume={resume}: not a whole llmtune checkpoint: {why}")
    return path


def agreed_resume_point(accelerator: Accelerator, r: Recipe, engine: engines.Engine) -> Path | None:
    """`resume_point` decided by the main process, its answer (or refusal) shared: every process must load the same
    checkpoint, and only one should log what it skipped."""

    def decide() -> tuple[Path | None, LlmtuneError | None]:
        try:
            return resume_point(r, engine, accelerator.num_processes), None
        except (ResumeError, NothingToDo) as err:
            return None, err

    path, refused = engines.decided_by_main(accelerator, decide)
    if refused is not None:
        raise refused
    return path


def completed_steps(output_dir: str | Path) -> int | None:
    """The steps of the run that finished in `output_dir` (its run_summary.json, written after final/), or None."""
    summary = Path(output_dir).expanduser() / "run_summary.json"
    if not (summary.parent / "final").is_dir() or not summary.is_file():
        return None
    try:
        return int(json.loads(summary.read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable: judged as no finished run (the checks below still apply)


def resume_point(r: Recipe, engine: engines.Engine = "ddp", processes: int = 1) -> Path | None:
    """The checkpoint this run continues, or None; refuses a resume that would be a different run, or that this launch
    (`engine`, `processes`) cannot load.

    Called before anything heavy loads, so a refusal costs nothing.
    """
    done = completed_steps(r.output_dir)
    if r.checkpoint.resume == "auto" and not r.overwrite and done is not None and done >= r.training.max_steps:
        raise NothingToDo(
            f"{r.output_dir} holds a complete run ({done} steps, final/ written), left as it is: raise"
            " training.max_steps to train on from its newest checkpoint, or set overwrite=true to start over"
        )
    path = resolve_resume(r.output_dir, r.checkpoint.resume)
    if path is None:
        if r.checkpoint.resume == "none" and not r.overwrite and checkpoint_folders(r.output_dir):
            # Starting over here would prune the earlier run's checkpoints as if they were ours.
            raise ResumeError(
                f"{r.output_dir} already holds checkpoints of an earlier run and checkpoint.resume=none: set"
                " checkpoint.resume=auto to continue it, or use another output_dir (or delete this one, or set"
                " overwrite=true)"
            )
        return None
    writer = foreign(path)
    if writer is not None and not r.checkpoint.trust:
        raise ResumeError(
            f"cannot resume from {path}: it was written by {writer}, not by this user (uid {os.getuid()}), and a"
            " resume unpickles some of its files, which can run code; set checkpoint.trust=true if you trust its"
            f" writer, or start over: {START_OVER}"
        )
    breaking, harmless = continuity_problems(saved_recipe(path), r.to_dict())
    if breaking:
        changes = "; ".join(breaking)
        raise ResumeError(
            f"cannot resume from {path}: the recipe changed in ways that make it a different run ({changes}); use"
            f" another output_dir, or start over in this one: {START_OVER}"
        )
    launch_problem = launch_refusal(path, engine, processes)
    if launch_problem is not None:
        raise ResumeError(launch_problem)
    for change in harmless:
        log.info("resume: recipe changed %s%s", change, " (applied: the run is planned again)" * replans(change))
    return path


# A new run in an output_dir that holds checkpoints: the command that does it (resume_point refuses resume=none alone).
START_OVER = "checkpoint.resume=none overwrite=true (the new run replaces checkpoints and final/ as it writes its own)"
# Recipe keys that only change how the global batch is split or recomputed: a resume plans them again
# (`llmtune.run.setup.resumed_plan`), the global batch kept.
REPLANNED_KEYS = (
    "training.micro_batch_size",
    "training.gradient_checkpointing",
    "memory.budget",
    "parallel.sequence_parallel",
    "parallel.tiled_mlp",
    "model.experts_implementation",  # the experts' kernel: what their activations keep
)


def replans(change: str) -> bool:
    return any(change.startswith(key + ":") or change.startswith(key + ".") for key in REPLANNED_KEYS)


def saved_launch(path: Path) -> tuple[str, int]:
    """(engine, processes) that wrote the checkpoint. Checkpoints from before engines were recorded: FSDP2's have
    `sharded/`, DeepSpeed's its per-process `*zero_pp_rank_*` files (the stage is not told apart: both shard)."""
    state = saved_state(path)
    processes = int(state.get("plan", {}).get("num_processes", 1))
    if "engine" in state:
        return state["engine"], processes
    if (path / engines.DCP_DIR).is_dir():
        return "fsdp2", processes
    if next(path.rglob("*zero_pp_rank_*"), None) is not None:
        return "zero", processes
    return "ddp", processes


def launch_refusal(path: Path, engine: engines.Engine, processes: int) -> str | None:
    """Why this launch cannot load the checkpoint, in one line, or None. DDP's (and one process's) state is whole in
    every process and resumes under any process count, the global batch kept; a sharded state (FSDP2, ZeRO) holds
    one part per process of the launch that wrote it, and no engine reads another's files."""
    saved_engine, saved_processes = saved_launch(path)
    sharded = saved_engine != "ddp"
    same_engine = saved_engine == engine or (saved_engine == "zero" and engine in ("zero2", "zero3"))
    if same_engine and (not sharded or saved_processes == processes):
        return None
    wrote = f"{saved_engine} over {saved_processes} process{'es' * (saved_processes > 1)}"
    this = f"{engine} over {processes} process{'es' * (processes > 1)}"
    how = f"launch it as it was written ({wrote})" if sharded else "launch it under DDP (any number of processes)"
    return (
        f"cannot resume from {path}: it was written by {wrote} and this launch is {this}; {how}, or use another"
        f" output_dir, or start over in this one: {START_OVER}"
    )


def _publish(accelerator: Accelerator, tmp: Path, final: Path) -> None:
    """Rename a finished temporary folder into place (main process), replacing an older `final`."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        replace_dir(tmp, final)
    accelerator.wait_for_everyone()


def _fresh_tmp(accelerator: Accelerator, parent: Path, name: str) -> Path:
    tmp = parent / f".{name}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a save that was killed
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    return tmp


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str | Path,
    step: int,
    state: dict[str, Any],
    recipe_yaml: str,
    keep_last: int,
    *,
    engine: engines.Engine,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainable_only: bool,
) -> Path:
    """Save everything a resume needs (all processes must call this), then prune the oldest of the run's own
    checkpoints (`state["lineage"]`: those it descends from) beyond `keep_last`."""
    root = checkpoints_root(output_dir)
    name = f"step-{step:06d}"
    tmp = _fresh_tmp(accelerator, root, name)
    final = root / name
    with writing(accelerator, tmp, f"checkpoint {final}", output_dir):
        engines.save_state(accelerator, tmp, engine, model, optimizer, peft=trainable_only)
        if accelerator.is_main_process:
            serial = 1 + max((written(p)[0] for p in checkpoint_folders(output_dir)), default=0)
            (tmp / STATE_FILE).write_text(json.dumps({**state, "serial": serial}, indent=2))
            (tmp / "recipe.yaml").write_text(recipe_yaml)
        accelerator.wait_for_everyone()  # every process's files (RNG states, shards) are written: list them
        reports = gather_object([file_sizes(tmp)])  # each process's own view, its own files whole in it
        if accelerator.is_main_process:
            write_manifest(tmp, reports)
    _publish(accelerator, tmp, final)  # renames only, outside `writing`: a failure there must not remove tmp
    if accelerator.is_main_process:
        ours = {*state["lineage"], name}
        for old in [p for p in complete_checkpoints(output_dir) if p.name in ours][:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    log.info("saved checkpoint %s", final)
    return final


def save_trainable_only(accelerator: Accelerator) -> None:
    """Under PEFT a checkpoint holds only what trains (the adapters, MBs): the frozen base comes back from
    where it was loaded (or, for random_init, from the seed), not from a multi-GB copy per checkpoint."""

    def drop_frozen(models: list, weights: list[dict[str, Any]], output_dir: str) -> None:
        # DeepSpeed and FSDP2 hand Accelerate no weights: they save through their own paths (save_checkpoint).
        if not weights:
            return
        for model, state in zip(models, weights, strict=True):
            trainable = {name for name, p in model.named_parameters() if p.requires_grad}
            for key in [k for k in state if k not in trainable]:
                del state[key]

    accelerator.register_save_state_pre_hook(drop_frozen)


def load_checkpoint(
    accelerator: Accelerator,
    path: Path,
    engine: engines.Engine,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    trainable_only: bool = False,
) -> dict[str, Any]:
    # Not strict only when the checkpoint was saved without the frozen base (save_trainable_only): then its keys are
    # compared here, as a non-strict load would leave a renamed adapter fresh under the old optimizer state.
    if trainable_only:
        check_trained_keys(path, accelerator.unwrap_model(model))
    engines.load_state(accelerator, path, engine, model, optimizer, peft=trainable_only)
    return saved_state(path)


def check_trained_keys(path: Path, model: torch.nn.Module) -> None:
    """Refuse a PEFT checkpoint whose tensors are not exactly what trains (an adapter renamed by a peft upgrade, one
    added or dropped): every engine loads these non-strictly, as they hold no frozen base."""
    saved = saved_tensor_names(path)
    if saved is None:
        return
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(trained - saved), sorted(saved - trained)
    if missing or unexpected:
        raise ResumeError(
            f"cannot resume from {path}: its tensors are not the ones this run trains (missing {missing[:2]},"
            f" unexpected {unexpected[:2]}; {len(missing)} and {len(unexpected)} in all): written by another peft or"
            " adapter setup; use another output_dir, or start over in this one: checkpoint.resume=none overwrite=true"
        )


def saved_tensor_names(path: Path) -> set[str] | None:
    """The model tensors' names in a checkpoint, from whichever format wrote it: Accelerate's safetensors (one
    process, DDP), DeepSpeed's module states, or FSDP2's distributed-checkpoint metadata; None if none is there."""
    from safetensors import safe_open

    if files := sorted(path.glob("model*.safetensors")):
        with safe_open(str(files[0]), "pt") as weights:
            return set(weights.keys())
    if states := sorted(path.glob("pytorch_model/*mp_rank_*_model_states.pt")):
        # A pickle, as DeepSpeed's own load reads it next (resumes from folders of others are refused before:
        # `checkpoint.trust`). Under PEFT it holds the adapters only (ZeRO-3: empty placeholders under their names).
        return set(torch.load(states[0], map_location="cpu", weights_only=False)["module"])
    if (path / engines.DCP_DIR / ".metadata").exists():
        import torch.distributed.checkpoint as dcp

        metadata = dcp.FileSystemReader(str(path / engines.DCP_DIR)).read_metadata()
        return {key.removeprefix("model.") for key in metadata.state_dict_metadata if key.startswith("model.")}
    return None


def saved_state(path: Path) -> dict[str, Any]:
    """The checkpoint's `trainer_state.json`: step, counters, the batch plan."""
    return json.loads((path / STATE_FILE).read_text())


def saved_recipe(path: Path) -> dict[str, Any]:
    return yaml.safe_load((path / "recipe.yaml").read_text())


def continuity_problems(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(breaking, harmless): dotted keys whose values differ between the saved and the current recipe."""
    breaking, harmless = [], []
    before, after = flatten(saved), flatten(current)
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key), after.get(key)
        if old == new:
            continue
        change = f"{key}: {old!r} -> {new!r}"
        if any(key == k or key.startswith(k + ".") for k in CONTINUITY_KEYS):
            breaking.append(change)
        else:
            harmless.append(change)
    return breaking, harmless


def save_final(
    accelerator: Accelerator,
    engine: engines.Engine,
    model,
    tokenizer,
    output_dir: str | Path,
    *,
    adapters_only: bool = False,
    save_base: bool = False,
    prompt_layout: str,
    card: str,
) -> Path:
    """Write `final/` atomically: a loadable `save_pretrained` model (or adapter), the tokenizer, the prompt
    layout the run trained with (`PROMPT_LAYOUT_FILE`: nothing in a Hugging Face folder says it was Alpaca's) and
    `card`, its model card (README.md, in place of PEFT's template; llmtune.run.model_card).

    `adapters_only`: the model is a peft model whose adapter is what `final/` holds; its frozen base is not
    gathered. `save_base` also writes the frozen base under `final/base/`: a randomly initialised base exists on
    no disk, and without it an adapter could never be merged.
    """
    out = Path(output_dir)
    tmp = _fresh_tmp(accelerator, out, "final")
    final = out / "final"
    with writing(accelerator, tmp, str(final), output_dir):
        # Gathers full weights from FSDP2 / ZeRO-3 shards; every process must take part.
        adapters = adapters_only and not save_base
        state_dict = engines.full_state_dict(accelerator, engine, model, trainable_only=adapters)
        if accelerator.is_main_process:
            inner = accelerator.unwrap_model(model).model
            weights = _strip_prefix(state_dict, "model.")
            # peft would also save the frozen base weight of an adapted lm_head or embedding ("auto": in case the
            # vocabulary was resized, which llmtune never does): V x h of what the base checkpoint already holds,
            # and only on the engines that gather the whole state dict.
            extra = {"save_embedding_layers": False} if adapters_only else {}
            inner.save_pretrained(tmp, state_dict=weights, **extra)
            tokenizer.save_pretrained(tmp)
            (tmp / PROMPT_LAYOUT_FILE).write_text(json.dumps({"layout": prompt_layout}) + "\n")
            (tmp / "README.md").write_text(card)  # after save_pretrained, which writes PEFT's template there
            if save_base:
                from llmtune.model.merge import BASE_DIR, save_base_weights

                save_base_weights(inner, tmp / BASE_DIR, weights)
                _name_base(tmp, (out / "final" / BASE_DIR).resolve())
    _publish(accelerator, tmp, final)
    return final


def _name_base(adapter_dir: Path, base: Path) -> None:
    """Point `adapter_config.json` at the folder that holds the base weights.

    peft writes the recipe's `model.name_or_path` there, which for `random_init` is a folder with a config and
    no weights: `AutoPeftModelForCausalLM.from_pretrained(final/)` would fail. The path is absolute because
    peft resolves it from the working directory, not from the adapter's folder; a moved run still loads in
    llmtune (`merge`, `generate`), which look for `final/base/` beside the adapter first.
    """
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = str(base)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _strip_prefix(state_dict: dict[str, Any] | None, prefix: str) -> dict[str, Any] | None:
    if state_dict is None:
        return None
    return {k.removeprefix(prefix): v for k, v in state_dict.items()}
