"""Generation evaluation of an exported HF directory: greedy decoding with transformers, exact match."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

_THINK = re.compile(r"^\s*<think>.*?</think>\s*", re.S)


def evaluate_exact_match(hf_dir: str | Path, chats_path: str | Path, max_new_tokens: int = 32,
                         max_examples: int = 200) -> tuple[float, int]:
    """Loads ``hf_dir`` with AutoModelForCausalLM, decodes each chat's prompt (all turns before the last
    assistant turn) greedily, and compares the answer (think block removed) with the last assistant turn."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, local_files_only=True).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id
    rows = [json.loads(line) for line in Path(chats_path).read_text().splitlines() if line.strip()][:max_examples]
    correct = 0
    for row in rows:
        messages = row["messages"]
        target = messages[-1]["content"].strip()
        ids = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = torch.tensor([list(ids)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False).split("<|im_end|>")[0]
        correct += _THINK.sub("", text).strip() == target
    return correct / max(len(rows), 1), len(rows)
