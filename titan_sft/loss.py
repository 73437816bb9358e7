"""Chunked cross-entropy: the output head and the loss applied a chunk of tokens at a time.

For Qwen3 the vocabulary is 151936, so the [tokens, vocab] fp32 logits of one 32k-token row would take 20 GB.
Here the head is applied to ``chunk_size`` tokens at a time, the token losses are summed in fp32, and the
gradients of that chunk (w.r.t. the hidden states and the head weight) are computed right away, while its logits
exist; backward then only scales them by the incoming gradient. Peak memory is one chunk of logits, the work is
the same three matmuls as the unchunked loss, and nothing is recomputed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_sft.constants import IGNORE_INDEX


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_size: int):
        h = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        w_all = None if weights is None else weights.reshape(-1).float()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, h.shape[0], chunk_size):
            hc, yc = h[start : start + chunk_size], y[start : start + chunk_size]
            logits = F.linear(hc, weight).float()
            valid = yc != IGNORE_INDEX
            wc = valid.float() if w_all is None else w_all[start : start + chunk_size] * valid
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, yc.clamp(min=0)[:, None]).squeeze(1)
            total += ((lse - target_logit) * wc).sum()
            if not (need_h or need_w):
                continue
            # d(sum w * CE)/d logits = w * (softmax - onehot), built in place in the logits buffer.
            g = logits.sub_(lse[:, None]).exp_()
            g[valid, yc[valid]] -= 1.0
            g.mul_(wc[:, None])
            g = g.to(hc.dtype)  # the unchunked autograd graph casts here too (logits were .float()-ed)
            if need_h:
                torch.mm(g, weight, out=grad_h[start : start + chunk_size])
            if need_w:
                if g.dtype == torch.float32:
                    grad_w.addmm_(g.t(), hc)
                else:
                    grad_w += (g.t() @ hc).float()
        ctx.save_for_backward(
            grad_h if need_h else torch.empty(0), grad_w.to(weight.dtype) if need_w else torch.empty(0)
        )
        ctx.shape = hidden.shape
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        gh = (grad_h * grad_out.to(grad_h.dtype)).view(ctx.shape) if ctx.needs_input_grad[0] else None
        gw = grad_w * grad_out.to(grad_w.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None


def chunked_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 4096,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of (optionally weighted) token cross-entropies of ``hidden @ weight.T`` against ``labels``, in fp32.

    Args:
        hidden: [..., dim] final hidden states.
        weight: [vocab, dim] output head.
        labels: [...] target ids; ``-100`` carries no loss.
        chunk_size: tokens per chunk; peak extra memory is ``chunk_size * vocab`` fp32 values.
        weights: optional [...] per-token fp32 weights (the loss-group normalisation: 1 / (G * N_group)).

    Returns:
        fp32 scalar; its gradients equal those of the unchunked ``F.cross_entropy(..., reduction="sum")``.
    """
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, weights, chunk_size)


def naive_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The unchunked reference: materialises all logits. For tests and benchmarks."""
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
