"""The engine on the toy Markov target: losslessness of the whole pipeline in distribution,
stop conditions, bad input, gates and metrics."""
import pytest
import torch

from dspark.config import Profile, SamplingParams, SpecConfig
from dspark.drafters.ngram import NgramDrafter
from dspark.engine import Engine
from dspark.step import EagerRunner
from dspark.targets.toy import MarkovTarget

from distribution import GEN, PROMPT, V, broken_sampler, chi2_pvalue, exact_sequence_probs, sampled_run
from toy_drafters import ScriptedDrafter, TableDrafter


@pytest.mark.parametrize(
    "drafter_kind,sampler,should_pass",
    [("table", None, True), ("ngram", None, True), ("table", broken_sampler, False)],
)
@pytest.mark.long
def test_speculative_sampling_preserves_the_sequence_distribution(drafter_kind, sampler, should_pass):
    engine, pvalue = sampled_run(
        lambda target: TableDrafter(V, seed=5, scale=1.5) if drafter_kind == "table" else NgramDrafter(1, 2), sampler,
        seed=3)
    if drafter_kind == "table":
        assert engine.metrics.num_drafts > 0 and 0.05 < engine.metrics.draft_acceptance_rate < 0.95
    assert (pvalue > 1e-3) == should_pass, pvalue


def test_plain_sampling_matches_the_closed_form_too():
    n = 20_000
    target = MarkovTarget(V, seed=11, scale=1.2, max_slots=n, max_seq_len=16)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=GEN)
    outputs = Engine(target).generate([PROMPT] * n, params)
    assert chi2_pvalue(outputs, exact_sequence_probs(target, params)) > 1e-3


def _greedy_reference(vocab, prompts, max_tokens, seed=2):
    target = MarkovTarget(vocab, seed=seed, max_slots=len(prompts), max_seq_len=128)
    return Engine(target).generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def test_seeded_requests_reproduce_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12)
    alone = Engine(MarkovTarget(7, seed=4), NgramDrafter(), SpecConfig(num_speculative_tokens=3)).generate([[1, 2, 3]], params)
    rng = torch.Generator().manual_seed(0)
    others = [torch.randint(0, 7, (5,), generator=rng).tolist() for _ in range(5)]
    batch = Engine(MarkovTarget(7, seed=4), NgramDrafter(), SpecConfig(num_speculative_tokens=3)).generate(
        others[:2] + [[1, 2, 3]] + others[2:], [SamplingParams(temperature=1.0, max_tokens=12)] * 2 + [params] + [SamplingParams(temperature=1.0, max_tokens=12)] * 3
    )
    assert batch[2].token_ids == alone[0].token_ids


def test_eos_inside_an_accepted_block_ends_the_request_there():
    vocab = 9
    prompts = [[1, 2], [3, 4, 5], [6]]
    ref = _greedy_reference(vocab, prompts, 30)
    # Pick as EOS a token that appears mid-way through request 0's greedy continuation.
    eos = ref[0].token_ids[6]
    scripts = {tuple(p): r.token_ids for p, r in zip(prompts, ref)}
    target = MarkovTarget(vocab, seed=2, max_slots=3, max_seq_len=128)
    engine = Engine(target, ScriptedDrafter(scripts, vocab, corrupt_every=50), SpecConfig(num_speculative_tokens=7), eos_token_ids=(eos,))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30))
    for o, r in zip(outs, ref):
        expect = r.token_ids[: r.token_ids.index(eos) + 1] if eos in r.token_ids else r.token_ids
        assert o.token_ids == expect
        assert o.finish_reason == ("stop" if eos in r.token_ids else "length")
    assert engine.metrics.acceptance_length > 3  # the EOS really sat inside accepted blocks


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9, 13])
def test_max_tokens_landing_mid_block_truncates(max_tokens):
    prompts = [[1, 2, 3], [4]]
    ref = _greedy_reference(8, prompts, 40)
    scripts = {tuple(p): r.token_ids for p, r in zip(prompts, ref)}
    engine = Engine(MarkovTarget(8, seed=2, max_slots=2, max_seq_len=128), ScriptedDrafter(scripts, 8, corrupt_every=100), SpecConfig(num_speculative_tokens=7))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids[:max_tokens] and o.finish_reason == "length"


