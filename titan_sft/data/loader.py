"""Each step's microbatches, built one or two steps ahead in a background thread.

Reading packs from the memory map, collating them and pinning the result (on GPU) happen off the training
thread, so the device never waits for the host; copies to the device are then ``non_blocking``. The batches of
step s depend only on s (the sampler is a pure function of the step), so prefetching never changes the data
order and resuming at step s simply starts building at s.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from titan_sft.config import JobConfig, require_data_path
from titan_sft.data.collator import collate
from titan_sft.data.dataset import PackedDataset
from titan_sft.data.sampler import RecipeSampler, holdout_split


@dataclass
class StepBatch:
    step: int  # 0-based optimizer step
    global_ids: np.ndarray  # pack ids of the whole global batch
    microbatches: list[Any]  # what the objective's collator makes of each per_device_batch packs
    metrics: dict = field(default_factory=dict)  # fields for the step's train record (a mixture's per-source counts)


class BatchLoader:
    """Builds each step's microbatches: the sampler picks the packs, ``collate_fn(packs, loss_groups, keys)`` (the
    objective's collator) turns ``per_device_batch`` of them into one microbatch. ``keys`` name each example's
    draw, ``step * global_batch + position in the global batch``: the same for any number of ranks and on resume,
    so an objective that draws noise per example (masked diffusion) seeds it from the key."""

    def __init__(self, dataset: PackedDataset, sampler: RecipeSampler, per_device_batch: int, loss_groups: int,
                 collate_fn: Callable = collate, pin_memory: bool = False, prefetch: int = 2):
        self.dataset, self.sampler = dataset, sampler
        self.per_device_batch, self.loss_groups = per_device_batch, loss_groups
        self.collate_fn, self.pin_memory, self.prefetch = collate_fn, pin_memory, prefetch
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def build(self, step: int) -> StepBatch:
        """The microbatches of ``step`` for this rank (synchronously)."""
        global_ids = self.sampler.global_indices(step)
        positions = self.sampler.local_positions()
        group_size = self.sampler.global_batch // self.loss_groups
        group_of = positions // group_size
        local_ids = global_ids[positions]
        P = self.per_device_batch
        mbs = []
        keys = step * self.sampler.global_batch + positions
        for k in range(0, len(local_ids), P):
            mb = self.collate_fn([self.dataset[int(i)] for i in local_ids[k : k + P]], group_of[k : k + P].tolist(),
                                 keys[k : k + P].tolist())
            mbs.append(mb.pin_memory() if self.pin_memory else mb)
        metrics = {"sources": self.sampler.source_stats(global_ids)} if hasattr(self.sampler, "source_stats") else {}
        return StepBatch(step, global_ids, mbs, metrics)

    def start(self, first_step: int) -> None:
        """Starts building steps ``first_step, first_step + 1, ...`` in the background."""
        self.close()
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.prefetch)

        def work() -> None:
            step = first_step
            while not self._stop.is_set():
                try:
                    item = self.build(step)
                except BaseException as e:  # noqa: BLE001 - handed to the training thread, raised there
                    item = e
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                step += 1

        self._thread = threading.Thread(target=work, name="titan_sft-batches", daemon=True)
        self._thread.start()

    def next(self) -> StepBatch:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


def build_loader(cfg: JobConfig, dp_rank: int, dp_world: int, collate_fn: Callable, pin_memory: bool) -> BatchLoader:
    """The packed dataset of ``data.path`` and the recipe sampler for this data-parallel rank (over the packs left
    after ``validation.holdout_fraction``), or the mixture of ``data.sources`` and its sampler; and the loader."""
    require_data_path(cfg)
    t, v, d = cfg.training, cfg.validation, cfg.data
    if d.sources:
        from titan_sft.data.mixture import MixtureDataset, MixtureSampler

        dataset = MixtureDataset([(x.name, x.path) for x in d.sources])
        sampler = MixtureSampler(dataset, [x.weight for x in d.sources], [x.max_epochs for x in d.sources],
                                 t.global_batch_size, dp_rank, dp_world, d.shuffle, d.shuffle_seed,
                                 offset=d.skip_examples, reshuffle=d.reshuffle_each_epoch)
        return BatchLoader(dataset, sampler, t.per_device_batch, t.loss_groups, collate_fn, pin_memory)
    dataset = PackedDataset(d.path)
    trained, _ = holdout_split(len(dataset), v.holdout_fraction, v.holdout_seed)
    sampler = RecipeSampler(len(dataset), t.global_batch_size, dp_rank, dp_world, d.shuffle, d.shuffle_seed,
                            subset=trained if v.holdout_fraction else None, offset=d.skip_examples,
                            reshuffle=d.reshuffle_each_epoch)
    return BatchLoader(dataset, sampler, t.per_device_batch, t.loss_groups, collate_fn, pin_memory)
