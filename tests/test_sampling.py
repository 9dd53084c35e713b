"""The sampler: greedy limits, top-k/top-p sets, the repetition penalty, and draws that follow the filtered
distribution."""

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from pocketlab.sampling import SamplingParams, filtered_probs, inverse_cdf, penalize, sample


def test_limits_reduce_to_greedy():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1)
    for p in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        assert torch.equal(sample(logits, [p] * 4, [0, 1, 2, 3]), greedy)


def test_top_k_top_p_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert (filtered_probs(logits, [SamplingParams(temperature=1, top_k=2)]) > 0).sum() == 2
    probs = filtered_probs(logits, [SamplingParams(temperature=1, top_p=0.7)])  # 0.5 + 0.3 covers 0.7
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0, 0]]))


def test_draws_follow_the_distribution():
    """Chi-square goodness of fit at significance 0.001 over 20,000 seeded draws."""
    expected = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05], dtype=torch.float64)
    logits = expected.log().float()[None]
    p = SamplingParams(temperature=1.0)
    n = 20_000
    u = torch.tensor([p.uniform(pos) for pos in range(n)])
    draws = inverse_cdf(filtered_probs(logits, [p]).expand(n, -1), u)
    counts = torch.bincount(draws, minlength=5).double()
    assert chisquare(counts.numpy(), (n * expected).numpy()).pvalue > 1e-3


def test_same_seed_same_draws_and_bad_params():
    logits = torch.randn(1, 50)
    a = [sample(logits, [SamplingParams(temperature=1, seed=3)], [i]).item() for i in range(20)]
    b = [sample(logits, [SamplingParams(temperature=1, seed=3)], [i]).item() for i in range(20)]
    c = [sample(logits, [SamplingParams(temperature=1, seed=4)], [i]).item() for i in range(20)]
    assert a == b and a != c
    with pytest.raises(ValueError, match="sampling"):
        SamplingParams(top_p=0)


def test_repetition_penalty_is_transformers_processor():
    """Bit for bit transformers' processor on every penalized row (repeated ids, negative logits, a penalty below
    1, an empty history); rows at 1.0 untouched, and their history never asked for."""
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * 4
    histories = [[5, 5, 9, 63, 0, 9], [], [1, 2, 3, 2], [7, 8, 40], None]
    penalties = [1.3, 1.3, 0.7, 2.0, 1.0]
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    ours = penalize(logits, params, lambda b: histories[b] if penalties[b] != 1.0 else pytest.fail("asked"))
    for b, (p, seen) in enumerate(zip(penalties, histories, strict=True)):
        ids = torch.tensor([seen or []], dtype=torch.long)
        want = RepetitionPenaltyLogitsProcessor(p)(ids, logits[b : b + 1].clone())[0] if p != 1.0 else logits[b]
        assert torch.equal(ours[b], want), b
    assert not torch.equal(ours[0], logits[0]) and (ours[0][[5, 9]] != logits[0][[5, 9]]).all()
    assert penalize(logits, [SamplingParams()] * 5, lambda b: pytest.fail("asked")) is logits
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad)
