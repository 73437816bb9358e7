"""The checkpointer: DCP checkpoints with atomic writes, Levanter's labels and cadence, auto-resume, and the
cadence of HF exports (what an export writes is ``titan_sft.hf_io``'s business).

Layout under ``<dump_folder>``::

    checkpoints/step-<L>/      DCP files + meta.json {"step": completed steps, "label": L, ...}
    checkpoints-temp/          the time-based temporary checkpoint (replaced each time)
    hf/step-<L>/               HF export (config.json, safetensors (+ index), padded tokenizer)

Every directory is written as ``<name>.partial`` and renamed when complete, so a crash mid-save leaves the
previous checkpoint intact and a ``*.partial`` is never resumed from or exported.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titan_sft.atomic import barrier, finalize, partial_dir, rank
from titan_sft.base_identity import base_source, describe, fingerprint, first_difference
from titan_sft.config import ConfigError, JobConfig
from titan_sft.log import logger
from titan_sft.lr_schedule import resume_lr_scheduler
from titan_sft.parallel.distributed import new_transient_group, release_group, transient_group


_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # added by AC and compile wrappers
# The optimizer's state and hyperparameters keyed by each parameter's name (not by param-group position): a
# pipeline rank holds some parameters only, and any layout must read any other's checkpoint.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Second and later names of parameters the model shares (a tied head: ``output.weight`` ->
    ``tok_embeddings.weight``), as state-dict keys, each mapped to its first name.

    Read from the module structure, so every rank agrees whatever its shards hold.
    """
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        for seg in _WRAPPER_SEGMENTS:
            name = name.replace(seg, "")
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state dict as checkpoints store it: each shared parameter once.

    DCP writes one copy per key, and a tied head shares the embedding's storage, so without this a Qwen3 <= 4B
    checkpoint holds its [vocab, dim] embedding twice (1.24 GB extra per save for 1.7B in fp32). The tensors are the
    model's own, so loading them in place fills the aliases too; :func:`with_aliases` puts the keys back for
    ``set_model_state_dict``. Checkpoints written before this (holding both keys) load the same way.
    """
    state = get_model_state_dict(model)
    for alias in tied_aliases(model):
        state.pop(alias, None)
    # A pipeline's last stage holds its own copy of a tied head: stored under the embedding's name (the values are
    # equal), so checkpoints are the same for any layout.
    for own, stored in getattr(model, "state_renames", {}).items():
        state[stored] = state.pop(own)
    return state


def with_aliases(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` from :func:`model_state` with the shared parameters' other keys added back."""
    renames = getattr(model, "state_renames", {})
    if renames:
        state = dict(state)
        for own, stored in renames.items():
            if stored in state:  # absent from a trainable-only state (a frozen tie under LoRA)
                state[own] = state.pop(stored)
    return {**state, **{alias: state[name] for alias, name in tied_aliases(model).items() if name in state}}


class _CrcFreeFileSystem(FileSystem):
    """DCP's local file system, with torch.save's CRC32 off while a file is open for writing."""

    @contextmanager
    def create_stream(self, path, mode):
        # DCP's writer threads torch.save each tensor into the open stream. The option is per thread (a
        # ContextVar), so setting it here reaches every writer thread, and restoring it leaves the thread as it was.
        previous = torch.serialization.get_crc32_options()
        if "w" in mode:
            torch.serialization.set_crc32_options(False)
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        finally:
            torch.serialization.set_crc32_options(previous)


