"""Chunked prefill (dspark/targets/prefill.py): prefill returns the last position's logits and
the taps over every position, feeds at most its chunk of tokens per forward, and leaves exactly
the state and taps of one pass over the whole prompt (on the CPU, bit for bit)."""
import pytest
import torch

from dspark.targets.kimi_k3 import K3_TINY, K3Model, K3Target
from dspark.targets.prefill import prefill_in_chunks

MAX_SEQ = 64


@pytest.fixture(scope="module")
def model():
    return K3Model.random(K3_TINY, seed=int(torch.randint(0, 2**31 - 1, ())), dtype=torch.float32)


def _prompts(lengths):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    return [torch.randint(0, K3_TINY.vocab_size, (n,), generator=gen) for n in lengths]


def _state(target, slots):
    return [t[slots].clone() for t in (target.kda_state, target.conv_state, target.lengths)] + [
        target.mla_cache[s, :, : int(target.lengths[s])].clone() for s in slots]


def _record_widths(target):
    """Wrap target.verify to record the [B, T] of every forward it runs."""
    widths, verify = [], target.verify
    target.verify = lambda slots, tokens, *rest: widths.append(tuple(tokens.shape)) or verify(slots, tokens, *rest)
    return widths


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_equals_one_pass_bitwise(model, chunk):
    lengths = (23, 9, 14)
    prompts = _prompts(lengths)
    taps = (-1, 2, K3_TINY.num_layers)  # the embeddings, a layer, the LM head's input
    whole = K3Target(model, max_slots=4, max_seq_len=MAX_SEQ, prefill_chunk_tokens=10_000)
    chunked = K3Target(model, max_slots=4, max_seq_len=MAX_SEQ, prefill_chunk_tokens=chunk)
    widths = _record_widths(chunked)
    slots = [3, 0, 1]
    one = whole.prefill(slots, prompts, taps)
    many = chunked.prefill(slots, prompts, taps)
    assert len(widths) > 1 and all(b * t <= max(chunk, b) for b, t in widths), widths
    assert one.logits.shape == many.logits.shape == (3, 1, K3_TINY.vocab_size)
    assert torch.equal(one.logits, many.logits)
    for layer in taps:
        assert one.taps[layer].shape == (3, max(lengths), K3_TINY.hidden_size)
        for r, n in enumerate(lengths):
            assert torch.equal(one.taps[layer][r, :n], many.taps[layer][r, :n]), (layer, r)
    for a, b in zip(_state(whole, slots), _state(chunked, slots)):
        assert torch.equal(a, b)
    # And the next verify reads that state: the same logits after both prefills.
    tokens = torch.randint(0, K3_TINY.vocab_size, (3, 4))
    assert torch.equal(whole.verify(slots, tokens, [4, 4, 4]).logits, chunked.verify(slots, tokens, [4, 4, 4]).logits)


def test_last_logits_are_those_of_the_last_prompt_position(model):
    lengths = (7, 3)
    prompts = _prompts(lengths)
    target = K3Target(model, max_slots=2, max_seq_len=MAX_SEQ, prefill_chunk_tokens=4)
    out = target.prefill([0, 1], prompts)
    for r, p in enumerate(prompts):
        fresh = K3Target(model, max_slots=1, max_seq_len=MAX_SEQ)
        every = fresh.verify([0], p[None], [len(p)]).logits
        assert torch.equal(out.logits[r, 0], every[0, -1]), r


def test_a_prompt_longer_than_the_chunk_feeds_only_chunk_sized_forwards(model):
    """Memory follows the chunk: no forward of a 40-token prompt feeds more than 8 tokens."""
    target = K3Target(model, max_slots=1, max_seq_len=MAX_SEQ, prefill_chunk_tokens=8)
    widths = _record_widths(target)
    target.prefill([0], _prompts((40,)))
    assert widths == [(1, 8)] * 5


def test_bad_chunk_sizes_are_refused_naming_the_field(model):
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="prefill_chunk_tokens"):
            K3Target(model, max_slots=1, max_seq_len=MAX_SEQ, prefill_chunk_tokens=bad)


def test_helper_on_the_toy_contract():
    """prefill_in_chunks on a target whose verify sees its own rows: every row's tokens are fed once, in
    order, across the chunks."""

    class Recorder:
        def __init__(self):
            self.fed = {}

        def verify(self, slots, tokens, lengths, tap_layers):
            for s, row, n in zip(slots, tokens, lengths):
                self.fed.setdefault(s, []).extend(row[:n].tolist())
            logits = tokens.float()[..., None].expand(-1, -1, 2).clone()
            return type("Out", (), {"logits": logits, "taps": {0: tokens.float()[..., None]}})

        def commit(self, slots, counts):
            pass

    rec = Recorder()
    prompts = [torch.arange(1, 12), torch.arange(100, 104)]
    out = prefill_in_chunks(rec, [5, 2], prompts, (0,), chunk_tokens=6)
    assert rec.fed == {5: list(range(1, 12)), 2: list(range(100, 104))}
    assert out.logits[:, 0, 0].tolist() == [11.0, 103.0]
    assert out.taps[0][0, :, 0].tolist() == list(range(1, 12))
    assert out.taps[0][1, :4, 0].tolist() == list(range(100, 104)) and not out.taps[0][1, 4:].any()
