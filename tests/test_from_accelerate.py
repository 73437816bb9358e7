"""A run of the masked-diffusion reference trainer continues under titan_sft (issue 38, item 7):
``convert from-accelerate``.

The reference checkpoint is written here by Accelerate's own ``save_state`` over the objects that trainer builds:
the transformers model with PEFT LoRA (norms made trainable), torch's AdamW over the trainable parameters in the
PEFT model's order, a transformers scheduler. Its state is a titan_sft run's state after 3 updates, so the steps
after it have known losses: the imported run must give them exactly."""

import json
import os
import subprocess
import sys

import pytest
import torch

from test_from_reference import read_all
from test_warm_start import FAST, ROOT, _run
from titan_sft.models.hf_adapter import native_to_hf_name

DEBUG_BASE = ROOT / "titan_sft/assets/debug_base"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# 5 updates, transformers' linear schedule with one warmup step, decay on every trainable tensor (the reference's)
SCHEDULE = ["--training.steps", "5", "--checkpoint.interval", "2", "--checkpoint.enable", "true",
            "--checkpoint.hf_export_interval", "-1", "--lr_scheduler.name", "linear", "--lr_scheduler.warmup", "0",
            "--lr_scheduler.warmup_steps", "1", "--optimizer.weight_decay", "0.01", "--optimizer.decay_mask", "all"]


def peft_name(native: str) -> str:
    """The PEFT model's parameter name of a titan_sft LoRA run's trainable tensor."""
    for kind, factor in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
        if native.endswith(kind):
            return "base_model.model." + native_to_hf_name(native[: -len(kind)] + "weight")[: -len(".weight")] + \
                f".{factor}.default.weight"
    return "base_model.model." + native_to_hf_name(native)


def write_accelerate_checkpoint(titan_ckpt, out, updates, lr=3e-3):
    """The reference trainer's ``checkpoint-N`` of the state in the LoRA run's checkpoint ``titan_ckpt``, written by
    ``Accelerator.save_state``; returns the PEFT model's trainable names in its optimizer's order."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, get_scheduler

    saved = read_all(titan_ckpt)
    natives = [k[len("model."):] for k in saved if k.startswith("model.")]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(DEBUG_BASE, dtype=torch.float32),
                           LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    for name, p in model.named_parameters():
        if "norm" in name:
            p.requires_grad_(True)  # the reference unfreezes the normalisation weights
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in natives:
            params[peft_name(n)].copy_(saved[f"model.{n}"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(trainable) == sorted(peft_name(n) for n in natives)
    first = natives[0]
    opt = torch.optim.AdamW([params[n] for n in trainable], lr=lr,
                            betas=tuple(saved[f"optimizer.param_groups.{first}.betas"]),
                            eps=saved[f"optimizer.param_groups.{first}.eps"],
                            weight_decay=saved[f"optimizer.param_groups.{first}.weight_decay"])
    by_peft = {peft_name(n): n for n in natives}
    for n in trainable:
        opt.state[params[n]] = {m: saved[f"optimizer.state.{by_peft[n]}.{m}"].clone()
                                for m in ("step", "exp_avg", "exp_avg_sq")}
    sched = get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=5)
    for _ in range(updates):
        sched.step()
    accelerator = Accelerator(cpu=True)
    try:
        model, opt, sched = accelerator.prepare(model, opt, sched)
        accelerator.save_state(str(out))
    finally:
        AcceleratorState._reset_state(True)
    (out / "state.json").write_text(json.dumps({"completed_updates": updates}))  # the trainer's own file
    return trainable


def convert(checkpoint, dump, *overrides, nproc=0):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    cmd = [sys.executable, *launcher, "-m", "titan_sft.convert", "from-accelerate", "--checkpoint", str(checkpoint),
           "--config", "train_configs/debug_diffusion.toml", *FAST, *SCHEDULE, "--job.dump_folder", str(dump),
           *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def last_line(proc):
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_an_accelerate_checkpoint_continues_with_the_same_losses(tmp_path):
    """Steps 4 and 5 after the imported update-3 checkpoint (2 FSDP ranks) equal the uninterrupted LoRA run's
    losses and grad norms: the adapters, trained norms, both Adam moments and Adam's step, the schedule and the
    data position carried over (weight decay on every trainable tensor, tied model). A schedule, a decay or a base
    that differs is refused with one line naming it."""
    _, straight = _run(tmp_path / "straight", *SCHEDULE)
    ckpt = tmp_path / "old" / "checkpoint-3"
    order = write_accelerate_checkpoint(tmp_path / "straight" / "checkpoints" / "step-2", ckpt, 3)
    assert {p.name for p in ckpt.iterdir()} >= {"model.safetensors", "optimizer.bin", "scheduler.bin"}
    # the order the importer rebuilds is the one the reference's AdamW numbered
    from titan_sft.config import load_config
    from titan_sft.from_accelerate import native_name, peft_trainable_order

    cfg = load_config("train_configs/debug_diffusion.toml", [])
    assert peft_trainable_order(cfg) == [native_name(n) for n in order]

    proc = convert(ckpt, tmp_path / "new", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[import]" in proc.stdout and "update 3" in proc.stdout
    meta = json.loads((tmp_path / "new" / "checkpoints" / "step-2" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["sampler"]["step"] == 3 and meta["lr_scheduler"]["last_epoch"] == 3
    _, continued = _run(tmp_path / "new", *SCHEDULE)
    want = {r["step"]: (r["loss"], r["grad_norm"]) for r in straight}
    got = {r["step"]: (r["loss"], r["grad_norm"]) for r in continued}
    assert sorted(got) == [4, 5]
    for step in (4, 5):
        assert got[step][0] == pytest.approx(want[step][0], rel=1e-6, abs=0), step
        assert got[step][1] == pytest.approx(want[step][1], rel=1e-5, abs=0), step

    bad = convert(ckpt, tmp_path / "sched", "--lr_scheduler.name", "constant_with_warmup")
    assert bad.returncode == 2 and "scheduler.bin" in last_line(bad) and "lr_scheduler" in last_line(bad), bad.stderr
    bad = convert(ckpt, tmp_path / "wd", "--optimizer.decay_mask", "recipe")
    assert bad.returncode == 2 and "weight_decay 0.01" in last_line(bad) and "decay_mask" in last_line(bad)
    bad = convert(ckpt, tmp_path / "rank", "--lora.targets", '["q_proj","v_proj"]')
    assert bad.returncode == 2 and "lora.targets" in last_line(bad), bad.stderr


def test_what_cannot_continue_the_reference_is_refused_with_one_line(tmp_path):
    """Not an Accelerate folder, no LoRA, another objective, a folder with checkpoints: one line each."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "random_states_0.pkl").write_bytes(b"")
    cases = [(tmp_path / "ckpt", [], "needs model.safetensors or pytorch_model.bin"),
             (tmp_path / "ckpt", ["--model.converters", "[]"], "add 'lora'"),
             (tmp_path / "ckpt", ["--objective.name", "causal_lm"], "objective.name"),
             (tmp_path / "nothing", [], "no such directory")]
    for ckpt, overrides, message in cases:
        proc = convert(ckpt, tmp_path / "run", *overrides)
        assert proc.returncode == 2 and message in last_line(proc), (overrides, proc.stderr[-2000:])
