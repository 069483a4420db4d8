"""Synthetic acceptance (issue 3): measured AL and per-position rates follow vLLM's semantics."""
import math

import pytest

from dspark.config import SamplingParams, SpecConfig
from dspark.drafters.uniform import UniformDrafter
from dspark.engine import Engine
from dspark.sampling import acceptance_length_to_rates
from dspark.targets.toy import MarkovTarget


def _run(spec: SpecConfig, steps_wanted: int, batch: int = 50, temperature: float = 0.0):
    target = MarkovTarget(16, seed=3, max_slots=batch, max_seq_len=4096)
    engine = Engine(target, UniformDrafter(16), spec)
    per_req = steps_wanted // batch
    engine.generate([[1, 2, 3]] * batch, SamplingParams(temperature=temperature, max_tokens=per_req * (spec.num_speculative_tokens + 1), ignore_eos=True))
    return engine.metrics


@pytest.mark.parametrize("length", [1, 2, 3, 6, 8])
def test_integer_length_gives_that_acceptance_length_exactly(length):
    m = _run(SpecConfig(num_speculative_tokens=7, rejection_sample_method="synthetic", synthetic_acceptance_length=float(length)), 400)
    assert m.acceptance_length == length


@pytest.mark.parametrize("length,temperature", [(3.84, 0.0), (2.5, 1.0), (6.3, 0.0)])
def test_fractional_length_within_0_02_over_2000_steps(length, temperature):
    m = _run(SpecConfig(num_speculative_tokens=7, rejection_sample_method="synthetic", synthetic_acceptance_length=length), 2000, temperature=temperature)
    assert m.num_drafts >= 2000
    assert abs(m.acceptance_length - length) <= 0.02, m.acceptance_length


def test_per_position_rates_within_three_standard_errors():
    rates = (0.95, 0.8, 0.8, 0.5, 0.3, 0.1, 0.0)
    m = _run(SpecConfig(num_speculative_tokens=7, rejection_sample_method="synthetic", synthetic_acceptance_rates=rates), 3000)
    n = m.num_drafts
    for i, (r, got) in enumerate(zip(rates, m.per_position_acceptance + [0.0] * 7)):
        se = math.sqrt(r * (1 - r) / n)
        assert abs(got - r) <= 3 * se + 1e-12, (i, got, r)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(synthetic_acceptance_length=9.0), r"synthetic_acceptance_length=9.0: must be in \[1, k\+1\]"),
        (dict(synthetic_acceptance_length=0.5), "synthetic_acceptance_length=0.5"),
        (dict(synthetic_acceptance_rates=(1.0, 0.5)), "must have k=7 entries"),
        (dict(synthetic_acceptance_rates=(1, 1, 1, 1, 1, 0, 1.2)), "outside"),
        (dict(synthetic_acceptance_rates=(0.5, 0.6, 0, 0, 0, 0, 0)), "non-increasing"),
        (dict(synthetic_acceptance_length=3.0, synthetic_acceptance_rates=(1,) * 7), "exactly one"),
        (dict(), "exactly one"),
    ],
)
def test_invalid_synthetic_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig(num_speculative_tokens=7, rejection_sample_method="synthetic", **kwargs).validate()


@pytest.mark.parametrize("kwargs", [dict(synthetic_acceptance_length=3.0), dict(synthetic_acceptance_rates=(1.0,) * 7)])
def test_synthetic_options_need_the_synthetic_method(kwargs):
    with pytest.raises(ValueError, match="needs rejection_sample_method='synthetic'"):
        SpecConfig(num_speculative_tokens=7, **kwargs).validate()


def test_presets_reproduce_their_source_curves():
    from dspark.presets import SYNTHETIC_PRESETS

    golden = SYNTHETIC_PRESETS["kimi-k3-dspark-golden"]
    assert [golden.acceptance_length(k) for k in range(1, 9)] == [1.85, 2.51, 3.00, 3.36, 3.62, 3.75, 3.84, 4.00]
    spec = SYNTHETIC_PRESETS["seed-al6-k7"].spec(7)
    assert spec.synthetic_acceptance_rates == (1, 1, 1, 1, 1, 0, 0)
    assert acceptance_length_to_rates(6.0, 7) == list(spec.synthetic_acceptance_rates)
    assert SYNTHETIC_PRESETS["kimi-k3-dspark-golden"].spec(7).synthetic_acceptance_length == 3.84
