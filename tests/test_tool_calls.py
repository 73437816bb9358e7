"""Conversations as agents and reasoning models write them (issue 23, item 3): tool schemas, assistant tool calls,
tool results and reasoning, rendered by the real Qwen3 template. Ids equal ``apply_chat_template``; the loss mask
covers the assistant turns (think block, content, tool-call markup, closing <|im_end|>) and never a tool result."""

import json

import pytest

from conftest import QWEN_DIR

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
AGENT = {"tools": TOOLS, "messages": [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should look both up.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
    {"role": "tool", "content": "{\"temp\": 18, \"sky\": \"cloudy\"}"},
    {"role": "tool", "content": "{\"temp\": 24, \"sky\": \"sunny\"}"},
    {"role": "assistant", "content": "Paris: 18 C and cloudy. Rome: 24 C and sunny.",
     "reasoning_content": "Both results are in."},
    {"role": "user", "content": "Thanks! And Oslo?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
]}


@pytest.fixture(scope="module")
def qwen():
    from titan_sft.data.chat import encoder_for, load_tokenizer

    tok = load_tokenizer(QWEN_DIR)
    return tok, encoder_for(tok)[0]


def _runs(mask):
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_tool_conversations_match_apply_chat_template_and_mask_assistant_turns(qwen):
    from titan_sft.data.chat import parse_line

    tok, enc = qwen
    conv = parse_line(json.dumps(AGENT))
    ids, mask = enc.encode([conv])[0]
    messages = [dict(m, content=m["content"] or "") for m in AGENT["messages"]]
    expected = tok.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=True)["input_ids"]
    assert ids.tolist() == list(expected)
    texts = [tok.decode(ids[a:b]) for a, b in _runs(mask)]
    assert len(texts) == 3  # the three assistant turns
    assert "<tool_call>" in texts[0] and '"Paris"' in texts[0] and '"Rome"' in texts[0] and texts[0].endswith("<|im_end|>\n")
    assert "Paris: 18 C" in texts[1] and "<tool_call>" in texts[2] and '"Oslo"' in texts[2]
    assert not any("<tool_response>" in t or "sunny\"}" in t for t in texts)  # tool results carry no loss
    # Earlier turns' reasoning is dropped as the template does (it keeps it only after the last user query).
    assert "I should look both up." not in tok.decode(ids)
    # A batch mixing plain and tool conversations renders each with its own tools.
    plain = parse_line(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "hello"}]}))
    both = enc.encode([plain, conv])
    assert both[1][0].tolist() == ids.tolist()
    assert both[0][0].tolist() == list(tok.apply_chat_template(plain, tokenize=True, return_dict=True)["input_ids"])


def test_bad_tool_rows_name_the_problem():
    from titan_sft.data.chat import BadRow, parse_line

    bad = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                                           "tool_calls": [{"function": {"arguments": {}}}]}]}
    with pytest.raises(BadRow, match="tool call 0 needs a function name"):
        parse_line(json.dumps(bad))
    with pytest.raises(BadRow, match="'tools' must be a list"):
        parse_line(json.dumps({"tools": "get_weather", "messages": AGENT["messages"]}))


def test_prepare_keeps_tool_conversations(tmp_path):
    from titan_sft.data.dataset import PackedDataset
    from titan_sft.data.prepare import prepare

    src = tmp_path / "agent.jsonl"
    src.write_text(json.dumps(AGENT) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                         {"role": "assistant", "content": "hey"}]}) + "\n")
    m = prepare([str(src)], str(QWEN_DIR), 1024, str(tmp_path / "out"), workers=1, progress=False)
    assert m["n_documents"] == 2 and m["bad_rows"]["skipped"] == 0
    ds = PackedDataset(tmp_path / "out")
    tokens, amask, _ = ds[0]
    assert amask.sum() > 0


def test_prepare_diffusion_answers_tool_calls_and_renders_the_tools(qwen):
    """Masked diffusion's examples of an agent row: each assistant turn is an answer, tool-call turns (empty
    content) included, not skipped as empty; prompt + answer are the template's rendering of the conversation up
    to that turn with the row's tools, as prepare renders it."""
    import numpy as np

    from titan_sft.data.prepare_diffusion import ExampleEncoder, examples_from_row

    tok, _ = qwen
    row = json.loads(json.dumps(AGENT))
    pairs = examples_from_row(row, np.random.default_rng(0), -1, 1.0)
    assert len(pairs) == 3
    enc = ExampleEncoder(tok, None)
    for (prompt, answer, _), k in zip(pairs, (2, 5, 7)):
        prompt_ids, answer_ids = enc(prompt, answer)
        messages = [dict(m, content=m["content"] or "") for m in AGENT["messages"][: k + 1]]
        whole = tok.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=True)["input_ids"]
        ids = [*prompt_ids.tolist(), *answer_ids.tolist()]
        assert ids == list(whole[: len(ids)]) and len(whole) - len(ids) == 1  # all but the template's last "\n"
        assert tok.decode(answer_ids).endswith("<|im_end|>")
    assert "<tool_call>" in tok.decode(enc(*pairs[2][:2])[1]) and "get_weather" in tok.decode(enc(*pairs[0][:2])[0])