class _CrcFreeWriter(FileSystemWriter):
    """A FileSystemWriter whose ``torch.save`` records carry no CRC32.

    DCP writes each tensor with ``torch.save``, which by default runs a CRC32 over every byte (about 3 GB/s on one
    core) for a checksum that nothing reads: ``torch.load`` does not verify it, and DCP loads by byte range through
    ``torch.load``.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fs = _CrcFreeFileSystem()


def label(completed_steps: int) -> int:
    """Levanter labels a step with completed_steps - 1."""
    return completed_steps - 1


def hook_fires(completed_steps: int, total_steps: int, period: int) -> bool:
    """Levanter's periodic hook: label > 1 and label % period == 0, and always after the final step."""
    lab = label(completed_steps)
    return completed_steps == total_steps or (period > 0 and lab > 1 and lab % period == 0)


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
    """Complete checkpoints as (completed step, path), newest first (not those moved aside as damaged)."""
    root = Path(dump_folder)
    found = []
    for path in [*sorted((root / "checkpoints").glob("step-*")), root / "checkpoints-temp"]:
        meta = read_meta(path) if path.is_dir() and not path.name.endswith(DAMAGED) else None
        if meta is not None:
            found.append((int(meta["step"]), path))
    return sorted(found, key=lambda x: (x[0], x[1].name != "checkpoints-temp"), reverse=True)


DAMAGED = ".damaged"


def move_aside(path: Path) -> Path:
    """Renames a checkpoint that failed to load to ``<name>.damaged`` (``.damaged-<n>`` if taken), so that it is
    neither retried at the next start nor pruned; rank 0 renames, every rank returns the new path."""
    aside = path.with_name(path.name + DAMAGED)
    n = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}{DAMAGED}-{n}")
        n += 1
    barrier()  # every rank has given up on it before it moves
    if rank() == 0:
        path.rename(aside)
    barrier()
    return aside


