"""Fault injection: what a killed, stopped, full or misused run leaves on disk, and whether the next run continues it.

Each fault runs the real entry point (`scripts/finetune.py`'s `llmtune.cli.main.main`; `accelerate launch` with 2
processes where the world size matters) on a tiny Llama built here (nothing from the hub). A phase is reached by
wrapping the llmtune function that runs it in a small entry script (`ENTRY`), never by timing: the wrapper sends the
signal to its own process, or lowers RLIMIT_FSIZE so the next large write fails as a full disk does. Just before the
fault the entry hashes every file of the run folder; afterwards the suite checks that each is still there with the same
bytes (the lock and `metrics.jsonl`'s appended lines aside), then runs `checkpoint.resume=auto` and checks that it
resumed the newest sound checkpoint (found here independently: the highest write serial whose manifest agrees with its
files) and finished. Bad inputs must exit 2 with one `llmtune: error:` line naming the file, row or key, and no
traceback.

    .venv/bin/python -m benchmarks.faults            # ~5 minutes on 2 cores
    .venv/bin/python -m benchmarks.faults --only sigterm

Prints one row per fault and writes benchmarks/results/faults-<date>.json. `tests/test_faults.py` runs the most
important rows through the same functions.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from benchmarks import RESULTS, ROOT

PYTHON = sys.executable
TOKENIZER = ROOT / "assets" / "quickstart" / "model"  # trained offline, ships with the repo

# The entry each fault runs: llmtune's own `main`, with the function of the chosen phase wrapped. LLMTUNE_FAULT is
# `phase:action[:n]`: the fault comes at the phase's n-th call (1 by default); action is sigkill, sigterm (the
# process goes on: a handler decides), slow-sigterm (a SIGTERM, then the phase's work takes 3 s, past a 1 s grace),
# enospc (every file write of more than 4 KiB fails from here on, as on a full disk) or sleep (the process waits,
# a run still going on). Before the fault it writes the run folder's hashes to LLMTUNE_FAULT_BEFORE.
ENTRY = r"""
import hashlib, json, os, resource, signal, sys, time
from pathlib import Path
import accelerate
import llmtune.run.checkpoint, llmtune.model.merge, llmtune.run.preemption, llmtune.run.loop, llmtune.run.setup
from llmtune.cli.main import main

phase, action, *nth = os.environ["LLMTUNE_FAULT"].split(":")
nth = int(nth[0]) if nth else 1
calls = {"n": 0}
if action == "slow-sigterm":
    llmtune.run.preemption.SIGNAL_GRACE_S = 1.0


