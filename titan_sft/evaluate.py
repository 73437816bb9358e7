"""Evaluation of an exported HF directory.

* ``python -m titan_sft.evaluate --hf DIR --tasks T[,T] [--backend vllm|hf]``: the lm-evaluation-harness (the
  ``eval`` extra: ``pip install 'titan_sft[eval]'``) on an HF export: the ``vllm`` backend where a GPU and vLLM are
  there, the ``hf`` (transformers) backend elsewhere. ``--include-path`` adds a folder of task YAMLs.
* :func:`evaluate_exact_match`: greedy decoding with transformers and exact match on held-out chats (the debug
  job's validator).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

import torch

_THINK = re.compile(r"^\s*<think>.*?</think>\s*", re.S)


def evaluate_exact_match(hf_dir: str | Path, chats_path: str | Path, max_new_tokens: int = 32,
                         max_examples: int = 200, device: torch.device | str = "cpu") -> tuple[float, int]:
    """Loads ``hf_dir`` with AutoModelForCausalLM on ``device`` (bf16 on a GPU, fp32 on CPU), decodes each chat's
    prompt (all turns before the last assistant turn) greedily, and compares the answer (think block removed) with
    the last assistant turn."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, local_files_only=True).to(device).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id
    rows = [json.loads(line) for line in Path(chats_path).read_text().splitlines() if line.strip()][:max_examples]
    correct = 0
    for row in rows:
        messages = row["messages"]
        target = messages[-1]["content"].strip()
        ids = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = torch.tensor([list(ids)], device=device)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False).split("<|im_end|>")[0]
        correct += _THINK.sub("", text).strip() == target
    return correct / max(len(rows), 1), len(rows)


def default_backend() -> str:
    """vllm on a GPU machine that has it, else hf."""
    return "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") else "hf"


def run_lm_eval(hf_dir: str | Path, tasks: list[str], backend: str | None = None, include_path: str | None = None,
                limit: int | None = None, batch_size: int | str = 1) -> dict:
    """Runs lm-evaluation-harness tasks on an HF directory; returns its results dict (``results[task][metric]``).

    Raises:
        RuntimeError: lm-eval (or vLLM for ``backend="vllm"``) is not installed; the message says what to install.
    """
    if importlib.util.find_spec("lm_eval") is None:
        raise RuntimeError("lm-evaluation-harness is not installed: pip install 'titan_sft[eval]' (or lm-eval)")
    backend = backend or default_backend()
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise RuntimeError("--backend vllm needs vLLM (pip install vllm, GPU); or use --backend hf")
    import lm_eval
    from lm_eval.tasks import TaskManager

    dtype = "bfloat16" if backend == "vllm" else ("bfloat16" if torch.cuda.is_available() else "float32")
    model_args = f"pretrained={Path(hf_dir).resolve()},dtype={dtype}"
    if backend == "hf":
        model_args += f",device={'cuda' if torch.cuda.is_available() else 'cpu'}"
    out = lm_eval.simple_evaluate(model=backend, model_args=model_args, tasks=tasks, limit=limit,
                                  batch_size=batch_size, task_manager=TaskManager(include_path=include_path),
                                  log_samples=False)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_sft.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, help="HF directory (e.g. <dump_folder>/hf/step-<L>)")
    ap.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    ap.add_argument("--backend", choices=["vllm", "hf"], default=None, help="default: vllm on a GPU with vLLM, else hf")
    ap.add_argument("--include-path", default=None, help="folder of extra task YAMLs")
    ap.add_argument("--limit", type=int, default=None, help="examples per task (for a quick look)")
    ap.add_argument("--batch-size", default="1")
    ap.add_argument("--output", default=None, help="write the results JSON here")
    a = ap.parse_args(argv)
    if not (Path(a.hf) / "config.json").is_file():
        print(f"evaluate: error: {a.hf} is not an HF directory (no config.json)", file=sys.stderr)
        return 2
    try:
        out = run_lm_eval(a.hf, [t for t in a.tasks.split(",") if t], a.backend, a.include_path, a.limit,
                          int(a.batch_size) if a.batch_size.isdigit() else a.batch_size)
    except RuntimeError as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 2
    from lm_eval.utils import make_table

    print(make_table(out))
    if a.output:
        Path(a.output).write_text(json.dumps({"results": out["results"], "config": out.get("config", {})},
                                             indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
