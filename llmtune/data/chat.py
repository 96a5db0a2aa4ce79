"""Chats through the tokenizer's own chat template: the ids a conversation renders to, and which of them are trained.

The ids are the template's rendering of the whole conversation, exactly what `apply_chat_template` gives (the text,
then the tokenizer without added special tokens), so the model trains on what it sees at inference for that
history. The trained tokens are each assistant turn's text and the end-of-turn token after it, nothing else: not the
newline a template writes after that token, not the next role's header.

Turns are found in the rendered text, not by rendering prefixes (which breaks on templates that render history
differently from the last turn: Qwen3 drops earlier reasoning, Mistral moves the system prompt to the last user
turn). The conversation is rendered a second time with each message's text replaced by a marker; the text between
markers is the template's own and must equal the real rendering around each text (as given, or as the template
trimmed it), which places every text to the character. The fast tokenizer's offsets map characters to tokens, and
the end-of-turn token is the first special token after the text (whitespace between is trained too: the model
writes it). A template whose rendering of a text cannot be placed so is refused, naming the turn.

* `{% generation %}` markers, where a template has them, decide instead (transformers' assistant mask).
* Reasoning (`reasoning_content`; `thinking` or `reasoning` also read; or a leading `<think>...</think>` in the
  content) reaches the template under the key it reads; what it renders is trained or not by
  `data.train_reasoning`. Templates that drop earlier turns' reasoning drop it here too.
* Tool calls (`tool_calls`), `tool` turns and the `tools` schemas pass through as the template renders them; a call
  is trained from where the model starts writing it (after the assistant header, the template's generation prompt,
  or after the token that closes the previous turn) to the token that ends it; a tool's output never is.
* A template that refuses a system turn (Gemma-2 raises) gets it folded into the first user turn, said once.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOL_CALL_ENDS = ("<|call|>", "<|eom_id|>", "<tool_call|>")  # gpt-oss, Llama 3.1's built-in tools, Gemma-4
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # Qwen3 / DeepSeek, gpt-oss, Gemma-4
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_INLINE_THINK = re.compile(r"\s*<think>(.*?)</think>\s*", re.S)  # used with .match: at the text's start
_MARKER = re.compile(r"@@llmtune:(\d+):([crtou]\d*)@@")
_folded_templates: set[str] = set()
Tools = list[dict[str, Any]] | None  # function schemas, as `apply_chat_template(tools=...)` takes them


class ChatError(ValueError):
    """A conversation whose assistant turns cannot be placed in the template's rendering (the message says which)."""


def ensure_chat_template(tokenizer: Any) -> None:
    """Give a tokenizer without a chat template ChatML, loudly (saved with the model, so inference matches)."""
    if not getattr(tokenizer, "chat_template", None):
        logger.warning(
            "tokenizer has no chat template: rendering chats with ChatML (<|im_start|>role ... <|im_end|>) and"
            " setting it on the tokenizer so the saved model renders chats as it was trained"
        )
        tokenizer.chat_template = CHATML_TEMPLATE


def _template(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else str(template)


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Tools = None) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def as_rendered(
    tokenizer: Any, messages: list[dict[str, Any]], tools: Tools = None
) -> tuple[list[dict[str, Any]], str]:
    """The turns as the template is given them (reasoning under the key it reads, a system turn it refuses folded
    into the first user turn, said once per template) and their rendering, without a generation prompt."""
    messages = _reasoning_for(_template(tokenizer), messages)
    try:
        return messages, _render(tokenizer, messages, False, tools)
    except Exception:  # a chat template may raise anything (jinja's raise_exception, TypeError...)
        folded = _fold_system(messages)
        if folded is None:
            raise
        text = _render(tokenizer, folded, False, tools)  # the template's own error if it still refuses
        template = _template(tokenizer)
        if template not in _folded_templates:
            _folded_templates.add(template)
            logger.warning("the chat template refuses a system turn: folding it into the first user turn")
        return folded, text


def _fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    if len(messages) < 2 or messages[0]["role"] != "system" or messages[1]["role"] != "user":
        return None
    user = {**messages[1], "content": f"{messages[0]['content']}\n\n{messages[1]['content']}"}
    return [user, *messages[2:]]


