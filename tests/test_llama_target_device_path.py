"""LlamaTarget's batched path driven by device tensors, on the CPU: what a CUDA graph of the engine's step
replays (dspark/graph_step.py), with slots as a device index (on a CPU target, a CPU long tensor), lengths and
kept counts as tensors, none read on the host.

- verify of a device index gives the host path's logits and taps over ragged batches, several steps with
  partial commits, a padding row on a free slot (a graph's bucket) and stale cache rows poisoned with NaN,
  zero past each row's length; both agree with the per_query reference to the batched path's tolerance;
- verify and commit of a device index read no device value on the host;
- the contract's checks: what a device index needs beside it, what host slots keep;
- greedy decoding through the engine, and through the device step exactly as a graph's bucket calls it
  (DeviceStep.run with a device index, a padding row, a step with live = 0 as warm-up and capture run it),
  emits plain greedy decoding's tokens.

A random 3-layer Llama (GQA, tied head; logits up to ~7). Tolerances, float32, measured over 40 seeds: the
device index and the host path run the same forward, on a batch one padding row larger, which moves the
matmuls' blocking: logits within 4.8e-6 (bound 5e-5), taps 8e-7 relative (bound 1e-5). The host path against
the per_query reference: logits 1.2e-5 (bound 1e-4), taps 1.3e-6 relative (bound 1e-5). The batched path is
not row-invariant, so a greedy divergence passes only at a near tie of the reference: its two top logits
within TIE at the first differing token.
"""
import pytest
import torch

from launch_counter import counting
from toy_drafters import ScriptedDrafter

from dspark.config import SamplingParams, SpecConfig
from dspark.engine import Engine
from dspark.graph_step import capturable
from dspark.sampling import SamplingTensors
from dspark.step import DeviceStep, StepInputs
from dspark.targets.llama import LlamaConfig, LlamaLayerWeights, LlamaTarget, LlamaWeights

CONFIG = LlamaConfig(vocab_size=61, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=48,
                     rope_theta=10000.0, rms_norm_eps=1e-5, context_length=256, tie_word_embeddings=True)
MAX_SEQ = 64
TAPS = (-1, 1, 3)  # 3 = num_layers: the LM head's input
TIE = 1e-4


def tiny_weights() -> LlamaWeights:
    """Random weights from torch's generator (seeded per test by conftest.py), large enough that the
    distributions are neither flat nor one-hot (logits of std ~2)."""
    c = CONFIG
    r = lambda *shape: torch.randn(*shape) / shape[-1] ** 0.5  # noqa: E731
    layers = [LlamaLayerWeights(1 + 0.1 * torch.randn(c.hidden_size), r((c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
                                                                         c.hidden_size),
                                r(c.hidden_size, c.num_heads * c.head_dim), 1 + 0.1 * torch.randn(c.hidden_size),
                                r(2 * c.intermediate_size, c.hidden_size), r(c.hidden_size, c.intermediate_size))
              for _ in range(c.num_layers)]
    embedding = 0.4 * torch.randn(c.vocab_size, c.hidden_size)
    return LlamaWeights(embedding, layers, torch.ones(c.hidden_size), embedding)


def target_of(weights, attention="batched", max_slots=4) -> LlamaTarget:
    return LlamaTarget(CONFIG, weights, max_slots=max_slots, max_seq_len=MAX_SEQ, attention=attention)


def poison_stale_rows(target: LlamaTarget) -> None:
    """NaN in every cache row past its slot's committed length (the spare rows too): a read of a row
    that is not the request's own shows."""
    for slot, held in enumerate(target.cache_lengths):
        target.k_cache[:, slot, :, held:] = float("nan")
        target.v_cache[:, slot, :, held:] = float("nan")


def assert_same_greedy(weights, prompts, expected, got):
    """got == expected token for token, or first differing where the per_query reference's two top
    logits lie within TIE (either token is then greedy's to float rounding)."""
    for prompt, e, g in zip(prompts, expected, got):
        if e == g:
            continue
        first = next(i for i, (a, b) in enumerate(zip(e, g)) if a != b)
        reference = target_of(weights, "per_query", max_slots=1)
        context = torch.tensor(list(prompt) + e[:first])
        top2 = reference.prefill([0], [context]).logits[0, -1].topk(2).values
        assert float(top2[0] - top2[1]) < TIE, (first, e, g)


def test_device_index_verify_gives_the_host_paths_values():
    weights = tiny_weights()
    host, device, reference = target_of(weights), target_of(weights), target_of(weights, "per_query")
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,)) for n in (9, 3, 14)]
    for target in (host, device, reference):
        target.prefill([2, 0, 1], prompts, TAPS)
    for step in range(6):
        T = int(torch.randint(1, 7, ()))
        slots = torch.randperm(3).tolist()
        lengths = torch.randint(1, T + 1, (3,))
        keep = (torch.rand(3) * (lengths + 1)).long().clamp(max=lengths)  # 0..lengths[r] kept
        tokens = torch.randint(0, CONFIG.vocab_size, (3, T))
        tokens[torch.arange(T) >= lengths[:, None]] = -1  # ids past a request's length are never fed
        poison_stale_rows(device)
        expected = host.verify(slots, tokens, lengths.tolist(), TAPS)
        host.commit(slots, keep.tolist())
        exact = reference.verify(slots, tokens, lengths.tolist(), TAPS)
        reference.commit(slots, keep.tolist())
        # As a graph's bucket runs it: the slots as a device index, a padding row on the free slot 3
        # that feeds 0 tokens and keeps 0.
        index = torch.tensor(slots + [3])
        out = device.verify(index, torch.cat([tokens, torch.zeros(1, T, dtype=torch.long)]),
                            torch.cat([lengths, torch.zeros(1, dtype=torch.long)]), TAPS)
        device.commit(index, torch.cat([keep, torch.zeros(1, dtype=torch.long)]))

        assert out.logits.shape == (4, T, CONFIG.vocab_size) and all(t.shape == (4, T, 32) for t in out.taps.values())
        fed = (torch.arange(T) < torch.cat([lengths, torch.zeros(1, dtype=torch.long)])[:, None])[..., None]
        for t in (out.logits, *out.taps.values()):  # zero past each row's length, as verify's padding always was
            assert not t.masked_fill(fed, 0).any(), step
        assert bool(torch.isfinite(out.logits).all()), step
        for r, n in enumerate(lengths.tolist()):
            torch.testing.assert_close(out.logits[r, :n], expected.logits[r, :n], rtol=0, atol=5e-5)
            torch.testing.assert_close(expected.logits[r, :n], exact.logits[r, :n], rtol=0, atol=1e-4)
            for layer in TAPS:
                mine, ref = out.taps[layer][r, :n], expected.taps[layer][r, :n]
                assert (mine - ref).norm() / ref.norm() < 1e-5, (step, r, layer)
                exact_tap = exact.taps[layer][r, :n]
                assert (ref - exact_tap).norm() / exact_tap.norm() < 1e-5, (step, r, layer)
        assert device.cache_lengths == host.cache_lengths == reference.cache_lengths
        assert device.cache_lengths[3] == 0


