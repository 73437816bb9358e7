"""Chunked cross-entropy: the output head and the loss applied a chunk of tokens at a time.

For Qwen3 the vocabulary is 151936, so the [tokens, vocab] fp32 logits of one 32k-token row would take 20 GB.
Here the head is applied to ``chunk_size`` tokens at a time, the token losses are summed in fp32, and the
gradients of that chunk (w.r.t. the hidden states and the head weight) are computed right away, while its logits
exist; backward then only scales them by the incoming gradient. Peak memory is one chunk of logits, the work is
the same three matmuls as the unchunked loss, and nothing is recomputed.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from titan_sft.constants import IGNORE_INDEX


def _accumulate_chunk_grads(g, weight, hc, grad_h, grad_w, start: int, chunk_size: int) -> None:
    """Gradients of one chunk from d(loss)/d(logits) ``g`` (fp32, in the logits buffer): hidden states into their
    rows of ``grad_h``, the head into the fp32 accumulator ``grad_w``."""
    g = g.to(hc.dtype)  # the unchunked autograd graph casts here too (logits were .float()-ed)
    if grad_h is not None:
        torch.mm(g, weight, out=grad_h[start : start + chunk_size])
    if grad_w is not None:
        if g.dtype == torch.float32:
            grad_w.addmm_(g.t(), hc)
        else:
            grad_w += (g.t() @ hc).float()


def _ce_chunk(logits: torch.Tensor, target: torch.Tensor, wc: torch.Tensor):
    """One chunk's weighted CE sum and d(loss)/d(logits) = wc * (softmax - onehot(target)) in the logits' dtype.

    Written out of place for torch.compile, which fuses the passes over the [chunk, vocab] block (upcast, max, sum
    of exponentials, the gradient and its downcast) so no fp32 copy of bf16 logits is materialised.
    """
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    target_logit = x.gather(1, target[:, None]).squeeze(1)
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == target[:, None]
    g = (torch.exp(x - lse[:, None]) - onehot.float()) * wc[:, None]
    return ((lse - target_logit) * wc).sum(), g.to(logits.dtype)


def _ce_grad(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, has_target: torch.Tensor,
             wc: torch.Tensor) -> torch.Tensor:
    """d(loss)/d(logits) from a (globally reduced) logsumexp, for a vocabulary slice that may not hold the
    target (loss parallel); the compiled counterpart of the in-place steps in :class:`_VocabParallelCrossEntropy`."""
    x = logits.float()
    onehot = (torch.arange(x.shape[1], device=x.device)[None, :] == target[:, None]) & has_target[:, None]
    return ((torch.exp(x - lse[:, None]) - onehot.float()) * wc[:, None]).to(logits.dtype)


def _tp_partial_sums(logits: torch.Tensor, row_max: torch.Tensor, target: torch.Tensor,
                     has_target: torch.Tensor) -> torch.Tensor:
    """[2, n]: this vocabulary slice's sum of exp(logit - global max), and the target's logit where it lives here
    (else 0); summed across the tp ranks they give the logsumexp and the target logit."""
    x = logits.float()
    target_logit = torch.where(has_target, x.gather(1, target[:, None]).squeeze(1), 0.0)
    return torch.stack([torch.exp(x - row_max[:, None]).sum(dim=-1), target_logit])


@functools.cache
def _compiled(fn):
    return torch.compile(fn, fullgraph=True)


class _ChunkedLossBase(torch.autograd.Function):
    """The gradients are computed in forward (while each chunk's logits exist); backward only scales them."""

    @staticmethod
    def save_grads(ctx, hidden, weight, grad_h, grad_w) -> None:
        ctx.save_for_backward(grad_h if grad_h is not None else torch.empty(0),
                              grad_w.to(weight.dtype) if grad_w is not None else torch.empty(0))
        ctx.shape = hidden.shape

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        gh = (grad_h * grad_out.to(grad_h.dtype)).view(ctx.shape) if ctx.needs_input_grad[0] else None
        gw = grad_w * grad_out.to(grad_w.dtype) if ctx.needs_input_grad[1] else None
        return (gh, gw) + (None,) * (len(ctx.needs_input_grad) - 2)


class _ChunkedLinearCrossEntropy(_ChunkedLossBase):
    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_size: int, compiled: bool = False):
        h = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        w_all = None if weights is None else weights.reshape(-1).float()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, h.shape[0], chunk_size):
            hc, yc = h[start : start + chunk_size], y[start : start + chunk_size]
            valid = yc != IGNORE_INDEX
            wc = valid.float() if w_all is None else w_all[start : start + chunk_size] * valid
            if compiled and (need_h or need_w):
                loss, g = _compiled(_ce_chunk)(F.linear(hc, weight), yc.clamp(min=0), wc)
                total += loss
                _accumulate_chunk_grads(g, weight, hc, grad_h, grad_w, start, chunk_size)
                continue
            logits = F.linear(hc, weight).float()
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, yc.clamp(min=0)[:, None]).squeeze(1)
            total += ((lse - target_logit) * wc).sum()
            if not (need_h or need_w):
                continue
            # d(sum w * CE)/d logits = w * (softmax - onehot), built in place in the logits buffer.
            g = logits.sub_(lse[:, None]).exp_()
            g[valid, yc[valid]] -= 1.0
            g.mul_(wc[:, None])
            _accumulate_chunk_grads(g, weight, hc, grad_h, grad_w, start, chunk_size)
        _ChunkedLossBase.save_grads(ctx, hidden, weight, grad_h, grad_w)
        return total


