"""Chat conversations -> token ids + assistant (loss) mask, through a chat template with generation markers.

The mask comes from ``{% generation %}`` spans of the template: transformers' renderer returns their character
ranges, and the tokens holding a span's first through last character are assistant tokens (as transformers
decides). The text is tokenized whole, exactly as ``tokenizer.apply_chat_template(messages, tokenize=True)``
does, so the ids are identical to it.

Qwen3's stock template has no generation markers; pointed at it, we recognise it by hash and use the shipped
marked equivalent (``assets/chat_templates/qwen3_marked.jinja``), which renders the same text; for speed the
same text and spans come from :func:`render_qwen3`, a plain-Python rendering tested against both templates.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "assets" / "chat_templates"
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
ROLES = ("system", "user", "assistant", "tool")


class Conversation(list):
    """A conversation's messages, and the ``tools`` (function schemas) its template renders, if any."""

    tools: list | None = None


def _needs_template(conversation) -> bool:
    """Tool schemas, tool calls and tool results render through the Jinja template (render_qwen3 has none)."""
    return bool(getattr(conversation, "tools", None)) or any(
        "tool_calls" in m or m.get("role") == "tool" for m in conversation)


class BadRow(ValueError):
    """A conversation that cannot be used; the message says why (the caller adds file:line)."""


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


_EXPORT_PADDING = re.compile(r"<\|padding_\d+\|>")


def tokenizer_sha256(tokenizer: Any) -> str:
    """Hash of what decides the ids: the tokenizer's own serialisation (vocabulary, merges, normaliser, added tokens)
    and its special tokens. How its files are formatted does not enter, nor does the chat template (hashed apart),
    nor the ``<|padding_i|>`` tokens an HF export appends up to the model's vocab_size (so an exported model's
    tokenizer hashes like the one its data were prepared with)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec.get("added_tokens", [])
                            if t.get("special") or not _EXPORT_PADDING.fullmatch(t.get("content", ""))]
    special = {k: v for k, v in sorted(tokenizer.special_tokens_map.items()) if isinstance(v, str)}
    return sha256(json.dumps(spec, sort_keys=True) + json.dumps(special))


def _stock_hashes() -> dict[str, str]:
    """sha256 of known stock templates -> the shipped marked template that renders the same text."""
    out = {}
    for f in TEMPLATE_DIR.glob("*_stock.sha256"):
        marked = f.name.replace("_stock.sha256", "_marked.jinja")
        for line in f.read_text().split():
            out[line.strip()] = marked
    return out


@dataclass
class ResolvedTemplate:
    template: str  # the template actually rendered (has generation markers)
    source: str  # where it came from, for the log and the manifest
    sha256: str  # of the template the user's tokenizer (or --chat-template) holds
    qwen3: bool = False  # the stock Qwen3 text: render_qwen3 reproduces it without Jinja


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the names transformers aliases


def render_qwen3(messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Qwen3's stock chat template in plain Python: the same text, plus the assistant bodies' character spans.

    About 10x faster than the Jinja template; the tests check it against the template on many conversations.
    Mirrors the template line by line: the last user query decides which assistant turns keep their reasoning,
    reasoning comes from ``reasoning_content`` (or an inline ``<think>`` block), and the final turn always gets
    a think block.
    """
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0

    def emit(text: str) -> None:
        nonlocal pos
        parts.append(text)
        pos += len(text)

    if messages[0]["role"] == "system":
        emit("<|im_start|>system\n" + messages[0]["content"] + "<|im_end|>\n")
    last_query = len(messages) - 1
    for index in range(len(messages) - 1, -1, -1):
        m = messages[index]
        c = m["content"]
        if m["role"] == "user" and not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
            last_query = index
            break
    n = len(messages)
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "user" or (role == "system" and i != 0):
            emit("<|im_start|>" + role + "\n" + content + "<|im_end|>\n")
        elif role == "assistant":
            reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
            if reasoning is None:
                reasoning = ""
                if "</think>" in content:
                    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                    content = content.split("</think>")[-1].lstrip("\n")
            emit("<|im_start|>assistant\n")
            start = pos
            if i > last_query and (i == n - 1 or reasoning):
                emit("<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n"))
            else:
                emit(content)
            emit("<|im_end|>\n")
            spans.append((start, pos))
    return "".join(parts), spans


