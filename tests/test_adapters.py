"""Adapters a user can serve (issue 19, item 1): every LoRA run writes adapters/final, and adapters/best beside its
best checkpoint, as PEFT saves them, with the tokenizer and the norms' values before training; the best checkpoint
holds the trainable state only; peft and titan_sft read the same model from each; vLLM's LoRA rules are checked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "titan_sft/assets/debug_base"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("adapters") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "titan_sft.train", "--config", "train_configs/debug_diffusion.toml", "--job.dump_folder", str(dump),
           "--training.steps", "6", "--validation.interval", "2", "--validation.generation_every", "0",
           "--validation.test_path", "", "--training.per_device_batch", "4", "--checkpoint.interval", "100",
           "--checkpoint.hf_export_interval", "-1", "--optimizer.lr", "2e-2", "--metrics.enable_tensorboard", "false"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return dump


def _peft_logits(adapter, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32, attn_implementation="sdpa")
    model = PeftModel.from_pretrained(hf, adapter).eval()
    full = torch.ones(ids.shape[0], 1, ids.shape[1], ids.shape[1], dtype=torch.bool)  # bidirectional
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=full).logits


@pytest.mark.slow
def test_final_and_best_adapters_load_in_peft_as_titan_sft_reads_them(run):
    from safetensors.torch import load_file

    from titan_sft.generate import load_model

    for name in ("final", "best"):
        d = run / "adapters" / name
        for f in ("adapter_config.json", "adapter_model.safetensors", "initial_norms.safetensors",
                  "objective.json", "tokenizer_config.json"):
            assert (d / f).is_file(), (name, f)
    ids = torch.randint(3, 280, (2, 24))
    for adapter, ours in ((run / "adapters" / "final", run / "adapters" / "final"),
                          (run / "adapters" / "best", run / "checkpoints-best")):
        model, _, _ = load_model(str(ours))  # titan_sft's reader: the adapter, or the trainable-only checkpoint
        model.backend.causal = False
        with torch.no_grad():
            mine = model(ids)
        assert (_peft_logits(adapter, ids) - mine).abs().max() < 1e-5, adapter
    # the norms before training are the base model's
    base = load_file(str(BASE / "model.safetensors"))
    initial = load_file(str(run / "adapters" / "final" / "initial_norms.safetensors"))
    assert initial and all(torch.equal(v.float(), base[k].float()) for k, v in initial.items())
    trained = load_file(str(run / "adapters" / "final" / "adapter_model.safetensors"))
    norm = "base_model.model.model.layers.0.input_layernorm.weight"
    assert not torch.equal(trained[norm].float(), base["model.layers.0.input_layernorm.weight"].float())


@pytest.mark.slow
def test_best_checkpoint_holds_no_frozen_tensor(run):
    from torch.distributed.checkpoint import FileSystemReader

    meta = json.loads((run / "checkpoints-best" / "meta.json").read_text())
    assert meta["base_identity"]["source"] == {"kind": "hf", "path": "titan_sft/assets/debug_base"}
    keys = set(FileSystemReader(str(run / "checkpoints-best")).read_metadata().state_dict_metadata)
    model = [k for k in keys if k.startswith("model.")]
    assert model and all(k.endswith(("lora_a", "lora_b")) or "norm" in k for k in model), sorted(model)[:5]
    # like every checkpoint of a run with a frozen base: the trainable state with its optimizer state
    assert all(k.startswith("optimizer.") for k in keys - set(model))


def test_vllm_rules_for_adapters(tmp_path):
    from titan_sft.config import load_config
    from titan_sft.lora import save_peft_adapter, vllm_lora_problems
    from titan_sft.models.hf_adapter import native_to_hf_name

    lo = load_config("train_configs/debug_diffusion.toml", []).lora
    state = {"layers.0.attention.wq.lora_a": torch.zeros(16, 128), "layers.0.attention.wq.lora_b": torch.zeros(128, 16),
             "layers.0.attention_norm.weight": torch.ones(128)}
    save_peft_adapter(state, lo, tmp_path / "plain", None, False, native_to_hf_name)
    assert vllm_lora_problems(tmp_path / "plain") == []
    save_peft_adapter(state, lo, tmp_path / "norms", None, True, native_to_hf_name)
    assert any("modules_to_save" in p for p in vllm_lora_problems(tmp_path / "norms"))


@pytest.mark.slow
def test_parameter_audit_counts_trainable_and_frozen_by_module_type(run):
    """Counted from the debug base's shapes (dim 128, 4 query and 2 key/value heads of 32, MLP 384, 4 layers, a
    512-token tied embedding) and the config's LoRA (rank 16 on all seven projections, trained norms)."""
    audit = json.loads((run / "parameter_audit.json").read_text())
    r, dim, q, kv, ffn, layers, vocab = 16, 128, 4 * 32, 2 * 32, 384, 4, 512
    projections = [(dim, q), (dim, kv), (dim, kv), (q, dim), (dim, ffn), (dim, ffn), (ffn, dim)]  # (in, out)
    adapters = layers * sum(r * (i + o) for i, o in projections)  # A: r x in, B: out x r
    base = layers * sum(i * o for i, o in projections)
    norms = layers * (2 * dim + 2 * 32) + dim  # input/post-attention norms, q/k norms; the final norm
    assert audit["by_module_type"] == {
        "Embedding": {"trainable": 0, "frozen": vocab * dim},  # the tied head counts once, here
        "LoRALinear": {"trainable": adapters, "frozen": base},
        "RMSNorm": {"trainable": norms, "frozen": 0},
    }, audit["by_module_type"]
    assert (audit["trainable"], audit["frozen"]) == (adapters + norms, base + vocab * dim) == (157056, 851968)
    # the trainable names: A and B of 7 projections and 4 norms per layer, and the final norm
    names = audit["trainable_names"]
    assert len(names) == layers * (7 * 2 + 4) + 1 and names == sorted(names)
    assert "layers.0.attention.wq.lora_a" in names and "layers.3.feed_forward.w2.lora_b" in names
    assert "norm.weight" in names and not any("tok_embeddings" in n or n.endswith("wq.weight") for n in names)


@pytest.mark.slow
def test_validation_records_carry_the_split_loss_components(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "titan_sft.train", "--config", "train_configs/debug_diffusion.toml",
           "--job.dump_folder", str(tmp_path), "--training.steps", "2", "--validation.interval", "2",
           "--validation.generation_every", "0", "--validation.test_path", "", "--objective.split_loss", "true",
           "--checkpoint.enable", "false", "--validation.keep_best", "false", "--checkpoint.hf_export_interval", "-1",
           "--metrics.enable_tensorboard", "false"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (val,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if json.loads(x)["split"] == "validation"]
    assert val["loss"] == pytest.approx(val["loss_answer"] + val["loss_padding"], rel=1e-12)
    assert val["loss_answer"] > 0 and val["loss_padding"] > 0