def hashes(folder):
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def fault():
    if os.environ.get("RANK", "0") != "0":
        return
    Path(os.environ["LLMTUNE_FAULT_BEFORE"]).write_text(json.dumps(hashes(os.environ["LLMTUNE_FAULT_RUN"])))
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action in ("sigterm", "slow-sigterm", "sigterm-slow-exit"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(3 if action == "slow-sigterm" else 0.1)  # the handler runs; slow: the work outlasts the grace
    elif action == "enospc":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, not a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    elif action == "sleep":
        Path(os.environ["LLMTUNE_FAULT_BEFORE"] + ".ready").write_text("")
        time.sleep(600)


def wrap(owner, name, before=True, when=lambda *a, **k: True):
    real = getattr(owner, name)
    def wrapped(*args, **kwargs):
        if not when(*args, **kwargs):
            return real(*args, **kwargs)
        calls["n"] += 1
        if before and calls["n"] == nth:
            fault()
        result = real(*args, **kwargs)
        if not before and calls["n"] == nth:
            fault()
        return result
    setattr(owner, name, wrapped)


if phase == "tokenising":
    wrap(llmtune.run.setup, "prepare_data")
elif phase == "planning":
    wrap(llmtune.run.setup, "plan_run")
elif phase == "mid-step":
    wrap(llmtune.run.loop, "train_step")
    if action == "sigterm-slow-exit":  # process 0 takes 2 s to leave the loop: the launcher stops it meanwhile
        loop = llmtune.run.loop.loop
        def slow_loop(run):
            out = loop(run)
            if os.environ.get("RANK", "0") == "0":
                time.sleep(2)
            return out
        llmtune.run.loop.loop = slow_loop
elif phase == "mid-save":  # the checkpoint's tensors: the model, then the optimizer (written by save_state)
    wrap(accelerate.Accelerator, "save_state")
elif phase == "after-save":  # a checkpoint complete, the run still going on
    wrap(llmtune.run.checkpoint, "save_checkpoint", before=False)
elif phase == "final-save":
    wrap(llmtune.run.checkpoint, "save_final")
elif phase == "merge":
    wrap(llmtune.model.merge, "_write_atomically")
elif phase == "publish-final":  # the first rename that puts a new final/ in the old one's place
    import llmtune.files
    if hasattr(llmtune.files, "_exchange"):
        wrap(llmtune.files, "_exchange", before=False)
    real_replace = os.replace
    def replacing(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        if str(dst).endswith(".final.old"):
            fault()
    os.replace = replacing
sys.exit(main(sys.argv[1:]))
"""


@dataclass
class Outcome:
    """One fault's row: what the faulty command did, what survived it, what the next `resume: auto` did."""

    fault: str
    phase: str
    exit_code: int | None
    message: str  # the first error line ("-" where there was none)
    survived: bool  # every file there before the fault is still there, with the same bytes
    resumed_from: str  # the checkpoint the next run resumed ("-": started fresh; "n/a": no next run)
    expected_resume: str  # the newest sound checkpoint, found here
    finished: bool | None  # the next run ended with exit 0 and a whole final/ (None: no next run)
    ok: bool  # the row's own verdict: survived, the newest sound checkpoint resumed, and what the row expects
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    next_message: str = "-"  # what the next run said (a refusal's line)


# ---------------------------------------------------------------- the tiny model, data and recipes


def build_assets(folder: Path) -> dict[str, Path]:
    """A tiny Llama with weights (2 layers, hidden 64) on the quickstart tokenizer, its data, and bad inputs."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model = folder / "model"
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.save_pretrained(model)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model)
    rows = [json.loads(line) for line in (ROOT / "assets" / "quickstart" / "train.jsonl").open() if line.strip()][:96]
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = folder / "bad"
    bad.mkdir()
    not_utf8 = b'{"prompt": "\xff\xfe", "completion": "x"}\n'  # the second row
    (bad / "not_utf8.jsonl").write_bytes(data.read_bytes().replace(b"\n", b"\n" + not_utf8, 1))
    no_completion = json.dumps(rows[0]) + "\n" + json.dumps({"prompt": "only a prompt"}) + "\n"
    (bad / "no_completion.jsonl").write_text(no_completion)
    (bad / "broken.yaml").write_text("training:\n  max_steps: [1, 2\n")
    return {"model": model, "data": data, "bad": bad}


def recipe(folder: Path, assets: dict[str, Path], name: str, **overrides: object) -> Path:
    """A 6-step run checkpointing every 2 steps into folder/name/run; `a__b=v` overrides key a.b."""
    body: dict = {
        "output_dir": str(folder / name / "run"),
        "seed": 0,
        "model": {"name_or_path": str(assets["model"])},
        "data": {"train": [{"path": str(assets["data"]), "format": "prompt_completion"}], "max_length": 48},
        "training": {
            "precision": "fp32",
            "gradient_checkpointing": False,
            "micro_batch_size": 4,
            "global_batch_size": 8,
            "max_steps": 6,
            "learning_rate": 1e-3,
            "warmup_steps": 1,
        },
        "logging": {"every_n_steps": 1, "progress_bar": False},
        "checkpoint": {"every_n_steps": 2, "keep_last": 10, "resume": "auto"},
    }
    for dotted, value in overrides.items():
        *parents, last = dotted.split("__")
        node = body
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    path = folder / name / "recipe.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(body))
    return path


# ---------------------------------------------------------------- running and checking


@dataclass
class Launch:
    code: int | None
    err: str


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    # One thread a process: the faults run one after another on shared cores, and the runs are tiny.
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(extra or {})}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(entry: Path, args: list[str], processes: int = 1, config: Path | None = None) -> list[str]:
    """The entry under `accelerate launch` for several processes (or a DeepSpeed config), else plain python."""
    if processes == 1 and config is None:
        return [PYTHON, str(entry), *args]
    accelerate = str(Path(PYTHON).with_name("accelerate"))
    topology = ["--config_file", str(config)] if config else ["--multi_gpu", "--num_machines", "1"]
    return [
        accelerate, "launch", *topology, "--num_processes", str(processes), "--main_process_port", str(free_port()),
        "--mixed_precision", "no", "--dynamo_backend", "no", str(entry), *args,
    ]  # fmt: skip


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> Launch:
    if os.environ.get("LLMTUNE_FAULTS_ECHO"):
        print("$", " ".join(cmd), env, flush=True)  # noqa: T201
    try:
        done = subprocess.run(cmd, env=environment(env), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        return Launch(None, (err.stderr or b"").decode(errors="replace") if isinstance(err.stderr, bytes) else "")
    if os.environ.get("LLMTUNE_FAULTS_ECHO"):
        print(done.stderr[-3000:], flush=True)  # noqa: T201
    return Launch(done.returncode, done.stderr)


def launched_code(launch: Launch) -> int | None:
    """Under `accelerate launch`, the exit status of the worker its report names as the root cause (the first to
    fail: the launcher then stops the others, which may report the SIGTERM it sent them); else the process's own."""
    codes, root = [], None
    for line in launch.err.splitlines():
        key, _, value = line.strip().partition(":")
        if line.startswith("Root Cause"):
            root = len(codes)
        elif key.strip() == "exitcode":
            with contextlib.suppress(ValueError):
                codes.append(int(value.split()[0]))
    if root is not None and root < len(codes):
        return codes[root]
    return codes[0] if codes else launch.code


def own_traceback(err: str) -> bool:
    """A traceback from llmtune's processes; the launcher's own (ChildFailedError: a worker exited non-zero) aside."""
    launcher = err.rfind("ChildFailedError")
    if launcher != -1:
        err = err[: err.rfind("Traceback", 0, launcher)]
    return "Traceback" in err


def first_error(err: str) -> str:
    """What the command said: its `llmtune:` line, else llmtune's first warning or error log line (a signal, an
    out-of-memory stop), else an exception's line; never the launcher's own report of a worker's exit."""
    lines = err.splitlines()
    for line in lines:
        if line.startswith("llmtune: "):
            return line
    for line in lines:
        if (" WARNING llmtune." in line or " ERROR llmtune." in line) and "resume: skipping" not in line:
            return line[line.index("llmtune.") :]
    for line in lines:
        if ("Error:" in line or "error:" in line) and "ChildFailedError" not in line:
            return line.strip()
    return "-"


def hashes(folder: Path) -> dict[str, str]:
    if not folder.is_dir():
        return {}
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def lost(before: dict[str, str], run_dir: Path) -> list[str]:
    """Files there before the fault that are gone or changed; the lock and the metrics log (appended to) aside."""
    after = hashes(run_dir)
    changed = [name for name, digest in before.items() if after.get(name) != digest]
    return [n for n in changed if n not in (".llmtune.lock", "metrics.jsonl")]


def newest_sound(run_dir: Path) -> str:
    """The newest checkpoint whose manifest lists every file at its size (by write serial), or "-"."""
    best: tuple[int, int, str] | None = None
    root = run_dir / "checkpoints"
    for folder in sorted(root.glob("step-*")) if root.is_dir() else []:
        try:
            files = json.loads((folder / "manifest.json").read_text())["files"]
            serial = json.loads((folder / "trainer_state.json").read_text()).get("serial", 0)
        except (OSError, ValueError, KeyError):
            continue
        if all((folder / n).is_file() and (folder / n).stat().st_size == s for n, s in files.items()):
            key = (serial, int(folder.name.split("-")[1]), folder.name)
            best = key if best is None or key > best else best
    return best[2] if best else "-"


def resumed_from(err: str) -> str:
    for line in err.splitlines():
        if "resumed from " in line:
            return Path(line.split("resumed from ")[1].split(" at step")[0]).name
    return "-"


def whole_final(run_dir: Path) -> bool:
    final = run_dir / "final"
    return (final / "config.json").is_file() and any(final.glob("*.safetensors"))


# ---------------------------------------------------------------- the faults


class Suite:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.assets = build_assets(folder / "assets")
        self.entry = folder / "fault_entry.py"
        self.entry.write_text(ENTRY)

    def fault_env(self, name: str, fault: str, run_dir: Path) -> dict[str, str]:
        return {
            "LLMTUNE_FAULT": fault,
            "LLMTUNE_FAULT_RUN": str(run_dir),
            "LLMTUNE_FAULT_BEFORE": str(self.folder / name / "before.json"),
        }

    def before(self, name: str) -> dict[str, str]:
        path = self.folder / name / "before.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def next_run(self, name: str, rec: Path, then: Then) -> tuple[Launch, str]:
        """The next run: the same command with resume: auto, no fault, and `then`'s launch and overrides."""
        expected = newest_sound(self.folder / name / "run")
        args = ["train", "--recipe", str(rec), *then.overrides]
        launch = run(command(self.entry, args, then.processes, then.config), {"LLMTUNE_FAULT": "none:none"})
        return launch, expected

    def train_fault(
        self,
        fault: str,
        phase: str,
        spec: str,
        *,
        want_code: int | None,
        processes: int = 1,
        config: Path | None = None,
        expect: Callable[[Path, Launch], list[str]] | None = None,
        then: Then | None = None,
        **overrides: object,
    ) -> Outcome:
        """Run a training with the fault, check what survived, then run `then` (by default the same command again)
        and check that it resumed the newest sound checkpoint and finished (or was refused as `then` says)."""
        then = then or Then(processes=processes, config=config)
        name = f"{fault}-{phase}".replace(" ", "_").replace(",", "")
        started = time.perf_counter()
        rec = recipe(self.folder, self.assets, name, **overrides)
        run_dir = self.folder / name / "run"
        env = self.fault_env(name, spec, run_dir)
        launch = run(command(self.entry, ["train", "--recipe", str(rec)], processes, config), env)
        code = launched_code(launch)
        notes = [f"lost or changed: {', '.join(gone)}" for gone in [lost(self.before(name), run_dir)] if gone]
        if want_code is not None and code != want_code:
            notes.append(f"exit {code}, expected {want_code}")
        if own_traceback(launch.err):
            notes.append("traceback printed")
        if expect is not None:
            notes += expect(run_dir, launch)
        after, expected = self.next_run(name, rec, then)
        got, finished = resumed_from(after.err), None
        if then.want_code == 0 and not then.named:
            if got != expected:
                notes.append(f"resumed {got}, the newest sound checkpoint is {expected}")
            finished = launched_code(after) == 0 and whole_final(run_dir)
            if not finished:
                notes.append(f"the next run did not finish: {first_error(after.err)}")
        else:
            notes += refused(after, then.want_code, then.named, then.prefix)
            said = "refused" if then.prefix == "error" else then.prefix
            got = f"{said} (exit {launched_code(after)})"
        if then.check is not None:
            notes += then.check(run_dir, after)
        survived = not any(n.startswith("lost") for n in notes)
        return Outcome(
            fault, phase, code, first_error(launch.err), survived, got, expected, finished, not notes, notes,
            round(time.perf_counter() - started, 1), first_error(after.err),
        )  # fmt: skip


@dataclass
class Then:
    """The run after a fault: its launch, its command-line overrides, and what it must do (`want_code` 0 and nothing
    `named`: resume the newest sound checkpoint and finish; else answer in one `llmtune: <prefix>:` line naming
    `named`, exit `want_code`: 2 refused, 0 nothing to do)."""

    processes: int = 1
    config: Path | None = None
    overrides: list[str] = field(default_factory=list)
    want_code: int = 0
    named: list[str] = field(default_factory=list)
    check: Callable[[Path, Launch], list[str]] | None = None
    prefix: str = "error"


def refused(launch: Launch, want_code: int, named: list[str], prefix: str = "error") -> list[str]:
    """A one-line answer: exit `want_code`, one `llmtune: <prefix>:` line (the first process's) naming each of
    `named`."""
    code = launched_code(launch)
    lines = [line for line in launch.err.splitlines() if line.startswith(f"llmtune: {prefix}:")]
    notes = [] if code == want_code else [f"exit {code}, expected {want_code}"]
    if not lines:
        notes.append(f"no `llmtune: {prefix}:` line")
    notes += [f"{n} not named" for n in named if not any(n in line for line in lines[:1])]
    if own_traceback(launch.err):
        notes.append("traceback printed")
    return notes


def no_final_and_checkpoint(step: str | None) -> Callable[[Path, Launch], list[str]]:
    """The faulty run wrote no final/, and its newest sound checkpoint is `step` (None: no checkpoint at all)."""

    def check(run_dir: Path, launch: Launch) -> list[str]:
        notes = []
        if whole_final(run_dir):
            notes.append("final/ written by a stopped run")
        newest = newest_sound(run_dir)
        if newest != (step or "-"):
            notes.append(f"newest sound checkpoint after the fault: {newest}, expected {step or 'none'}")
        return notes

    return check


# The run after one that finished (final/ whole, no checkpoint to resume): the same command is refused.
# The same command on a finished run: said, and nothing rewritten (exit 0).
finished_run = Then(want_code=0, named=["holds a complete run"], prefix="nothing to do")


def stopped_at_4_unlocked(run_dir: Path, launch: Launch) -> list[str]:
    """`no_final_and_checkpoint("step-000004")`, and the lock released: a lock left on another node's host would
    refuse the requeued run."""
    left = ["the lock was left behind"] if (run_dir / ".llmtune.lock").exists() else []
    return no_final_and_checkpoint("step-000004")(run_dir, launch) + left


def final_whole(run_dir: Path, launch: Launch) -> list[str]:
    return [] if whole_final(run_dir) else ["final/ missing or not whole after the fault"]


Row = tuple[str, Callable[[], Outcome]]  # "fault phase" and the thunk that runs it


def training_faults(s: Suite) -> list[Row]:
    f = s.train_fault
    two = "mid-step, 2 processes"
    rows: list[Row] = []
    for action, code in (("sigkill", -signal.SIGKILL), ("sigterm", -signal.SIGTERM)):
        for phase in ("tokenising", "planning"):
            rows.append((f"{action} {phase}", lambda a=action, p=phase, c=code: f(a, p, f"{p}:{a}", want_code=c)))
    rows += [
        ("sigkill mid-step", lambda: f("sigkill", "mid-step", "mid-step:sigkill:4", want_code=-signal.SIGKILL,
                                       expect=no_final_and_checkpoint("step-000002"))),
        ("sigterm mid-step", lambda: f("sigterm", "mid-step", "mid-step:sigterm:4", want_code=75,
                                       expect=no_final_and_checkpoint("step-000004"))),
        ("sigkill mid-save", lambda: f("sigkill", "mid-save", "mid-save:sigkill:2", want_code=-signal.SIGKILL,
                                       expect=no_final_and_checkpoint("step-000002"))),
        # The first checkpoint, slower than the grace: the save must finish, then the run stops with it.
        ("sigterm mid-save", lambda: f("sigterm", "mid-save", "mid-save:slow-sigterm:1", want_code=75,
                                       expect=no_final_and_checkpoint("step-000002"))),
        ("sigkill final save", lambda: f("sigkill", "final save", "final-save:sigkill", want_code=-signal.SIGKILL,
                                         expect=no_final_and_checkpoint("step-000006"))),
        # No checkpoint asked for: the final save is all the run has.
        ("sigterm final save", lambda: f("sigterm", "final save", "final-save:slow-sigterm", want_code=0,
                                         expect=final_whole, then=finished_run, checkpoint__every_n_steps=0)),
        ("disk full mid-save", lambda: f("disk full", "mid-save", "mid-save:enospc:2", want_code=1,
                                         expect=no_final_and_checkpoint("step-000002"))),
        ("disk full final save", lambda: f("disk full", "final save", "final-save:enospc", want_code=1,
                                           expect=no_final_and_checkpoint("step-000006"))),
        (f"sigterm {two}", lambda: f("sigterm", two, "mid-step:sigterm:4", want_code=75, processes=2,
                                     expect=stopped_at_4_unlocked)),
        (f"sigterm {two}, slow exit", lambda: f("sigterm", f"{two}, process 0 slow to exit",
                                                "mid-step:sigterm-slow-exit:4", want_code=75, processes=2,
                                                expect=stopped_at_4_unlocked)),
    ]  # fmt: skip
    return rows


ZERO2 = ROOT / "recipes" / "accelerate" / "deepspeed_zero2.yaml"


def summary_says(**want: object) -> Callable[[Path, Launch], list[str]]:
    """run_summary.json of the next run holds these values."""

    def check(run_dir: Path, launch: Launch) -> list[str]:
        try:
            summary = json.loads((run_dir / "run_summary.json").read_text())
        except (OSError, ValueError):
            return ["no run_summary.json"]
        return [f"{k}: {summary.get(k)!r}, expected {v!r}" for k, v in want.items() if summary.get(k) != v]

    return check


def resume_faults(s: Suite) -> list[Row]:
    """A run stopped at step 4 (SIGTERM: checkpoint step-4, exit 75), resumed by another launch or recipe."""
    f, stop = s.train_fault, "mid-step:sigterm:4"
    keep = no_final_and_checkpoint("step-000004")
    ddp = Then(processes=2, check=summary_says(num_processes=2, micro_batch_size=4, grad_accum_steps=1))
    zero = Then(processes=2, config=ZERO2, want_code=2, named=["1 process", "2 processes"])
    micro = Then(overrides=["training.micro_batch_size=2"], check=summary_says(micro_batch_size=2, grad_accum_steps=4))
    seed = Then(overrides=["seed=1"], want_code=2, named=["seed"], check=advice_works(["seed=1"]))
    return [
        ("resume another world size ddp", lambda: f("resume", "another world size: DDP 1 -> 2 processes", stop,
                                                    want_code=75, expect=keep, then=ddp)),
        ("resume another world size zero2", lambda: f("resume", "another world size: ZeRO-2 1 -> 2 processes", stop,
                                                      want_code=75, config=ZERO2, expect=keep, then=zero)),
        ("resume another recipe micro", lambda: f("resume", "another recipe: micro-batch 4 -> 2", stop, want_code=75,
                                                  expect=keep, then=micro)),
        ("resume another recipe seed", lambda: f("resume", "another recipe: seed 0 -> 1", stop, want_code=75,
                                                 expect=keep, then=seed)),
    ]  # fmt: skip


def advice_works(overrides: list[str]) -> Callable[[Path, Launch], list[str]]:
    """The refusal's way out, run: the command it names, with `overrides`, must finish."""

    def check(run_dir: Path, launch: Launch) -> list[str]:
        line = first_error(launch.err)
        if "start over in this one: " not in line:
            return ["the refusal names no command to start over"]
        advice = line.split("start over in this one: ")[1].split(" (")[0].split()
        entry = run_dir.parents[1] / "fault_entry.py"
        args = ["train", "--recipe", str(run_dir.parent / "recipe.yaml"), *overrides, *advice]
        done = run(command(entry, args), {"LLMTUNE_FAULT": "none:none"})
        return [] if done.code == 0 else [f"the advised {' '.join(advice)} failed: {first_error(done.err)}"]

    return check


def two_launches(s: Suite) -> Outcome:
    """A run that is still going on (it waits after its checkpoint of step 2), and the same command launched again."""
    started = time.perf_counter()
    name = "two-launches"
    rec = recipe(s.folder, s.assets, name)
    run_dir = s.folder / name / "run"
    env = s.fault_env(name, "after-save:sleep:1", run_dir)
    ready = Path(env["LLMTUNE_FAULT_BEFORE"] + ".ready")
    first = subprocess.Popen(command(s.entry, ["train", "--recipe", str(rec)]), env=environment(env),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not ready.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        second = run(command(s.entry, ["train", "--recipe", str(rec)]), {"LLMTUNE_FAULT": "none:none"})
        notes = refused(second, 2, [f"pid {first.pid}"])
        if first.poll() is not None:
            notes.append(f"the first run ended ({first.returncode}) while the second was refused")
    finally:
        first.kill()  # the first run is then lost mid-run (SIGKILL): its lock stays, its checkpoint must resume
        first.wait()
    notes += [f"lost or changed: {', '.join(gone)}" for gone in [lost(s.before(name), run_dir)] if gone]
    after, expected = s.next_run(name, rec, Then())
    got = resumed_from(after.err)
    if got != expected:
        notes.append(f"resumed {got}, the newest sound checkpoint is {expected}")
    finished = launched_code(after) == 0 and whole_final(run_dir)
    if not finished:
        notes.append(f"the next run did not finish: {first_error(after.err)}")
    return Outcome("two launches", "one folder, the first still running", launched_code(second),
                   first_error(second.err), not any(n.startswith("lost") for n in notes), got, expected, finished,
                   not notes, notes, round(time.perf_counter() - started, 1))  # fmt: skip


def partly_copied(s: Suite) -> Outcome:
    """A finished run whose newest checkpoint lost the end of a file (a copy cut short), continued to 8 steps."""
    started = time.perf_counter()
    name = "partly-copied"
    rec = recipe(s.folder, s.assets, name)
    run_dir = s.folder / name / "run"
    first = run(command(s.entry, ["train", "--recipe", str(rec)]), {"LLMTUNE_FAULT": "none:none"})
    cut = run_dir / "checkpoints" / "step-000006" / "optimizer.bin"
    before = {
        k: v for k, v in hashes(run_dir).items() if k.startswith(("checkpoints/step-000002", "checkpoints/step-000004"))
    }
    notes = [] if first.code == 0 and cut.is_file() else [f"the run to copy failed: {first_error(first.err)}"]
    if cut.is_file():
        with cut.open("r+b") as f:
            f.truncate(cut.stat().st_size // 2)
    after, expected = s.next_run(name, rec, Then(overrides=["training.max_steps=8"]))
    got = resumed_from(after.err)
    if got != expected or expected != "step-000004":
        notes.append(f"resumed {got}, the newest sound checkpoint is {expected}")
    notes += [f"lost or changed: {', '.join(gone)}" for gone in [lost(before, run_dir)] if gone]
    finished = after.code == 0 and whole_final(run_dir)
    if not finished:
        notes.append(f"the next run did not finish: {first_error(after.err)}")
    skipped = [line for line in after.err.splitlines() if "resume: skipping" in line]
    message = skipped[0][skipped[0].index("resume: ") :] if skipped else "-"
    survived = not any(n.startswith("lost") for n in notes)
    return Outcome("partly copied checkpoint", "resume", after.code, message, survived, got, expected, finished,
                   not notes, notes, round(time.perf_counter() - started, 1))  # fmt: skip


def final_replaced(s: Suite) -> Outcome:
    """A finished run continued to 8 steps, SIGKILLed at the first rename that puts its new final/ in place of the
    old one: final/ must name a whole model at that instant (the old one or the new one)."""
    started = time.perf_counter()
    name = "sigkill-replacing-final"
    rec = recipe(s.folder, s.assets, name)
    run_dir = s.folder / name / "run"
    first = run(command(s.entry, ["train", "--recipe", str(rec)]), {"LLMTUNE_FAULT": "none:none"})
    notes = [] if first.code == 0 else [f"the first run failed: {first_error(first.err)}"]
    env = s.fault_env(name, "publish-final:sigkill", run_dir)
    launch = run(command(s.entry, ["train", "--recipe", str(rec), "training.max_steps=8"]), env)
    if launch.code != -signal.SIGKILL:
        notes.append(f"exit {launch.code}, expected {-signal.SIGKILL}")
    if not whole_final(run_dir):
        notes.append("no whole final/ after the kill (lost: the old one is aside, the new one in a temporary)")
    after, expected = s.next_run(name, rec, Then(overrides=["training.max_steps=8"]))
    got = resumed_from(after.err)
    if got != expected:
        notes.append(f"resumed {got}, the newest sound checkpoint is {expected}")
    finished = after.code == 0 and whole_final(run_dir)
    if not finished:
        notes.append(f"the next run did not finish: {first_error(after.err)}")
    survived = not any(n.startswith("no whole") for n in notes)
    return Outcome("sigkill", "final save, replacing an older final/", launch.code, first_error(launch.err), survived,
                   got, expected, finished, not notes, notes, round(time.perf_counter() - started, 1))  # fmt: skip


def merge_faults(s: Suite) -> list[Row]:
    return [(f"{action} merge", lambda a=action, c=code: merge_fault(s, a, c))
            for action, code in (("sigkill", -signal.SIGKILL), ("sigterm", -signal.SIGTERM))]  # fmt: skip


def merge_fault(s: Suite, action: str, want_code: int) -> Outcome:
    """`llmtune merge` of a finished LoRA run, stopped while it writes: the run stays whole, no half merged/ appears,
    and the same merge then succeeds."""
    started = time.perf_counter()
    name = f"{action}-merge"
    rec = recipe(s.folder, s.assets, name, peft__method="lora", peft__rank=4, training__max_steps=2,
                 checkpoint__every_n_steps=0)  # fmt: skip
    run_dir = s.folder / name / "run"
    trained = run(command(s.entry, ["train", "--recipe", str(rec)]), {"LLMTUNE_FAULT": "none:none"})
    notes = [] if trained.code == 0 else [f"the LoRA run failed: {first_error(trained.err)}"]
    launch = run(command(s.entry, ["merge", "--run", str(run_dir)]), s.fault_env(name, f"merge:{action}", run_dir))
    if launch.code != want_code:
        notes.append(f"exit {launch.code}, expected {want_code}")
    notes += [f"lost or changed: {', '.join(gone)}" for gone in [lost(s.before(name), run_dir)] if gone]
    if (run_dir / "merged").exists():
        notes.append("a merged/ folder after the stopped merge")
    again = run(command(s.entry, ["merge", "--run", str(run_dir)]), {"LLMTUNE_FAULT": "none:none"})
    finished = again.code == 0 and (run_dir / "merged" / "config.json").is_file()
    if not finished:
        notes.append(f"the next merge failed: {first_error(again.err)}")
    return Outcome(action, "merge", launch.code, first_error(launch.err), not any(n.startswith("lost") for n in notes),
                   "n/a", "n/a", finished, not notes, notes, round(time.perf_counter() - started, 1))  # fmt: skip


def bad_inputs(s: Suite) -> list[Row]:
    """Each must exit 2 with one line naming the file, row or key, and print no traceback."""
    bad = s.assets["bad"]
    cases = [
        ("unknown key", [], ["training.learning_rat=1e-3"], "training.learning_rat"),
        ("broken YAML", [str(bad / "broken.yaml")], [], "broken.yaml"),
        ("missing data file", [], [f"data.train=[{{path: {bad / 'nowhere.jsonl'}}}]"], "nowhere.jsonl"),
        ("non-UTF-8 row", [], [f"data.train=[{{path: {bad / 'not_utf8.jsonl'}}}]"], "not_utf8.jsonl"),
        ("row without its column", [], [f"data.train=[{{path: {bad / 'no_completion.jsonl'}}}]"], "no_completion"),
        ("missing model", [], [f"model.name_or_path={bad / 'no-model'}"], "no-model"),
        ("wrong type", [], ["training.max_steps=many"], "training.max_steps"),
    ]
    return [(f"bad input {c[0]}", lambda c=c: bad_input(s, *c)) for c in cases]


def bad_input(s: Suite, what: str, recipe_file: list[str], overrides: list[str], named: str) -> Outcome:
    started = time.perf_counter()
    name = "bad-" + what.replace(" ", "_")
    rec = Path(recipe_file[0]) if recipe_file else recipe(s.folder, s.assets, name)
    launch = run(command(s.entry, ["train", "--recipe", str(rec), *overrides]), {"LLMTUNE_FAULT": "none:none"})
    lines = [line for line in launch.err.splitlines() if line.startswith("llmtune: error:")]
    notes = [] if launch.code == 2 else [f"exit {launch.code}, expected 2"]
    if len(lines) != 1:
        notes.append(f"{len(lines)} error lines")
    if "Traceback" in launch.err:
        notes.append("traceback printed")
    if not any(named in line for line in lines):
        notes.append(f"{named} not named")
    if (s.folder / name / "run").exists():
        notes.append("the refused run left its folder behind")
    message = lines[0] if lines else first_error(launch.err)
    return Outcome("bad input", what, launch.code, message, True, "n/a", "n/a", None, not notes, notes,
                   round(time.perf_counter() - started, 1))  # fmt: skip


# Rows that launch 2 processes run alone: they take both cores, and each picks a free port.
ALONE = ("2 processes", "world size")


def all_faults(s: Suite, only: str | None, jobs: int) -> list[Outcome]:
    """Every row (those whose label contains `only`), `jobs` one-process rows at a time, then the others one by one;
    reported in the order listed."""
    rows = [*training_faults(s), ("two launches", lambda: two_launches(s))]
    rows += [("partly copied checkpoint", lambda: partly_copied(s)), ("replacing final", lambda: final_replaced(s))]
    rows += [*resume_faults(s), *merge_faults(s)]
    rows += bad_inputs(s)
    rows = [(label, thunk) for label, thunk in rows if only is None or only in label]
    alone = [any(a in label for a in ALONE) for label, _ in rows]
    with ThreadPoolExecutor(jobs) as pool:
        together = {i: pool.submit(thunk) for i, (_, thunk) in enumerate(rows) if not alone[i]}
        done = {i: future.result() for i, future in together.items()}
    done |= {i: thunk() for i, (_, thunk) in enumerate(rows) if alone[i]}
    return [done[i] for i in range(len(rows))]


# ---------------------------------------------------------------- report


def table(rows: list[Outcome]) -> str:
    head = ("fault", "phase", "exit", "first error line", "survived", "resumed-from", "ok")
    body = [
        (r.fault, r.phase, str(r.exit_code), r.message[:90], "yes" if r.survived else "NO", r.resumed_from[:60],
         "yes" if r.ok else "NO: " + "; ".join(r.notes)[:120])
        for r in rows
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="run the faults whose name or phase contains this")
    parser.add_argument("--jobs", type=int, default=2, help="one-process faults run this many at a time")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    parser.add_argument("--out", default=None, help="JSON output (default: benchmarks/results/faults-<date>.json)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="llmtune-faults-"))
    started = time.perf_counter()
    try:
        rows = all_faults(Suite(folder), args.only, args.jobs)
    finally:
        if args.keep:
            print(f"kept {folder}")  # noqa: T201
        else:
            shutil.rmtree(folder, ignore_errors=True)
    print(table(rows))  # noqa: T201
    for r in rows:  # the next run's refusals, whole: their way out is part of what they must get right
        if r.resumed_from.startswith("refused"):
            print(f"  {r.fault}, {r.phase}: the next run said: {r.next_message}")  # noqa: T201
    seconds = time.perf_counter() - started
    print(f"{sum(r.ok for r in rows)} of {len(rows)} rows hold their invariants ({seconds:.0f} s)")  # noqa: T201
    today = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else RESULTS / f"faults-{today}.json"
    record = {
        "date": today,
        "host": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()},
        "seconds": round(seconds, 1),
        "rows": [asdict(r) for r in rows],
    }
    if args.only is None or args.out:
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}")  # noqa: T201


if __name__ == "__main__":
    main()