def test_stop_token_ids_and_context_limit():
    prompts = [[1, 2, 3]]
    ref = _greedy_reference(8, prompts, 20)
    stop = ref[0].token_ids[3]
    out = Engine(MarkovTarget(8, seed=2, max_seq_len=128), NgramDrafter(), SpecConfig(num_speculative_tokens=3)).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop,)))
    assert out[0].token_ids == ref[0].token_ids[: ref[0].token_ids.index(stop) + 1] and out[0].finish_reason == "stop"
    # A context of 10 positions: 3 prompt tokens + 7 committed, then the 8th output has no slot.
    out = Engine(MarkovTarget(8, seed=2, max_seq_len=10), NgramDrafter(), SpecConfig(num_speculative_tokens=3)).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=50))
    assert out[0].finish_reason == "length" and out[0].token_ids == ref[0].token_ids[:8]


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], SamplingParams(), "prompt"),
        ([1, 99], SamplingParams(), "token id 99"),
        ([-1], SamplingParams(), "token id -1"),
        (list(range(8)) * 3, SamplingParams(), "max_seq_len"),
        ([1], SamplingParams(temperature=-0.5), "temperature=-0.5"),
        ([1], SamplingParams(top_p=0.0), "top_p=0.0"),
        ([1], SamplingParams(top_p=1.5), "top_p=1.5"),
        ([1], SamplingParams(top_k=-1), "top_k=-1"),
        ([1], SamplingParams(max_tokens=0), "max_tokens=0"),
        ([1], SamplingParams(stop_token_ids=(8,)), "stop_token_ids"),
    ],
)
def test_a_bad_request_fails_alone(prompt, params, match):
    engine = Engine(MarkovTarget(8, seed=2, max_slots=4, max_seq_len=16), NgramDrafter(), SpecConfig(num_speculative_tokens=3))
    good = SamplingParams(temperature=0.0, max_tokens=4)
    outs = engine.generate([[1, 2], prompt, [3]], [good, params, good])
    assert outs[1].finish_reason == "error" and match in outs[1].error
    assert [len(o.token_ids) for o in (outs[0], outs[2])] == [4, 4] and outs[0].error is None
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_speculative_tokens=-1), "num_speculative_tokens=-1"),
        (dict(drafter="eagle"), "drafter='eagle'"),
        (dict(prompt_lookup_min=0), "prompt_lookup_min=0"),
        (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max=2"),
        (dict(rejection_sample_method="block"), "rejection_sample_method='block'"),
        (dict(num_speculative_tokens_per_batch_size=((1, 4, 9),)), "num_speculative_tokens_per_batch_size"),
        (dict(num_speculative_tokens_per_batch_size=((4, 2, 1),)), "num_speculative_tokens_per_batch_size"),
        (dict(max_speculative_seq_len=0), "max_speculative_seq_len=0"),
        (dict(batch1_profile=Profile(num_speculative_tokens=-2)), "batch1_profile.num_speculative_tokens=-2"),
    ],
)
def test_bad_spec_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        SpecConfig(**kwargs).validate()


def test_speculation_needs_a_drafter():
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(MarkovTarget(8), None, SpecConfig(num_speculative_tokens=3))


def test_streaming_yields_each_step_in_order():
    engine = Engine(MarkovTarget(8, seed=2), NgramDrafter(), SpecConfig(num_speculative_tokens=3))
    streamed = {}
    for ev in engine.stream([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)):
        streamed.setdefault(ev.request_id, []).extend(ev.new_token_ids)
    ref = _greedy_reference(8, [[1, 2, 3], [4, 5]], 10)
    assert [streamed[0], streamed[1]] == [r.token_ids for r in ref]


