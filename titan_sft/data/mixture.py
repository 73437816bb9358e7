"""Weighted mixtures of packed datasets (``[[data.sources]]``): one pack id space, and a schedule of sources.

A weight counts packs: source i supplies a share w_i of the packed examples of every step (so roughly w_i of the
tokens, as packs are full rows). The schedule is a pure function of the example's position q in the run (q =
``skip_examples + step * global_batch + i``), so every layout draws the same packs and a resumed run continues
exactly:

* the normalised weights become integer counts m_i out of a period of D slots (``Fraction.limit_denominator``:
  weights are honoured to about 1/1000); within a period the sources take turns by smooth weighted round-robin
  (each slot goes to the source furthest behind its share), so any window of slots holds each source's share to
  within a slot or two of the source count, not only on average. The period is rotated by an offset drawn from
  ``data.shuffle_seed``;
* source i's k-th draw is its pack ``order_i(k mod n_i)``: in order, or (``data.shuffle``) a permutation seeded by
  (seed, source), drawn again each pass with ``data.reshuffle_each_epoch``;
* a source with ``max_epochs`` stops after ``max_epochs * n_i`` draws; from that slot on the remaining sources
  share the slots by their weights renormalised (a new phase of the schedule). When every source is capped and
  spent, the data ends.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from fractions import Fraction
from functools import reduce

import numpy as np

from titan_sft.data.dataset import DatasetError, PackedDataset


def _integer_shares(weights: list[float]) -> list[int]:
    total = sum(weights)
    fracs = [Fraction(w / total).limit_denominator(1000) for w in weights]
    fracs = [f if f > 0 else Fraction(1, 1000) for f in fracs]
    denom = reduce(lambda a, b: a * b // math.gcd(a, b), (f.denominator for f in fracs))
    shares = [int(f * denom) for f in fracs]
    g = reduce(math.gcd, shares)
    return [x // g for x in shares]


def _round_robin(shares: list[int]) -> np.ndarray:
    """One period (sum(shares) slots) of smooth weighted round-robin: slot by slot the source with the largest
    credit (credit += share each slot, the chosen one pays the period) goes next; ties go to the lower index."""
    total = sum(shares)
    credit = [0] * len(shares)
    out = np.empty(total, dtype=np.int64)
    for t in range(total):
        for i, s in enumerate(shares):
            credit[i] += s
        best = max(range(len(shares)), key=lambda i: (credit[i], -i))
        credit[best] -= total
        out[t] = best
    return out


@dataclass
class _Phase:
    start: int  # first slot of the phase
    end: float  # first slot after it (inf for the last, uncapped phase)
    sources: list[int]  # the sources drawn in this phase (global indices)
    period: np.ndarray  # one period of source indices (global), rotated
    prefix: np.ndarray  # [D + 1, n_sources]: draws of each source in the first t slots of a period
    base: np.ndarray  # [n_sources]: draws of each source before the phase


class MixtureSchedule:
    """Which source, and which of its draws, each example position q is (see the module docstring)."""

    def __init__(self, sizes: list[int], weights: list[float], max_epochs: list[float], seed: int):
        self.sizes, self.n = list(sizes), len(sizes)
        caps = [int(e * n) if e > 0 else None for e, n in zip(max_epochs, sizes)]
        self.caps = caps
        rng = np.random.default_rng([seed, 7])
        self.phases: list[_Phase] = []
        active, start, base = list(range(self.n)), 0, np.zeros(self.n, dtype=np.int64)
        while active:
            shares = _integer_shares([weights[i] for i in active])
            period = np.asarray(active)[_round_robin(shares)]
            period = np.roll(period, -int(rng.integers(len(period))))
            prefix = np.zeros((len(period) + 1, self.n), dtype=np.int64)
            prefix[1:, :] = np.cumsum(np.eye(self.n, dtype=np.int64)[period], axis=0)
            phase = _Phase(start, math.inf, active, period, prefix, base.copy())
            # The phase ends at the slot after which a capped source has made its last draw.
            ends = {i: start + self._slots_for(phase, i, caps[i] - base[i]) for i in active if caps[i] is not None}
            if not ends:
                self.phases.append(phase)
                break
            end = min(ends.values())
            phase.end = end
            self.phases.append(phase)
            base = base + self._draws(phase, end - start)
            active = [i for i in active if caps[i] is None or base[i] < caps[i]]
            start = end
        self.total = self.phases[-1].end  # slots available (inf unless every source is capped)
        self.starts = [p.start for p in self.phases]

    def _draws(self, phase: _Phase, t: int) -> np.ndarray:
        D = len(phase.period)
        return (t // D) * phase.prefix[D] + phase.prefix[t % D]

    def _slots_for(self, phase: _Phase, i: int, need: int) -> int:
        """Slots from the phase start until source i has made ``need`` more draws (including that draw)."""
        if need <= 0:
            return 0
        per = int(phase.prefix[-1, i])
        full, rest = divmod(need - 1, per)
        hits = np.flatnonzero(phase.period == i)
        return full * len(phase.period) + int(hits[rest]) + 1

    def assign(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, that source's draw index) of every example position in ``q``."""
        q = np.asarray(q, dtype=np.int64)
        if len(q) and q.max() >= self.total:
            raise IndexError(f"example {int(q.max())} is past the end of the mixture ({self.total} examples: "
                             "every source is capped by max_epochs)")
        src, k = np.empty_like(q), np.empty_like(q)
        for j, x in enumerate(q.tolist()):
            phase = self.phases[bisect.bisect_right(self.starts, x) - 1]
            t = x - phase.start
            D = len(phase.period)
            s = int(phase.period[t % D])
            src[j] = s
            k[j] = phase.base[s] + (t // D) * phase.prefix[D, s] + phase.prefix[t % D, s]
        return src, k

    def draws_before(self, q: int) -> list[int]:
        """Each source's draws in the first ``q`` example positions (its position in its own data)."""
        if q == 0:
            return [0] * self.n
        phase = self.phases[bisect.bisect_right(self.starts, q - 1) - 1]
        return (phase.base + self._draws(phase, q - phase.start)).tolist()


class MixtureDataset:
    """The packs of every source in one id space (source i's pack p is ``offsets[i] + p``). Sources must agree on
    the sequence length, tokenizer, chat template and kind (prompt/answer or causal); the error names the source."""

    def __init__(self, sources: list[tuple[str, str]]):
        self.names = [n for n, _ in sources]
        self.datasets = [PackedDataset(p) for _, p in sources]
        first = self.datasets[0]
        for name, ds in zip(self.names[1:], self.datasets[1:]):
            for key, what in (("max_seq_len", "sequence length"), ("tokenizer_sha256", "tokenizer"),
                              ("chat_template_sha256", "chat template"), ("vocab_size", "vocabulary"),
                              ("eos_pad", "EOS padding")):
                a, b = first.manifest.get(key), ds.manifest.get(key)
                if a is not None and b is not None and a != b:
                    raise DatasetError(f"data.sources '{name}' ({ds.path}): its {what} ({key} {b}) differs from "
                                       f"source '{self.names[0]}' ({a}); every source must be prepared alike")
            if (ds.answer_lens is None) != (first.answer_lens is None):
                raise DatasetError(f"data.sources '{name}' ({ds.path}): a {'causal' if ds.answer_lens is None else 'prompt/answer'} "
                                   f"dataset mixed with a {'causal' if first.answer_lens is None else 'prompt/answer'} one")
        self.sizes = [len(d) for d in self.datasets]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.seq_len = first.seq_len
        self.path = first.path
        self.manifest = {**first.manifest, "n_packs": int(self.offsets[-1]),
                         "n_documents": sum(int(d.manifest["n_documents"]) for d in self.datasets),
                         "n_tokens": sum(int(d.manifest.get("n_tokens", 0)) for d in self.datasets),
                         "n_loss_targets": sum(int(d.manifest.get("n_loss_targets", 0)) for d in self.datasets),
                         "sources": dict(zip(self.names, (str(d.path) for d in self.datasets)))}
        self.answer_lens = first.answer_lens
        self.assistant_counts = np.concatenate([d.assistant_counts for d in self.datasets])
        self.used = np.concatenate([d.used for d in self.datasets])
        self.source_of = np.repeat(np.arange(len(self.datasets)), self.sizes)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, i: int) -> tuple[int, int]:
        s = int(self.source_of[i])
        return s, int(i - self.offsets[s])

    def __getitem__(self, i: int):
        s, p = self.locate(i)
        return self.datasets[s][p]

    def describe_sources(self, packs) -> str:
        parts = []
        for i in packs:
            s, p = self.locate(int(i))
            parts.append(f"source '{self.names[s]}' {self.datasets[s].describe_sources([p])}")
        return "; ".join(parts)