def resolve_template(tokenizer_template: str | None, override_file: str | None = None) -> ResolvedTemplate:
    """Chooses the template that yields assistant masks.

    Raises:
        ValueError: no template at all, or one without generation markers that we do not recognise.
    """
    if override_file is not None:
        text = Path(override_file).read_text()
        origin = f"--chat-template {override_file}"
    elif tokenizer_template:
        text = tokenizer_template
        origin = "the tokenizer's chat template"
    else:
        raise ValueError("the tokenizer has no chat template; pass --chat-template FILE (a Jinja chat template)")
    if _GENERATION_RE.search(text):
        return ResolvedTemplate(text, origin, sha256(text))
    marked = _stock_hashes().get(sha256(text))
    if marked is not None:
        src = f"{origin} is a known stock template without generation markers; using shipped {marked} (same text)"
        return ResolvedTemplate((TEMPLATE_DIR / marked).read_text(), src, sha256(text), qwen3=marked == "qwen3_marked.jinja")
    raise ValueError(
        f"{origin} has no {{% generation %}} markers and is not a known stock template, so assistant tokens cannot "
        "be found; pass --chat-template FILE with {% generation %}...{% endgeneration %} around assistant turns"
    )


def _check_tool_calls(i: int, calls: Any) -> None:
    if not isinstance(calls, list) or not calls:
        raise BadRow(f"message {i} 'tool_calls' must be a non-empty list")
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRow(f"message {i} tool call {j} needs a function name ({{'function': {{'name': ..., "
                         f"'arguments': ...}}}})")
        if not isinstance(fn.get("arguments", {}), (dict, str)):
            raise BadRow(f"message {i} tool call {j} arguments must be an object or a JSON string")


def validate_conversation(row: Any) -> Conversation:
    """Checks one parsed JSON row and returns its messages (with the row's ``tools``); raises :class:`BadRow`
    naming the problem. Assistant turns may carry ``tool_calls`` (OpenAI/Qwen3 format: ``{"type": "function",
    "function": {"name", "arguments"}}``) with empty content; ``tool`` messages carry the results."""
    if not isinstance(row, dict) or "messages" not in row:
        raise BadRow("no 'messages' list")
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRow("'messages' must be a non-empty list")
    tools = row.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRow("'tools' must be a list of function schemas (objects)")
    has_assistant = False
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRow(f"message {i} is not an object")
        role = m.get("role")
        if role not in ROLES:
            raise BadRow(f"message {i} has unknown role {role!r} (allowed: {', '.join(ROLES)})")
        content = m.get("content")
        calls = m.get("tool_calls")
        if role == "assistant" and calls is not None:
            _check_tool_calls(i, calls)
            if content is None:
                m["content"] = content = ""
        if not isinstance(content, str):
            raise BadRow(f"message {i} content must be a string")
        if role == "assistant":
            if not content.strip() and not (m.get("reasoning_content") or "").strip() and not calls:
                raise BadRow(f"message {i} (assistant) has empty content")
            has_assistant = True
    if not has_assistant:
        raise BadRow("no assistant turn")
    conversation = Conversation(messages)
    conversation.tools = tools or None
    return conversation