def test_metrics_count_like_vllm():
    prompts = [[1, 2, 3], [4]]
    ref = _greedy_reference(8, prompts, 24)
    scripts = {tuple(p): r.token_ids for p, r in zip(prompts, ref)}
    engine = Engine(MarkovTarget(8, seed=2, max_slots=2, max_seq_len=128), ScriptedDrafter(scripts, 8, corrupt_every=4), SpecConfig(num_speculative_tokens=3))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    m = engine.metrics
    steps = sum(o.num_steps for o in outs)
    emitted = sum(len(o.token_ids) - 1 for o in outs)  # the first token of each comes from prefill
    # every step verified drafts here, so AL = emitted tokens per verify step (up to truncation)
    assert m.num_drafts == steps
    assert abs(m.acceptance_length - (1 + m.num_accepted_tokens / steps)) < 1e-12
    assert emitted <= steps * m.acceptance_length
    assert m.per_position_acceptance == sorted(m.per_position_acceptance, reverse=True)
    assert 1.0 < m.acceptance_length < 4.0


def test_batch_size_gates_and_the_batch1_profile_pick_k():
    spec = SpecConfig(num_speculative_tokens=6, num_speculative_tokens_per_batch_size=((2, 3, 4), (4, 8, 1), (9, 64, 0)),
                      batch1_profile=Profile(num_speculative_tokens=5))
    engine = Engine(MarkovTarget(8), NgramDrafter(), spec)
    assert [engine.step_k(b) for b in (1, 2, 3, 4, 8, 9, 64, 65)] == [5, 4, 4, 1, 1, 0, 0, 6]
    no_profile = Engine(MarkovTarget(8), NgramDrafter(), SpecConfig(num_speculative_tokens=6, num_speculative_tokens_per_batch_size=((1, 1, 2),)))
    assert no_profile.step_k(1) == 2 and no_profile.step_k(2) == 6


def test_opt_out_and_sequence_length_gate_switch_speculation_off_per_request():
    prompts = [[1, 2, 1, 2, 1, 2], [3, 4, 3, 4, 3, 4, 3, 4, 3, 4]]
    ref = _greedy_reference(8, prompts, 12)
    scripts = {tuple(p): r.token_ids for p, r in zip(prompts, ref)}
    # The long prompt is past the gate from the start; the short one opts out.
    spec = SpecConfig(num_speculative_tokens=3, max_speculative_seq_len=8)
    engine = Engine(MarkovTarget(8, seed=2, max_slots=2, max_seq_len=128), ScriptedDrafter(scripts, 8, corrupt_every=1000), spec)
    outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, speculate=False),
                                     SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)])
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert engine.metrics.num_drafts == 0 and all(o.num_steps == 11 for o in outs)


def _policy_engine(spec, confidences, prompts, ref):
    from toy_drafters import ConfidenceDrafter

    scripts = {tuple(p): r.token_ids for p, r in zip(prompts, ref)}
    drafter = ConfidenceDrafter(scripts, 8, confidences, corrupt_every=7)
    return Engine(MarkovTarget(8, seed=2, max_slots=len(prompts), max_seq_len=128), drafter, spec)


def test_threshold_policy_verifies_the_confident_prefix_and_stays_lossless():
    prompts = [[1, 2, 3], [4, 5], [6]]
    ref = _greedy_reference(8, prompts, 20)
    engine = _policy_engine(SpecConfig(num_speculative_tokens=5, verify_policy="threshold", confidence_threshold=0.5),
                            [0.9, 0.8, 0.7, 0.4, 0.9], prompts, ref)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert len(engine.metrics.drafts_per_position) == 3  # position 4 (c = 0.4) is never verified


def test_confidence_scheduler_through_the_engine_never_exceeds_k(tmp_path):
    import json

    prompts = [[1, 2, 3], [4, 5], [6], [7, 1]]
    ref = _greedy_reference(8, prompts, 16)
    # Flat steps/s: every admitted draft with positive survival improves tau * SPS, so it admits all k.
    table = tmp_path / "sps.json"
    table.write_text(json.dumps({"token_counts": [1, 64], "steps_per_s": [100.0, 100.0]}))
    spec = SpecConfig(num_speculative_tokens=3, verify_policy="scheduler", sps_table_path=str(table))
    engine = _policy_engine(spec, [0.9, 0.9, 0.9, 0.9, 0.9], prompts, ref)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert len(engine.metrics.drafts_per_position) == 3 and engine.metrics.num_drafts > 0
    # A steep cost curve admits nothing: speculation switches itself off, output unchanged.
    table.write_text(json.dumps({"token_counts": [1, 4, 5], "steps_per_s": [100.0, 100.0, 1.0]}))
    engine = _policy_engine(spec, [0.9] * 5, prompts, ref)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref] and engine.metrics.num_drafts == 0


