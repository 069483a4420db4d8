"""Verification-length policies (dspark/policy.py): fixed, confidence threshold and the paper's
confidence scheduler (docs/dspark-algorithm.md §5.3), including the Appendix A
counterexample as a sampling experiment."""
import itertools
import json
import math
import random

import pytest
import torch
from scipy.stats import chisquare

from dspark.policy import ConfidenceScheduler, ConfidenceThreshold, FixedK, SPSTable, calibrated_confidence, make_policy
from dspark.protocols import Proposal


def proposal(confidence, num_drafts=None):
    c = torch.tensor(confidence, dtype=torch.float32)
    B, k = c.shape
    num = torch.full((B,), k) if num_drafts is None else torch.tensor(num_drafts)
    return Proposal(tokens=torch.randint(0, 100, (B, k)), num_drafts=num, confidence=c)


# ---- fixed and threshold on hand-made confidences --------------------------------------------------

def test_fixed_k_verifies_all_proposed_up_to_k():
    p = proposal([[0.1] * 5] * 3, num_drafts=[5, 2, 0])
    assert FixedK().verify_lengths(p).tolist() == [5, 2, 0]
    assert FixedK(3).verify_lengths(p).tolist() == [3, 2, 0]
    assert FixedK(0).verify_lengths(p).tolist() == [0, 0, 0]


def test_threshold_stops_before_first_low_confidence():
    p = proposal([[0.9, 0.8, 0.3, 0.9, 0.9],
                  [0.2, 0.9, 0.9, 0.9, 0.9],
                  [0.9, 0.9, 0.9, 0.9, 0.9],
                  [0.9, 0.9, 0.9, 0.9, 0.1]], num_drafts=[5, 5, 3, 5])
    assert ConfidenceThreshold(0.5).verify_lengths(p).tolist() == [2, 0, 3, 4]
    assert ConfidenceThreshold(0.5, k=1).verify_lengths(p).tolist() == [1, 0, 1, 1]
    assert ConfidenceThreshold(0.0).verify_lengths(p).tolist() == [5, 5, 3, 5]  # 0 = the whole block
    exact = proposal([[0.5, 0.25, 0.75]])  # binary fractions: c == threshold passes (c >= threshold)
    assert [ConfidenceThreshold(t).verify_lengths(exact).item() for t in (0.25, 0.5, 0.75)] == [3, 1, 0]


def test_policies_need_confidence_and_valid_proposals():
    p = Proposal(tokens=torch.zeros(2, 3, dtype=torch.long), num_drafts=torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="Proposal.confidence"):
        ConfidenceThreshold(0.5).verify_lengths(p)
    with pytest.raises(ValueError, match="Proposal.num_drafts"):
        FixedK().verify_lengths(Proposal(torch.zeros(2, 3, dtype=torch.long), torch.tensor([4, 1])))
    with pytest.raises(ValueError, match="Proposal.confidence"):
        ConfidenceThreshold(0.5).verify_lengths(proposal([[0.5, 1.5, 0.2]]))


@pytest.mark.parametrize("threshold", [-0.1, 1.01, float("nan"), "0.5"])
def test_threshold_outside_unit_interval_raises(threshold):
    with pytest.raises(ValueError, match="threshold"):
        ConfidenceThreshold(threshold)


# ---- SPS table -------------------------------------------------------------------------------------

@pytest.mark.parametrize("counts, rates, field", [
    ([], [], "token_counts"),
    ([1, 2], [1.0, -0.5], "steps_per_s"),
    ([1, 2], [1.0, 0.0], "steps_per_s"),
    ([0, 2], [1.0, 0.5], "token_counts"),
    ([2, 2], [1.0, 0.5], "token_counts"),
    ([1, 2], [1.0], "steps_per_s"),
])
def test_bad_sps_table_raises_naming_the_field(counts, rates, field):
    with pytest.raises(ValueError, match=field):
        SPSTable(counts, rates)


def test_sps_table_interpolates_step_time_and_stays_monotone():
    rng = random.Random()
    t1, t2 = rng.uniform(1e-3, 2e-3), rng.uniform(3e-3, 5e-3)
    table = SPSTable([2, 6], [1 / t1, 1 / t2])
    assert table(1) == pytest.approx(1 / t1)  # below the table: the smallest size's rate
    assert table(4) == pytest.approx(1 / ((t1 + t2) / 2))  # halfway in step time
    assert table(10) == pytest.approx(1 / (t2 + (t2 - t1)))  # the last slope continues
    noisy = SPSTable([1, 2, 3], [10.0, 12.0, 8.0])  # a noisy size faster than a smaller one
    assert noisy.steps_per_s == [10.0, 10.0, 8.0]
    rates = [noisy(n) for n in range(1, 12)]
    assert all(b <= a for a, b in zip(rates, rates[1:]))


