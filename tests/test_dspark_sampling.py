"""Probabilistic DSpark drafting through the engine keeps the target's sequence distribution:
the foundation's distribution test (tests/distribution.py) with a random DSpark drafter whose
drafts are sampled from its Markov-corrected distribution q, which the rejection sampler uses.

The drafter's weights and the engine's draws come from a fresh seed each run (printed), not from
whatever state earlier tests left the global generator in: with a correct sampler the test then
fails one run in a thousand (its threshold) whatever runs before it, and a failure is reproduced
from its seed."""
import os

import pytest
import torch

from dspark.config import SamplingParams, SpecConfig
from dspark.engine import Engine
from dspark.targets.toy import MarkovTarget

from distribution import GEN, PROMPT, V, broken_sampler, chi2_pvalue, exact_sequence_probs, toy_dspark


@pytest.mark.parametrize("sampler,should_pass", [(None, True), (broken_sampler, False)])
def test_probabilistic_dspark_drafts_preserve_the_distribution(sampler, should_pass):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    torch.manual_seed(seed)
    n = 20_000
    target = MarkovTarget(V, seed=11, scale=1.2, max_slots=n, max_seq_len=16)
    drafter = toy_dspark(target, n, "probabilistic")
    engine = Engine(target, drafter, SpecConfig(num_speculative_tokens=2, draft_sample_method="probabilistic", seed=seed),
                    sampler=sampler)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=GEN)
    outputs = engine.generate([PROMPT] * n, params)
    assert all(len(o.token_ids) == GEN for o in outputs)
    assert engine.metrics.num_drafts > 0 and 0.02 < engine.metrics.draft_acceptance_rate < 0.98
    pvalue = chi2_pvalue(outputs, exact_sequence_probs(target, params))
    assert (pvalue > 1e-3) == should_pass, (seed, pvalue)
