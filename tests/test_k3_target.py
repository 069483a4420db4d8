"""K3Target on k3-tiny in float32: rollback after commit is bitwise sequential decoding, verify is
output-only and token-invariant, validation errors name the field."""
import pytest
import torch

from dspark.protocols import Target
from dspark.targets.kimi_k3 import K3_TINY, K3Model, K3Target, load_target

T = 8
PROMPT_LENS = (5, 3)
MAX_SEQ = 32


@pytest.fixture(scope="module")
def model():
    return K3Model.random(K3_TINY, seed=int(torch.randint(0, 2**31 - 1, ())), dtype=torch.float32)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))


def prompts(gen):
    return [torch.randint(0, K3_TINY.vocab_size, (n,), generator=gen) for n in PROMPT_LENS]


def snapshot(target, slot):
    """Every piece of committed state of one slot (MLA rows only below the committed length)."""
    n = int(target.lengths[slot])
    return dict(kda=target.kda_state[slot].clone(), conv=target.conv_state[slot].clone(),
                mla=target.mla_cache[slot, :, :n].clone(), length=n)


def assert_same_state(a, b, what):
    assert a["length"] == b["length"], f"{what}: length {a['length']} != {b['length']}"
    for key in ("kda", "conv", "mla"):
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs"


def full_state(target):
    return [t.clone() for t in (target.kda_state, target.conv_state, target.mla_cache, target.lengths)]


