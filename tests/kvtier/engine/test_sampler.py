"""Sampler: greedy, temperature, top-p, and per-request seeded generators."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.sampler import Sampler, SamplingParams, top_p_filter


def draw(logits: torch.Tensor, p: SamplingParams, n: int) -> list[int]:
    g = p.make_generator()
    return [Sampler()(logits[None], [p], [g])[0] for _ in range(n)]


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    p = SamplingParams()
    assert Sampler()(logits, [p, p], [None, None]) == [1, 0]


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    logits = torch.zeros(50)
    a = draw(logits, SamplingParams(temperature=1.0, seed=3), 40)
    assert a == draw(logits, SamplingParams(temperature=1.0, seed=3), 40)
    assert a != draw(logits, SamplingParams(temperature=1.0, seed=4), 40)


def test_a_row_samples_the_same_whatever_shares_its_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=0.8, seed=s) for s in (1, 2, 3)]
    gens = [p.make_generator() for p in params]
    together = [Sampler()(logits, params, gens) for _ in range(10)]
    alone = draw(logits[1], params[1], 10)
    assert [row[1] for row in together] == alone


def test_top_p_keeps_the_nucleus_and_renormalises() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    kept = top_p_filter(probs, 0.8)  # 0.5 + 0.3 reaches 0.8: the other two go
    torch.testing.assert_close(kept, torch.tensor([0.0, 0.625, 0.0, 0.375]))
    torch.testing.assert_close(top_p_filter(probs, 0.81), torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95)
    assert torch.equal(top_p_filter(probs, 1.0), probs)
    assert top_p_filter(probs, 1e-6).tolist() == [0.0, 1.0, 0.0, 0.0]  # the top token always stays


def test_tiny_top_p_is_greedy() -> None:
    logits = torch.tensor([0.0, 0.3, 0.2, 0.1])
    assert set(draw(logits, SamplingParams(temperature=1.0, top_p=0.01, seed=0), 50)) == {1}


def test_temperature_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0])
    n = 3000
    for temperature in (0.5, 2.0):
        tokens = draw(logits, SamplingParams(temperature=temperature, seed=11), n)
        freq = torch.bincount(torch.tensor(tokens), minlength=3).double() / n
        expected = torch.softmax(logits.double() / temperature, 0)
        assert (freq - expected).abs().max() < 0.03, (temperature, freq, expected)


def test_unseeded_generators_differ() -> None:
    logits = torch.zeros(1000)
    p = SamplingParams(temperature=1.0)
    assert draw(logits, p, 8) != draw(logits, p, 8)


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"temperature": -1.0}, {"temperature": float("nan")},
                                    {"top_p": 0.0}, {"top_p": 1.5}])
def test_invalid_params(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
