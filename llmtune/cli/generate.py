"""Talk to a trained run: load its `final/` (a full model, or an adapter on its base, unmerged) and generate.

The prompt is given to the model the way the run trained on it, as `final/prompt_layout.json` records: a run
trained on `messages` is prompted with the tokenizer's chat template; one trained on Alpaca rows with the
Alpaca template around the message; one trained on other `prompt_completion` or `text` rows with the plain
prompt ids that `data.render_prompt` gives at training time (a chat template would be a format the model never
saw). A run saved before the layout was recorded falls back to its recipe.yaml (chat or plain), a folder with
neither to the chat template when the tokenizer has one.
`scripts/eval_accuracy.py` scores answers with `answer`, so `llmtune generate` answers exactly as it is scored.
A reply ends at any of `stop_ids`: the model's own list (generation_config), not only the tokenizer's eos.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from llmtune.cli.args import positive_int
from llmtune.data import alpaca_prompt, render_prompt
from llmtune.data.chat import chat_ids
from llmtune.errors import UserError
from llmtune.model.decode import pad_id, stop_ids, until_stop
from llmtune.model.merge import ADAPTER_CONFIG, WEIGHT_FILES
from llmtune.run.checkpoint import PROMPT_LAYOUT_FILE


class GenerateError(UserError, ValueError):
    """The folder given is not a trained run (or final/) that can be loaded; the message says why."""


@dataclass(frozen=True)
class Sampling:
    """Greedy by default (temperature 0): the same prompt always gives the same answer."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise GenerateError(f"--temperature {self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise GenerateError(f"--top-p {self.top_p}: must be in (0, 1]")

    def generate_kwargs(self) -> dict[str, Any]:
        if self.temperature <= 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p}


@dataclass
class LoadedRun:
    model: Any  # a transformers model, or a peft model (adapter on its base, unmerged)
    tokenizer: Any
    chat: bool  # prompt with the chat template (else plain prompt ids)
    folder: Path
    alpaca: bool = False  # plain prompts inside the Alpaca template (the run trained on Alpaca rows)


def load_run(run: str | Path, *, chat: bool | None = None, trust_remote_code: bool = False) -> LoadedRun:
    """The model and tokenizer of a run's output_dir (its `final/`) or of a `final/` folder itself.

    `chat`: force the prompt format; None takes the one the run trained on (see the module's docstring).
    `trust_remote_code`: the caller's (--trust-remote-code), never the run folder's recipe.yaml.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = final_folder(Path(run))
    if (folder / ADAPTER_CONFIG).is_file():
        from llmtune.model.merge import MergeError, load_adapter_model  # torch-heavy: only for adapters

        try:
            model, tokenizer = load_adapter_model(folder, trust_remote_code=trust_remote_code)
        except MergeError as err:
            raise GenerateError(str(err)) from None
    elif not any((folder / w).is_file() for w in WEIGHT_FILES):
        raise GenerateError(f"{folder}: a config without weights ({WEIGHT_FILES[0]}); is it a trained run's final/?")
    else:
        from llmtune.model.merge import remote_code_refusal

        try:
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto", trust_remote_code=trust_remote_code)
            tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as err:
            first_line = str(err).strip().splitlines()[0]
            raise GenerateError(
                remote_code_refusal(folder, err) or f"{folder}: cannot load the model: {first_line}"
            ) from None
    model = on_accelerator(model)
    model.eval()
    # Training saves use_cache=False (a cache is useless there); generation wants it back.
    model.config.use_cache = True
    layout = _recorded_layout(folder)
    if chat is None:
        chat = layout == "chat" if layout else _trained_on_chats(folder)
        chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if chat and not getattr(tokenizer, "chat_template", None):
        raise GenerateError(f"{folder}: the tokenizer has no chat template; prompt it with plain text instead")
    return LoadedRun(model, tokenizer, chat, folder, alpaca=not chat and layout == "alpaca")


def on_accelerator(model: Any) -> Any:
    """The model on the GPU when there is one (from_pretrained leaves it on the CPU), else as it is."""
    return model.to("cuda") if torch.cuda.is_available() else model


def final_folder(path: Path) -> Path:
    """`path/final` for a run's output_dir, or `path` when it is a saved model or adapter itself."""
    if not path.is_dir():
        raise GenerateError(f"{path}: no such directory (pass a run's output_dir or its final/)")
    for folder in (path / "final", path):
        if (folder / ADAPTER_CONFIG).is_file() or (folder / "config.json").is_file():
            return folder
    if (path / "recipe.yaml").is_file():
        raise GenerateError(f"{path}: the run has no final/ (it did not finish)")
    raise GenerateError(f"{path}: not a run's output_dir nor a saved model (no final/, config.json or adapter)")


