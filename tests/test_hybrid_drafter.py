"""The hybrid drafter (drafters/hybrid.py): n-gram's continuation where a request repeats itself,
DSpark's block elsewhere. Greedy output equals plain decoding with both drafters proposing rows,
and probabilistic drafting keeps the target's sequence distribution (the shared chi-square test,
shown to fail with the broken sampler)."""
import random
import types

import pytest
import torch

from dspark.config import SamplingParams, SpecConfig
from dspark.drafters.hybrid import HybridDrafter
from dspark.drafters.ngram import NgramDrafter
from dspark.engine import Engine
from dspark.targets.toy import MarkovTarget
from dspark_fixtures import one_thread  # noqa: F401 (autouse fixture)

from distribution import SAMPLES, broken_sampler, sampled_run, toy_dspark


def test_greedy_hybrid_output_equals_plain_decoding_with_both_drafters_proposing():
    """The order-2 toy target's greedy text is a function of its last two tokens: over 8 tokens
    (64 pairs) it must repeat a pair within 66 tokens and cycle from there, so n-gram matches
    come; a prompt of two distinct tokens has no 2-token match, so DSpark drafts the first step."""
    seed = random.randrange(2**32)  # the run's seed (tests/conftest.py) repeats it
    print(f"seed {seed}")
    torch.manual_seed(seed)
    prompts = [torch.randperm(8)[:2].tolist() for _ in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)

    def target():
        return MarkovTarget(8, seed=seed % 1000, max_slots=3, max_seq_len=128)

    plain = Engine(target(), None, SpecConfig(num_speculative_tokens=0)).generate(prompts, greedy)
    speculative = target()
    hybrid = HybridDrafter(toy_dspark(speculative, 3), NgramDrafter(2, 4))
    outs = Engine(speculative, hybrid, SpecConfig(num_speculative_tokens=2)).generate(prompts, greedy)
    for ours, reference in zip(outs, plain):
        assert ours.token_ids == reference.token_ids, (seed, ours.request_id)
    assert hybrid.rows["ngram"] > 0 and hybrid.rows["dspark"] >= len(prompts), (seed, hybrid.rows)


@pytest.mark.long
@pytest.mark.parametrize("sampler,should_pass", [(None, True), (broken_sampler, False)])
def test_probabilistic_hybrid_drafts_preserve_the_distribution(sampler, should_pass):
    seed = random.randrange(2**32)  # the run's seed (tests/conftest.py) repeats it
    print(f"seed {seed}")
    torch.manual_seed(seed)
    # One-token matches, so that most steps mix n-gram (one-hot q) and DSpark (sampled q) rows.
    engine, pvalue = sampled_run(
        lambda target: HybridDrafter(toy_dspark(target, SAMPLES, "probabilistic"), NgramDrafter(1, 2)), sampler,
        draft_sample_method="probabilistic", seed=seed)
    assert min(engine.drafter.rows.values()) > SAMPLES // 10, engine.drafter.rows
    assert (pvalue > 1e-3) == should_pass, (seed, pvalue)


def test_a_dspark_drafter_that_commits_on_the_device_is_refused():
    with pytest.raises(ValueError, match="commits on the device"):
        HybridDrafter(types.SimpleNamespace(commits_on_device=True), NgramDrafter(2, 4))