def chunked_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 4096,
    weights: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Sum of (optionally weighted) token cross-entropies of ``hidden @ weight.T`` against ``labels``, in fp32.

    Args:
        hidden: [..., dim] final hidden states.
        weight: [vocab, dim] output head.
        labels: [...] target ids; ``-100`` carries no loss.
        chunk_size: tokens per chunk; peak extra memory is ``chunk_size * vocab`` fp32 values.
        weights: optional [...] per-token fp32 weights (the loss-group normalisation: 1 / (G * N_group)).
        rows: optional long [n]: apply the head only at these positions of the flattened ``hidden`` (masked
            diffusion scores masked positions alone); ``labels`` and ``weights`` are then [n].
        compiled: run each chunk's softmax/cross-entropy math through torch.compile (``training.compile_loss``);
            the head's matmuls are the same either way.

    Returns:
        fp32 scalar; its gradients equal those of the unchunked ``F.cross_entropy(..., reduction="sum")``.
        A vocab-sharded DTensor head (tensor parallel) goes to :func:`vocab_parallel_cross_entropy_sum`.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        return vocab_parallel_cross_entropy_sum(hidden, weight, labels, chunk_size, weights, rows, compiled)
    if rows is not None:
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, weights, chunk_size, compiled)


def naive_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The unchunked reference: materialises all logits. For tests and benchmarks."""
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


class _VocabParallelCrossEntropy(_ChunkedLossBase):
    """The chunked loss with a vocab-sharded head (loss parallel): every tp rank holds rows ``[offset, offset +
    V_local)`` of the head and the whole (replicated) hidden states. Per chunk the rank computes its slice of the
    logits; the max, the sum of exponentials and the target logit are reduced across the tp group, so each rank
    holds at most one chunk of [tokens, V / tp] logits and every rank computes the same loss. The gradient w.r.t.
    the hidden states is this rank's partial sum (the caller declares it Partial; DTensor reduce-scatters it back
    to the sequence shards)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_size: int, offset: int, group, compiled: bool = False):
        import torch.distributed as dist

        from titan_sft.parallel import comm

        h = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        w_all = None if weights is None else weights.reshape(-1).float()
        v_local = weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, h.shape[0], chunk_size):
            hc, yc = h[start : start + chunk_size], y[start : start + chunk_size]
            raw = F.linear(hc, weight)
            valid = yc != IGNORE_INDEX
            wc = valid.float() if w_all is None else w_all[start : start + chunk_size] * valid
            local_t = yc - offset
            mine = valid & (local_t >= 0) & (local_t < v_local)  # the target's logit lives on this rank
            local_t = local_t.clamp(0, v_local - 1)
            if compiled:  # the logits stay in the head's dtype; compiled kernels read them, no fp32 copy
                row_max = raw.amax(dim=-1).float()
                comm.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group, what="loss parallel max")
                sums = _compiled(_tp_partial_sums)(raw, row_max, local_t, mine)
            else:
                logits = raw.float()
                target_logit = torch.where(mine, logits.gather(1, local_t[:, None]).squeeze(1), 0.0)
                row_max = logits.max(dim=-1).values
                comm.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group, what="loss parallel max")
                probs = logits.sub_(row_max[:, None]).exp_()  # in place: one chunk buffer per rank
                sums = torch.stack([probs.sum(dim=-1), target_logit])
            comm.all_reduce(sums, group=group, what="loss parallel sums")
            lse = row_max + sums[0].log()
            total += ((lse - sums[1]) * wc).sum()
            if not (need_h or need_w):
                continue
            if compiled:
                g = _compiled(_ce_grad)(raw, lse, local_t, mine, wc)
                _accumulate_chunk_grads(g, weight, hc, grad_h, grad_w, start, chunk_size)
                continue
            g = probs.div_(sums[0][:, None])  # softmax restricted to this rank's vocabulary slice
            rows = mine.nonzero().squeeze(1)
            g[rows, local_t[rows]] -= 1.0
            g.mul_(wc[:, None])
            _accumulate_chunk_grads(g, weight, hc, grad_h, grad_w, start, chunk_size)
        _ChunkedLossBase.save_grads(ctx, hidden, weight, grad_h, grad_w)
        return total


def vocab_parallel_cross_entropy_sum(hidden, weight, labels: torch.Tensor, chunk_size: int = 4096,
                                     weights: torch.Tensor | None = None,
                                     rows: torch.Tensor | None = None, compiled: bool = False) -> torch.Tensor:
    """:func:`chunked_cross_entropy_sum` under tensor parallelism (loss parallel).

    Args:
        hidden: DTensor [..., dim] on the tp mesh (sequence-sharded or replicated).
        weight: DTensor [vocab, dim] sharded on the vocabulary (``Shard(0)``) on the same mesh.
        labels, chunk_size, weights, rows, compiled: as for :func:`chunked_cross_entropy_sum` (plain tensors, the full rows).

    Returns:
        fp32 scalar, the same on every tp rank.
    """
    from torch.distributed.tensor import Partial, Replicate

    mesh = weight.device_mesh
    # All-gather the sequence; the gradient coming back is each rank's partial sum over its vocabulary slice.
    h = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    if rows is not None:  # local indexing: its backward scatters this rank's partial gradient
        h = h.reshape(-1, h.shape[-1]).index_select(0, rows)
    vocab, tp = weight.shape[0], mesh.size()
    offset = mesh.get_local_rank() * -(-vocab // tp)  # Shard(0) splits like torch.chunk: earlier ranks get ceil
    return _VocabParallelCrossEntropy.apply(h, weight.to_local(), labels, weights, chunk_size, offset,
                                            mesh.get_group(), compiled)
