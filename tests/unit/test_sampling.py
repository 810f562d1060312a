import pytest
import torch

from services.common.sampling import SamplingParams, make_generator, warp_probs


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
