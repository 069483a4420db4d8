"""The distribution test shared by the engine and drafter tests: short sequences from a small
vocabulary against their closed-form probabilities under the toy Markov target."""
import itertools

import numpy as np
import torch
from scipy import stats

from dspark.config import SamplingParams
from dspark.sampling import SamplingTensors, processed_probs, rejection_sample
from dspark.targets.toy import MarkovTarget

V = 5
PROMPT = [0, 3]
GEN = 3  # generated tokens per sequence: 125 possible sequences


def exact_sequence_probs(target: MarkovTarget, params: SamplingParams) -> dict[tuple, float]:
    """Closed-form distribution of the first GEN tokens under plain sampling."""
    st = SamplingTensors.from_params([params], "cpu")
    probs = {}
    for seq in itertools.product(range(V), repeat=GEN):
        ctx, p = list(PROMPT), 1.0
        for t in seq:
            row = processed_probs(target.next_logits(torch.tensor([ctx[-2]]), torch.tensor([ctx[-1]])), st)[0]
            p *= float(row[t].double())
            ctx.append(t)
        probs[seq] = p
    return probs


def broken_sampler(logits, drafts, num_drafts, q, sampling, u, noise):
    """Resamples from p instead of the residual max(p - q, 0) after a rejection."""
    acc, nxt = rejection_sample(logits, drafts, num_drafts, q, sampling, u, noise)
    p = processed_probs(logits[torch.arange(len(acc)), acc], sampling)
    rejected = acc < num_drafts
    return acc, torch.where(rejected, (p / noise).argmax(-1), nxt)


def chi2_pvalue(outputs, expected_probs):
    counts = {}
    for o in outputs:
        key = tuple(o.token_ids[:GEN])
        counts[key] = counts.get(key, 0) + 1
    n = len(outputs)
    keys = sorted(expected_probs)
    exp = np.array([expected_probs[k] * n for k in keys])
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    small = exp < 5  # merge sparse bins into one so the chi-square approximation holds
    exp = np.append(exp[~small], exp[small].sum())
    obs = np.append(obs[~small], obs[small].sum())
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