def one_line(e: BaseException) -> str:
    """``Type: first line`` of an exception; for DCP's collective CheckpointException, of the first rank's
    failure (its message otherwise holds every rank's traceback)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


@contextmanager
def _quiet_root_logger():
    """DCP's loader logs a damaged checkpoint's tracebacks on the root logger before it raises; the caller reports
    the failure in one line (:func:`one_line`), so those records are dropped while it loads."""
    root = logging.getLogger()
    drop = logging.Filter("-")  # matches no logger name: drops every record logged on the root logger itself
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def gather_rng_states() -> list[dict]:
    """Every rank's RNG states, rank by rank (collective): the CPU generator and, on a GPU, the generator of the
    rank's own device. Ranks draw differently (rank 0 alone draws the random init; dropout masks are per rank),
    so a resumed run needs each rank's own state to continue exactly."""
    mine = {"cpu": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        mine["cuda"] = _b64(torch.cuda.get_rng_state())
    if not dist.is_initialized():
        return [mine]
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def restore_rng_state(meta: dict) -> None:
    """Sets this rank's generators from a checkpoint's ``rng`` (its own entry; rank 0's when the world size
    changed, where the old streams cannot continue anyway). Reads the CPU-only ``torch_rng`` of older checkpoints."""
    if "rng" not in meta:
        torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
        return
    states = meta["rng"]
    r = rank() if len(states) == (dist.get_world_size() if dist.is_initialized() else 1) else 0
    torch.set_rng_state(_unb64(states[r]["cpu"]))
    if torch.cuda.is_available() and "cuda" in states[r]:
        torch.cuda.set_rng_state(_unb64(states[r]["cuda"]))


class BaseMismatch(ConfigError):
    """An adapter-only checkpoint and this run's base differ (raised before anything is loaded)."""


def is_weights_only(path: str) -> bool:
    """Whether ``path`` is a weights-only checkpoint (``convert from-hf``'s: a run's starting point)."""
    meta = read_meta(Path(path)) if path not in ("auto", "none") else None
    return meta is not None and meta.get("kind") == "weights_only"


def run_folder(dump_folder: str, resume: str, checkpoint_enabled: bool = True) -> str:
    """The run's output folder: ``dump_folder``, unless it holds an earlier run (a metrics.jsonl) that this run
    does not continue; then the first free ``<dump_folder>-<n>``, so an earlier run is never overwritten.

    Under ``resume = "auto"`` (checkpoints enabled) ``dump_folder`` is the run's home: a start that finds a
    complete checkpoint there resumes it, and one that finds none (killed before its first checkpoint was
    complete) starts over in it; the records of the lost attempt are dropped when the run starts
    (``MetricsLogger.start``). The exception is a folder holding ``checkpoints-best`` and nothing to resume (a
    finished ``validation.best_only`` run): it is kept. A weights-only ``resume`` (the run's starting point)
    counts as auto. ``resume`` naming a checkpoint inside ``dump_folder``
    continues it too. Otherwise (``none``, another run's checkpoint, ``checkpoint.enable = false``) a folder with
    records is an earlier run: a new suffixed folder. Stale ``*.partial`` directories of the folder are removed
    when it is reused (call on rank 0 only)."""
    root = Path(dump_folder)
    if not (root / "metrics.jsonl").exists():
        return dump_folder
    home = checkpoint_enabled and (
        ((resume == "auto" or is_weights_only(resume))
         and (find_checkpoints(root) or not (root / "checkpoints-best").exists()))
        or (resume not in ("auto", "none") and Path(resume).resolve().is_relative_to(root.resolve())))
    if home:
        for stale in [*root.glob("*.partial"), *root.glob("*/*.partial")]:
            shutil.rmtree(stale, ignore_errors=True)
        return dump_folder
    n = 1
    while Path(f"{dump_folder}-{n}").exists():
        n += 1
    return f"{dump_folder}-{n}"


class CheckpointManager:
    """Saves and restores everything a run needs to continue exactly (model, optimizer, LR schedule, sampler),
    and decides when the run exports HF weights.

    Args:
        job_cfg: the run's config (``[checkpoint]`` and ``job.dump_folder``; the whole of it goes into meta.json).
        exporter: ``exporter(model, out_dir)`` writes an HF directory (``titan_sft.hf_io.HFExporter``).
    """

    def __init__(self, job_cfg: JobConfig, model, optimizer, lr_scheduler, sampler, exporter: Callable):
        self.cfg, self.root = job_cfg.checkpoint, Path(job_cfg.job.dump_folder)
        self.model, self.optimizer, self.lr_scheduler, self.sampler = model, optimizer, lr_scheduler, sampler
        self.run_config = job_cfg.to_dict()
        self.exporter = exporter
        self.best_only = job_cfg.validation.best_only  # regular saves off: only the best (and temp) checkpoints
        self.last_export: Path | None = None
        self.last_temp_time = time.monotonic()
        from titan_sft.parallel.distributed import unwrapped_name

        # A run with frozen parameters (LoRA's base) stores the trainable ones, the buffers and the base's identity
        # (titan_sft.base_identity) unless checkpoint.frozen_base = "stored": the base is rebuilt on resume.
        params = list(model.named_parameters())
        self.trainable = ({unwrapped_name(n) for n, p in params if p.requires_grad}
                          if any(not p.requires_grad for _, p in params) else None)
        self.adapter_only = self.trainable is not None and job_cfg.checkpoint.frozen_base == "identity"
        self.stored = (self.trainable | {unwrapped_name(n) for n, _ in model.named_buffers()}
                       if self.trainable is not None else None)
        self.base_source = base_source(job_cfg)
        self._fingerprint: dict | None = None  # the base's, computed at the first save or resume
        self._pending = None  # (future or None, tmp dir, final dir, meta, start time) of a save not yet renamed
        self._staging = None  # future: the pending async save's copy of the state is complete
        self._async_pg = self._stager = None  # the pending async save's own group and stager (see save())
        # The lowest held-out loss so far (the one checkpoints-best holds); every checkpoint records it, so a
        # resumed run compares with the best as of its checkpoint's step, for either objective.
        self.best_loss = math.inf

    def _state(self, with_base: bool | None = None) -> dict[str, Any]:
        """What a checkpoint holds: the model (without the frozen base when ``with_base`` is false; default: as
        ``checkpoint.frozen_base`` says) and the optimizer."""
        model = model_state(self.model)
        if not (with_base if with_base is not None else not self.adapter_only):
            model = {k: v for k, v in model.items() if k in self.stored}
        return {"model": model,
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=OPTIM_OPTIONS)}

    def base_fingerprint(self) -> dict[str, list[float]]:
        """The frozen base's fingerprint (collective the first time; the base never changes during a run)."""
        if self._fingerprint is None:
            state = model_state(self.model)
            self._fingerprint = fingerprint(state, [k for k in state if k not in self.stored])
        return self._fingerprint

    def check_base(self, meta: dict, path: Path) -> None:
        """Refuses (:class:`BaseMismatch`, one line) to resume ``path``'s trainable state on another base."""
        saved = meta["base_identity"]
        if self.trainable is None:
            raise BaseMismatch(f"checkpoint {path} holds the trainable part of a run with a frozen base "
                               f"({describe(saved['source'])}); this run trains every parameter")
        why = first_difference(saved["fingerprint"], self.base_fingerprint())
        if why is not None:
            raise BaseMismatch(f"checkpoint {path} was trained on the base {describe(saved['source'])}; this run's "
                               f"base ({describe(self.base_source)}) is another: {why}. Resume with that base, or "
                               "start over with checkpoint.resume = \"none\"")

    def save(self, completed_steps: int, temp: bool = False, kind: str | None = None,
             extra_meta: dict | None = None) -> Path:
        """Writes a checkpoint to ``<name>.partial`` and renames it into place when complete.

        ``kind``: "regular" (``checkpoints/step-<L>``), "temp" (``checkpoints-temp``, also ``temp=True``) or
        "best" (``checkpoints-best``, the best held-out loss; never resumed from automatically). In async mode this
        returns once the state is staged in host memory; the write finishes in the background and is finalised by
        :meth:`wait` (as soon as :meth:`poll` sees it written, before the next save, at the end of the run).
        """
        self.wait()
        kind = kind or ("temp" if temp else "regular")
        final = {"temp": self.root / "checkpoints-temp", "best": self.root / "checkpoints-best"}.get(
            kind, self.root / "checkpoints" / f"step-{label(completed_steps)}")
        t0 = time.monotonic()
        tmp = partial_dir(final)
        meta = {
            **(extra_meta or {}),
            "step": completed_steps,
            "label": label(completed_steps),
            "kind": kind,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "time": time.time(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": gather_rng_states(),
            "config": self.run_config,
            # the frozen base is not stored: where it comes from and its fingerprint, checked on resume
            **({"base_identity": {"source": self.base_source, "fingerprint": self.base_fingerprint()}}
               if self.adapter_only else {}),
            "best_validation_loss": None if math.isinf(self.best_loss) else self.best_loss,
        }
        # Every save runs its collectives on a group of its own, released when the save is complete: a long-lived
        # gloo group slows every later CPU step (parallel/distributed.new_transient_group). It also keeps the
        # background writes of an async save from interleaving with training collectives.
        if self.cfg.async_mode == "async":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._async_pg = new_transient_group()
            cuda = torch.cuda.is_available()
            # Staging (the copy to host memory) also runs in the background; wait_staged() holds the next
            # optimizer step until it is done, so the copy overlaps the next forward/backward.
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=True, use_non_blocking_copy=cuda))
            response = dcp.async_save(self._state(), storage_writer=self._writer(tmp), process_group=self._async_pg,
                                      async_stager=self._stager)
            self._staging = response.staging_completion
            self._pending = (response.upload_completion, tmp, final, meta, t0)
        else:
            with transient_group() as pg:
                dcp.save(self._state(), storage_writer=self._writer(tmp), process_group=pg)
            self._pending = (None, tmp, final, meta, t0)
            self.wait()
        if kind == "best" and getattr(self.exporter, "lora", None) is not None:
            path = self.exporter.save_adapter(self.model, self.root / "adapters" / "best")
            logger.info(f"[export] wrote {path} (step {completed_steps})")
        if kind == "temp":
            self.last_temp_time = time.monotonic()
        return final

    def _writer(self, path: Path):
        """DCP's file writer with ``checkpoint.write_threads`` threads and without zip CRC32s.

        With DCP's default of one thread, serialising, writing and fsyncing each file happen one after the other and
        a save reaches ~0.6-0.8x of a plain write; two or more threads overlap them. Files are still fsynced before
        the directory is renamed into place. See :class:`_CrcFreeWriter` for the CRC32s.
        """
        return _CrcFreeWriter(str(path), thread_count=self.cfg.write_threads, sync_files=True)

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
        future, tmp, final, meta, t0 = self._pending
        self._pending = None
        if future is not None:
            future.result()
            self._stager.close()
            release_group(self._async_pg)
            self._async_pg = self._stager = None
        if rank() == 0:
            (tmp / "meta.json").write_text(json.dumps(meta))
        finalize(tmp, final)
        logger.info(f"[checkpoint] saved {final} (step {meta['step']}) in {time.monotonic() - t0:.1f} s")
        if meta["kind"] == "regular":
            self._prune()

    def votes(self) -> list[float]:
        """This rank's part of the step's agreement all-reduce (summed over all ranks): [temporary checkpoint due
        (rank 0's clock decides; 0 elsewhere), 1 where no async save is still writing]."""
        minutes = self.cfg.temp_interval_minutes
        due = rank() == 0 and minutes > 0 and time.monotonic() - self.last_temp_time >= minutes * 60
        writing = self._pending is not None and self._pending[0] is not None and not self._pending[0].done()
        return [float(due), float(not writing)]

    def poll(self, not_writing: float) -> None:
        """Finishes a pending async save as soon as every rank's write is done (``not_writing``: the summed
        second vote), so its group and staging thread are released well before the next save."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if self._pending is not None and self._pending[0] is not None and not_writing >= world:
            self.wait()

    def close(self) -> None:
        """Finishes any pending save (and releases its group and staging thread)."""
        self.wait()

    def _prune(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0 or rank() != 0:
            return
        regular = [p for s, p in find_checkpoints(self.root) if p.parent.name == "checkpoints"]
        for path in regular[k:]:
            shutil.rmtree(path, ignore_errors=True)

    def maybe_save(self, completed_steps: int, total_steps: int, votes: list[float]) -> None:
        """Saves when Levanter's cadence (``checkpoint.interval``) or the temporary-checkpoint timer says so."""
        if not self.cfg.enable:
            return
        self.poll(votes[1])
        if not self.best_only and hook_fires(completed_steps, total_steps, self.cfg.interval):
            self.save(completed_steps)
            return
        if votes[0] > 0:  # all ranks agree to enter the collective save: rank 0's clock decided
            self.save(completed_steps, temp=True)

    def load(self, path: Path) -> int:
        """Restores the state of ``path`` (any world size: DCP reshards); returns its completed step count."""
        meta = read_meta(path)
        if meta is None:
            raise RuntimeError(f"checkpoint {path} is partial or damaged (no .metadata / meta.json)")
        if meta.get("trainable_only"):
            raise RuntimeError(f"checkpoint {path} holds the trainable weights only (a LoRA run's best checkpoint "
                               "written before checkpoints kept the optimizer with them, for evaluation); resume "
                               "from checkpoints/step-* or checkpoints-temp")
        if meta.get("kind") == "weights_only":  # written by `convert from-hf`: a starting point, step 0
            self.load_weights(path)
            return 0
        with_base = "base_identity" not in meta
        if not with_base:
            self.check_base(meta, path)
        state = self._state(with_base)
        with transient_group() as pg, _quiet_root_logger():  # see save()
            dcp.load(state, checkpoint_id=str(path), process_group=pg)
        set_model_state_dict(self.model, with_aliases(self.model, state["model"]),
                             options=StateDictOptions(strict=with_base))
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=OPTIM_OPTIONS)
        was, now = resume_lr_scheduler(self.lr_scheduler, meta["lr_scheduler"])
        if not math.isclose(was, now, rel_tol=1e-9, abs_tol=1e-15):
            logger.info(f"[resume] the learning-rate schedule differs from the checkpoint's (training.steps, "
                        f"[lr_scheduler] or optimizer.lr changed): the next update uses lr {now:.4e} (the "
                        f"checkpoint's schedule: {was:.4e})")
        self.sampler.load_state_dict(meta["sampler"])
        restore_rng_state(meta)
        self.best_loss = self._best_as_of(meta)
        return int(meta["step"])

    def _best_as_of(self, meta: dict) -> float:
        """The best held-out loss when the run had completed ``meta``'s steps: the loss the checkpoint recorded,
        or checkpoints-best's when that one is not newer and lower (a validation runs after its step's checkpoint
        is written, and a resumed run does not repeat it; checkpoints older than the record have only this)."""
        recorded = meta.get("best_validation_loss")
        best = math.inf if recorded is None else float(recorded)
        saved = read_meta(self.root / "checkpoints-best")
        if saved is not None and "validation_loss" in saved and int(saved["step"]) <= int(meta["step"]):
            best = min(best, float(saved["validation_loss"]))
        return best

    def keep_if_best(self, completed_steps: int, loss: float) -> bool:
        """Saves ``checkpoints-best`` when the held-out ``loss`` is lower than every earlier one of the run
        (:attr:`best_loss`, restored on resume); returns whether it did. Call on every rank."""
        if not loss < self.best_loss:
            return False
        self.best_loss = loss
        self.save(completed_steps, kind="best", extra_meta={"validation_loss": loss})
        return True

    def load_weights(self, path: Path) -> int:
        """Restores only the model weights of ``path`` (e.g. the best checkpoint, for a final test evaluation);
        returns its completed step count."""
        meta = read_meta(path)
        if meta is None:
            raise RuntimeError(f"checkpoint {path} is partial or damaged (no .metadata / meta.json)")
        state = {"model": model_state(self.model)}
        partial = meta.get("trainable_only") or "base_identity" in meta
        if "base_identity" in meta:
            self.check_base(meta, path)
        if partial:  # the trainable state only: the base stays as loaded
            state["model"] = {k: v for k, v in state["model"].items() if k in (self.stored or ())}
        elif meta.get("kind") == "weights_only" and self.trainable is not None:
            # a starting point written before LoRA was applied: the adapters keep their init
            from titan_sft import nf4
            from titan_sft.lora import is_adapter_key

            # NF4 weights (QLoRA) are quantized from the unquantized ones it holds
            state["model"] = {k: v for k, v in state["model"].items() if not is_adapter_key(k)
                              and not nf4.is_nf4_key(k)}
            nf4.fill_from_dcp(self.model, str(path))
            partial = True
        with transient_group() as pg:
            dcp.load(state, checkpoint_id=str(path), process_group=pg)
        set_model_state_dict(self.model, with_aliases(self.model, state["model"]),
                             options=StateDictOptions(strict=not partial))
        return int(meta["step"])

    def resume(self) -> int:
        """Applies ``[checkpoint] resume``; returns the completed steps to continue from (0 = fresh start)."""
        mode = self.cfg.resume
        if not self.cfg.enable or mode == "none":
            return 0
        if mode != "auto" and not is_weights_only(mode):
            return self.load(Path(mode))
        if mode != "auto":
            # A weights-only checkpoint (`convert from-hf`) is where the run starts, not where it continues: its
            # weights are loaded, then the run's own newest checkpoint, if any (a requeued run loses no step).
            self.load_weights(Path(mode))
            self.base_source, self._fingerprint = {"kind": "dcp", "path": str(mode)}, None
        for step, path in find_checkpoints(self.root):
            try:
                return self.load(path)
            except BaseMismatch:  # not damaged: the run was started on another base
                raise
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - damaged: fall back to the next newest
                aside = move_aside(path)
                logger.warning(f"[checkpoint] cannot resume from {path}: {one_line(e)}; moved to {aside.name} "
                               "(kept, not retried); trying an older one")
        return 0

    def maybe_export(self, completed_steps: int, total_steps: int) -> Path | None:
        """Writes ``hf/step-<L>`` when Levanter's cadence for ``checkpoint.hf_export_interval`` fires (-1: never)."""
        period = self.cfg.hf_export_interval
        if period < 0 or not hook_fires(completed_steps, total_steps, period):
            return None
        path = self.root / "hf" / f"step-{label(completed_steps)}"
        self.exporter(self.model, path)
        self.last_export = path
        logger.info(f"[export] wrote {path}")
        return path
