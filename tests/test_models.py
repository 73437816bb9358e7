"""Native models equal the transformers reference: logits, packed documents, gradients, parameter counts."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import save_tiny_hf

from titan_sft.models import build_model, load_hf
from titan_sft.models.attention import positions_from_cu_seqlens
from titan_sft.models.hf_adapter import hf_config_from_args, native_to_hf_name
from titan_sft.models.llama3 import LLAMA3_FLAVORS
from titan_sft.models.qwen3 import QWEN3_FLAVORS
from titan_sft.registry import get_train_spec

KINDS = ["qwen3_tied", "qwen3_untied", "qwen3_yarn", "llama3"]


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_hf(request.param, path)
    return hf, path


def test_plain_batch_logits(pair):
    hf, path = pair
    model = load_hf(path)
    x = torch.randint(0, 320, (3, 40))
    with torch.no_grad():
        ref = hf(x).logits
        out = model(x)
    assert out.shape == (3, 40, 320)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("reset", [False, True])
def test_packed_rows_equal_documents_alone(pair, backend, reset):
    hf, path = pair
    model = load_hf(path, attention=backend)
    lens = [7, 30, 1, 22]  # the last one stands in for trailing padding
    docs = [torch.randint(0, 320, (1, n)) for n in lens]
    row = torch.cat(docs, dim=1)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pos = positions_from_cu_seqlens(cu, row.shape[1], reset=reset)
    with torch.no_grad():
        out = model(row, cu_seqlens=cu, positions=pos)
        for i, doc in enumerate(docs):
            ref = hf(doc).logits
            got = out[:, cu[i] : cu[i + 1]]
            assert (got - ref).abs().max().item() < 1e-5, (i, backend, reset)


def test_gradients_match(pair):
    hf, path = pair
    model = load_hf(path)
    x = torch.randint(0, 320, (2, 24))
    y = torch.randint(0, 320, (2, 24))
    F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).backward()
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    hf_params = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        ref = hf_params[native_to_hf_name(name)].grad
        rel = (p.grad - ref).norm() / ref.norm()
        assert rel.item() < 1e-5, name


def test_hidden_states_and_head_equal_logits(pair):
    """The training path (hidden states, then the objective's chunked head + CE) equals CE of the logits."""
    from titan_sft.loss import chunked_cross_entropy_sum

    _, path = pair
    model = load_hf(path)
    x = torch.randint(0, 320, (2, 24))
    y = torch.randint(0, 320, (2, 24))
    y[0, :5] = -100
    ref = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum", ignore_index=-100)
    loss = chunked_cross_entropy_sum(model(x, hidden_only=True), model.output.weight, y, 7)
    assert torch.allclose(loss, ref, rtol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_document_isolation_bitwise(pair, backend):
    _, path = pair
    model = load_hf(path, attention=backend)
    row = torch.randint(0, 320, (1, 48))
    cu = torch.tensor([0, 20, 48], dtype=torch.int32)
    other = row.clone()
    other[0, 20:] = torch.randint(0, 320, (28,))
    with torch.no_grad():
        a = model(row, cu_seqlens=cu, hidden_only=True)
        b = model(other, cu_seqlens=cu, hidden_only=True)
    assert torch.equal(a[:, :20], b[:, :20])
    assert not torch.equal(a[:, 20:], b[:, 20:])


def test_tied_model_shares_one_tensor(tmp_path):
    save_tiny_hf("qwen3_tied", tmp_path)
    model = load_hf(tmp_path)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == model.args.num_params()


@pytest.mark.parametrize(
    "family,flavor",
    [("qwen3", f) for f in QWEN3_FLAVORS] + [("llama3", f) for f in LLAMA3_FLAVORS],
)
def test_param_count_equals_hf(family, flavor):
    from transformers import AutoConfig, AutoModelForCausalLM

    args = (QWEN3_FLAVORS if family == "qwen3" else LLAMA3_FLAVORS)[flavor]
    native = build_model(args)  # meta device
    spec = get_train_spec(family)
    cfg = hf_config_from_args(args, spec.hf_model_type, spec.hf_architecture)
    hf_cfg = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    n_native = sum(p.numel() for p in native.parameters())
    n_hf = sum(p.numel() for p in hf.parameters())
    assert n_native == n_hf == args.num_params()
    assert all(p.is_meta for p in native.parameters())


def test_load_hf_names_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny_hf("qwen3_untied", tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight|layers.1.feed_forward.w3.weight"):
        load_hf(tmp_path)


def test_load_hf_names_shape_mismatch(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny_hf("llama3", tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.embed_tokens.weight"] = torch.zeros(321, 64)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):
        load_hf(tmp_path)


def test_legacy_rope_config_keys():
    from titan_sft.models.hf_adapter import args_from_hf_config

    legacy = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
              "intermediate_size": 128, "vocab_size": 10, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    args = args_from_hf_config(legacy)
    assert args.rope_theta == 500000.0 and args.rope_scaling.factor == 8.0 and args.head_dim == 16
    new = hf_config_from_args(args, "llama", "LlamaForCausalLM")
    again = args_from_hf_config(new)
    assert again.rope_scaling == args.rope_scaling and again.rope_theta == args.rope_theta


def test_yarn_logits_past_the_original_context_and_config_round_trip(tmp_path):
    """Qwen3 with YaRN (factor 4 over 64 original positions) equals transformers at positions up to 4x the original
    context; the exported config.json says the same scaling; model.yarn_factor puts it on a model without any."""
    import dataclasses

    from titan_sft.config import load_config
    from titan_sft.hf_io import model_args
    from titan_sft.models.hf_adapter import args_from_hf_config
    from titan_sft.models.transformer import rope_attention_factor

    hf = save_tiny_hf("qwen3_yarn", tmp_path)
    model = load_hf(tmp_path)
    assert model.args.rope_scaling.rope_type == "yarn" and rope_attention_factor(model.args) == pytest.approx(
        0.1 * math.log(4.0) + 1.0)
    x = torch.randint(0, 320, (1, 256))
    with torch.no_grad():
        assert (model(x) - hf(x).logits).abs().max().item() < 1e-5
    again = args_from_hf_config(hf_config_from_args(model.args, "qwen3", "Qwen3ForCausalLM"))
    assert again.rope_scaling == model.args.rope_scaling
    cfg = load_config(None, ["--model.yarn_factor", "4", "--model.yarn_original_positions", "64"])
    args = model_args(cfg.model, get_train_spec("qwen3"))
    assert args.rope_scaling.factor == 4.0 and args.rope_scaling.original_max_position_embeddings == 64
    assert args.max_seq_len == 256
    # YaRN changes the numbers: the same weights without it give other logits
    plain = build_model(dataclasses.replace(model.args, rope_scaling=None), "cpu")
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (plain(x) - hf(x).logits).abs().max().item() > 1e-3


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_packed_rows_get_per_row_masks(pair, backend):
    """Two packed rows in one microbatch: the sdpa mask is [rows, 1, T, T] (none spans both rows) and each row's
    output equals the row run alone."""
    _, path = pair
    model = load_hf(path, attention=backend)
    x = torch.randint(0, 320, (2, 24))
    cu = torch.tensor([0, 10, 24, 48], dtype=torch.int32)  # row 0: docs of 10 and 14; row 1: one doc of 24
    mask = model.backend.prepare(2, 24, torch.device("cpu"), cu)
    if backend == "sdpa":
        assert mask.dense.shape == (2, 1, 24, 24)
    with torch.no_grad():
        both = model(x, cu_seqlens=cu)
        first = model(x[:1], cu_seqlens=torch.tensor([0, 10, 24], dtype=torch.int32))
        second = model(x[1:], cu_seqlens=torch.tensor([0, 24], dtype=torch.int32))
    assert (both[0] - first[0]).abs().max() < 1e-5 and (both[1] - second[0]).abs().max() < 1e-5