def test_device_index_verify_and_commit_read_nothing_on_the_host(monkeypatch):
    """No aten op that reads a device value on the host (item, is_nonzero, equal: launch_counter's
    syncs), no nonzero (whose output shape is a device value) and no tolist."""
    target = target_of(tiny_weights())
    target.prefill([0, 1], [torch.randint(0, CONFIG.vocab_size, (n,)) for n in (5, 8)])
    index = torch.tensor([1, 0, 2])  # slot 2 free: a padding row
    tokens = torch.randint(0, CONFIG.vocab_size, (3, 4))
    lengths, kept = torch.tensor([4, 2, 0]), torch.tensor([3, 1, 0])
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(tuple(t.shape)) or tolist(t))
    with counting() as launches:
        target.verify(index, tokens, lengths, TAPS)
        target.commit(index, kept)
    monkeypatch.undo()
    assert not launches.syncs and "nonzero" not in launches.glue and not reads, (launches, reads)
    assert target.cache_lengths[:3] == [5 + 1, 8 + 3, 0]


def test_the_device_index_contract_and_the_host_checks_it_keeps():
    weights = tiny_weights()
    batched, per_query = target_of(weights), target_of(weights, "per_query")
    assert batched.supports_cuda_graphs and not per_query.supports_cuda_graphs
    assert not capturable(batched)  # capture needs a CUDA device too: a CPU target stays eager
    tokens = torch.ones(2, 2, dtype=torch.long)
    index = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"lengths: beside a device index of slots, must be a \[2\] tensor"):
        batched.verify(index, tokens, [1, 1])
    with pytest.raises(ValueError, match="slots: a device index of slots must be a 1-D long tensor"):
        batched.verify(index[None], tokens, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"tokens: beside a device index of 2 slots"):
        batched.verify(index, tokens[:1], torch.tensor([1, 1]))
    batched.verify(index, tokens, torch.tensor([2, 1]))
    with pytest.raises(ValueError, match="slots: a device index of slots commits the last verify"):
        batched.commit(torch.tensor([0, 1]), torch.tensor([1, 1]))  # another tensor than the verify's
    with pytest.raises(ValueError, match=r"num_tokens: beside a device index of slots, must be a \[2\] tensor"):
        batched.commit(index, [1, 1])
    batched.commit(index, torch.tensor([2, 1]))
    assert batched.cache_lengths[:2] == [2, 1]
    with pytest.raises(ValueError, match="slots: slot 0 has no verify to commit"):
        batched.commit([0], [1])  # the device index's verify was committed
    batched.release([0, 1])
    # Host slots are checked as before, on both paths; a tensor of slots is a device index only to the batched path.
    for target in (batched, per_query):
        with pytest.raises(ValueError, match=r"lengths\[0\]=3: must be in \[1, T=2\]"):
            target.verify([0], tokens[:1], torch.tensor([3]))
        target.prefill([0], [torch.ones(MAX_SEQ - 1, dtype=torch.long)])
        with pytest.raises(ValueError, match=r"lengths\[0\]=2: slot 0 holds 63 tokens, max_seq_len=64 leaves room for 1"):
            target.verify([0], tokens[:1], [2])
        with pytest.raises(ValueError, match=r"tokens\[1\]: token 61 outside the vocabulary"):
            target.verify([2, 1], torch.tensor([[1, 1], [1, 61]]), [1, 2])
        target.verify([1], tokens[:1], [2])
        with pytest.raises(ValueError, match=r"num_tokens\[0\]=3: the last verify of slot 1 fed 2 tokens"):
            target.commit([1], [3])
        target.release([0, 1])
    with pytest.raises(ValueError, match=r"slots=\[5\]: slot 5 outside"):
        per_query.verify(torch.tensor([5]), tokens[:1], [1])


