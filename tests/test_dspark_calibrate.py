"""Confidence calibration by sequential temperature scaling (docs/dspark-algorithm.md §5.2)."""
import math

import pytest
import torch

from dspark.config import SamplingParams
from dspark.drafters.dspark import DSparkDrafter, DSparkModel, load_checkpoint, save_checkpoint
from dspark.drafters.dspark.calibrate import (
    Rounds,
    bootstrap_interval,
    brier_score,
    calibrate,
    expected_calibration_error,
    fit_temperatures,
    report,
    roc_auc,
)
from dspark.drafters.dspark.train import TrainConfig, generate_sequences, train
from dspark_fixtures import SyntheticTarget, one_thread, small_config  # noqa: F401 (autouse fixture)


def simulated_rounds(true_temps, n, seed):
    """Rounds whose drafts are accepted with conditional probability sigmoid(logit_k / T*_k)."""
    g = torch.Generator().manual_seed(seed)
    G = len(true_temps)
    logits = torch.randn(n, G, generator=g) * 2.5 + 1.5
    p = torch.sigmoid(logits / torch.tensor(true_temps))
    accept = torch.rand(n, G, generator=g) < p
    return Rounds(logits, accept.long().cumprod(dim=1).sum(dim=1))


def test_metrics_match_direct_definitions():
    g = torch.Generator().manual_seed(0)
    pred = torch.rand(300, generator=g)
    obs = (torch.rand(300, generator=g) < pred).float()
    pairs = [(float(a), float(b)) for a, oa in zip(pred, obs) for b, ob in zip(pred, obs) if oa == 1 and ob == 0]
    expected_auc = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) / len(pairs)
    assert roc_auc(pred, obs) == pytest.approx(expected_auc, rel=1e-12)
    tied = torch.tensor([0.5, 0.5, 0.2, 0.9])
    assert roc_auc(tied, torch.tensor([1.0, 0.0, 0.0, 1.0])) == pytest.approx(0.875)
    assert brier_score(pred, obs) == pytest.approx(float(((pred.double() - obs.double()) ** 2).mean()))
    # ECE by hand: bins of width 1/15; |mean pred - mean obs| weighted by bin share.
    ece = 0.0
    for b in range(15):
        in_bin = [(float(p), float(o)) for p, o in zip(pred, obs) if min(int(float(p) * 15), 14) == b]
        if in_bin:
            ece += len(in_bin) / 300 * abs(sum(p for p, _ in in_bin) / len(in_bin) - sum(o for _, o in in_bin) / len(in_bin))
    assert expected_calibration_error(pred, obs) == pytest.approx(ece, rel=1e-9)


def test_sts_recovers_known_temperatures_and_lowers_held_out_ece():
    true_temps = (2.0, 0.6, 3.0, 1.0, 1.5)
    fit = fit_temperatures(simulated_rounds(true_temps, 6000, seed=1))
    for k in range(3):  # early positions have enough positives to pin T_k down
        assert abs(math.log(fit[k] / true_temps[k])) < 0.25, (k, fit)
    held_out = simulated_rounds(true_temps, 6000, seed=2)
    before, after = report(held_out), report(held_out, fit)
    assert after["ece"] < 0.5 * before["ece"]
    assert after["brier"] < before["brier"]
    for p in after["positions"][:3]:
        assert p["ece"] < 0.03


