"""``python -m titan_sft.generate --model DIR``: the masked-diffusion sampler (LLaDA low-confidence remasking) on
a trained model, in one process.

DIR is any of
* a DCP checkpoint of a run (``checkpoints/step-<L>``, ``checkpoints-best``): the model is rebuilt from the
  run's saved config, LoRA adapters included;
* an HF export (``hf/step-<L>``, config.json + safetensors);
* a PEFT adapter directory (``adapters/step-<L>``): its base model (``base_model_name_or_path``, or ``--base``)
  with the adapters and trained norms applied.
The mask token comes from ``--mask-token-id``, else from the ``objective.json`` a masked-diffusion run writes
beside its exports and in its run folder.

    python -m titan_sft.generate --model outputs/diffusion/hf/step-299 --prompt "upper: abcd" --gen-length 16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from titan_sft.diffusion_sampler import answer_tokens, end_token_ids, generate


class GenerateError(RuntimeError):
    pass


def _objective_record(*dirs: Path) -> dict:
    for d in dirs:
        f = d / "objective.json"
        if f.is_file():
            return json.loads(f.read_text())
    return {}


def load_adapter(model: torch.nn.Module, adapter_dir: Path) -> None:
    """Applies a PEFT LoRA adapter directory (written by titan_sft or PEFT) to a native model, in place."""
    from titan_sft.config import JobConfig
    from titan_sft.lora import EXPERT_TARGETS, TARGETS, apply_lora, is_adapter_key, read_peft_adapter

    conf, state = read_peft_adapter(adapter_dir)
    cfg = JobConfig()
    cfg.lora.rank, cfg.lora.alpha = int(conf["r"]), float(conf["lora_alpha"])
    cfg.lora.use_rslora, cfg.lora.use_dora = bool(conf.get("use_rslora")), bool(conf.get("use_dora"))
    cfg.lora.experts = bool(conf.get("titan_sft_expert_adapters"))  # the routed experts' adapters too
    targets = conf["target_modules"]
    cfg.lora.targets = sorted(targets) if isinstance(targets, list) else [t for t in TARGETS if t in targets]
    # the routed experts' targets (and a dense MLP's beside them) are not in target_modules: PEFT names them apart
    cfg.lora.targets = sorted({*cfg.lora.targets, *conf.get("titan_sft_dense_mlp_adapters", []),
                               *(hf for hf, w in EXPERT_TARGETS.items() if any(k.endswith(f".{w}_lora_a") for k in state))})
    cfg.lora.dropout = 0.0
    apply_lora(model, cfg)
    missing = [n for n, _ in model.named_parameters() if is_adapter_key(n) and n not in state]
    if missing:
        raise GenerateError(f"{adapter_dir}: the adapter lacks {missing[0]} (and {len(missing) - 1} more)")
    model.load_state_dict(state, strict=False)


def load_model(path: str, base: str | None = None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer directory, objective record) for a checkpoint, HF export or adapter directory."""
    from titan_sft.models import load_hf

    d = Path(path)
    if (d / "meta.json").is_file():
        from titan_sft.convert import model_from_checkpoint

        model, cfg, _, _ = model_from_checkpoint(d)
        tok = cfg.model.tokenizer_path or cfg.model.hf_assets_path
        return model.to(dtype), tok, _objective_record(d.parent, d.parent.parent)
    if (d / "adapter_config.json").is_file():
        conf = json.loads((d / "adapter_config.json").read_text())
        base = base or conf.get("base_model_name_or_path")
        if not base:
            raise GenerateError(f"{d}: the adapter names no base model; pass --base HF_DIR")
        model = load_hf(base, dtype=dtype)
        load_adapter(model, d)
        return model, base, {**_objective_record(Path(base)), **_objective_record(d, d.parent.parent)}
    if (d / "config.json").is_file():
        return load_hf(d, dtype=dtype), str(d), _objective_record(d, d.parent.parent)
    raise GenerateError(f"{d}: not a checkpoint (meta.json), an HF export (config.json) or an adapter directory "
                        "(adapter_config.json)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_sft.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint, HF export or adapter directory")
    ap.add_argument("--base", default=None, help="base HF directory of an adapter (default: its config's)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    ap.add_argument("--prompt", action="append", default=[], help="a user message (repeatable)")
    ap.add_argument("--prompts", default=None, help="JSONL of chat or instruction rows (their prompts are used)")
    ap.add_argument("--raw", action="store_true", help="use --prompt text as is, without the chat template")
    ap.add_argument("--mask-token-id", type=int, default=None)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--remasking", choices=["low_confidence", "random"], default="low_confidence")
    ap.add_argument("--cfg-scale", type=float, default=0.0)
    ap.add_argument("--no-early-eos", action="store_true", help="never generate end-of-text / end-of-turn tokens")
    ap.add_argument("--confidence-eos-eot-inf", action="store_true",
                    help="reveal drawn end-of-text / end-of-turn tokens after every other position of their block")
    ap.add_argument("--system-prompt", default="", help="a system turn for every chat prompt without one")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first prompt (prompt i uses seed + i)")
    ap.add_argument("--max-examples", type=int, default=1000)
    ap.add_argument("--out", default=None, help="write one JSON object per prompt here (default: stdout)")
    a = ap.parse_args(argv)
    try:
        from titan_sft.data.chat import load_tokenizer
        from titan_sft.diffusion_sampler import inline_prompts, load_prompts

        model, tok_dir, record = load_model(a.model, a.base)
        tokenizer = load_tokenizer(a.tokenizer or tok_dir)
        mask_id = a.mask_token_id if a.mask_token_id is not None else record.get("mask_token_id")
        if mask_id is None:
            raise GenerateError("no mask token: pass --mask-token-id (no objective.json beside the model)")
        if not 0 <= mask_id < model.args.vocab_size:
            raise GenerateError(f"--mask-token-id {mask_id} is outside the embedding table (0 .. "
                                f"{model.args.vocab_size - 1})")
        prompts: list[tuple[list[int], str | None]] = []
        if a.raw:
            prompts += [(tokenizer.encode(text, add_special_tokens=False), None) for text in a.prompt]
        else:
            prompts += inline_prompts(a.prompt, tokenizer, a.system_prompt)
        if a.prompts:
            prompts += load_prompts(a.prompts, tokenizer, a.max_examples, a.system_prompt)
        if not prompts:
            raise GenerateError("no prompts: give --prompt TEXT or --prompts FILE")
        model.backend.causal = False  # masked diffusion: bidirectional attention
        shift = bool(record.get("shift"))  # trained Dream-style: read position i's prediction at i - 1
        end_ids = end_token_ids(tokenizer)
        out = open(a.out, "w") if a.out else sys.stdout
        for i, (prompt, ref) in enumerate(prompts):
            ids = generate(lambda x: model(x), torch.tensor(prompt), mask_id=mask_id, gen_length=a.gen_length,
                           block_length=a.block_length, steps=a.steps, temperature=a.temperature,
                           remasking=a.remasking, cfg_scale=a.cfg_scale,
                           forbid_ids=end_ids if a.no_early_eos else None,
                           late_ids=end_ids if a.confidence_eos_eot_inf else None, seed=a.seed + i, shift=shift)
            toks = answer_tokens(ids.tolist(), end_ids)
            row = {"index": i, "prompt": tokenizer.decode(prompt), "text": tokenizer.decode(toks, skip_special_tokens=True),
                   "n_tokens": len(toks)}
            if ref is not None:
                row["reference"] = ref
            out.write(json.dumps(row) + "\n")
            out.flush()
        if a.out:
            out.close()
    except (GenerateError, FileNotFoundError, ValueError, KeyError) as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
