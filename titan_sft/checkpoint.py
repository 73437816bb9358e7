"""DCP checkpoints with atomic writes, Levanter's labels and cadence, auto-resume; HF safetensors export.

Layout under ``<dump_folder>``::

    checkpoints/step-<L>/      DCP files + meta.json {"step": completed steps, "label": L, ...}
    checkpoints-temp/          the time-based temporary checkpoint (replaced each time)
    hf/step-<L>/               HF export (config.json, safetensors (+ index), padded tokenizer)

Every directory is written as ``<name>.partial`` and renamed when complete, so a crash mid-save leaves the
previous checkpoint intact and a ``*.partial`` is never resumed from or exported.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titan_sft.config import Checkpoint as CkptConfig
from titan_sft.models.hf_adapter import StateDictAdapter, hf_config_from_args

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def label(completed_steps: int) -> int:
    """Levanter labels a step with completed_steps - 1."""
    return completed_steps - 1


def hook_fires(completed_steps: int, total_steps: int, period: int) -> bool:
    """Levanter's periodic hook: label > 1 and label % period == 0, and always after the final step."""
    lab = label(completed_steps)
    return completed_steps == total_steps or (period > 0 and lab > 1 and lab % period == 0)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _finalize(tmp: Path, final: Path) -> None:
    """Rank 0 renames the finished ``tmp`` to ``final`` (replacing an older one); all ranks wait."""
    _barrier()
    if _rank() == 0:
        if final.exists():
            old = final.with_name(final.name + ".old")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    _barrier()


def _prepare_dir(tmp: Path) -> None:
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()


