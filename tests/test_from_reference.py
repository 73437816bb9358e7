"""A run of the Levanter-port SFT script continues under titan_sft (issue 38, item 8): ``convert from-reference``.

The reference checkpoint is written here the way that script writes it: a wrapper module holding the transformers
model as ``hf_model``, torch's AdamW with its two groups, ``get_state_dict(wrapper, optimizer)`` saved with DCP as
``{"model": ..., "optim": ...}`` and ``meta.json`` ``{"step": completed steps}``. Its state is a titan_sft run's
state at step 3, so the steps after it have known losses: the converted run must give them exactly."""

import io
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict

from test_train_e2e import BASE, ROOT, run
from titan_sft.models.hf_adapter import native_to_hf_name

DEBUG_BASE = ROOT / "titan_sft/assets/debug_base"
SCHEDULE = ["--training.steps", "5", "--checkpoint.interval", "2", "--optimizer.weight_decay", "0.01"]


def read_all(path):
    """Every entry of a DCP directory by its flat key (tensors and unpickled values)."""
    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    out = {k: torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else io.BytesIO()
           for k, v in md.items()}
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def write_reference_checkpoint(titan_ckpt, out, step, weight_decay=None):
    """The old script's checkpoint of the state in the titan_sft checkpoint ``titan_ckpt`` (weights, Adam moments
    and their step), with its decay group's ``weight_decay`` replaced when given."""
    from transformers import AutoConfig, Qwen3ForCausalLM

    class Wrapper(torch.nn.Module):  # the reference's FSDP1 root module
        def __init__(self, hf_model):
            super().__init__()
            self.hf_model = hf_model

    saved = read_all(titan_ckpt)
    hf = Qwen3ForCausalLM(AutoConfig.from_pretrained(DEBUG_BASE)).float()
    names = {native_to_hf_name(k[len("model."):]): k[len("model."):] for k in saved if k.startswith("model.")}
    hf.load_state_dict({h: saved[f"model.{n}"] for h, n in names.items()}, strict=False)
    hf.tie_weights()
    wrapper = Wrapper(hf)
    params = dict(wrapper.named_parameters())
    decayed = {h for h, n in names.items() if saved[f"optimizer.param_groups.{n}.weight_decay"] > 0}
    wd = saved[f"optimizer.param_groups.{names['model.norm.weight']}.weight_decay"]  # 0: the recipe's mask
    decay_value = next(saved[f"optimizer.param_groups.{names[h]}.weight_decay"] for h in decayed)
    groups = [{"params": [params[f"hf_model.{h}"] for h in names if h in decayed],
               "weight_decay": decay_value if weight_decay is None else weight_decay},
              {"params": [params[f"hf_model.{h}"] for h in names if h not in decayed], "weight_decay": wd}]
    first = names["model.embed_tokens.weight"]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=tuple(saved[f"optimizer.param_groups.{first}.betas"]),
                            eps=saved[f"optimizer.param_groups.{first}.eps"])
    for h, n in names.items():
        opt.state[params[f"hf_model.{h}"]] = {m: saved[f"optimizer.state.{n}.{m}"].clone()
                                              for m in ("step", "exp_avg", "exp_avg_sq")}
    model_sd, optim_sd = get_state_dict(wrapper, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out), no_dist=True)
    (out / "meta.json").write_text(json.dumps({"step": step, "label": step - 1}))
    return model_sd, optim_sd


def convert(reference, dump, *overrides, nproc=0):
    """``convert from-reference`` (under torchrun on ``nproc`` processes when given) with the test's config."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    cmd = [sys.executable, *launcher, "-m", "titan_sft.convert", "from-reference", "--reference", str(reference),
           "--config", "train_configs/debug_model.toml", *BASE, *SCHEDULE, "--job.dump_folder", str(dump),
           *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_reference_checkpoint_continues_with_the_same_losses(tmp_path):
    """Steps 4 and 5 after the step-3 checkpoint imported on 2 ranks equal the uninterrupted run's (the weights, both Adam
    moments, Adam's step, the schedule and the data position all carried over; weight decay on, tied model); a
    reference run optimized with another weight decay is refused with one line naming it."""
    straight = run(1, tmp_path / "straight", *SCHEDULE)
    assert [r["step"] for r in straight if "loss" in r][-2:] == [4, 5]
    reference = tmp_path / "old" / "checkpoints" / "step-2"
    model_sd, optim_sd = write_reference_checkpoint(tmp_path / "straight" / "checkpoints" / "step-2", reference, 3)
    assert "hf_model.lm_head.weight" in model_sd and "hf_model.model.norm.weight" in optim_sd["state"]
    assert len(optim_sd["param_groups"]) == 2

    proc = convert(reference, tmp_path / "new", nproc=2)  # each of 2 FSDP ranks reads its shards
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((tmp_path / "new" / "checkpoints" / "step-2" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["sampler"]["step"] == 3 and meta["imported_from"] == str(reference)
    assert meta["lr_scheduler"]["last_epoch"] == 3
    continued = run(1, tmp_path / "new", *SCHEDULE)
    want = {r["step"]: r["loss"] for r in straight if "loss" in r}
    got = {r["step"]: r["loss"] for r in continued if "loss" in r}
    assert sorted(got) == [4, 5]
    assert got == {4: want[4], 5: want[5]}

    bad = convert(reference, tmp_path / "bad", "--optimizer.weight_decay", "0.1")
    assert bad.returncode == 2
    line = bad.stderr.strip().splitlines()[-1]
    assert "weight_decay 0.01" in line and "0.1" in line and "optimizer.weight_decay" in line, line


@pytest.mark.parametrize("overrides, message", [
    (["--model.converters", "lora"], "remove 'lora'"),
    (["--validation.holdout_fraction", "0.1"], "validation.holdout_fraction"),
])
def test_what_cannot_continue_the_reference_is_refused_with_one_line(tmp_path, overrides, message):
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / ".metadata").write_bytes(b"")
    (ref / "meta.json").write_text(json.dumps({"step": 3}))
    proc = convert(ref, tmp_path / "run", *overrides)
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1], proc.stderr
    missing = convert(tmp_path / "nothing", tmp_path / "run")
    assert missing.returncode == 2 and "not a reference checkpoint" in missing.stderr, missing.stderr