@pytest.mark.parametrize("batch", [1, 3])
def test_engine_greedy_speculation_on_the_batched_target_equals_plain_decoding(batch):
    weights = tiny_weights()
    target = target_of(weights)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,)).tolist() for n in (7, 12, 4)[:batch]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in Engine(target, None).generate(prompts, params)]
    drafter = ScriptedDrafter({tuple(p): o for p, o in zip(prompts, plain)}, CONFIG.vocab_size, corrupt_every=4)
    outs = Engine(target, drafter, SpecConfig(num_speculative_tokens=4)).generate(prompts, params)
    assert_same_greedy(weights, prompts, plain, [o.token_ids for o in outs])
    assert sum(o.num_accepted_drafts for o in outs) > 0 and target.cache_lengths == [0] * target.max_slots


def test_a_graph_buckets_step_run_eagerly_emits_plain_greedys_tokens():
    """DeviceStep.run as GraphedRunner's captured step calls it (dspark/graph_step.py, _StaticStep):
    three requests in the bucket of 4 with the slots as a device index, the padding row on the free
    slot 3 (valid 0: it verifies 0 tokens and commits 0), ragged drafts; and one step with live 0, as
    a graph's warm-up and capture run it, which must change no committed state."""
    weights = tiny_weights()
    target = target_of(weights)
    k, N, V = 3, 20, CONFIG.vocab_size
    prompts = [torch.randint(0, V, (n,)) for n in (5, 11, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=N + k + 1, ignore_eos=True)
    expected = [o.token_ids for o in Engine(target, None).generate([p.tolist() for p in prompts], params)]

    step = DeviceStep(target, TAPS)
    first = target.prefill([0, 1, 2], prompts).logits[:, 0].argmax(-1)
    step.anchors[:3] = first
    emitted = [[t] for t in first.tolist()]
    index, valid = torch.tensor([0, 1, 2, 3]), torch.tensor([1, 1, 1, 0])
    sampling = SamplingTensors(torch.zeros(4), torch.zeros(4, dtype=torch.long), torch.ones(4), True, False)
    uniforms, noise = torch.zeros(4, k), torch.ones(4, V)
    for n in range(4 * N):
        if min(len(e) for e in emitted) >= N:
            break
        drafts, num_drafts = torch.zeros(4, k, dtype=torch.long), torch.zeros(4, dtype=torch.long)
        for r in range(3):
            script = expected[r][len(emitted[r]):][:k]
            num_drafts[r] = (n + r) % (k + 1)  # 0..k drafts
            drafts[r, : len(script)] = torch.tensor(script)
            if (n + 2 * r) % 3 == 0:  # a wrong draft: acceptance stops there
                drafts[r, (n + r) % k] = (drafts[r, (n + r) % k] + 1) % V
        if n == 3:  # as a graph's warm-up and capture run the step: nothing committed, no anchor moved
            before = (target.lengths.clone(), step.anchors.clone(),
                      [target.k_cache[:, s, :, :held].clone() for s, held in enumerate(target.cache_lengths)])
            step.run(StepInputs(index, index, valid, torch.zeros(4, dtype=torch.long), drafts, num_drafts, None,
                                sampling, uniforms, noise, None))
            assert torch.equal(target.lengths, before[0]) and torch.equal(step.anchors, before[1])
            for s, rows in enumerate(before[2]):
                assert torch.equal(target.k_cache[:, s, :, : rows.shape[2]], rows), s
        out = step.run(StepInputs(index, index, valid, valid, drafts, num_drafts, None, sampling, uniforms, noise, None))
        for r, (accepted, token, *_) in enumerate(out.packed.tolist()[:3]):
            emitted[r] += drafts[r, :accepted].tolist() + [token]
    assert_same_greedy(weights, [p.tolist() for p in prompts], [e[:N] for e in expected], [e[:N] for e in emitted])
    assert target.cache_lengths == [len(p) + len(e) - 1 for p, e in zip(prompts, emitted)] + [0]