def read_meta(path: Path) -> dict | None:
    """meta.json of a complete checkpoint, else None (partial, damaged or not a checkpoint)."""
    if path.name.endswith(".partial") or not (path / ".metadata").is_file():
        return None
    try:
        meta = json.loads((path / "meta.json").read_text())
        int(meta["step"])
        return meta
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_checkpoints(dump_folder: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (completed step, path), newest first."""
    root = Path(dump_folder)
    found = []
    for path in [*sorted((root / "checkpoints").glob("step-*")), root / "checkpoints-temp"]:
        meta = read_meta(path) if path.is_dir() else None
        if meta is not None:
            found.append((int(meta["step"]), path))
    return sorted(found, key=lambda x: (x[0], x[1].name != "checkpoints-temp"), reverse=True)


class CheckpointManager:
    """Saves and restores everything a run needs to continue exactly: model, optimizer, LR schedule, sampler."""

    def __init__(self, cfg: CkptConfig, dump_folder: str, model, optimizer, lr_scheduler, sampler, run_config: dict):
        self.cfg, self.root = cfg, Path(dump_folder)
        self.model, self.optimizer, self.lr_scheduler, self.sampler = model, optimizer, lr_scheduler, sampler
        self.run_config = run_config
        self.last_temp_time = time.monotonic()
        self._pending = None  # (future or None, tmp dir, final dir, meta) of a save not yet renamed into place
        self._staging = None  # future: the pending async save's copy of the state is complete
        self._async_pg = self._stager = None

    def _state(self) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
        }

    def save(self, completed_steps: int, temp: bool = False) -> Path:
        """Writes a checkpoint to ``<name>.partial`` and renames it into place when complete.

        In async mode this returns once the state is staged in host memory; the write finishes in the background
        and is finalised by :meth:`wait` (called before the next save and at the end of the run).
        """
        self.wait()
        final = self.root / "checkpoints-temp" if temp else self.root / "checkpoints" / f"step-{label(completed_steps)}"
        tmp = final.with_name(final.name + ".partial")
        _prepare_dir(tmp)
        meta = {
            "step": completed_steps,
            "label": label(completed_steps),
            "kind": "temp" if temp else "regular",
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "time": time.time(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "torch_rng": torch.get_rng_state().tolist(),
            "config": self.run_config,
        }
        if self.cfg.async_mode == "async":
            if self._async_pg is None:  # a separate group, so background writes never interleave with training
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                self._async_pg = dist.new_group(backend="gloo")
                cuda = torch.cuda.is_available()
                # Staging (the copy to host memory) also runs in the background; wait_staged() holds the next
                # optimizer step until it is done, so the copy overlaps the next forward/backward.
                self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                            use_async_staging=True, use_non_blocking_copy=cuda))
            response = dcp.async_save(self._state(), checkpoint_id=str(tmp), process_group=self._async_pg,
                                      async_stager=self._stager)
            self._staging = response.staging_completion
            self._pending = (response.upload_completion, tmp, final, meta)
        else:
            dcp.save(self._state(), checkpoint_id=str(tmp))
            self._pending = (None, tmp, final, meta)
            self.wait()
        if temp:
            self.last_temp_time = time.monotonic()
        return final

    def wait_staged(self) -> None:
        """Blocks until a pending async save has copied the state; call before anything mutates it."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def wait(self) -> None:
        """Finishes the pending save: waits for its write, adds meta.json, renames it into place, prunes."""
        self.wait_staged()
        if self._pending is None:
            return
        future, tmp, final, meta = self._pending
        self._pending = None
        if future is not None:
            future.result()
        if _rank() == 0:
            (tmp / "meta.json").write_text(json.dumps(meta))
        _finalize(tmp, final)
        if meta["kind"] == "regular":
            self._prune()

    def close(self) -> None:
        """Finishes any pending save and stops the staging thread."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _prune(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0 or _rank() != 0:
            return
        regular = [p for s, p in find_checkpoints(self.root) if p.parent.name == "checkpoints"]
        for path in regular[k:]:
            shutil.rmtree(path, ignore_errors=True)

    def maybe_save(self, completed_steps: int, total_steps: int) -> None:
        if hook_fires(completed_steps, total_steps, self.cfg.interval):
            self.save(completed_steps)
            return
        minutes = self.cfg.temp_interval_minutes
        if minutes > 0:
            due = torch.tensor(float(time.monotonic() - self.last_temp_time >= minutes * 60))
            if dist.is_initialized():  # all ranks must agree to enter the collective save
                dist.broadcast(due, 0)
            if due.item():
                self.save(completed_steps, temp=True)

    def load(self, path: Path) -> int:
        """Restores the state of ``path`` (any world size: DCP reshards); returns its completed step count."""
        meta = read_meta(path)
        if meta is None:
            raise RuntimeError(f"checkpoint {path} is partial or damaged (no .metadata / meta.json)")
        if meta.get("kind") == "weights_only":  # written by `convert from-hf`: a starting point, step 0
            state = {"model": get_model_state_dict(self.model)}
            dcp.load(state, checkpoint_id=str(path))
            set_model_state_dict(self.model, state["model"])
            return 0
        state = self._state()
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(meta["lr_scheduler"])
        self.sampler.load_state_dict(meta["sampler"])
        torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
        return int(meta["step"])

    def resume(self) -> int:
        """Applies ``[checkpoint] resume``; returns the completed steps to continue from (0 = fresh start)."""
        mode = self.cfg.resume
        if mode == "none":
            return 0
        if mode != "auto":
            return self.load(Path(mode))
        for step, path in find_checkpoints(self.root):
            try:
                return self.load(path)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - damaged: fall back to the next newest
                if _rank() == 0:
                    print(f"[checkpoint] cannot resume from {path}: {e}; trying an older one", flush=True)
        return 0


def hf_tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of an HF directory's tensors, read from the safetensors headers only."""
    from safetensors import safe_open

    from titan_sft.models import hf_safetensors_files

    shapes = {}
    for file in hf_safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def load_hf_weights(model, args, path: str | Path) -> None:
    """Loads an HF directory (one file or sharded with an index) straight into the (sharded) ``model``.

    Each rank reads only the slices of its own shards through DCP's ``HuggingFaceStorageReader``; no rank builds
    a whole copy. Names and shapes are checked against the safetensors headers first, so a missing tensor or a
    shape (vocab) mismatch is an error naming the tensor.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    adapter = StateDictAdapter(args)
    hf_state = adapter.to_hf(get_model_state_dict(model))
    shapes = hf_tensor_shapes(path)
    for name, tensor in hf_state.items():
        if name not in shapes:
            raise ValueError(f"{path}: the checkpoint lacks tensor '{name}'")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{path}: tensor '{name}' has shape {shapes[name]}, the model expects {tuple(tensor.shape)}")
    dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(str(path)))
    # FSDP2's state dict holds the parameters themselves, so the load above already wrote into them; setting it
    # again keeps this correct for wrappers whose state dict holds copies.
    set_model_state_dict(model, adapter.from_hf(hf_state), options=StateDictOptions(strict=False))


def export_hf(model, args, out_dir: str | Path, dtype: str = "bfloat16", tokenizer_dir: str | None = None,
              max_shard_gb: float = 5.0) -> Path | None:
    """Writes an HF directory (config.json, safetensors shards + index, padded tokenizer) atomically.

    Parameters are gathered one tensor at a time onto rank 0's CPU (``full_state_dict`` + ``cpu_offload``), so no
    rank holds the whole model on its device; rank 0 writes.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    _prepare_dir(tmp)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _rank() == 0:
        tdtype = DTYPES[dtype]
        hf_sd = {k: v.to(tdtype).contiguous() for k, v in StateDictAdapter(args).to_hf(full).items()}
        limit = int(max_shard_gb * 1e9)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in hf_sd.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > limit:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({k: fname for k in shard})
            total = sum(t.numel() * t.element_size() for t in hf_sd.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        (tmp / "config.json").write_text(json.dumps(hf_config_from_args(args, tdtype), indent=2))
        if tokenizer_dir:
            save_padded_tokenizer(tokenizer_dir, tmp, args.vocab_size)
    _finalize(tmp, out_dir)
    return out_dir


def save_padded_tokenizer(tokenizer_dir: str | Path, out_dir: Path, vocab_size: int) -> int:
    """Saves the tokenizer with ``<|padding_i|>`` tokens added so that len(tokenizer) == vocab_size."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    n_pad = vocab_size - len(tok)
    if n_pad > 0:
        tok.add_tokens([f"<|padding_{i}|>" for i in range(n_pad)], special_tokens=True)
    tok.save_pretrained(str(out_dir))
    return max(n_pad, 0)
