"""The acceptance rules: greedy, standard rejection sampling, logits processing, synthetic rates."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from dspark.sampling import (
    SamplingTensors,
    acceptance_length_to_rates,
    conditional_rates,
    processed_probs,
    rejection_sample,
    synthetic_sample,
)


def _sampling(B, temperature=1.0, top_k=0, top_p=1.0):
    return SamplingTensors(
        torch.full((B,), float(temperature)), torch.full((B,), top_k, dtype=torch.long), torch.full((B,), float(top_p))
    )


def _reference_probs(logits, temperature, top_k, top_p):
    """float64 numpy reference of temperature -> top-k -> top-p processing."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros_like(z, dtype=bool)
    keep[order[: top_k if top_k > 0 else len(z)]] = True
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    p /= p.sum()
    sp = p[order]
    before = np.cumsum(sp) - sp
    sp = np.where(before >= top_p, 0.0, sp)
    out = np.zeros_like(p)
    out[order] = sp / sp.sum()
    return out


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 7, 0.6)])
def test_processed_probs_matches_float64_reference(temperature, top_k, top_p):
    logits = torch.randn(6, 40) * 2
    got = processed_probs(logits, _sampling(6, temperature, top_k, top_p))
    for row in range(6):
        ref = _reference_probs(logits[row].numpy(), temperature, top_k, top_p)
        np.testing.assert_allclose(got[row].double().numpy(), ref, atol=1e-6)


def test_greedy_rows_are_one_hot_argmax():
    logits = torch.randn(4, 30)
    got = processed_probs(logits, _sampling(4, temperature=0.0))
    assert torch.equal(got.argmax(-1), logits.argmax(-1)) and torch.equal(got.sum(-1), torch.ones(4))


def test_greedy_acceptance_is_argmax_match():
    B, k, V = 64, 5, 11
    logits = torch.randn(B, k + 1, V)
    argmax = logits.argmax(-1)
    drafts = argmax[:, :k].clone()
    # break each row at a random position (or not at all)
    cut = torch.randint(0, k + 1, (B,))
    for b in range(B):
        if cut[b] < k:
            drafts[b, cut[b]] = (drafts[b, cut[b]] + 1) % V
    num_drafts = torch.randint(0, k + 1, (B,))
    acc, nxt = rejection_sample(logits, drafts, num_drafts, None, _sampling(B, 0.0), torch.rand(B, k), torch.ones(B, V))
    expect = torch.minimum(cut, num_drafts)
    assert torch.equal(acc, expect)
    assert torch.equal(nxt, argmax[torch.arange(B), expect])


def test_standard_acceptance_decisions_follow_min_1_p_over_q():
    B, k, V = 200, 3, 6
    logits = torch.randn(B, k + 1, V)
    q = torch.softmax(torch.randn(B, k, V), -1)
    drafts = torch.multinomial(q.view(-1, V), 1).view(B, k)
    u = torch.rand(B, k)
    acc, _ = rejection_sample(logits, drafts, torch.full((B,), k), q, _sampling(B), u, torch.empty(B, V).exponential_())
    p = torch.softmax(logits.double(), -1)
    for b in range(B):
        n = 0
        while n < k:
            ratio = p[b, n, drafts[b, n]] / q[b, n, drafts[b, n]].double()
            if not u[b, n] < ratio:
                break
            n += 1
        assert acc[b] == n


