"""Continuing a run of the Levanter-port SFT script (HF + FSDP1, the script titan_sft replaces) under titan_sft.

That script saves ``checkpoints/step-L`` and ``checkpoints-temp`` as DCP directories holding ``{"model": ...,
"optim": ...}`` as ``torch.distributed.checkpoint.state_dict.get_state_dict`` returns them for its wrapper module
(parameter names ``hf_model.model.*`` and ``hf_model.lm_head.weight``; AdamW's ``exp_avg``, ``exp_avg_sq`` and
``step`` per parameter; its two parameter groups), plus ``meta.json`` with ``{"step": completed steps}``. Its data
position is the step count (the same order titan_sft's sampler gives for the same batch size, shuffle and seed).

:func:`import_reference` builds the titan_sft run of a config (its model, optimizer, schedule and sampler, as FSDP
over the processes it is started on), reads the reference's weights and Adam moments into it in place (DCP
reshards: each rank reads its own shard), puts the schedule and the data order at the reference's step, and saves
an ordinary titan_sft checkpoint ``checkpoints/step-<L>`` into the config's run folder. The run then resumes from
it on any layout with ``checkpoint.resume = "auto"``: the next step's loss is the one the old script computes.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_model_state_dict

from titan_sft.config import ConfigError, JobConfig, Parallelism

PREFIX = "hf_model."  # the reference's wrapper module holds the transformers model under this attribute
MOMENTS = ("exp_avg", "exp_avg_sq", "step")


class ReferenceError(ConfigError):
    """The reference checkpoint cannot continue under this config (one line: what differs)."""


def reference_step(path: Path) -> int:
    """Completed steps of a reference checkpoint directory (its meta.json); refuses anything else."""
    meta_file = path / "meta.json"
    if not (path / ".metadata").is_file() or not meta_file.is_file():
        raise ReferenceError(f"{path}: not a reference checkpoint (a DCP directory with .metadata and meta.json, "
                             "as checkpoints/step-L or checkpoints-temp)")
    try:
        step = int(json.loads(meta_file.read_text())["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise ReferenceError(f"{meta_file}: no integer 'step' ({e})") from None
    if step <= 0:
        raise ReferenceError(f"{meta_file}: step {step}; a checkpoint to continue has completed at least one step")
    return step


def reference_groups(path: Path, metadata) -> dict[str, dict]:
    """The reference optimizer's hyperparameters by HF parameter name (weight_decay, betas, eps)."""
    keys = [k for k in metadata if k.startswith("optim.param_groups.")]
    values = {k: io.BytesIO() for k in keys}  # DCP fills byte entries with their unpickled values
    dcp.load(values, checkpoint_id=str(path), no_dist=not torch.distributed.is_initialized())
    groups: dict[int, dict] = {}
    for key, value in values.items():
        index, field = key[len("optim.param_groups."):].split(".", 1)
        groups.setdefault(int(index), {})[field] = value
    return {name[len(PREFIX):]: {"weight_decay": g["weight_decay"], "betas": tuple(g["betas"]), "eps": g["eps"]}
            for g in groups.values() for name in g["params"]}


