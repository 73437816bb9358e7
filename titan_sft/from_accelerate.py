"""Continuing a run of the masked-diffusion reference trainer (Accelerate + PEFT LoRA) under titan_sft.

That trainer saves ``checkpoint-N/`` with Accelerate's ``save_state``: ``model.safetensors`` (or
``pytorch_model.bin``) holding the whole PEFT model's state dict (``base_model.model.<hf name>``, the adapted
projections' frozen weights as ``<module>.base_layer.weight`` and their factors as ``<module>.lora_A.<adapter>.weight``
/ ``lora_B``, the trained norms under their own names; a ``module.`` prefix when it ran under DDP),
``optimizer.bin`` (torch AdamW's ``state_dict()``: per-parameter state by index over its groups' ``params``),
``scheduler.bin`` (the LR scheduler's ``state_dict()``) and RNG states, plus the trainer's own ``state.json``.

What carries over, and how it is read:

- **Adapters and norms**: the trainable tensors of ``model.safetensors``; every frozen tensor in it must equal this
  config's base (``model.hf_assets_path``) at the file's precision, else the run trained another model.
- **Adam moments**: torch numbers a group's parameters in the order given to it, which for a PEFT model is
  ``named_parameters()`` order over the trainable ones. That order is rebuilt here from this config's model and
  LoRA settings (transformers + PEFT on the meta device, norms trainable as the reference has them) and every
  moment's shape is checked against its tensor. Weight decay, betas and eps must be this config's per parameter.
- **The update count**: AdamW's per-parameter ``step`` (equal for all). ``scheduler.bin`` is not used for it
  (Accelerate steps a scheduler once per process per update unless batches are split), but its last lr is
  checked against this config's schedule at the next update, so the continued run follows the reference's lr.
- **The data position**: the update count, in titan_sft's own order over the same prepared data. The reference's
  example order (its DataLoader's shuffle) and its masking noise (its RNG stream) are its own: the examples and
  the noise after the import are titan_sft's, as if titan_sft had run the first updates.

``state.json`` is not read: the count above comes from the optimizer and the schedule check.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from titan_sft.config import ConfigError, JobConfig, Parallelism

MOMENTS = ("step", "exp_avg", "exp_avg_sq")
_FACTOR = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")  # <module>.lora_A.<adapter name>.weight


class AccelerateImportError(ConfigError):
    """The Accelerate checkpoint cannot continue under this config (one line: what differs)."""


def native_name(key: str) -> str:
    """titan_sft's parameter name for a key of the PEFT model's state dict (a ``module.`` prefix allowed)."""
    from titan_sft.models.hf_adapter import hf_to_native_name, text_tensor_name

    hf = text_tensor_name(key.removeprefix("module.").removeprefix("base_model.model."))
    m = _FACTOR.search(hf)
    if m:
        return hf_to_native_name(hf[: m.start()] + ".weight")[: -len("weight")] + f"lora_{m.group(1).lower()}"
    return hf_to_native_name(hf.replace(".base_layer.", "."))


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(model tensors by native name, the optimizer's state_dict, the scheduler's state_dict) of ``path``."""
    from safetensors.torch import load_file

    files = {name: path / name for name in ("model.safetensors", "pytorch_model.bin", "optimizer.bin",
                                            "scheduler.bin")}
    if not path.is_dir():
        raise AccelerateImportError(f"{path}: no such directory (an Accelerate checkpoint folder, checkpoint-N)")
    model_file = next((files[n] for n in ("model.safetensors", "pytorch_model.bin") if files[n].is_file()), None)
    missing = [n for n in ("optimizer.bin", "scheduler.bin") if not files[n].is_file()]
    if model_file is None or missing:
        held = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing"
        raise AccelerateImportError(
            f"{path}: not an Accelerate checkpoint of one model, optimizer and scheduler (needs model.safetensors or "
            f"pytorch_model.bin, optimizer.bin and scheduler.bin; holds {held}; FSDP- or DeepSpeed-sharded states "
            "are not read)")
    raw = (load_file(str(model_file)) if model_file.suffix == ".safetensors"
           else torch.load(model_file, map_location="cpu", weights_only=True))
    model = {}
    for key, t in raw.items():
        try:
            model[native_name(key)] = (key, t)
        except KeyError:
            raise AccelerateImportError(f"{model_file}: '{key}' is not a tensor of a dense Qwen3 or Llama model "
                                        "(the families this import covers)") from None
    optim = torch.load(files["optimizer.bin"], map_location="cpu", weights_only=True)
    sched = torch.load(files["scheduler.bin"], map_location="cpu", weights_only=True)
    return model, optim, sched