def test_scheduler_profiles_its_cost_curve_when_no_table_is_given():
    spec = SpecConfig(num_speculative_tokens=3, verify_policy="scheduler")
    engine = Engine(MarkovTarget(8, seed=2, max_slots=2, max_seq_len=64), NgramDrafter(), spec)
    table = engine.drafting.policy.sps
    assert table.token_counts[0] == 1 and table.token_counts[-1] == 8 and all(s > 0 for s in table.steps_per_s)


def test_batch1_profile_kernel_overrides_apply_only_at_batch_1(monkeypatch):
    from dspark.kernels import registry

    seen = []
    real = MarkovTarget.verify

    def spy(self, slots, tokens, lengths, tap_layers=()):
        seen.append((len(slots), registry.active_overrides()))
        return real(self, slots, tokens, lengths, tap_layers)

    monkeypatch.setattr(MarkovTarget, "verify", spy)
    spec = SpecConfig(num_speculative_tokens=2, batch1_profile=Profile(num_speculative_tokens=3, kernels=(("linear", "reference"),)))
    engine = Engine(MarkovTarget(8, max_slots=2), NgramDrafter(), spec)
    engine.generate([[1, 2], [3]], [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                                   SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)])
    assert any(b == 2 and o == {} for b, o in seen) and any(b == 1 and o == {"linear": "reference"} for b, o in seen)
    assert registry.overrides == {}


def test_batch1_profile_options_are_checked():
    profile = Profile(kernels=(("linear", "nope"),))
    with pytest.raises(ValueError, match="linear='nope'"):
        Engine(MarkovTarget(8), NgramDrafter(), SpecConfig(num_speculative_tokens=2, batch1_profile=profile))


def test_cuda_graphs_required_of_a_target_that_cannot_be_captured_is_an_error():
    spec = SpecConfig(num_speculative_tokens=2, batch1_profile=Profile(cuda_graphs=True))
    engine = Engine(MarkovTarget(8), NgramDrafter(), spec)  # the profile allows graphs; a CPU target runs eagerly
    assert isinstance(engine.runner, EagerRunner)
    with pytest.raises(ValueError, match="cuda_graphs=True: the target \\(MarkovTarget on cpu\\) cannot be captured"):
        Engine(MarkovTarget(8), NgramDrafter(), spec, cuda_graphs=True)