def _reasoning_for(template: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reasoning under the key the template reads; a leading <think> block split off the content only for a template
    that reads reasoning from a key (others render the content, think block included, as they choose)."""
    key = next(
        (k for k in REASONING_KEYS if re.search(rf"\.{k}\b|\[['\"]{k}['\"]\]|get\(['\"]{k}['\"]", template)), None
    )
    out = []
    for turn in messages:
        turn = dict(turn)
        if turn["role"] == "assistant":
            reasoning = next((turn.pop(k) for k in REASONING_KEYS if turn.get(k) is not None), None)
            inline = _INLINE_THINK.match(turn.get("content") or "") if key else None
            if reasoning is None and inline:
                reasoning, turn["content"] = inline.group(1).strip("\n"), turn["content"][inline.end() :]
            if reasoning is not None and key:
                turn[key] = reasoning
        out.append(turn)
    return out


def chat_text(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Tools = None) -> str:
    messages, text = as_rendered(tokenizer, messages, tools)
    return _render(tokenizer, messages, True, tools) if add_generation_prompt else text


def chat_ids(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Tools = None
) -> list[int]:
    """The ids `apply_chat_template(..., tokenize=True)` gives (system turn folded where the template refuses it)."""
    text = chat_text(tokenizer, messages, add_generation_prompt, tools)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    train_reasoning: bool = True,
    first_trained: int = 0,
    tools: Tools = None,
) -> tuple[list[int], list[bool]]:
    """The conversation's ids and, per id, whether it is trained: assistant turns from index `first_trained` on
    (a preference pair's earlier rounds are context), each its text and end-of-turn token. `first_trained` counts
    the turns as given: a system turn folded into the first user turn moves every later turn one place back."""
    given = len(messages)
    messages, text = as_rendered(tokenizer, messages, tools)
    first_trained = max(0, first_trained - (given - len(messages)))
    if _GENERATION_TAG.search(_template(tokenizer)):
        return _by_generation_tags(tokenizer, messages, first_trained, tools)
    if not any(turn["role"] == "assistant" for turn in messages[first_trained:]):
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids, [False] * len(ids)
    try:
        spans = _place(text, _render(tokenizer, _with_markers(messages, users=True), False, tools), messages)
    except ChatError:  # a template whose rendering depends on the user's text (rare): assistant texts alone
        spans = _place(text, _render(tokenizer, _with_markers(messages, users=False), False, tools), messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    offsets = _cores(text, ids, encoded["offset_mapping"], tokenizer)
    trained = [False] * len(ids)
    header, special, closers = _template_facts(tokenizer)
    for k in sorted({k for k, part in spans if part[0] in "crt"}):
        parts = {part: span for (turn, part), span in spans.items() if turn == k}
        floor = max((e for (turn, _), (_, e) in spans.items() if turn < k), default=0)  # the previous turn's text
        start, end = _turn_range(text, parts, Opening(header, closers, floor), train_reasoning)
        if k < first_trained or start >= end:
            continue
        _mark(trained, offsets, start, end)
        last = max(i for i, (s, e) in enumerate(offsets) if s < end and e > s)
        if any(part.startswith("t") for part in parts):
            bound = min((s for s, _ in spans.values() if s >= end), default=len(text))
            _mark_call_end(trained, ids, offsets, last, bound, _call_ends(tokenizer))
        else:
            _mark_end_of_turn(trained, ids, offsets, text, last, special)
    return ids, trained


def _by_generation_tags(
    tokenizer: Any, messages: list[dict[str, Any]], first_trained: int, tools: Tools
) -> tuple[list[int], list[bool]]:
    """What the template's own `{% generation %}` markers enclose (transformers' assistant mask)."""
    out = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    first = len(chat_ids(tokenizer, messages[:first_trained], True, tools)) if first_trained else 0
    return ids, [m and i >= first for i, m in enumerate(mask)]


def _with_markers(messages: list[dict[str, Any]], users: bool) -> list[dict[str, Any]]:
    """The turns with each assistant text (content, reasoning, a tool call's function name), each tool output and
    (`users`) each user text replaced by a marker: the others bound where an assistant turn starts and ends."""
    marked = copy.deepcopy(messages)
    for k, turn in enumerate(marked):
        if turn["role"] == "tool" and isinstance(turn.get("content"), str) and turn["content"]:
            turn["content"] = f"@@llmtune:{k}:o@@"
        if users and turn["role"] == "user" and isinstance(turn.get("content"), str) and turn["content"]:
            turn["content"] = f"@@llmtune:{k}:u@@"
        if turn["role"] != "assistant":
            continue
        if isinstance(turn.get("content"), str) and turn["content"]:
            turn["content"] = f"@@llmtune:{k}:c@@"
        for key in REASONING_KEYS:
            if isinstance(turn.get(key), str) and turn[key]:
                turn[key] = f"@@llmtune:{k}:r@@"
        for j, call in enumerate(turn.get("tool_calls") or []):
            function = call.get("function", call) if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                function["name"] = f"@@llmtune:{k}:t{j}@@"
    return marked


def _original(messages: list[dict[str, Any]], k: int, part: str) -> str:
    turn = messages[k]
    if part in ("c", "o", "u"):
        return turn["content"]
    if part == "r":
        return next(turn[key] for key in REASONING_KEYS if isinstance(turn.get(key), str) and turn[key])
    call = turn["tool_calls"][int(part[1:])]
    return call.get("function", call)["name"]


def _place(text: str, marked: str, messages: list[dict[str, Any]]) -> dict[tuple[int, str], tuple[int, int]]:
    """{(turn, part): (start, end) in text} from the marked rendering: the template's own text between markers must
    equal the real rendering's, each marker standing for its text as given or as the template trimmed it."""
    pieces = _MARKER.split(marked)  # literal, turn, part, literal, turn, part, ..., literal
    spans: dict[tuple[int, str], tuple[int, int]] = {}
    at = 0
    for i in range(0, len(pieces), 3):
        literal = pieces[i]
        if not text.startswith(literal, at):
            raise ChatError(_unplaced(spans, messages))
        at += len(literal)
        if i + 1 == len(pieces):
            break
        k, part, after = int(pieces[i + 1]), pieces[i + 2], pieces[i + 3]
        value = _original(messages, k, part)
        shown = next(
            (v for v in _trimmed(value) if text.startswith(v, at) and text.startswith(after, at + len(v))), None
        )
        if shown is None:
            raise ChatError(_unplaced(spans, messages, k))
        spans.setdefault((k, part), (at, at + len(shown)))
        at += len(shown)
    if at != len(text):
        raise ChatError(_unplaced(spans, messages))
    return spans


def _trimmed(value: str) -> dict[str, None]:
    """What templates do to a text before writing it: nothing, `| trim`, Qwen3's lstrip('\\n') / strip('\\n'), and
    DeepSeek-R1's dropping of a reasoning block (`content.split('</think>')[-1]`), JSON quoting (gpt-oss)."""
    forms = (value, value.split("</think>")[-1]) if "</think>" in value else (value,)
    trims = (f for v in forms for f in (v, v.strip(), v.lstrip("\n"), v.strip("\n"), v.rstrip(), v.lstrip()))
    return dict.fromkeys((*trims, json.dumps(value, ensure_ascii=False)[1:-1]))  # in `| tojson`: quotes are its own


def _unplaced(
    spans: dict[tuple[int, str], tuple[int, int]], messages: list[dict[str, Any]], turn: int | None = None
) -> str:
    """The refusal, naming `turn`, or else the first assistant turn not placed (the template's text around it
    differs)."""
    placed = {k for k, part in spans if part[0] in "crt"}
    unplaced = (k for k, t in enumerate(messages) if t["role"] == "assistant" and k not in placed)
    turn = turn if turn is not None else next(unplaced, max((k for k, _ in spans), default=0))
    return (
        f"turn {turn} ({messages[turn]['role']}): the chat template rewrites this turn's text (not only trimming it),"
        " so the assistant tokens cannot be located in the rendering; give the template {% generation %} markers, or"
        " the text as the template writes it"
    )


def _turn_range(
    text: str, parts: dict[str, tuple[int, int]], opening: Opening, train_reasoning: bool
) -> tuple[int, int]:
    """The characters an assistant turn trains, one stretch: its text (past a <think> block the template wrote inside
    it, when reasoning is not trained), its reasoning from the block's opening (when trained), its tool calls from
    where the model starts writing them."""
    starts, ends = [], []
    if "c" in parts:
        start, end = parts["c"]
        think = None if train_reasoning else _INLINE_THINK.match(text, start, end)
        starts.append(think.end() if think else start)
        ends.append(end)
    for part, (start, end) in parts.items():
        if part.startswith("t") or (part == "r" and train_reasoning):
            starts.append(opening.before(text, start))
            ends.append(end)
    return (min(starts), max(ends)) if starts else (0, 0)


@dataclass(frozen=True)
class Opening:
    """Where the model starts writing a reasoning block or a tool call, after the previous turn's text (`floor`)."""

    header: str  # the template's generation prompt: the assistant header a reply follows
    closers: list[str]  # the special tokens' texts
    floor: int

    def before(self, text: str, start: int) -> int:
        """Right after this turn's assistant header: the generation prompt, or its longest head (cut at a line break
        or after a special token) found there, as a reply's header without the reasoning opening the generation
        prompt adds (DeepSeek-R1's `<think>`, Gemma-4's thought channel); without a header, right after the special
        token that closes the previous turn (Mistral's `[/INST]`); else at a `<think>` just before; else `start`."""
        for form in self.heads():
            found = text.rfind(form, self.floor, start)
            if found >= 0:
                return found + len(form)
        if not self.header:
            closing = [(at, len(c)) for c in self.closers if (at := text.find(c, self.floor, start)) >= 0]
            if closing:
                at, length = min(closing)
                return at + length
        before = text[:start].rstrip()
        return len(before) - len("<think>") if before.endswith("<think>") else start

    def heads(self) -> list[str]:
        header = self.header
        cuts = {len(header)} | {i + 1 for i, char in enumerate(header) if char == "\n"}
        cuts |= {header.find(c) + len(c) for c in self.closers if c and c in header}
        return [header[:cut] for cut in sorted(cuts, reverse=True) if cut > 0]


def _cores(text: str, ids: list[int], offsets: Sequence[Sequence[int]], tokenizer: Any) -> list[tuple[int, int]]:
    """Each token's characters; for an added token, its own text only: one that strips whitespace around it (Phi-3's
    `<|assistant|>` takes the newlines after it) must not reach into the answer beside it."""
    added = {i: getattr(t, "content", None) for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()}
    cores = []
    for token, (s, e) in zip(ids, offsets, strict=True):
        at = text.find(added[token], s, e) if added.get(token) else -1
        cores.append((at, at + len(added[token])) if at >= 0 else (s, e))
    return cores


def _mark(trained: list[bool], offsets: Sequence[tuple[int, int]], start: int, end: int) -> None:
    for i, (s, e) in enumerate(offsets):
        if s < end and e > start and e > s:
            trained[i] = True


def _mark_end_of_turn(
    trained: list[bool], ids: list[int], offsets: Sequence[tuple[int, int]], text: str, last: int, special: set[int]
) -> None:
    """Train the first special token after a turn's last trained token, and the whitespace before it (the model
    writes both to end its turn); nothing when text comes first (a template without an end-of-turn token)."""
    for i in range(last + 1, len(ids)):
        if ids[i] in special:
            for j in range(last + 1, i + 1):
                trained[j] = True
            return
        s, e = offsets[i]
        if text[s:e].strip():
            return


def _mark_call_end(
    trained: list[bool], ids: list[int], offsets: Sequence[tuple[int, int]], last: int, bound: int, ends: set[int]
) -> None:
    """Train a tool call's arguments and the token that ends the call (the template's end of turn, eos, or a call's
    own end: gpt-oss `<|call|>`, Llama 3.1 `<|eom_id|>`, Gemma-4 `<tool_call|>`), before the next located text."""
    for i in range(last + 1, len(ids)):
        if offsets[i][0] >= bound:
            return
        if ids[i] in ends:
            for j in range(last + 1, i + 1):
                trained[j] = True
            return


def _call_ends(tokenizer: Any) -> set[int]:
    """The tokens that can end a tool call: the known call closers, the end of turn, eos (once per template: finding
    the end of turn renders a probe)."""

    def ends() -> set[int]:
        known = [tokenizer.convert_tokens_to_ids(token) for token in TOOL_CALL_ENDS]
        closers = {i for i in known if isinstance(i, int) and i != tokenizer.unk_token_id}
        return closers | set(end_of_turn_ids(tokenizer)) | ({tokenizer.eos_token_id} - {None})

    return _per_template(_ends, tokenizer, ends)


def _special_ids(tokenizer: Any) -> set[int]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}


_facts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _per_template(store: weakref.WeakKeyDictionary, tokenizer: Any, compute: Callable[[], Any]) -> Any:
    """`compute()`, worked out once per tokenizer and template: the same for every row (a dataset renders each row
    with one tokenizer), and a template changed on the tokenizer is worked out again."""
    template = _template(tokenizer)
    cached = store.get(tokenizer)
    if cached is None or cached[0] != template:
        cached = store[tokenizer] = (template, compute())
    return cached[1]


def _template_facts(tokenizer: Any) -> tuple[str, set[int], list[str]]:
    """(the generation prompt, the special ids, their texts)."""

    def facts() -> tuple[str, set[int], list[str]]:
        special = _special_ids(tokenizer)
        return _generation_prompt(tokenizer), special, tokenizer.convert_ids_to_tokens(sorted(special))

    return _per_template(_facts, tokenizer, facts)


def _generation_prompt(tokenizer: Any) -> str:
    """The assistant header the template writes for a reply (after a one-turn chat), or '' when it cannot tell."""
    probe = [{"role": "user", "content": "@@llmtune:probe@@"}]
    try:
        bare, prompted = _render(tokenizer, probe, False), _render(tokenizer, probe, True)
    except Exception:  # a template that needs more than one user turn
        return ""
    return prompted[len(bare) :] if prompted.startswith(bare) else ""


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The token the template writes to end a reply (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, gpt-oss's
    `<|return|>`...): the special token after the assistant text of a one-exchange chat; [] when there is none."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        ids, trained = render_chat(tokenizer, probe)
    except Exception:  # a template that refuses the probe: no stop from it
        return []
    last = max((i for i, t in enumerate(trained) if t), default=None)
    return [ids[last]] if last is not None and ids[last] in _special_ids(tokenizer) else []