def peft_trainable_order(cfg: JobConfig) -> list[str]:
    """The reference's trainable parameters (native names) in the order its AdamW numbered them: the PEFT model's
    ``named_parameters()`` order, built on the meta device from this config's base and LoRA settings."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    lo = cfg.lora
    config = AutoConfig.from_pretrained(cfg.model.hf_assets_path, local_files_only=True)
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(config),
                               LoraConfig(r=lo.rank, lora_alpha=lo.alpha, target_modules=list(lo.targets),
                                          use_rslora=lo.use_rslora))
    return [native_name(n) for n, p in model.named_parameters()
            if p.requires_grad or (lo.train_norms and "norm" in n.rsplit(".", 2)[-2])]


def _check_config(cfg: JobConfig, step_dir: Path) -> None:
    from titan_sft.checkpoint import find_checkpoints

    if "lora" not in cfg.model.converters:
        raise AccelerateImportError("config key 'model.converters': the reference trains LoRA adapters; add 'lora'")
    if cfg.objective.name != "masked_diffusion":
        raise AccelerateImportError(f"config key 'objective.name': the reference trains masked_diffusion, not "
                                    f"{cfg.objective.name}")
    if not cfg.model.init_from_hf:
        raise AccelerateImportError("config key 'model.init_from_hf': the reference adapts an HF base; set true "
                                    "with model.hf_assets_path")
    if cfg.lora.base_quant != "none" or cfg.lora.use_dora or cfg.lora.experts:
        raise AccelerateImportError("config keys 'lora.base_quant', 'lora.use_dora', 'lora.experts': the reference "
                                    "trains plain LoRA over a full-precision base; use none / false / false")
    if find_checkpoints(cfg.job.dump_folder):
        raise AccelerateImportError(f"{cfg.job.dump_folder} already holds checkpoints; import {step_dir} into a "
                                    "new run folder (config key 'job.dump_folder')")


def _update_count(optim: dict, path: Path) -> int:
    steps = {float(s["step"]) for s in optim["state"].values() if "step" in s}
    if not optim["state"]:
        raise AccelerateImportError(f"{path / 'optimizer.bin'}: no optimizer state (no update was taken); start "
                                    "the run from the base instead")
    if len(steps) != 1:
        raise AccelerateImportError(f"{path / 'optimizer.bin'}: parameters at different update counts "
                                    f"{sorted(steps)}; not AdamW's state of one run")
    return int(steps.pop())


def _pair_moments(optim: dict, order: list[str], model: dict, path: Path) -> dict[str, dict]:
    """Each trainable native name's AdamW state and hyperparameters (weight_decay, betas, eps)."""
    indices = [(i, g) for g in optim["param_groups"] for i in g["params"]]
    if len(indices) != len(order):
        raise AccelerateImportError(
            f"{path / 'optimizer.bin'}: the reference optimized {len(indices)} tensors; this config's LoRA "
            f"(lora.targets, lora.train_norms) has {len(order)} trainable tensors")
    out = {}
    for (index, group), name in zip(indices, order):
        state = optim["state"].get(index, {})
        if set(state) != set(MOMENTS):
            raise AccelerateImportError(f"{path / 'optimizer.bin'}: parameter {index} has state "
                                        f"{sorted(state)}; AdamW (without amsgrad) keeps {list(MOMENTS)}")
        key, tensor = model.get(name, (None, None))
        if tensor is None:
            raise AccelerateImportError(f"{path}: no tensor for the trainable '{name}' in the model file")
        if state["exp_avg"].shape != tensor.shape:
            raise AccelerateImportError(
                f"{path / 'optimizer.bin'}: parameter {index} ({key}) has moments of shape "
                f"{tuple(state['exp_avg'].shape)}, the tensor {tuple(tensor.shape)}: the optimizer's parameter "
                "order is not the PEFT model's (another lora.targets or lora.train_norms?)")
        out[name] = {**state, "weight_decay": group["weight_decay"], "betas": tuple(group["betas"]),
                     "eps": group["eps"], "key": key}
    return out


