"""The recipe's data order, sharded by data-parallel rank and resumable.

Step s (0-based) uses packed examples ``order[(k + s * B + i) mod n_packs]`` for i = 0..B-1 (recipe item 5; k is
``data.skip_examples``, 0 in the recipe), where
``order`` is the identity (the recipe) or a seeded permutation drawn once; with ``reshuffle`` (the reference
diffusion trainer's per-epoch shuffle) example q of the run is ``order_e[q mod n_packs]`` with e = q // n_packs
and ``order_e`` a permutation drawn from (seed, e), so every epoch visits the packs in a new order. Rank r of W takes
the contiguous slice
``i in [r * B / W, (r + 1) * B / W)``, so the ranks together cover exactly the 1-rank global batch, in order.
"""

from __future__ import annotations

import numpy as np


class RecipeSampler:
    def __init__(self, n_packs: int, global_batch: int, dp_rank: int = 0, dp_world: int = 1,
                 shuffle: bool = False, seed: int = 0, subset: np.ndarray | None = None, offset: int = 0,
                 reshuffle: bool = False):
        if global_batch % dp_world:
            raise ValueError(
                f"training.global_batch_size={global_batch} must be divisible by the data-parallel ranks ({dp_world})"
            )
        self.n_packs, self.global_batch = n_packs, global_batch
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.shuffle, self.seed = shuffle, seed
        # The packs trained on, in the recipe's (sequential) order: all, or those left after a held-out split.
        self.subset = None if subset is None else np.asarray(subset, dtype=np.int64)
        n_packs = n_packs if subset is None else len(self.subset)
        self.n_packs = n_packs
        self.order = np.random.default_rng(seed).permutation(n_packs) if shuffle and not reshuffle else None
        self.reshuffle = reshuffle
        self._epoch_orders: dict[int, np.ndarray] = {}
        self.offset = offset  # examples skipped at the start of the order (data.skip_examples)
        self.step = 0  # next step to hand out

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_world

    def global_indices(self, step: int) -> np.ndarray:
        """Pack ids of the whole global batch of ``step``, in order."""
        q = self.offset + step * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        if self.reshuffle:
            idx = np.concatenate([self._epoch_order(int(e))[q[q // self.n_packs == e] % self.n_packs]
                                  for e in np.unique(q // self.n_packs)])
        else:
            idx = q % self.n_packs
            idx = self.order[idx] if self.order is not None else idx
        return self.subset[idx] if self.subset is not None else idx

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._epoch_orders:
            if len(self._epoch_orders) > 4:
                self._epoch_orders.clear()
            self._epoch_orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_packs)
        return self._epoch_orders[epoch]

    def local_positions(self) -> np.ndarray:
        """This rank's positions i inside the global batch."""
        return np.arange(self.dp_rank * self.local_batch, (self.dp_rank + 1) * self.local_batch)

    def next(self) -> tuple[int, np.ndarray, np.ndarray]:
        """(step, global pack ids of the step, this rank's positions in it); advances the position."""
        step = self.step
        self.step += 1
        return step, self.global_indices(step), self.local_positions()

    def state_dict(self) -> dict:
        return {"step": self.step, "n_packs": self.n_packs, "global_batch": self.global_batch,
                "shuffle": self.shuffle, "seed": self.seed, "offset": self.offset, "reshuffle": self.reshuffle}

    def load_state_dict(self, state: dict) -> None:
        state = {"offset": 0, "reshuffle": False, **state}  # checkpoints from before these keys
        for key in ("n_packs", "global_batch", "shuffle", "seed", "offset", "reshuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"cannot resume the data order: checkpoint has {key}={state[key]}, "
                                 f"this run has {getattr(self, key)}")
        self.step = int(state["step"])


def holdout_split(n_packs: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(trained packs, held-out packs), both sorted: a seeded choice of max(1, int(fraction * n)) packs is held
    out; fraction 0 holds none out."""
    if fraction <= 0:
        return np.arange(n_packs), np.arange(0)
    k = max(1, int(fraction * n_packs))
    held = np.sort(np.random.default_rng(seed).permutation(n_packs)[:k])
    return np.setdiff1d(np.arange(n_packs), held), held