def _recorded_layout(folder: Path) -> str | None:
    """The prompt layout the run recorded in final/ (chat, alpaca or plain), or None in a folder without it."""
    path = folder / PROMPT_LAYOUT_FILE
    return json.loads(path.read_text())["layout"] if path.is_file() else None


def _trained_on_chats(folder: Path) -> bool | None:
    """True/False when the run's recipe.yaml (beside final/) says its data were chats or not; None without it."""
    path = folder.parent / "recipe.yaml"
    if not path.is_file():
        return None
    try:
        sources = (yaml.safe_load(path.read_text()) or {}).get("data", {}).get("train", [])
        return all(src.get("format") == "messages" for src in sources) if sources else None
    except (yaml.YAMLError, AttributeError):
        return None


def prompt_ids(run: LoadedRun, messages: list[dict[str, str]]) -> list[int]:
    """The ids the model is given: the chat rendered for a reply, or (plain) the last user message alone, inside the
    Alpaca template for a run trained on Alpaca rows."""
    if run.chat:
        return chat_ids(run.tokenizer, messages, add_generation_prompt=True)
    text = messages[-1]["content"]
    return render_prompt(alpaca_prompt(text, "") if run.alpaca else text, run.tokenizer)


def answer(
    model: Any, tokenizer: Any, ids: list[int], sampling: Sampling, streamer: Any = None, *, chat: bool = False
) -> str:
    """Generate after `ids` and return the new text up to the first stop id (special tokens dropped, surrounding
    spaces kept). `chat`: `ids` were rendered with the chat template, so its end-of-turn token ends the reply."""
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    stop = stop_ids(model, tokenizer, chat)
    device = next(model.parameters()).device
    inputs = torch.tensor([ids], device=device)
    with torch.no_grad():
        out = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=pad_id(tokenizer, stop),
            eos_token_id=stop or None,
            streamer=streamer,
            **sampling.generate_kwargs(),
        )
    # A stop id need not be a special token (decoding would keep it), so the text ends before it.
    return tokenizer.decode(until_stop(out[0, len(ids) :].tolist(), stop), skip_special_tokens=True)


def batch_answers(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    max_new_tokens: list[int],
    sampling: Sampling | None = None,
    batch_size: int = 64,
    *,
    chat: bool = False,
) -> list[str]:
    """`answer` for many prompts, batched: greedy (the default), what `answer` returns for each, many times faster.

    Only prompts of the same length share a batch, so no row is padded and each is decoded as it would be
    alone (padding would shift positions and need a mask the single-prompt path never uses). Each row keeps
    its own `max_new_tokens` and ends at its first stop id (`stop_ids`), as `answer` does. With a temperature,
    rows are sampled (reproducibly with `sampling.seed`, though not as `answer` would sample them one by one).
    """
    sampling = sampling or Sampling()
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    order: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        order.setdefault(len(ids), []).append(i)
    stop = stop_ids(model, tokenizer, chat)
    pad = pad_id(tokenizer, stop)
    device = next(model.parameters()).device
    out: list[str] = [""] * len(prompts)
    for length, indices in order.items():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            inputs = torch.tensor([prompts[i] for i in chunk], device=device)
            with torch.no_grad():
                generated = model.generate(
                    inputs,
                    attention_mask=torch.ones_like(inputs),
                    max_new_tokens=max(max_new_tokens[i] for i in chunk),
                    pad_token_id=pad,
                    eos_token_id=stop or None,
                    **sampling.generate_kwargs(),
                )
            for row, i in zip(generated[:, length:].tolist(), chunk, strict=True):
                # Rows that finished early are padded after their stop id; the cut keeps the answer right with a
                # pad token or a stop id that is not a special token (decoding would keep those).
                out[i] = tokenizer.decode(until_stop(row[: max_new_tokens[i]], stop), skip_special_tokens=True)
    return out