def test_calibrate_a_trained_drafter_end_to_end(tmp_path):
    target = SyntheticTarget(seed=0)
    torch.manual_seed(0)
    model = DSparkModel(small_config(target, "gqa"), *target.embedding_weights())
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.vocab_size - 1, (8,), generator=g) for _ in range(32)]
    train(target, model, generate_sequences(target, prompts, 40, 1.0, g), progress=False,
          config=TrainConfig(steps=30, batch_size=8, num_anchors=32, lr=3e-3))
    # Real raw heads are over-confident (docs/dspark-algorithm.md §11 item 5); this briefly trained
    # one is nearly calibrated already, so sharpen its logits 3x to give STS something to undo
    # that stands out of the sampling noise of ~450 rounds.
    with torch.no_grad():
        model.confidence_head.proj.weight.mul_(3.0)
        model.confidence_head.proj.bias.mul_(3.0)
    drafter = DSparkDrafter(model, max_slots=16, max_seq_len=target.max_seq_len, draft_sample_method="probabilistic")
    fit_prompts = [torch.randint(0, target.vocab_size - 1, (8,), generator=g) for _ in range(16)]
    eval_prompts = [torch.randint(0, target.vocab_size - 1, (8,), generator=g) for _ in range(16)]
    result = calibrate(target, drafter, fit_prompts, eval_prompts=eval_prompts, max_new_tokens=48,
                       sampling=SamplingParams(temperature=1.0), seed=3)
    temps = tuple(result["temperatures"])
    assert len(temps) == 7 and drafter.config.confidence_temperatures == temps
    assert result["eval"]["after"]["ece"] < 0.6 * result["eval"]["before"]["ece"], result["eval"]
    assert 1.0 < result["eval"]["before"]["acceptance_length"] < 8.0
    # The drafter now reports sigmoid(logit_k / T_k).
    out = target.prefill([0], [eval_prompts[0]], drafter.tap_layers)
    target.release([0])
    drafter.start(0, eval_prompts[0], {layer: t[0] for layer, t in out.taps.items()})
    draft = drafter.draft([0], torch.tensor([5]), [SamplingParams(temperature=0.0)], [torch.Generator()])
    expected = torch.sigmoid(draft.confidence_logits / torch.tensor(temps))
    torch.testing.assert_close(draft.confidence, expected, rtol=1e-6, atol=1e-7)
    save_checkpoint(model, tmp_path)
    assert load_checkpoint(tmp_path, *target.embedding_weights()).config.confidence_temperatures == temps


def test_rounds_are_the_engines_steps_for_any_drafter():
    """run_rounds is the engine with an observer: one round per request-step, the engine's accepted
    counts; a drafter without a confidence head gives zero logits, its misses count as rejections."""
    from dspark.config import SpecConfig
    from dspark.drafters.ngram import NgramDrafter
    from dspark.drafters.dspark.calibrate import run_rounds
    from dspark.engine import Engine

    target = SyntheticTarget(seed=5, max_slots=4, max_seq_len=128)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, target.vocab_size, (int(n),), generator=g) for n in (6, 9, 3, 12, 7)]
    rounds = run_rounds(target, NgramDrafter(1, 2), prompts, max_new_tokens=30, block_size=4)
    engine = Engine(target, NgramDrafter(1, 2), SpecConfig(num_speculative_tokens=4))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert len(rounds.accepted) == sum(o.num_steps for o in outs) > 0
    assert int(rounds.accepted.sum()) == engine.metrics.num_accepted_tokens > 0
    assert rounds.confidence_logits.shape == (len(rounds.accepted), 4) and not rounds.confidence_logits.any()
    # Per prompt: its accepted drafts and rounds, which the held-out interval resamples.
    assert rounds.prompt_accepted.tolist() == [o.num_accepted_drafts for o in outs]
    assert rounds.prompt_rounds.tolist() == [o.num_steps for o in outs]
    low, high = rounds.acceptance_interval(samples=400)
    assert low <= rounds.acceptance_length <= high
    # A prompt with no room for one whole block gives no rounds.
    assert len(run_rounds(target, NgramDrafter(1, 2), [torch.zeros(125, dtype=torch.long)], max_new_tokens=30, block_size=4).accepted) == 0


def test_the_bootstrap_interval_covers_the_estimate_and_narrows_with_prompts():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    intervals = {}
    for prompts in (40, 640):
        rounds = torch.randint(10, 40, (prompts,), generator=g)
        rate = torch.rand(prompts, generator=g) * 3  # prompts differ: the interval has a width
        accepted = (rounds * rate).long()
        point = float((accepted.sum() + rounds.sum()) / rounds.sum())
        low, high = bootstrap_interval(accepted, rounds, samples=2000, seed=1)
        assert low < point < high
        intervals[prompts] = high - low
    # the standard error falls as 1/sqrt(prompts): 16x the prompts, ~1/4 the width
    assert 0.15 < intervals[640] / intervals[40] < 0.4, intervals
    rounds = torch.randint(10, 40, (30,), generator=g)
    same = bootstrap_interval(2 * rounds, rounds, samples=200)
    assert same == [3.0, 3.0]  # every prompt at AL 3 (however many rounds): so is every resample
    with pytest.raises(ValueError, match="no rounds"):
        bootstrap_interval(torch.zeros(0), torch.zeros(0))