def test_sps_table_files_round_trip(tmp_path):
    rng = random.Random()
    counts = sorted(rng.sample(range(1, 200), 5))
    rates = sorted((rng.uniform(10, 100) for _ in counts), reverse=True)
    table = SPSTable(counts, rates)
    table.to_file(tmp_path / "sps.json")
    assert SPSTable.from_file(tmp_path / "sps.json").steps_per_s == pytest.approx(rates)
    (tmp_path / "sps.csv").write_text("token_counts,steps_per_s\n" + "".join(f"{n},{s!r}\n" for n, s in zip(counts, rates)))
    assert SPSTable.from_file(tmp_path / "sps.csv").steps_per_s == pytest.approx(rates)
    (tmp_path / "bad.json").write_text(json.dumps({"token_counts": [1], "steps_per_s": [-1]}))
    with pytest.raises(ValueError, match="steps_per_s"):
        SPSTable.from_file(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="token_counts"):
        (tmp_path / "empty.csv").write_text("token_counts,steps_per_s\n")
        SPSTable.from_file(tmp_path / "empty.csv")


def test_sps_table_profile_times_the_callable():
    calls = []

    def step(n):  # cost grows with the token count
        calls.append(n)
        x = torch.randn(64 * n, 64)
        for _ in range(20):
            x = torch.tanh(x @ torch.randn(64, 64))

    table = SPSTable.profile(step, [1, 8], warmup=1, repeats=3)
    assert calls == [1] * 4 + [8] * 4
    assert table.steps_per_s[0] >= table.steps_per_s[1] > 0


# ---- the scheduler ---------------------------------------------------------------------------------

def brute_force_best(survival, proposed, sps):
    """max over every prefix choice of tau * SPS(B) (the objective Algorithm 1 climbs)."""
    R = len(survival)
    best = (R * sps(R), [0] * R)
    for lengths in itertools.product(*(range(n + 1) for n in proposed)):
        tau = R + sum(sum(survival[r][:lengths[r]]) for r in range(R))
        theta = tau * sps(R + sum(lengths))
        if theta > best[0] + 1e-12:
            best = (theta, list(lengths))
    return best


def test_scheduler_finds_the_optimum_on_a_concave_table():
    # With a smooth table (step time linear in tokens) Θ is unimodal along the greedy path, so
    # Algorithm 1's early stop lands on the global optimum (docs/dspark-algorithm.md §5.3). Fresh random confidences.
    torch.manual_seed(random.randrange(1 << 30))
    table = SPSTable(list(range(1, 40)), [1.0 / (1.0 + 0.15 * n) for n in range(1, 40)])
    for _ in range(20):
        c = torch.rand(3, 4, dtype=torch.float64) ** 0.3
        num = torch.randint(0, 5, (3,))
        p = Proposal(torch.zeros(3, 4, dtype=torch.long), num, confidence=c)
        lengths = ConfidenceScheduler(table).verify_lengths(p)
        survival = torch.cumprod(c, 1).tolist()
        theta, best = brute_force_best(survival, num.tolist(), table)
        got = 3 + sum(sum(survival[r][:lengths[r]]) for r in range(3))
        assert got * table(3 + int(lengths.sum())) == pytest.approx(theta, rel=1e-9), (lengths, best)


def test_scheduler_never_exceeds_num_drafts_or_k():
    table = SPSTable([1, 64], [1.0, 0.999])  # verification almost free: admit everything allowed
    c = torch.rand(6, 7) * 0.05 + 0.95
    p = Proposal(torch.zeros(6, 7, dtype=torch.long), torch.tensor([7, 0, 3, 7, 1, 5]), confidence=c)
    assert ConfidenceScheduler(table).verify_lengths(p).tolist() == [7, 0, 3, 7, 1, 5]
    assert ConfidenceScheduler(table, k=4).verify_lengths(p).tolist() == [4, 0, 3, 4, 1, 4]
    costly = SPSTable([1, 2], [1.0, 0.01])  # any extra token is ruinous: verify nothing
    assert ConfidenceScheduler(costly).verify_lengths(p).tolist() == [0] * 6


def test_calibrated_confidence_changes_the_schedulers_choice():
    """STS temperatures (applied once, by calibrated_confidence, before the policy sees the
    proposal) change what the scheduler verifies."""
    table = SPSTable([1, 2, 3], [1.0, 0.5, 0.45])
    p = proposal([[0.8, 0.9]])
    assert ConfidenceScheduler(table).verify_lengths(p).tolist() == [0]  # Θ1 = 1.8 * 0.5 < 1
    # With SPS(2) = 0.53 the raw c_1 = 0.8 gives Θ1 = 1.8 * 0.53 = 0.954 < 1 (verify nothing);
    # T_1 = 0.25 sharpens it to σ(4 logit 0.8) = 0.996, Θ1 = 1.058 > 1 (verify one draft).
    cheaper = SPSTable([1, 2, 3], [1.0, 0.53, 0.3])
    assert ConfidenceScheduler(cheaper).verify_lengths(p).tolist() == [0]
    logits = torch.logit(torch.tensor([[0.8, 0.9]], dtype=torch.float64))
    sharpened = calibrated_confidence(logits, [0.25, 1.0])
    assert sharpened[0, 0].item() == pytest.approx(1 / (1 + (0.2 / 0.8) ** 4), rel=1e-12)
    assert sharpened[0, 1].item() == pytest.approx(0.9, rel=1e-12)
    assert torch.equal(calibrated_confidence(logits, None), torch.sigmoid(logits))
    recalibrated = Proposal(p.tokens, p.num_drafts, confidence=sharpened.float())
    assert ConfidenceScheduler(cheaper).verify_lengths(recalibrated).tolist() == [1]
    with pytest.raises(ValueError, match="temperatures"):
        calibrated_confidence(logits, [1.0, 0.0])
    with pytest.raises(ValueError, match="temperatures has 1 entries"):
        calibrated_confidence(logits, [1.0])


