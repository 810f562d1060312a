"""The head's LM head and log-softmax, read at the teacher's ids only, a block of rows at a time.

The distillation loss needs log q(ids) for the teacher's top-k ids of each row, never the whole
[rows, draft_vocab] log-softmax. Computed whole, the logits and their log-softmax, argmax, gather
and scatter each pass over several hundred MB per unrolled step, which on a 2-core CPU took longer
than the matmuls. Here each block of rows is produced, reduced and dropped while it is still in
cache; only the logits themselves are kept (in the matmuls' dtype) for the backward, which turns
them into their gradient in place.
"""

from __future__ import annotations

import torch

BLOCK_ROWS = 256  # rows of logits at a time on a CPU: 256 x 9,830 float32 is about 10 MB


def _block(x: torch.Tensor) -> int:
    """Rows a block: BLOCK_ROWS on a CPU; all of them on a GPU, where a block's kernel launches
    would cost more than the memory passes they save."""
    return BLOCK_ROWS if x.device.type == "cpu" else max(1, len(x))


class _PickedLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, ids, dtype):
        # x [R, hidden], weight [V, hidden], ids [R, k] long -> log q at ids [R, k], argmax [R]
        xs, w = x.to(dtype), weight.to(dtype)
        logits = torch.empty(len(x), len(w), dtype=dtype, device=x.device)  # [R, V], kept for the backward
        picked = torch.empty(ids.shape, dtype=torch.float32, device=x.device)
        lse = torch.empty(len(x), dtype=torch.float32, device=x.device)
        best = torch.empty(len(x), dtype=torch.long, device=x.device)
        step = _block(x)
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are chosen here, and out= needs it off
            for a in range(0, len(x), step):
                b = slice(a, a + step)
                torch.mm(xs[b], w.T, out=logits[b])
                logq = torch.log_softmax(logits[b], -1, dtype=torch.float32)  # one pass: cast, normalize
                lse[b] = logits[b, 0].float() - logq[:, 0]
                picked[b] = logq.gather(1, ids[b])
                best[b] = logq.max(-1).indices
        ctx.save_for_backward(xs, w, ids, lse, logits)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.mark_non_differentiable(best)
        return picked, best

    @staticmethod
    def backward(ctx, grad, _best):
        # d picked[r, j] / d z[r] = onehot(ids[r, j]) - softmax(z[r]), so
        # dz[r] = scatter(grad[r] at ids[r]) - softmax(z[r]) * grad[r].sum()
        # dz: the logits' buffer, overwritten block by block (so one backward per forward, as training runs)
        xs, w, ids, lse, dz = ctx.saved_tensors
        gx = torch.empty(xs.shape, dtype=ctx.x_dtype, device=xs.device)
        step = _block(xs)
        for a in range(0, len(xs), step):
            b = slice(a, a + step)
            g = grad[b].float()
            z = dz[b].float().sub_(lse[b, None]).exp_().mul_(-g.sum(-1, keepdim=True))
            dz[b] = z.scatter_add_(1, ids[b], g)
            gx[b] = dz[b] @ w
        return gx, (dz.T @ xs).to(ctx.w_dtype), None, None


def picked_log_softmax(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(x @ weight.T).gather(1, ids) and its argmax, without the [R, V] tensors:
    x [R, hidden], weight [V, hidden], ids [R, k] long -> ([R, k] float32, [R] long); the
    matmuls in the dtype autocast would run a linear in there (float32 where it is off)."""
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else torch.float32
    return _PickedLogSoftmax.apply(x, weight, ids, dtype)
