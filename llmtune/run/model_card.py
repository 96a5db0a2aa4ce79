"""`final/README.md`: the model card of a run's final model, from what the run knows (its recipe, plan, steps and eval
loss), where PEFT's `save_pretrained` leaves its template ("[More Information Needed]" under every heading) and a full
model's none.

The front matter is the Hugging Face Hub's model-card metadata (`base_model`, `library_name`, `tags`, `datasets`), so
the folder uploads as it is. The Hub takes only its own ids there: a base model or data on this disk is named in the
text alone."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from llmtune.data.load import on_hub
from llmtune.model.merge import BASE_DIR
from llmtune.recipe import PeftConfig, Recipe, dump_recipe
from llmtune.run.state import Run

METHODS = {"lora": "LoRA", "dora": "DoRA (weight-decomposed LoRA)", "qlora": "QLoRA"}
OBJECTIVES = {
    "sft": "supervised fine-tuning (sft)",
    "dpo": "preference pairs, DPO",
    "orpo": "preference pairs, ORPO",
    "simpo": "preference pairs, SimPO",
    "grpo": "online RL, GRPO",
}
PRECISIONS = {
    "bf16": "bf16 mixed precision (fp32 weights)",
    "fp16": "fp16 mixed precision (fp32 weights, loss scaling)",
    "bf16-true": "bf16 weights, updates by stochastic rounding",
    "fp32": "fp32",
}
# How prompts reached the model in training (`final/prompt_layout.json`): a prompt given another way is another task.
PROMPTS = {
    "chat": "the tokenizer's chat template (`tokenizer.apply_chat_template(messages, add_generation_prompt=True)`)",
    "alpaca": "Stanford Alpaca's prompt template around the instruction (`llmtune generate` applies it)",
    "plain": "the prompt's own text, no template",
}


def model_card(run: Run, step: int, eval_loss: float | None) -> str:
    """The card of the run's `final/`, after `step` optimizer steps; `eval_loss`: the last evaluation's, if any."""
    r = run.recipe
    final = Path(r.output_dir).expanduser().resolve() / "final"
    rows = "\n".join(f"| {name} | {value} |" for name, value in training_rows(run, step, eval_loss))
    return "\n".join(
        [
            front_matter(r),
            f"# {final.parent.name}\n",
            f"{_what(r)}, made by llmtune in {_count(step, 'optimizer step')}.\n",
            "## Training\n",
            "| | |\n|---|---|",
            rows,
            "",
            how_to_load(r, final),
            "## Recipe\n",
            f"The recipe the run trained with, resolved (also `recipe.yaml` in the run's folder, `{final.parent}`):\n",
            "<details>\n<summary>recipe.yaml</summary>\n",
            f"```yaml\n{dump_recipe(r).rstrip()}\n```\n",
            "</details>\n",
        ]
    )


def front_matter(r: Recipe) -> str:
    """The Hub's metadata block: `base_model` only for a hub id the run started from (not random weights)."""
    adapter = r.peft.method != "none"
    meta: dict = {}
    if not r.model.random_init and _on_hub(r.model.name_or_path):
        meta["base_model"] = r.model.name_or_path
    meta["library_name"] = "peft" if adapter else "transformers"
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = ["llmtune", r.training.objective, *([r.peft.method] if adapter else [])]
    datasets = [s.path for s in r.data.train if on_hub(s.path)]
    if datasets:
        meta["datasets"] = datasets
    return f"---\n{yaml.safe_dump(meta, sort_keys=False)}---\n"


def _on_hub(model: str) -> bool:
    """Whether the run loaded `model` from the hub: a name that is no folder here (llmtune.model.load)."""
    return not Path(model).expanduser().exists()


def _local_or_hub(name: str, hub: bool) -> str:
    """A hub id as it is, a local path made absolute: the card is read from elsewhere than the run's folder."""
    return name if hub else str(Path(name).expanduser().resolve())


def _base(r: Recipe) -> str:
    """The base model as `from_pretrained` takes it."""
    return _local_or_hub(r.model.name_or_path, _on_hub(r.model.name_or_path))


def _base_words(r: Recipe) -> str:
    """The base model in words: random weights under `random_init` (the name gives only the architecture)."""
    base = f"`{_base(r)}`" + (f" (revision `{r.model.revision}`)" if r.model.revision else "")
    return f"random weights with the architecture of {base}" if r.model.random_init else base


def _what(r: Recipe) -> str:
    """What `final/` holds, in one phrase."""
    base = _base_words(r)
    if r.peft.method == "none":
        return f"A model trained from {base}" if r.model.random_init else f"A full fine-tune of {base}"
    return f"A {METHODS[r.peft.method]} adapter on {base}" + (
        f" (saved in `{BASE_DIR}/`)" if r.model.random_init else ""
    )