# ---- Appendix A: the early stop is what keeps the scheduler lossless ------------------------------

def rejection_sample(drafts, length, p_target, q_draft, generator) -> list[int]:
    """Standard speculative sampling (docs/dspark-algorithm.md §4) on the first `length` drafts: accept x_j with
    probability min(1, p(x_j)/q(x_j)); on a rejection emit a sample of norm(max(0, p - q)) and
    stop; if all are accepted emit a bonus token from p."""
    emitted = []
    for j in range(length):
        x = int(drafts[j])
        if torch.rand((), generator=generator, dtype=torch.float64) < min(1.0, float(p_target[x] / q_draft[x])):
            emitted.append(x)
            continue
        residual = (p_target - q_draft).clamp(min=0)
        emitted.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(p_target, 1, generator=generator)))
    return emitted


def first_emitted_tokens(early_stop: bool, trials: int, generator: torch.Generator) -> list[int]:
    """R = 1, γ = 2, vocabulary {A = 0, B = 1}. Target p_t = (0.7, 0.3) at every position, draft
    p_d = (0.5, 0.5); c_1 = 0.8 (a_1 = 0.8) and c_2 = 0.9 if x_1 = A else 0; SPS(1, 2, 3) =
    (1.0, 0.5, 0.45). Each trial drafts, schedules, verifies the admitted prefix and returns the
    first emitted token."""
    p_target = torch.tensor([0.7, 0.3], dtype=torch.float64)
    q_draft = torch.tensor([0.5, 0.5], dtype=torch.float64)
    scheduler = ConfidenceScheduler(SPSTable([1, 2, 3], [1.0, 0.5, 0.45]), early_stop=early_stop)
    emitted = []
    for _ in range(trials):
        drafts = torch.multinomial(q_draft, 2, replacement=True, generator=generator)
        c2 = 0.9 if drafts[0] == 0 else 0.0  # the confidence of x_2 depends on the realised x_1
        prop = Proposal(drafts[None], torch.tensor([2]), confidence=torch.tensor([[0.8, c2]]))
        length = int(scheduler.verify_lengths(prop)[0])
        emitted.append(rejection_sample(drafts, length, p_target, q_draft, generator)[0])
    return emitted


def test_appendix_a_counterexample_distribution():
    # 2000 trials per arm. Each check passes at p > 1e-3 (a correct implementation fails it 1 time
    # in 1000) and the wrong distribution is rejected at p < 1e-6 (chi-square, 1 dof): 0.7 vs 0.85
    # over 2000 draws is a ~14 sigma separation.
    generator = torch.Generator().manual_seed(random.randrange(1 << 30))
    trials = 2000
    for early_stop, right, wrong in ((True, (0.7, 0.3), (0.85, 0.15)), (False, (0.85, 0.15), (0.7, 0.3))):
        tokens = first_emitted_tokens(early_stop, trials, generator)
        observed = [tokens.count(0), tokens.count(1)]
        assert chisquare(observed, [trials * p for p in right]).pvalue > 1e-3, (early_stop, observed)
        assert chisquare(observed, [trials * p for p in wrong]).pvalue < 1e-6, (early_stop, observed)


def test_appendix_a_lengths():
    table = SPSTable([1, 2, 3], [1.0, 0.5, 0.45])
    high, low = proposal([[0.8, 0.9]]), proposal([[0.8, 0.0]])
    assert ConfidenceScheduler(table).verify_lengths(high).tolist() == [0]  # Θ1 = 0.9 < Θ0 = 1: stop
    assert ConfidenceScheduler(table, early_stop=False).verify_lengths(high).tolist() == [2]  # Θ2 = 1.134
    assert ConfidenceScheduler(table, early_stop=False).verify_lengths(low).tolist() == [0]  # Θ2 = 0.81


def test_make_policy(tmp_path):
    SPSTable([1, 2], [2.0, 1.0]).to_file(tmp_path / "sps.json")
    assert isinstance(make_policy("fixed", 3), FixedK)
    assert make_policy("threshold", 3, confidence_threshold=0.4).threshold == 0.4
    assert isinstance(make_policy("scheduler", 3, sps_table_path=str(tmp_path / "sps.json")), ConfidenceScheduler)
    with pytest.raises(ValueError, match="sps_table_path"):
        make_policy("scheduler", 3)
    with pytest.raises(ValueError, match="verify_policy"):
        make_policy("greedy", 3)
    assert math.isfinite(SPSTable.from_file(tmp_path / "sps.json")(5))
