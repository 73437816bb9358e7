"""Packed examples -> the model's padding-free rows (recipe items 6 and 7).

A microbatch of P packed examples of length L becomes P rows [P, L] with:
- ``cu_seqlens``: document boundaries in the flattened P * L tokens (each pack's trailing padding is a segment
  of its own, and every row boundary is a boundary), so attention masks stay per row and varlen kernels see
  one flat sequence;
- ``positions``: 0..L-1 per packed example (the recipe), or restarting at 0 per document (option);
- ``labels``: position i of a pack predicts x[i+1] iff m[i+1] == 1 and i + 1 < L, else -100; so the last
  position of every pack carries no loss and no target crosses into the next pack;
- ``groups``: the loss group of every position (from the pack's position in the global batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from titan_sft.constants import IGNORE_INDEX


@dataclass
class Microbatch:
    input_ids: torch.Tensor  # [P, L] long
    labels: torch.Tensor  # [P, L] long, -100 where no loss
    positions: torch.Tensor  # [P, L] long
    cu_seqlens: torch.Tensor  # [n_segments + 1] int32, over the flattened P * L tokens
    groups: torch.Tensor  # [P, L] long, loss group per position
    max_seqlen: int
    n_loss_tokens: int
    # [n] long: flat positions (p * L + i) that carry a target, where the output head runs; made on the host with
    # the labels, so the device never has to report how many there are
    rows: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "Microbatch":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Microbatch(move(self.input_ids), move(self.labels), move(self.positions), move(self.cu_seqlens),
                          move(self.groups), self.max_seqlen, self.n_loss_tokens, move(self.rows))

    def shard(self, cp) -> "Microbatch":
        """This context-parallel rank's part of the rows (``cp``: a ``SequenceShard``): every per-position field
        sliced alike (labels were shifted in the whole row, so a part's last target is the next part's first
        token); ``cu_seqlens`` stays the whole rows' (attention sees them whole)."""
        labels = cp.rows(self.labels)
        rows = target_rows(labels)
        return Microbatch(cp.rows(self.input_ids), labels, cp.rows(self.positions), self.cu_seqlens,
                          cp.rows(self.groups), self.max_seqlen, len(rows), rows)

    def pin_memory(self) -> "Microbatch":
        pin = lambda t: t.pin_memory()  # noqa: E731
        return Microbatch(pin(self.input_ids), pin(self.labels), pin(self.positions), pin(self.cu_seqlens),
                          pin(self.groups), self.max_seqlen, self.n_loss_tokens, pin(self.rows))


def target_rows(labels: torch.Tensor) -> torch.Tensor:
    """Flat positions of ``labels`` [P, L] that carry a target (long [n], ascending)."""
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def shifted_labels(tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """labels[i] = tokens[i+1] where mask[i+1] == 1, else -100; the last position never carries loss."""
    labels = np.full(tokens.shape, IGNORE_INDEX, dtype=np.int64)
    carry = mask[1:].astype(bool)
    labels[:-1][carry] = tokens[1:][carry]
    return labels


def collate(packs: list[tuple[np.ndarray, np.ndarray, np.ndarray]], groups: list[int],
            reset_positions: bool = False) -> Microbatch:
    """Stacks packed examples (tokens, mask, doc_lens) of one length with their loss groups into rows."""
    ids, labels, pos, grp, seg_lens = [], [], [], [], []
    for (tokens, mask, doc_lens, *_), g in zip(packs, groups):
        L = len(tokens)
        ids.append(tokens.astype(np.int64))
        labels.append(shifted_labels(tokens, mask))
        grp.append(np.full(L, g, dtype=np.int64))
        lens = [int(n) for n in doc_lens]
        pad = L - sum(lens)
        segs = lens + ([pad] if pad > 0 else [])
        seg_lens.extend(segs)
        if reset_positions:
            pos.append(np.concatenate([np.arange(n) for n in segs]))
        else:
            pos.append(np.arange(L))
    cu = np.concatenate([[0], np.cumsum(seg_lens)]).astype(np.int32)
    labels_np = np.concatenate(labels)
    rows = len(packs)
    targets = np.flatnonzero(labels_np != IGNORE_INDEX)
    return Microbatch(
        input_ids=torch.from_numpy(np.concatenate(ids)).view(rows, -1),
        labels=torch.from_numpy(labels_np).view(rows, -1),
        positions=torch.from_numpy(np.concatenate(pos).astype(np.int64)).view(rows, -1),
        cu_seqlens=torch.from_numpy(cu),
        groups=torch.from_numpy(np.concatenate(grp)).view(rows, -1),
        max_seqlen=int(max(seg_lens)),
        n_loss_tokens=len(targets),
        rows=torch.from_numpy(targets.astype(np.int64)),
    )
