"""Qwen3.5's released checkpoints are multimodal (``Qwen3_5ForConditionalGeneration``): the language model nested
under ``model.language_model.``, a vision tower under ``model.visual.``, a multi-token-prediction head under
``mtp.``, and (MoE) the routed experts stored fused. A text run reads the language model alone; its export is the
whole model again (vision tower, mtp and processor files carried through unchanged), and its adapters load in PEFT
on the multimodal model."""

import json

import pytest
import torch

from titan_sft.models import load_hf

VOCAB = 96
_TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
             linear_num_value_heads=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                    "linear_attention"])
_VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, out_hidden_size=64,
               num_position_embeddings=16)
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 4}


def _multimodal(kind: str, path):
    """A random multimodal checkpoint written as the hub's are: the in-memory names (fused experts), no
    ``lm_head.weight`` when tied, plus an mtp tensor and a processor file; returns the transformers model."""
    from safetensors.torch import save_file
    from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration)

    torch.manual_seed(0)
    if kind == "moe":
        text = dict(_TEXT, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
                    num_experts_per_tok=2)
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=_VISION,
                                                                    tie_word_embeddings=False))
    else:
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=dict(_TEXT, intermediate_size=80),
                                                              vision_config=_VISION, tie_word_embeddings=True))
    with torch.no_grad():  # non-trivial norm weights (the offset norms start at 0)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0, 0.2)
    model = model.float().eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    state["mtp.fc.weight"] = torch.randn(64, 128)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return model


@pytest.fixture(scope="module", params=["dense", "moe"])
def base(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "base"
    return _multimodal(request.param, path), path


def test_the_language_model_reads_equal_to_transformers_by_both_readers(base):
    """load_hf (one process) and the distributed reader (DCP over the safetensors; fused q/k/v rows and expert
    slices per rank) give the same tensors bit for bit, and the logits equal transformers' multimodal model on
    text (1e-5). A rank's slice of the fused experts equals that slice of the whole stacked tensor."""
    from titan_sft.hf_io import model_args, read_hf_weights
    from titan_sft.config import load_config
    from titan_sft.models.hf_checkpoint import index_hf_tensors, read_expert_rows
    from titan_sft.registry import get_train_spec

    hf, path = base
    model = load_hf(path)
    x = torch.randint(0, VOCAB, (2, 70))
    with torch.no_grad():
        assert (model(x) - hf(input_ids=x).logits).abs().max().item() < 1e-5
    name = "qwen3_5_moe" if model.args.n_experts else "qwen3_5"
    cfg = load_config(None, ["--model.name", name, "--model.init_from_hf", "true", "--model.hf_assets_path", str(path)])
    spec = get_train_spec(name)
    assert model_args(cfg.model, spec).layer_types == model.args.layer_types  # model_type read from text_config
    state = model.state_dict()
    if model.args.tie_embeddings:
        state.pop("output.weight")
    read = read_hf_weights({k: tuple(v.shape) for k, v in state.items()}, model.args, path, spec)
    assert all(torch.equal(read[k], v) for k, v in state.items())
    index = index_hf_tensors(path)
    assert index.multimodal and set(index.carried) >= {"mtp.fc.weight"}
    assert any(n.startswith("model.visual.") for n in index.carried)
    if model.args.n_experts:
        assert index.fused_experts
        for w in ("w1", "w2", "w3"):
            full = state[f"layers.0.feed_forward.experts.{w}"]
            part = read_expert_rows(index, f"layers.0.feed_forward.experts.{w}", 4, range(1, 3), slice(3, 9),
                                    slice(5, 20))
            assert torch.equal(part, full[1:3, 3:9, 5:20]), w


def test_export_is_the_whole_multimodal_model_and_its_adapter_loads_in_peft(base, tmp_path):
    """An export of a (LoRA-trained) run from the multimodal base: transformers loads it as the multimodal model
    (and AutoModelForCausalLM as its language model) with no missing or unexpected tensor and its text logits equal
    titan_sft's (1e-5); the vision tower, the mtp
    head and the processor file are the base's bit for bit; experts stay fused; the export reads back bitwise;
    the PEFT adapter (nested names) on the multimodal base gives the same logits, and titan_sft reads it back."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from titan_sft.config import load_config
    from titan_sft.hf_io import export_hf
    from titan_sft.lora import apply_lora, is_adapter_key, read_peft_adapter
    from titan_sft.registry import get_train_spec

    hf, path = base
    model = load_hf(path)
    kind = type(hf)
    cfg = load_config(None, ["--model.converters", "lora", "--lora.rank", "4", "--lora.alpha", "8", "--lora.targets",
                             "q_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,out_proj,gate_proj,up_proj,down_proj"])
    apply_lora(model, cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("lora_a", "lora_b")):
                p.normal_(std=0.1)
    spec = get_train_spec("qwen3_5_moe" if model.args.n_experts else "qwen3_5")
    out = export_hf(model, model.args, tmp_path / "hf", "float32", spec=spec, lora=cfg.lora,
                    adapter_dir=tmp_path / "adapter", base_model=str(path))
    written, source = load_file(str(out / "model.safetensors")), load_file(str(path / "model.safetensors"))
    carried = [k for k in source if k.startswith(("model.visual.", "mtp."))]
    assert carried and all(torch.equal(written[k], source[k]) for k in carried)
    assert written.keys() == source.keys()  # same layout: nesting, fused experts, tied head left out
    assert json.loads((out / "preprocessor_config.json").read_text()) == PREPROCESSOR
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == hf.config.architectures and config["vision_config"]["depth"] == 1
    again, info = kind.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    x = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        ours = model(x)
        assert (again.eval()(input_ids=x).logits - ours).abs().max().item() < 1e-5
        assert (load_hf(out)(x) - ours).abs().max().item() < 1e-5
    from transformers import AutoModelForCausalLM  # what evaluate loads: the language model of the export

    text, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert (text.eval()(x).logits - ours).abs().max().item() < 1e-5
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.model.language_model.") for k in adapter if "lora_" in k)
    peft = PeftModel.from_pretrained(kind.from_pretrained(path, dtype=torch.float32), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert (peft(input_ids=x).logits - ours).abs().max().item() < 1e-5
    _, back = read_peft_adapter(tmp_path / "adapter")
    params = dict(model.named_parameters())  # the adapters, and the norms (trained by default with LoRA)
    assert {n for n in params if is_adapter_key(n)} < back.keys()
    assert all(torch.equal(v, params[k]) for k, v in back.items())