def _synthetic_metrics(spec, batch):
    from dspark.drafters.uniform import UniformDrafter

    engine = Engine(MarkovTarget(16, seed=3, max_slots=batch, max_seq_len=512), UniformDrafter(16), spec)
    engine.generate([[1, 2, 3]] * batch, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    return engine.metrics


def test_synthetic_rates_are_sized_with_the_k_each_step_uses():
    """One rule for k (SpecConfig.k_for_batch) picks the step's k and sizes its synthetic rates:
    a batch-1 profile whose k is above num_speculative_tokens forces the same AL over its own k
    positions; a gate with a smaller k gets the first k positions of the schedule."""
    spec = SpecConfig(num_speculative_tokens=2, rejection_sample_method="synthetic", synthetic_acceptance_length=3.0,
                      batch1_profile=Profile(num_speculative_tokens=5))
    assert [spec.k_for_batch(b) for b in (1, 2, 7)] == [5, 2, 2]
    alone = _synthetic_metrics(spec, batch=1)
    assert alone.acceptance_length == 3.0 and alone.per_position_acceptance == [1.0, 1.0, 0.0, 0.0, 0.0]
    batched = _synthetic_metrics(spec, batch=3)
    assert batched.acceptance_length == 3.0 and batched.per_position_acceptance == [1.0, 1.0]
    gated = SpecConfig(num_speculative_tokens=4, rejection_sample_method="synthetic", synthetic_acceptance_length=4.0,
                       num_speculative_tokens_per_batch_size=((2, 8, 1),))
    assert _synthetic_metrics(gated, batch=3).per_position_acceptance == [1.0]  # [1, 1, 1, 0][:1]
    with pytest.raises(ValueError, match="batch1_profile.num_speculative_tokens=5"):
        SpecConfig(num_speculative_tokens=2, rejection_sample_method="synthetic", synthetic_acceptance_rates=(1.0, 0.5),
                   batch1_profile=Profile(num_speculative_tokens=5)).validate()
    with pytest.raises(ValueError, match="batch_size=0"):
        spec.k_for_batch(0)


def test_observers_see_every_step_as_it_was_verified():
    prompts = [[1, 2, 3], [4, 5], [6]]
    ref = _greedy_reference(8, prompts, 14)
    scripts = {tuple(p): r.token_ids for p, r in zip(prompts, ref)}
    engine = Engine(MarkovTarget(8, seed=2, max_slots=2, max_seq_len=128), ScriptedDrafter(scripts, 8, corrupt_every=4),
                    SpecConfig(num_speculative_tokens=3))
    records, tapped = [], []
    engine.add_observer(records.append)
    engine.add_observer(lambda r: tapped.append(r.taps), tap_layers=(0,))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    rebuilt = {o.request_id: o.token_ids[:1] for o in outs}  # the first token comes from prefill
    steps = {o.request_id: 0 for o in outs}
    for rec in records:
        assert len(rec.request_ids) == len(rec.num_accepted) == len(rec.emitted) == rec.proposal.tokens.shape[0]
        for i, rid in enumerate(rec.request_ids):
            a, verified = rec.num_accepted[i], int(rec.proposal.num_drafts[i])
            assert 0 <= a <= verified <= 3
            assert rec.emitted[i][:a] == rec.proposal.tokens[i, :a].tolist()[: len(rec.emitted[i])]
            rebuilt[rid] += rec.emitted[i]
            steps[rid] += 1
    assert rebuilt == {o.request_id: o.token_ids for o in outs}
    assert steps == {o.request_id: o.num_steps for o in outs}
    assert sum(sum(r.num_accepted) for r in records) == engine.metrics.num_accepted_tokens > 0
    assert len(tapped) == len(records) and all(set(t) == {0} for t in tapped)
    for rec, taps in zip(records, tapped):  # MarkovTarget's tap is the embedding of each verified token
        torch.testing.assert_close(taps[0][:, 1:], engine.target.embedding[rec.proposal.tokens], rtol=0, atol=0)


def test_graph_buckets_cover_a_run_and_a_bad_one_is_refused_by_name():
    """cuda_graphs.buckets_up_to(n): the default buckets, every power of two up to n and n itself, so a
    batch of any size up to n runs in a bucket at most twice its size; Engine(graph_buckets=...) refuses a
    malformed set by name (checked on any device; DSparkDrafter's: tests/test_dspark_model.py)."""
    from dspark.cuda_graphs import BUCKETS, bucket_table, buckets_up_to

    n = int(torch.randint(9, 300, ()))
    buckets = buckets_up_to(n)
    assert set(BUCKETS) <= set(buckets) and max(buckets) == n and list(buckets) == sorted(set(buckets))
    _, bucket_of = bucket_table(buckets, n)
    assert all(batch <= bucket_of[batch] < 2 * batch for batch in range(1, n + 1))
    assert buckets_up_to(3) == (1, 2, 3, 4, 8)
    with pytest.raises(ValueError, match=r"batch=0: must be an integer >= 1"):
        buckets_up_to(0)
    target = MarkovTarget(V, seed=0)
    for bad in ((), (0, 4), (2.0,), "8"):
        with pytest.raises(ValueError, match=r"graph_buckets=.*must be a non-empty tuple of batch sizes >= 1"):
            Engine(target, graph_buckets=bad)
    Engine(target, graph_buckets=(1, 16))  # a CPU target steps eagerly: the buckets are only checked