def reply(run: LoadedRun, messages: list[dict[str, str]], sampling: Sampling, streamer: Any = None) -> str:
    return answer(run.model, run.tokenizer, prompt_ids(run, messages), sampling, streamer, chat=run.chat)


def describe(run: LoadedRun) -> str:
    kind = "adapter on its base (unmerged)" if (run.folder / ADAPTER_CONFIG).is_file() else "model"
    if run.chat:
        fmt = "the tokenizer's chat template"
    else:
        fmt = f"{'Alpaca-templated' if run.alpaca else 'plain'} prompts, as the run trained"
    return f"{run.folder}: {kind}; prompting with {fmt}"


def _sampling(args: argparse.Namespace):
    from llmtune.cli.generate import Sampling

    return Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> int:
    sampling = _sampling(args)  # flags first: a bad one costs no model load
    run = load_run(args.run, trust_remote_code=args.trust_remote_code)
    messages = [*system_turn(run, args.system), {"role": "user", "content": args.prompt}]
    print(reply(run, messages, sampling).strip())
    return 0


def system_turn(run: LoadedRun, system: str | None) -> list[dict[str, str]]:
    """The conversation's opening system turn, where one is given; refused for a run trained on plain prompts, which
    have no turns to put it in (it would be silently dropped)."""
    if not system:
        return []
    if not run.chat:
        raise GenerateError(
            f"--system: {run.folder} was trained on plain prompts, not chats (no chat template renders its prompts):"
            " put the instruction in the prompt instead"
        )
    return [{"role": "system", "content": system}]


def cmd_chat(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    sampling = _sampling(args)
    run = load_run(args.run, trust_remote_code=args.trust_remote_code)
    print(
        f"{describe(run)}. Empty line or Ctrl-D to quit; /reset forgets the conversation; /system TEXT sets the system"
        " prompt (and starts over).",
        file=sys.stderr,
    )
    streamer = TextStreamer(run.tokenizer, skip_prompt=True, skip_special_tokens=True)
    system = system_turn(run, args.system)
    messages: list[dict[str, str]] = list(system)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        if line == "/reset" or line.startswith("/system"):
            try:
                system = system_turn(run, line.removeprefix("/system").strip()) if line != "/reset" else system
            except GenerateError as err:
                print(f"llmtune: {err}", file=sys.stderr)
            messages = list(system)
            continue
        messages.append({"role": "user", "content": line})
        # The streamer prints the reply as it is generated; the full text is kept for the next turn.
        messages.append({"role": "assistant", "content": reply(run, messages, sampling, streamer).strip()})
    return 0


def sampling_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--run", required=True, help="a run's output_dir (uses final/), or a final/ folder")
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature > 0)")
    p.add_argument("--seed", type=int, help="seed for sampling (reproducible samples)")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a model that ships its own Python code run it (never taken from the run's recipe.yaml)",
    )
    p.add_argument("--system", help="a system prompt opening the conversation (runs trained on chats)")


def add_generate_parsers(sub: argparse._SubParsersAction) -> None:
    """Register `llmtune generate` and `llmtune chat`."""
    p = sub.add_parser("generate", help="answer one prompt with a trained run (greedy unless --temperature)")
    sampling_args(p, max_new_tokens=64)
    p.add_argument("--prompt", required=True, help="the prompt (as the run's data rendered prompts)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with a trained run in the terminal (streams replies)")
    sampling_args(p, max_new_tokens=256)
    p.set_defaults(func=cmd_chat)