class ChatEncoder:
    """Renders conversations with a marked template and tokenizes them with offsets (picklable)."""

    def __init__(self, template: str, backend_tokenizer: Any, special_tokens: dict[str, Any], qwen3: bool = False):
        self.template = template
        self.qwen3 = qwen3
        self.tok = backend_tokenizer  # a `tokenizers.Tokenizer`
        self.special_tokens = special_tokens

    def render(self, conversations: list[list[dict]]) -> tuple[list[str], list[list[tuple[int, int]]]]:
        if self.qwen3 and not any(_needs_template(c) for c in conversations):
            rendered = [render_qwen3(c) for c in conversations]
            return [t for t, _ in rendered], [s for _, s in rendered]
        from transformers.utils.chat_template_utils import render_jinja_template

        def render(batch, tools=None):
            return render_jinja_template(conversations=[list(c) for c in batch], chat_template=self.template,
                                         return_assistant_tokens_mask=True, tools=tools, **self.special_tokens)

        if not any(getattr(c, "tools", None) for c in conversations):
            return render(conversations)
        texts, spans = [], []
        for c in conversations:  # each conversation's own tool schemas
            t, sp = render([c], getattr(c, "tools", None))
            texts += t
            spans += sp
        return texts, spans

    def encode(self, conversations: list[list[dict]], keep_from: list[int] | None = None
               ) -> list[tuple[np.ndarray, np.ndarray]]:
        """[(ids int32 [n], mask uint8 [n])] per conversation. ``keep_from[c]``: conversation c's loss mask covers
        its assistant spans from that index on (the earlier ones are context, as in a split conversation)."""
        texts, spans = self.render(conversations)
        if keep_from is not None:
            spans = [sp[k:] for sp, k in zip(spans, keep_from)]
        encodings = self.tok.encode_batch(texts, add_special_tokens=False)
        out = []
        for enc, conv_spans in zip(encodings, spans):
            ids = np.asarray(enc.ids, dtype=np.int32)
            mask = np.zeros(len(ids), dtype=np.uint8)
            for s, e in conv_spans:
                # The tokens holding the span's first and last characters (as transformers finds them).
                first, last = enc.char_to_token(s), enc.char_to_token(e - 1)
                mask[first : last + 1] = 1
            out.append((ids, mask))
        return out


def load_tokenizer(path: str | Path):
    """An HF tokenizer from a local directory (never the network)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path}: not a tokenizer directory (no tokenizer.json / tokenizer_config.json)")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def encoder_for(tokenizer: Any, chat_template_file: str | None = None) -> tuple[ChatEncoder, ResolvedTemplate]:
    resolved = resolve_template(getattr(tokenizer, "chat_template", None), chat_template_file)
    special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    return ChatEncoder(resolved.template, tokenizer.backend_tokenizer, special, resolved.qwen3), resolved


def split_conversation(conversation: Conversation, encoder: "ChatEncoder", seq_len: int, max_history: int = -1
                       ) -> list[tuple[np.ndarray, np.ndarray, bool]]:
    """An over-long conversation as several documents that fit ``seq_len``, cut at assistant-turn boundaries.

    The conversation's turns are segments, each ending with an assistant message (what comes before it: user
    turns, tool results). Documents take consecutive segments while they fit; each later document starts with
    the system message and the preceding segments that still fit (at most ``max_history`` of them; -1: as many as
    fit) as context, whose assistant turns carry no loss there: every assistant turn is trained in exactly one
    document. Returns (ids, mask, truncated) per document; a single segment too long even without history is cut
    at ``seq_len`` (truncated True), keeping what of its answer fits.
    """
    system = [m for m in conversation[:1] if m["role"] == "system"]
    body = conversation[len(system):]
    segments, cur = [], []
    for m in body:
        cur.append(m)
        if m["role"] == "assistant":
            segments.append(cur)
            cur = []
    # Messages after the last assistant turn carry no loss: they are dropped.

    def render(history: list[list[dict]], new: list[list[dict]]):
        conv = Conversation(system + [m for seg in history + new for m in seg])
        conv.tools = conversation.tools
        n_context = sum(1 for seg in history for m in seg if m["role"] == "assistant")
        return encoder.encode([conv], keep_from=[n_context])[0]

    docs, i = [], 0
    while i < len(segments):
        # The history: the segments just before i that fit beside segment i (most recent first).
        history: list[list[dict]] = []
        for j in range(i - 1, -1, -1):
            if 0 <= max_history <= len(history):
                break
            if len(render([segments[j]] + history, [segments[i]])[0]) > seq_len:
                break
            history.insert(0, segments[j])
        ids, mask = render(history, [segments[i]])
        if len(ids) > seq_len:  # one segment alone is too long: keep what fits
            docs.append((ids[:seq_len], mask[:seq_len], True))
            i += 1
            continue
        k = i + 1
        while k < len(segments):
            more = render(history, segments[i : k + 1])
            if len(more[0]) > seq_len:
                break
            ids, mask = more
            k += 1
        docs.append((ids, mask, False))
        i = k
    return docs


def parse_line(line: str) -> Conversation:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadRow(f"not JSON ({e.msg})") from None
    return validate_conversation(row)