class MixtureSampler:
    """The sampler of a mixture, with :class:`~titan_sft.data.sampler.RecipeSampler`'s interface: step s uses the
    example positions ``offset + s * B + i``; rank r of W takes the contiguous slice of the global batch."""

    def __init__(self, dataset: MixtureDataset, weights: list[float], max_epochs: list[float], global_batch: int,
                 dp_rank: int = 0, dp_world: int = 1, shuffle: bool = False, seed: int = 0, offset: int = 0,
                 reshuffle: bool = False):
        self.dataset, self.weights, self.max_epochs = dataset, list(weights), list(max_epochs)
        self.global_batch, self.dp_rank, self.dp_world = global_batch, dp_rank, dp_world
        self.shuffle, self.seed, self.offset, self.reshuffle = shuffle, seed, offset, reshuffle
        self.schedule = MixtureSchedule(dataset.sizes, weights, max_epochs, seed)
        self.n_packs = len(dataset)
        self.step = 0
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_world

    @property
    def available(self) -> float:
        """Example positions the mixture can supply (inf unless every source is capped)."""
        return self.schedule.total - self.offset

    def _order(self, s: int, epoch: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        key = (s, epoch if self.reshuffle else 0)
        if key not in self._orders:
            if len(self._orders) > 16:
                self._orders.clear()
            seed = [self.seed, s, key[1]] if self.reshuffle else [self.seed, s]
            self._orders[key] = np.random.default_rng(seed).permutation(self.dataset.sizes[s])
        return self._orders[key]

    def global_indices(self, step: int) -> np.ndarray:
        q = self.offset + step * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        src, k = self.schedule.assign(q)
        out = np.empty_like(q)
        for j, (s, draw) in enumerate(zip(src.tolist(), k.tolist())):
            n = self.dataset.sizes[s]
            order = self._order(s, draw // n)
            local = draw % n if order is None else int(order[draw % n])
            out[j] = self.dataset.offsets[s] + local
        return out

    def local_positions(self) -> np.ndarray:
        return np.arange(self.dp_rank * self.local_batch, (self.dp_rank + 1) * self.local_batch)

    def next(self) -> tuple[int, np.ndarray, np.ndarray]:
        step = self.step
        self.step += 1
        return step, self.global_indices(step), self.local_positions()

    def state_dict(self) -> dict:
        positions = self.schedule.draws_before(self.offset + self.step * self.global_batch)
        return {"step": self.step, "global_batch": self.global_batch, "shuffle": self.shuffle, "seed": self.seed,
                "offset": self.offset, "reshuffle": self.reshuffle,
                "sources": [{"name": n, "n_packs": size, "weight": w, "max_epochs": e, "position": pos}
                            for n, size, w, e, pos in zip(self.dataset.names, self.dataset.sizes, self.weights,
                                                          self.max_epochs, positions)]}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        if "sources" not in state:
            raise ValueError("cannot resume the data order: the checkpoint was trained on data.path, this run on "
                             "data.sources")
        for key in ("global_batch", "shuffle", "seed", "offset", "reshuffle"):
            if state[key] != mine[key]:
                raise ValueError(f"cannot resume the data order: checkpoint has {key}={state[key]}, this run has "
                                 f"{mine[key]}")
        strip = lambda xs: [{k: v for k, v in x.items() if k != "position"} for x in xs]  # noqa: E731
        if strip(state["sources"]) != strip(mine["sources"]):
            raise ValueError(f"cannot resume the data order: the checkpoint's sources {strip(state['sources'])} "
                             f"differ from this run's {strip(mine['sources'])}")
        self.step = int(state["step"])

    def source_stats(self, global_ids: np.ndarray) -> dict:
        """Per source: packs, input tokens and loss-carrying targets of a global batch (from the dataset's
        metadata: the same on every rank, no communication)."""
        out = {}
        for s, name in enumerate(self.dataset.names):
            ids = global_ids[self.dataset.source_of[global_ids] == s]
            out[name] = {"n_packs": int(len(ids)), "n_tokens": int(self.dataset.used[ids].sum()),
                         "n_loss_tokens": int(self.dataset.assistant_counts[ids].sum())}
        return out