def restore(target, saved):
    for dst, src in zip((target.kda_state, target.conv_state, target.mla_cache, target.lengths), saved):
        dst.copy_(src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollback_and_block_logits_are_bitwise_sequential(model, gen, dtype):
    if dtype != torch.float32:  # the default checkpoint dtype: bf16 weights, fp32 KDA state
        model = K3Model.random(K3_TINY, seed=int(torch.randint(0, 2**31 - 1, ())), dtype=dtype)
    taps = (-1, 2, 3)
    drafts = torch.randint(0, K3_TINY.vocab_size, (2, T), generator=gen)
    ps = prompts(gen)

    # Reference: a fresh target decoding the tokens one by one (verify 1 + commit 1 each).
    seq = K3Target(model, max_slots=2, max_seq_len=MAX_SEQ)
    seq.prefill([0, 1], ps)
    seq_states = [[snapshot(seq, 0)], [snapshot(seq, 1)]]
    seq_logits, seq_taps = [], []
    for t in range(T):
        out = seq.verify([0, 1], drafts[:, t : t + 1], torch.tensor([1, 1]), taps)
        seq_logits.append(out.logits[:, 0])
        seq_taps.append({k: v[:, 0] for k, v in out.taps.items()})
        seq.commit([0, 1], torch.tensor([1, 1]))
        for r in range(2):
            seq_states[r].append(snapshot(seq, r))

    spec = K3Target(model, max_slots=3, max_seq_len=MAX_SEQ)
    spec.prefill([2, 0], ps)  # other slots than the reference used
    after_prefill = full_state(spec)
    for n in range(T + 1):
        restore(spec, after_prefill)
        out = spec.verify([2, 0], drafts, torch.tensor([T, T]), taps)
        for j in range(T):
            assert torch.equal(out.logits[:, j], seq_logits[j]), f"logits of block position {j}"
            for k in taps:
                assert torch.equal(out.taps[k][:, j], seq_taps[j][k]), f"tap {k} at position {j}"
        counts = (n, T - n)  # different accepted counts in one batch
        spec.commit([2, 0], torch.tensor(counts))
        for r, slot in enumerate((2, 0)):
            assert_same_state(snapshot(spec, slot), seq_states[r][counts[r]], f"request {r}, accepted {counts[r]}")

    # The engine commits only the requests that go on: the other verified slot keeps nothing.
    restore(spec, after_prefill)
    spec.verify([2, 0], drafts, torch.tensor([T, T]), taps)
    spec.commit([0], torch.tensor([3]))
    assert_same_state(snapshot(spec, 0), seq_states[1][3], "committed subset")
    assert_same_state(snapshot(spec, 2), seq_states[0][0], "slot left out of the commit")


def test_verify_is_output_only_and_ragged_batches_are_token_invariant(model, gen):
    target = load_target("k3-tiny", max_slots=2, max_seq_len=MAX_SEQ, dtype=torch.float32, seed=3)
    assert isinstance(target, Target)
    embed, lm_head = target.embedding_weights()
    assert embed.shape == lm_head.shape == (K3_TINY.vocab_size, K3_TINY.hidden_size)
    target.prefill([0, 1], prompts(gen))
    before = [snapshot(target, s) for s in (0, 1)]
    tokens = torch.randint(0, K3_TINY.vocab_size, (2, 6), generator=gen)
    first = target.verify([0, 1], tokens, torch.tensor([6, 4]), (1,))
    for s in (0, 1):
        assert_same_state(snapshot(target, s), before[s], f"slot {s} after verify")
    tokens[1, 4:] = -7  # padding is ignored, whatever it holds
    second = target.verify([0, 1], tokens, torch.tensor([6, 4]), (1,))
    assert torch.equal(first.logits[:, :4], second.logits[:, :4]) and torch.equal(first.logits[0], second.logits[0])
    alone = target.verify([1], tokens[1:, :4], torch.tensor([4]), (1,))
    assert torch.equal(alone.logits[0], first.logits[1, :4])
    assert torch.equal(alone.taps[1][0], first.taps[1][1, :4])
    logits = first.logits[0]
    assert logits.dtype == torch.float32 and logits.argmax(-1).unique().numel() > 1, "degenerate logits"


def test_bad_inputs_raise_value_errors_naming_the_field(model, gen):
    target = K3Target(model, max_slots=2, max_seq_len=8)
    with pytest.raises(ValueError, match="tokens"):
        target.prefill([0], [torch.tensor([1, K3_TINY.vocab_size])])
    with pytest.raises(ValueError, match="max_seq_len"):
        target.prefill([0], [torch.zeros(9, dtype=torch.long)])
    target.prefill([0], [torch.tensor([1, 2, 3, 4, 5])])
    with pytest.raises(ValueError, match="max_seq_len"):
        target.verify([0], torch.ones(1, 4, dtype=torch.long), torch.tensor([4]))
    with pytest.raises(ValueError, match="tokens"):
        target.verify([0], torch.tensor([[3, -1]]), torch.tensor([2]))
    with pytest.raises(ValueError, match="slots"):
        target.commit([1], torch.tensor([1]))
    target.verify([0], torch.ones(1, 3, dtype=torch.long), torch.tensor([3]))
    with pytest.raises(ValueError, match="num_tokens"):
        target.commit([0], torch.tensor([4]))
    with pytest.raises(ValueError, match="k3-tiny"):
        load_target("k3-huge", max_slots=1, max_seq_len=8)


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_every_mla_layer_pool_reaches_the_op_contiguous(model, gen, monkeypatch, batch):
    """The CuTe MLA kernels take one layer's cache as a contiguous [slots, L + 1, R + P] tensor
    (kernels/mla/cute_host.py check_arguments; a slot-major pool was contiguous only at one slot,
    so every batch of two or more fell back to the reference). Each pool the op gets is one,
    and it is the memory mla_cache shows for that layer."""
    from dspark.kernels import ops

    seen = []
    original = ops.mla_verify_attention

    def spy(q_latent, q_pe, kv_cache, slots, cache_lens, lengths, scale):
        seen.append(kv_cache)
        return original(q_latent, q_pe, kv_cache, slots, cache_lens, lengths, scale)

    monkeypatch.setattr(ops, "mla_verify_attention", spy)
    target = K3Target(model, max_slots=batch, max_seq_len=MAX_SEQ)
    target.mla_cache.normal_(generator=gen)
    tokens = torch.randint(0, K3_TINY.vocab_size, (batch, 2), generator=gen)
    target.verify(list(range(batch)), tokens, [2] * batch)
    assert len(seen) == len(K3_TINY.mla_layers)
    for k, pool in enumerate(seen):
        assert pool.is_contiguous() and tuple(pool.shape) == (batch, MAX_SEQ + 1, K3_TINY.kv_cache_width)
        assert pool[:, :MAX_SEQ].data_ptr() == target.mla_cache[:, k].data_ptr()
        assert torch.equal(pool[:, :MAX_SEQ], target.mla_cache[:, k])
