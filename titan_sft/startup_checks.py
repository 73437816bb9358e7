"""Start-up checks of the recipe that guard against silent errors in the attention masks."""

from __future__ import annotations

import math

import torch


class StartupCheckError(RuntimeError):
    """A recipe start-up check failed (document isolation, loss denominators)."""


@torch.no_grad()
def check_document_isolation(model, vocab_size: int, seq_len: int, device: torch.device, backend: str,
                             causal: bool = True, hint: str = "", cp_group=None) -> None:
    """Recipe item 7: the tokens of one document must not change another's hidden states (bit for bit).

    A row of two documents is run twice, with the first document changed; the second document's hidden states
    must not move. With bidirectional attention the second document is changed too and the first compared,
    since there leaks could run either way. (Changing only the later document proves nothing under causal
    attention: it is shielded from the earlier one anyway.)

    With routed experts the comparison has a tolerance: the expert GEMMs group each expert's rows, so changing
    one document changes which rows share a matmul with the other's tokens and, in the last bits, their rounding.
    A leak moves hidden states by about their own size; the tolerance (mean |change| at most 1e-4 of the mean
    |hidden|, 2e-2 in 16-bit dtypes) is far below that.

    Under context parallel the row is sharded like a training row (the documents' boundary falls inside a
    shard or between shards, by the row's length) and every cp rank checks its positions; the verdict is agreed
    over ``cp_group``.
    """
    was_training = model.training
    model.eval()  # dropout (LoRA's) would change the hidden states between the two forwards by itself
    try:
        with torch.compiler.set_stance("force_eager"):  # a [1, 256] row must not make compiled blocks recompile
            _check_isolation(model, vocab_size, seq_len, device, backend, causal, hint, cp_group)
    finally:
        model.train(was_training)


def _check_isolation(model, vocab_size, seq_len, device, backend, causal, hint, cp_group) -> None:
    from titan_sft.parallel import comm
    from titan_sft.parallel.context_parallel import sequence_shard

    g = torch.Generator().manual_seed(1234)
    shard = sequence_shard(model)
    # Under cp: a divisor of the row length that cp's chunks, and sequence parallel within them, split evenly.
    n = shard.chunks() * math.gcd(seq_len // shard.chunks(), 256) if shard else min(seq_len, 256)
    split = n // 2
    row = torch.randint(0, vocab_size, (1, n), generator=g)
    cu = torch.tensor([0, split, n], dtype=torch.int32, device=device)
    here = shard.index(n) if shard else torch.arange(n)  # the positions this rank runs (and checks)
    local = (lambda x: shard.rows(x)) if shard else (lambda x: x)  # noqa: E731
    base = _full(model(local(row).to(device), cu_seqlens=cu, hidden_only=True))
    routed = bool(getattr(model, "router_stats", None))
    cases = [(slice(0, split), slice(split, n), "document 2", "document 1")]
    if not causal:
        cases.append((slice(split, n), slice(0, split), "document 1", "document 2"))
    for changed, kept, kept_name, changed_name in cases:
        other = row.clone()
        other[0, changed] = torch.randint(0, vocab_size, (changed.stop - changed.start,), generator=g)
        out = _full(model(local(other).to(device), cu_seqlens=cu, hidden_only=True))
        mine = ((here >= kept.start) & (here < kept.stop)).to(device)
        bad = comm.tensor(float(bool(mine.any()) and not _same(base[:, mine], out[:, mine], routed)))
        if shard is not None:
            comm.all_reduce(bad, torch.distributed.ReduceOp.MAX, group=cp_group, what="isolation check")
        if bad.item():
            raise StartupCheckError(
                f"document isolation check failed for attention backend '{backend}': {kept_name}'s hidden states "
                f"changed when {changed_name} changed{hint} (use --training.skip_startup_checks true to bypass)"
            )


def _same(a: torch.Tensor, b: torch.Tensor, routed: bool) -> bool:
    if not routed:
        return torch.equal(a, b)
    tol = 1e-4 if a.dtype == torch.float32 else 2e-2
    return bool((a.float() - b.float()).abs().mean() <= tol * a.float().abs().mean())


def _full(hidden: torch.Tensor) -> torch.Tensor:
    """The whole hidden states (gathered from the sequence slices under tensor parallel)."""
    from torch.distributed.tensor import DTensor

    return hidden.full_tensor() if isinstance(hidden, DTensor) else hidden