def _first_token_distribution(sampler_fn, n, V, seed):
    """Sample one block (k=1) many times; return counts of the first emitted token."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 2, V, generator=g).expand(n, 2, V)
    q_row = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    q = q_row.expand(n, 1, V)
    drafts = torch.multinomial(q_row, n, replacement=True, generator=g)[:, None]
    u = torch.rand(n, 1, generator=g)
    noise = torch.empty(n, V).exponential_(generator=g)
    acc, nxt = sampler_fn(logits, drafts, torch.ones(n, dtype=torch.long), q, _sampling(n), u, noise)
    first = torch.where(acc > 0, drafts[:, 0], nxt)
    return np.bincount(first.numpy(), minlength=V), torch.softmax(logits[0, 0].double(), -1).numpy()


def _resample_from_p(logits, drafts, num_drafts, q, sampling, u, noise):
    """A deliberately broken sampler: on rejection it draws from p instead of max(p - q, 0)."""
    acc, nxt = rejection_sample(logits, drafts, num_drafts, q, sampling, u, noise)
    p = processed_probs(logits[torch.arange(len(acc)), acc], sampling)
    return acc, (p / noise).argmax(-1)


@pytest.mark.parametrize("sampler_fn,should_pass", [(rejection_sample, True), (_resample_from_p, False)])
def test_first_token_matches_target_distribution(sampler_fn, should_pass):
    counts, p = _first_token_distribution(sampler_fn, 40_000, 6, seed=7)
    pvalue = stats.chisquare(counts, p * counts.sum()).pvalue
    assert (pvalue > 1e-3) == should_pass, pvalue


def test_acceptance_length_to_rates_is_vllms_minimum_variance_schedule():
    assert acceptance_length_to_rates(2.5, 4) == [1.0, 0.5, 0.0, 0.0]
    assert acceptance_length_to_rates(6.0, 7) == [1, 1, 1, 1, 1, 0, 0]
    assert acceptance_length_to_rates(8.0, 7) == [1.0] * 7
    assert acceptance_length_to_rates(1.0, 3) == [0.0, 0.0, 0.0]
    got = acceptance_length_to_rates(3.4, 5)
    assert got[:2] == [1.0, 1.0] and math.isclose(got[2], 0.4) and got[3:] == [0.0, 0.0]
    for bad in (0.5, 9.0):
        with pytest.raises(ValueError, match="synthetic_acceptance_length"):
            acceptance_length_to_rates(bad, 7)


def test_conditional_rates():
    assert conditional_rates([0.8, 0.4, 0.4, 0.0, 0.0]) == [0.8, 0.5, 1.0, 0.0, 0.0]


def _unconditional_rates_as_conditional(rates):
    """A deliberately broken synthetic schedule: feeds P(accepted > i) where the sampler takes
    P(accept position i | positions before it accepted), so acceptance decays too fast."""
    return torch.tensor(rates)


@pytest.mark.parametrize("schedule,should_pass", [(conditional_rates, True), (_unconditional_rates_as_conditional, False)])
def test_synthetic_sample_accepts_by_rate_whatever_the_tokens(schedule, should_pass):
    """The accepted counts follow P(accepted >= i + 1) = rates[i], whatever the logits and drafts:
    one chi-square test over the k + 1 counts (fresh draws; a correct sampler fails it with
    probability 1e-4), which rejects the broken schedule."""
    B, k, V = 20_000, 4, 5
    rates = [0.9, 0.6, 0.3, 0.1]
    cond = torch.as_tensor(schedule(rates), dtype=torch.float32)
    logits = torch.randn(B, k + 1, V)
    drafts = torch.randint(0, V, (B, k))
    acc, _ = synthetic_sample(logits, drafts, torch.full((B,), k), cond, _sampling(B, 0.0), torch.rand(B, k), torch.ones(B, V))
    survival = np.array([1.0, *rates, 0.0])
    expected = (survival[:-1] - survival[1:]) * B  # P(accepted == j), j = 0..k
    pvalue = stats.chisquare(np.bincount(acc.numpy(), minlength=k + 1), expected).pvalue
    assert (pvalue > 1e-4) == should_pass, pvalue


def test_fast_paths_decide_like_the_general_path():
    """all_greedy skips softmax/noise and filters=False skips the sort; decisions must not change."""
    B, k, V = 64, 4, 9
    logits = torch.randn(B, k + 1, V)
    q = torch.softmax(torch.randn(B, k, V), -1)
    drafts = torch.where(torch.rand(B, k) < 0.5, logits[:, :k].argmax(-1), torch.randint(0, V, (B, k)))
    num, u, noise = torch.randint(0, k + 1, (B,)), torch.rand(B, k), torch.empty(B, V).exponential_()
    for temperature in (0.0, 0.8):
        general = _sampling(B, temperature)  # all_greedy=False, filters=True: the general path
        fast = SamplingTensors(general.temperature, general.top_k, general.top_p, all_greedy=temperature == 0.0, filters=False)
        a = rejection_sample(logits, drafts, num, q, general, u, noise)
        b = rejection_sample(logits, drafts, num, q, fast, u, noise)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
