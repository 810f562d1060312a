import pytest
import torch

from services.common.sampling import SamplingParams, make_generator, sample, warp_probs


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                     (0.9, 10, 0.6), (2.0, 1, 1.0), (1.0, 0, 0.01)])
def test_warp_probs_matches_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ours = warp_probs(logits, temperature, top_k, top_p)
    assert torch.allclose(ours, ref.softmax(-1), atol=1e-6)
    assert torch.allclose(ours.sum(-1), torch.ones(4))


def _sorted_nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus by a full sort: keep a token while the mass before it is below top_p."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    sorted_p = sorted_x.softmax(-1)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    return x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))


@pytest.mark.parametrize("scale,top_k,top_p", [(4.0, 0, 0.9), (0.05, 0, 0.9), (1.0, 0, 0.999), (2.0, 300, 0.95)])
def test_the_nucleus_among_the_top_tokens_is_the_full_sorts(scale, top_k, top_p):
    """A peaked row's nucleus lies in its first 64 tokens; a nearly flat one's spans thousands
    (the search grows to the whole vocabulary); with top-k, within the k."""
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)) * scale
    ref = x.clone()
    if top_k:
        ref = ref.masked_fill(ref < torch.topk(ref, top_k, dim=-1).values[..., -1:], float("-inf"))
    want = _sorted_nucleus(ref, top_p).softmax(-1)
    got = warp_probs(x, 1.0, top_k, top_p)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-7)


def test_sample_draws_by_weight_and_never_a_zero_weight(monkeypatch):
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(probs, g) for _ in range(20000)]), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert torch.allclose(counts.float() / 20000, probs, atol=0.015)
    # a uniform draw that rounds up to the total takes the last token with weight, not a zero one
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert sample(probs, g) == 4


@pytest.mark.parametrize("kwargs,name", [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
                                         ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                         ({"top_k": -2}, "top_k"), ({"stop": ("",)}, "stop")])
def test_out_of_range_parameters_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs).validate()


def test_seeded_generators_are_reproducible_and_streams_differ():
    a, b, c = make_generator(7, 0), make_generator(7, 0), make_generator(7, 1)
    x, y, z = torch.rand(5, generator=a), torch.rand(5, generator=b), torch.rand(5, generator=c)
    assert torch.equal(x, y) and not torch.equal(x, z)
