"""The DSpark drafter through the engine: greedy speculation emits exactly plain greedy decoding.

k3-tiny target (random weights) with a random-weight k3-tiny DSpark drafter: mostly rejections,
k in {1, 7} (k=1 drafts the full block and truncates it). The synthetic target with a briefly
trained drafter: long accepted blocks, so the draft cache grows by many rows per commit.
"""
import pytest
import torch

from dspark.build import build_target
from dspark.config import SamplingParams, SpecConfig
from dspark.drafters.dspark import K3_TINY_DSPARK, DSparkDrafter, DSparkModel
from dspark.drafters.dspark.train import TrainConfig, generate_sequences, train
from dspark.engine import Engine
from dspark_fixtures import SyntheticTarget, one_thread, single_thread, small_config  # noqa: F401 (autouse fixture)

MAX_TOKENS, SEQ_LEN = 12, 48


def k3_tiny(slots):
    return build_target("k3-tiny", max_slots=slots, max_seq_len=SEQ_LEN, device="cpu", seed=0)


def prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 3, (int(torch.randint(1, 16, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def k3_work_and_plain():
    work = prompts(3, 256, seed=5)
    with single_thread():
        return work, Engine(k3_tiny(3), None, SpecConfig(num_speculative_tokens=0)).generate(work, GREEDY)


@pytest.mark.parametrize("k", [1, 7])
def test_k3_tiny_greedy_speculation_equals_plain_decoding(k, k3_work_and_plain):
    work, plain = k3_work_and_plain
    target = k3_tiny(3)
    torch.manual_seed(0)
    model = DSparkModel(K3_TINY_DSPARK, *target.embedding_weights())
    engine = Engine(target, DSparkDrafter(model, target.max_slots, max_seq_len=target.max_seq_len), SpecConfig(num_speculative_tokens=k, drafter="dspark"))
    outs = engine.generate(work, GREEDY)
    for o, ref in zip(outs, plain):
        assert o.token_ids == ref.token_ids, o.request_id
    assert engine.metrics.num_draft_tokens > 0


def test_k3_tiny_probabilistic_drafting_is_seeded():
    work = prompts(2, 256, seed=6)
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, seed=100 + i) for i in range(2)]

    def run():
        target = k3_tiny(2)
        torch.manual_seed(0)
        model = DSparkModel(K3_TINY_DSPARK, *target.embedding_weights())
        drafter = DSparkDrafter(model, target.max_slots, max_seq_len=target.max_seq_len, draft_sample_method="probabilistic")
        return Engine(target, drafter, SpecConfig(num_speculative_tokens=7, drafter="dspark",
                                                  draft_sample_method="probabilistic")).generate(work, params)

    first, second = run(), run()
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert all(len(o.token_ids) == 8 for o in first)


def test_trained_drafter_long_blocks_equal_plain_decoding():
    target = SyntheticTarget(seed=0, max_slots=4, max_seq_len=128)
    torch.manual_seed(0)
    model = DSparkModel(small_config(target, "mla"), *target.embedding_weights())
    g = torch.Generator().manual_seed(1)
    data = generate_sequences(target, [torch.randint(0, 63, (8,), generator=g) for _ in range(64)], 56, 1.0, g)
    train(target, model, data, progress=False, config=TrainConfig(steps=60, batch_size=8, num_anchors=32, lr=3e-3))
    work = prompts(4, 64, seed=7)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = Engine(target, None, SpecConfig(num_speculative_tokens=0)).generate(work, greedy)
    engine = Engine(target, DSparkDrafter(model, target.max_slots, max_seq_len=target.max_seq_len), SpecConfig(num_speculative_tokens=7, drafter="dspark"))
    outs = engine.generate(work, greedy)
    for o, ref in zip(outs, plain):
        assert o.token_ids == ref.token_ids, o.request_id
    assert engine.metrics.acceptance_length > 2.5


def test_the_engines_policy_reads_calibrated_confidences():
    """The drafter's STS temperatures reach the verification policy: every step verifies the prefix
    whose calibrated confidence sigma(logit / T) clears the threshold, not the raw one."""
    import dataclasses

    from dspark.policy import calibrated_confidence

    target = SyntheticTarget(seed=3, max_slots=3, max_seq_len=128)
    torch.manual_seed(2)
    model = DSparkModel(small_config(target, "gqa"), *target.embedding_weights())
    with torch.no_grad():
        model.confidence_head.proj.weight.mul_(20.0)  # spread the raw logits of the untrained head
    work = prompts(3, 64, seed=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = Engine(target, None, SpecConfig(num_speculative_tokens=0)).generate(work, greedy)
    threshold = 0.7
    differs = 0
    for temps in ((0.25,) * 7, (100.0,) * 7):
        model.config = dataclasses.replace(model.config, confidence_temperatures=temps).validate()
        engine = Engine(target, DSparkDrafter(model, target.max_slots, max_seq_len=target.max_seq_len),
                        SpecConfig(num_speculative_tokens=7, drafter="dspark", verify_policy="threshold",
                                   confidence_threshold=threshold))
        records = []
        engine.add_observer(records.append)
        assert [o.token_ids for o in engine.generate(work, greedy)] == [o.token_ids for o in plain]
        for rec in records:
            logits = rec.proposal.confidence_logits
            calibrated = calibrated_confidence(logits, temps)
            torch.testing.assert_close(rec.proposal.confidence, calibrated, rtol=1e-6, atol=1e-7)
            expected = (calibrated >= threshold).long().cumprod(dim=1).sum(dim=1)
            assert rec.proposal.num_drafts.tolist() == expected.tolist()
            raw = (torch.sigmoid(logits) >= threshold).long().cumprod(dim=1).sum(dim=1)
            differs += int((raw != expected).sum())
        if temps[0] == 100.0:  # sigma(logit / 100) is about 0.5 everywhere: nothing is verified
            assert engine.metrics.num_drafts == 0
        else:
            assert engine.metrics.num_drafts > 0
    assert differs > 0, "raw and calibrated confidences chose the same lengths: the test shows nothing"