def _targets(trainer, metadata, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(reference key -> the titan_sft tensor it fills, the model state to set afterwards, native -> HF name of
    every trainable parameter), after checking names and shapes."""
    from titan_sft.checkpoint import model_state
    from titan_sft.models.hf_adapter import expert_hf_names, fused_slot, native_to_hf_name
    from titan_sft.parallel.distributed import unwrapped_name

    model, optimizer, args = trainer.model, trainer.optimizer, trainer.args
    # AdamW makes its state at the first step; this builds it (zeros) so the moments can be read into it in place.
    get_optimizer_state_dict(model, optimizer)
    params = {unwrapped_name(n): p for n, p in model.named_parameters()}
    state = model_state(model)
    targets, trained = {}, {}
    for native, tensor in state.items():
        if fused_slot(native, args) is not None or expert_hf_names(native, args.n_experts) is not None:
            raise ReferenceError(f"{path}: the model has tensors stored differently in HF files ('{native}': "
                                 "fused or per-expert); importing reference checkpoints covers dense Qwen3 and "
                                 "Llama models")
        try:
            hf = native_to_hf_name(native)
        except KeyError:  # a buffer of titan_sft's own (none in the dense families)
            continue
        key = f"model.{PREFIX}{hf}"
        stored = metadata.get(key)
        if not isinstance(stored, TensorStorageMetadata):
            raise ReferenceError(f"{path}: no tensor '{key}' (this config's model is not the reference run's)")
        if tuple(stored.size) != tuple(tensor.shape):
            raise ReferenceError(f"{path}: '{key}' has shape {tuple(stored.size)}, this config's model "
                                 f"{tuple(tensor.shape)} (another model or flavor)")
        targets[key] = tensor
        p = params.get(native)
        if p is not None and p.requires_grad:
            trained[native] = hf
            for moment in MOMENTS:
                okey = f"optim.state.{PREFIX}{hf}.{moment}"
                if okey not in metadata:
                    raise ReferenceError(f"{path}: no optimizer state '{okey}' (the reference run did not train "
                                         f"'{hf}', this config does)")
                targets[okey] = optimizer.state[p][moment]
    return targets, state, trained


def _check_hyperparameters(trainer, groups: dict[str, dict], trained: dict[str, str], path: Path) -> None:
    """Refuses when the reference optimized a parameter with other weight decay, betas or eps than this config."""
    from titan_sft.parallel.distributed import unwrapped_name

    mine = {}
    for group in trainer.optimizer.param_groups:
        ids = {id(p) for p in group["params"]}
        for n, p in trainer.model.named_parameters():
            if id(p) in ids:
                mine[unwrapped_name(n)] = group
    extra = sorted(set(groups) - set(trained.values()))
    if extra:
        raise ReferenceError(f"{path}: the reference trained '{extra[0]}' (and {len(extra) - 1} more) that this "
                             "config does not train")
    for native, hf in trained.items():
        ref, g = groups[hf], mine[native]
        here = {"weight_decay": g["weight_decay"], "betas": tuple(g["betas"]), "eps": g["eps"]}
        for field, key in (("weight_decay", "optimizer.weight_decay / optimizer.decay_mask"),
                           ("betas", "optimizer.beta1 / optimizer.beta2"), ("eps", "optimizer.eps")):
            if ref[field] != here[field]:
                raise ReferenceError(f"{path}: the reference optimized '{hf}' with {field} {ref[field]}, this "
                                     f"config with {here[field]} (config key {key})")


def import_reference(reference: str | Path, cfg: JobConfig) -> Path:
    """Writes the titan_sft checkpoint that continues the reference checkpoint ``reference`` into
    ``cfg.job.dump_folder``; returns its path. Call on every rank (any number of processes)."""
    from titan_sft.checkpoint import find_checkpoints, with_aliases
    from titan_sft.log import logger
    from titan_sft.lr_schedule import resume_lr_scheduler
    from titan_sft.train import Trainer

    path = Path(reference)
    step = reference_step(path)
    if "lora" in cfg.model.converters:
        raise ReferenceError("config key 'model.converters': the reference trains every parameter; remove 'lora'")
    if cfg.objective.name != "causal_lm":
        raise ReferenceError(f"config key 'objective.name': the reference trains causal_lm, not {cfg.objective.name}")
    if cfg.validation.holdout_fraction:
        raise ReferenceError("config key 'validation.holdout_fraction': the reference trains on every pack; set 0 to "
                             "continue its data order")
    if find_checkpoints(cfg.job.dump_folder):
        raise ReferenceError(f"{cfg.job.dump_folder} already holds checkpoints; import into a new run folder "
                             "(config key 'job.dump_folder')")
    user_config = cfg.to_dict()  # what meta.json records: the run as it will resume, on its own layout
    cfg.parallelism = Parallelism()  # FSDP over the processes of this conversion; DCP reshards on resume
    cfg.training.compile = False
    cfg.checkpoint.enable, cfg.checkpoint.resume = True, "auto"
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    trainer = Trainer(cfg)
    try:
        if step > trainer.total_steps:
            raise ReferenceError(f"{path}: step {step} is past this config's {trainer.total_steps} steps "
                                 "(config key 'training.steps')")
        targets, state, trained = _targets(trainer, metadata, path)
        _check_hyperparameters(trainer, reference_groups(path, metadata), trained, path)
        dcp.load(targets, checkpoint_id=str(path))
        set_model_state_dict(trainer.model, with_aliases(trainer.model, state))
        trainer.sampler.load_state_dict({**trainer.sampler.state_dict(), "step": step})
        resume_lr_scheduler(trainer.lr_scheduler, {**trainer.lr_scheduler.state_dict(), "last_epoch": step})
        logger.info(f"[import] {path}: the weights and Adam moments after the reference's step {step}; the schedule "
                    f"and the data order continue at step {step + 1} of {trainer.total_steps}")
        trainer.checkpointer.run_config = user_config
        out = trainer.checkpointer.save(step, extra_meta={"imported_from": str(path.resolve())})
    finally:
        trainer.close()
    return out
