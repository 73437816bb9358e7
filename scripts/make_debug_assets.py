"""Regenerates the embedded debug assets (deterministic):

* titan_sft/assets/debug_tokenizer/: a byte-level BPE tokenizer (256 byte tokens plus merges for the template's
  words only) with Qwen3's chat special tokens and the marked Qwen3 chat template;
* titan_sft/assets/debug_data/{train,heldout}.jsonl: a synthetic chat task with checkable answers
  ("upper: abcd" -> ABCD: four-letter words, so each answer character sits at a fixed distance from its source
  and the 0.9M-parameter debug model learns it in ~200 steps on CPU. Mixing in a second task ("reverse: abcd",
  "next: abcd" -> bcde) kept the same model at chance on the answers for 300 steps, too long for a debug job);
* titan_sft/assets/debug_data/packed/: train.jsonl packed at 256 tokens (python -m titan_sft.data.prepare);
* titan_sft/assets/debug_data/diffusion/: the same task as prompt/answer splits for masked diffusion (EOS-padded to
  32 tokens; 200 training rows held out for validation, heldout.jsonl as the test split);
* titan_sft/assets/debug_base/ (with --base): the debug model after the causal debug job (250 steps, ~2 minutes),
  exported in bfloat16: the "pretrained" base that train_configs/debug_diffusion.toml adapts with LoRA.

Run: python scripts/make_debug_assets.py [--base]
"""

import json
import random
import shutil
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent / "titan_sft" / "assets"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def make_tokenizer(out: Path) -> None:
    """Byte-level BPE whose only merges spell the chat template's words (user, assistant, newline pairs, the
    task word): conversations get short, while every letter of a task word stays a token of its own."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    snippets = ["system\n", "user\n", "assistant\n", "\n\n", "upper:"] * 50
    trainer = trainers.BpeTrainer(vocab_size=300, min_frequency=2, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(snippets, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    template = (ROOT / "chat_templates" / "qwen3_marked.jinja").read_text()
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "unk_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 4096, "chat_template": template}, indent=2))


def example(rng: random.Random) -> dict:
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(4))
    task = "upper"
    answer = word.upper()
    return {"messages": [{"role": "user", "content": f"{task}: {word}"}, {"role": "assistant", "content": answer}]}


def main() -> None:
    make_tokenizer(ROOT / "debug_tokenizer")
    rng = random.Random(0)
    data = ROOT / "debug_data"
    data.mkdir(parents=True, exist_ok=True)
    heldout = [example(rng) for _ in range(100)]
    seen = {json.dumps(x) for x in heldout}
    train = []
    while len(train) < 10000:
        x = example(rng)
        if json.dumps(x) not in seen:
            train.append(x)
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", heldout)):
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    sys.path.insert(0, str(ROOT.parent.parent))
    from titan_sft.data.prepare import prepare

    shutil.rmtree(data / "packed", ignore_errors=True)
    prepare([str(data / "train.jsonl")], str(ROOT / "debug_tokenizer"), 256, str(data / "packed"), workers=1)
    m = json.loads((data / "packed" / "manifest.json").read_text())
    m["tokenizer"] = "titan_sft/assets/debug_tokenizer"
    m["input_files"] = ["titan_sft/assets/debug_data/train.jsonl"]
    (data / "packed" / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")

    from titan_sft.data.prepare_diffusion import prepare_diffusion

    prepare_diffusion([str(data / "train.jsonl")], str(ROOT / "debug_tokenizer"), 32, str(data / "diffusion"),
                      eos_pad=True, test=[str(data / "heldout.jsonl")], validation_size=200, overwrite=True)
    if "--base" in sys.argv:
        make_debug_base()


def make_debug_base() -> None:
    import subprocess
    import tempfile

    repo = ROOT.parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["./run_train.sh", "--job.dump_folder", tmp, "--checkpoint.hf_export_interval", "-1",
                        "--validation.generation_eval_path", ""], cwd=repo, check=True)
        shutil.rmtree(ROOT / "debug_base", ignore_errors=True)
        subprocess.run([sys.executable, "-m", "titan_sft.convert", "to-hf", "--checkpoint",
                        f"{tmp}/checkpoints/step-249", "--out", str(ROOT / "debug_base"), "--dtype", "bfloat16"],
                       cwd=repo, check=True)


if __name__ == "__main__":
    main()
