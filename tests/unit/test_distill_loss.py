"""The blocked LM head + log-softmax of the head's trainer gives what the whole one gives: values,
argmax and both gradients, across block boundaries, in float32 and under bf16 autocast."""

import pytest
import torch

from services.draft.training import distill_loss


def _whole(x, w, ids):
    logq = (x @ w.T).log_softmax(-1)
    return logq.gather(1, ids), logq.argmax(-1)


@pytest.mark.parametrize("rows", [1, 255, 600])  # one row, one short block, three blocks
def test_blocks_give_the_whole_log_softmax_and_its_gradients(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=gen, requires_grad=True)
    w = (0.3 * torch.randn(700, 48, generator=gen)).requires_grad_()
    ids = torch.randint(0, 700, (rows, 8), generator=gen)
    upstream = torch.randn(rows, 8, generator=gen)  # any loss built on the picked values
    grads = []
    for fn in (_whole, distill_loss.picked_log_softmax):
        picked, best = fn(x, w, ids)
        (picked * upstream).sum().backward()
        grads.append((picked.detach(), best, x.grad, w.grad))
        x.grad = w.grad = None
    (p0, b0, gx0, gw0), (p1, b1, gx1, gw1) = grads
    assert torch.equal(b0, b1)
    torch.testing.assert_close(p1, p0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx1, gx0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw1, gw0, rtol=1e-4, atol=1e-5)


def test_under_bf16_autocast_it_matches_the_autocast_path():
    """The trainer's old path: the LM head's matmul in bf16 under autocast, the log-softmax in
    float32 on its output; the blocked one rounds the same logits, so it lands within bf16's step."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=gen, requires_grad=True)
    w = (0.2 * torch.randn(500, 64, generator=gen)).requires_grad_()
    ids = torch.randint(0, 500, (300, 4), generator=gen)
    p = torch.rand(300, 4, generator=gen)
    results = []
    for blocked in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if blocked:
                picked, _ = distill_loss.picked_log_softmax(x, w, ids)
            else:
                picked = torch.nn.functional.linear(x, w).log_softmax(-1).gather(1, ids)
            loss = -(p * picked).sum(-1).mean()
        loss.backward()
        results.append((float(loss.detach()), x.grad, w.grad))
        x.grad = w.grad = None
    (l0, gx0, gw0), (l1, gx1, gw1) = results
    assert l1 == pytest.approx(l0, rel=1e-4)
    torch.testing.assert_close(gx1, gx0, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gw1, gw0, rtol=2e-2, atol=2e-3)
