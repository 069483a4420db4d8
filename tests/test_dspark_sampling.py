"""Probabilistic DSpark drafting through the engine keeps the target's sequence distribution:
the foundation's distribution test (tests/distribution.py) with a random DSpark drafter whose
drafts are sampled from its Markov-corrected distribution q, which the rejection sampler uses.

The drafter's weights and the engine's draws come from a fresh seed each run (printed), not from
whatever state earlier tests left the global generator in: with a correct sampler the test then
fails one run in a thousand (its threshold) whatever runs before it, and a failure is reproduced
from its seed."""
import random

import pytest
import torch

from distribution import SAMPLES, broken_sampler, sampled_run, toy_dspark


@pytest.mark.long
@pytest.mark.parametrize("sampler,should_pass", [(None, True), (broken_sampler, False)])
def test_probabilistic_dspark_drafts_preserve_the_distribution(sampler, should_pass):
    seed = random.randrange(2**32)  # the run's seed (tests/conftest.py) repeats it
    print(f"seed {seed}")
    torch.manual_seed(seed)
    engine, pvalue = sampled_run(lambda target: toy_dspark(target, SAMPLES, "probabilistic"), sampler,
                                 draft_sample_method="probabilistic", seed=seed)
    assert engine.metrics.num_drafts > 0 and 0.02 < engine.metrics.draft_acceptance_rate < 0.98
    assert (pvalue > 1e-3) == should_pass, (seed, pvalue)