def training_rows(run: Run, step: int, eval_loss: float | None) -> list[tuple[str, str]]:
    """The training table's rows: (what, value)."""
    r, t, p = run.recipe, run.recipe.training, run.plan
    several = len(r.data.train) > 1
    sources = ", ".join(
        f"`{_local_or_hub(s.path, on_hub(s.path))}` ({s.format}"
        + (f", split {s.split}" if on_hub(s.path) else "")
        + (f", weight {s.weight:g}" if several else "")
        + ")"
        for s in r.data.train
    )
    schedule = f"{t.lr_schedule} after {_count(t.warmup_steps, 'warmup step')}"
    rows = [
        ("base model", _base_words(r)),
        ("method", _method(r.peft)),
        ("objective", _objective(r)),
        ("data", f"{sources}: {run.data.stats.examples} examples, {run.data.stats.trained_tokens} trained tokens"),
        ("prompts", PROMPTS.get(run.data.prompt_layout, run.data.prompt_layout)),
        ("sequence length", f"{r.data.max_length} tokens" + (", packed" if run.data.packed else "")),
        ("steps", f"{_count(step, 'optimizer step')}, {run.counters['trained_tokens']} trained tokens"),
        (
            "global batch",
            f"{t.global_batch_size} examples (micro-batch {p.micro_batch_size} x accumulation {p.grad_accum_steps}"
            f" x {_count(p.num_processes // p.sequence_parallel, 'process')})",
        ),
        ("learning rate", f"{t.learning_rate:g} peak, {schedule}, {t.optimizer} (weight decay {t.weight_decay:g})"),
        ("precision", PRECISIONS.get(run.precision, run.precision)),
        ("seed", str(r.seed)),
    ]
    if eval_loss is not None:
        rows.append(("eval loss", f"{eval_loss:.4f} (perplexity {math.exp(eval_loss):.2f}) at step {step}"))
    return rows


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "es" if noun.endswith("s") else "s")


def _method(peft: PeftConfig) -> str:
    if peft.method == "none":
        return "full fine-tune: every weight trained"
    targets = "every linear layer of the decoder" if peft.target_modules == "all-linear" else peft.target_modules
    words = f"{METHODS[peft.method]}: rank {peft.rank}, alpha {peft.alpha:g}, dropout {peft.dropout:g}, on " + (
        targets if isinstance(targets, str) else ", ".join(f"`{m}`" for m in targets)
    )
    if peft.modules_to_save:
        words += ", trained whole: " + ", ".join(f"`{m}`" for m in peft.modules_to_save)
    if peft.method == "qlora":
        words += "; the base quantised to 4-bit NF4 (bitsandbytes, double quantisation)"
    return words


def _objective(r: Recipe) -> str:
    words = OBJECTIVES[r.training.objective]
    if r.training.objective == "sft":
        return words + (", loss on the completions" if r.data.train_on == "completion" else ", loss on every token")
    if r.training.objective == "grpo":
        return words + ", rewards " + ", ".join(f"`{w.function}` x {w.weight:g}" for w in r.grpo.rewards)
    return words


def _literal(text: str) -> str:
    """`text` as a Python string literal in double quotes (a JSON string is one)."""
    return json.dumps(text)


def how_to_load(r: Recipe, final: Path) -> str:
    """The "How to load" section: transformers alone for a full model, with peft for an adapter."""
    remote = ", trust_remote_code=True" if r.model.trust_remote_code else ""
    generate = f"`llmtune generate --run {final.parent} --prompt ...` prompts it the way it trained.\n"
    lines = ["## How to load\n", "```python"]
    if r.peft.method == "none":
        lines += ["from transformers import AutoModelForCausalLM, AutoTokenizer", ""]
    else:
        lines += ["from peft import PeftModel", "from transformers import AutoModelForCausalLM, AutoTokenizer", ""]
    lines += [
        f"path = {_literal(str(final))}  # this folder, or its Hub id once uploaded",
        "tokenizer = AutoTokenizer.from_pretrained(path)",
    ]
    if r.peft.method == "none":
        return "\n".join([*lines, f"model = AutoModelForCausalLM.from_pretrained(path{remote})", "```\n", generate])
    if r.model.random_init:  # the base's random weights exist only in final/base/ (checkpoint.save_final)
        # Not `subfolder=`: transformers finds the adapter's config in `path` and loads the base it names instead.
        base = f'path + "/{BASE_DIR}"'
    else:
        base = _literal(_base(r)) + (f", revision={_literal(r.model.revision)}" if r.model.revision else "")
    lines += [
        f"base = AutoModelForCausalLM.from_pretrained({base}{remote})",
        "model = PeftModel.from_pretrained(base, path)",
        "```\n",
    ]
    if r.peft.method == "qlora":
        lines.append(
            "The adapter was trained on the base quantised to 4-bit NF4; to run it that way, load the base with"
            ' `quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",'
            " bnb_4bit_use_double_quant=True)` (CUDA, bitsandbytes).\n"
        )
    lines.append(
        f"Or merge the adapter into its base, a plain transformers model: `llmtune merge --run {final.parent}`"
        f" (writes `{final.parent / 'merged'}`).\n"
    )
    return "\n".join([*lines, generate])