def _check_hyperparameters(trainer, moments: dict[str, dict], path: Path) -> None:
    from titan_sft.parallel.distributed import unwrapped_name

    for group in trainer.optimizer.param_groups:
        ids = {id(p) for p in group["params"]}
        for n, p in trainer.model.named_parameters():
            if id(p) not in ids:
                continue
            ref = moments[unwrapped_name(n)]
            for field, keys in (("weight_decay", "optimizer.weight_decay / optimizer.decay_mask"),
                                ("betas", "optimizer.beta1 / optimizer.beta2"), ("eps", "optimizer.eps")):
                here = tuple(group[field]) if field == "betas" else group[field]
                if ref[field] != here:
                    raise AccelerateImportError(f"{path}: the reference optimized '{ref['key']}' with {field} "
                                                f"{ref[field]}, this config with {here} (config key {keys})")


@torch.no_grad()
def _fill(trainer, model: dict, moments: dict[str, dict], path: Path) -> None:
    """Copies the trained tensors and their moments in; checks every frozen tensor the file holds."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from titan_sft.lora import _copy_full
    from titan_sft.parallel.distributed import unwrapped_name

    get_optimizer_state_dict(trainer.model, trainer.optimizer)  # AdamW's state (zeros) to fill in place
    for n, p in trainer.model.named_parameters():
        name = unwrapped_name(n)
        if p.requires_grad:
            if name not in moments:
                raise AccelerateImportError(f"{path}: this config trains '{name}', which the reference did not")
            _copy_full(p, model[name][1].float())
            state = trainer.optimizer.state[p]
            for moment in MOMENTS:
                _copy_full(state[moment], moments[name][moment].to(state[moment].dtype))
        elif name in model:
            key, stored = model[name]
            full = p.full_tensor() if isinstance(p, DTensor) else p
            if full.shape != stored.shape or not torch.equal(full.to(stored.dtype), stored):
                diff = ((full.float() - stored.float()).abs().max().item() if full.shape == stored.shape
                        else f"shape {tuple(stored.shape)} vs {tuple(full.shape)}")
                raise AccelerateImportError(f"{path}: the frozen '{key}' differs from this config's base "
                                            f"(model.hf_assets_path; max |difference| {diff}): another base model")


def import_accelerate(checkpoint: str | Path, cfg: JobConfig) -> Path:
    """Writes the titan_sft checkpoint that continues the reference's Accelerate checkpoint ``checkpoint`` into
    ``cfg.job.dump_folder``; returns its path. Call on every rank (any number of processes)."""
    from titan_sft.log import logger
    from titan_sft.lr_schedule import resume_lr_scheduler
    from titan_sft.train import Trainer

    path = Path(checkpoint)
    _check_config(cfg, path)
    model, optim, sched = read_checkpoint(path)
    step = _update_count(optim, path)
    moments = _pair_moments(optim, peft_trainable_order(cfg), model, path)
    user_config = cfg.to_dict()  # what meta.json records: the run as it will resume, on its own layout
    cfg.parallelism = Parallelism()  # FSDP over the processes of this conversion; DCP reshards on resume
    cfg.training.compile = False
    cfg.training.per_device_batch = 1  # takes no step: any process count divides the batch
    cfg.checkpoint.enable, cfg.checkpoint.resume = True, "auto"
    cfg.lora.init_from = ""
    trainer = Trainer(cfg)
    try:
        if step > trainer.total_steps:
            raise AccelerateImportError(f"{path}: {step} updates done, past this config's {trainer.total_steps} "
                                        "steps (config keys training.steps / training.epochs)")
        _check_hyperparameters(trainer, moments, path)
        _fill(trainer, model, moments, path)
        trainer.sampler.load_state_dict({**trainer.sampler.state_dict(), "step": step})
        _, lr = resume_lr_scheduler(trainer.lr_scheduler, {**trainer.lr_scheduler.state_dict(), "last_epoch": step})
        theirs = float(sched.get("_last_lr", [lr])[0])
        if abs(theirs - lr) > 1e-6 * max(abs(theirs), abs(lr), 1e-12):
            raise AccelerateImportError(
                f"{path / 'scheduler.bin'}: the reference's lr for update {step + 1} is {theirs:.6g}, this config's "
                f"schedule gives {lr:.6g} (config keys optimizer.lr, optimizer.lr_scaling, lr_scheduler.*, "
                "training.steps)")
        logger.info(f"[import] {path}: the adapters, norms and Adam moments after the reference's update {step}; "
                    f"the schedule (lr {lr:.4g}) and titan_sft's data order continue at step {step + 1} of "
                    f"{trainer.total_steps}")
        trainer.checkpointer.run_config = user_config
        out = trainer.checkpointer.save(step, extra_meta={"imported_from": str(path.resolve())})
    finally:
        trainer.close()
    return out

