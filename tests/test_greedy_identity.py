"""Greedy identity on k3-tiny: speculative output equals plain decoding token for token.

20 prompts of mixed lengths, k in {1, 3, 7}, batch 1 (one slot: requests run one after another)
and batch 4 (four slots: ragged acceptance across live requests). The n-gram drafter gives
realistic, mostly short acceptance; the scripted drafter replays the plain continuation with
every few tokens corrupted, so blocks are long and an EOS and max_tokens land inside them.
"""
import pytest
import torch

from dspark.build import build_target
from dspark.config import SamplingParams, SpecConfig
from dspark.drafters.ngram import NgramDrafter
from dspark.engine import Engine
from toy_drafters import ScriptedDrafter

NUM_PROMPTS, MAX_TOKENS, SEQ_LEN = 20, 16, 64
pytestmark = pytest.mark.long  # the whole module, its module-scoped references beside it (tests/conftest.py)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1234)
    out = []
    for i in range(NUM_PROMPTS):
        n = int(torch.randint(1, 24, (1,), generator=g))
        if i % 3 == 0:  # repetitive prompts give the n-gram drafter something to find
            motif = torch.randint(3, 256, (3,), generator=g).tolist()
            out.append((motif * 8)[:n] or motif[:1])
        else:
            out.append(torch.randint(3, 256, (n,), generator=g).tolist())
    return out


def _target(slots):
    return build_target("k3-tiny", max_slots=slots, max_seq_len=SEQ_LEN, device="cpu", seed=0)


@pytest.fixture(scope="module")
def plain(prompts):
    engine = Engine(_target(4), None, SpecConfig(num_speculative_tokens=0))
    return engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))


def test_plain_outputs_are_not_degenerate(plain):
    distinct = {t for o in plain for t in o.token_ids}
    assert len(distinct) > 20 and all(len(o.token_ids) == MAX_TOKENS for o in plain)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_ngram_speculation_equals_plain_decoding(prompts, plain, k, batch):
    engine = Engine(_target(batch), NgramDrafter(1, 3), SpecConfig(num_speculative_tokens=k))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for o, ref in zip(outs, plain):
        assert o.token_ids == ref.token_ids, (o.request_id, o.prompt_token_ids)
    assert engine.metrics.num_drafts > 0


STOP_MAX_TOKENS = 11  # not a multiple of k + 1 for k in {3, 7}: lands mid-block


@pytest.fixture(scope="module")
def stopped(prompts, plain):
    """(eos, plain decoding that stops at it or at STOP_MAX_TOKENS): the reference of every k and batch."""
    eos = plain[1].token_ids[7]  # a token inside request 1's continuation ends it mid-way
    engine = Engine(_target(4), None, SpecConfig(num_speculative_tokens=0), eos_token_ids=(eos,))
    return eos, engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STOP_MAX_TOKENS))


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_long_blocks_with_eos_and_max_tokens_inside_them(prompts, plain, stopped, k, batch):
    eos, ref = stopped
    scripts = {tuple(p): r.token_ids for p, r in zip(prompts, plain)}
    engine = Engine(_target(batch), ScriptedDrafter(scripts, 256, corrupt_every=6), SpecConfig(num_speculative_tokens=k),
                    eos_token_ids=(eos,))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STOP_MAX_TOKENS))
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids and o.finish_reason == r.finish_reason, o.request_id
    assert any(o.finish_reason == "stop" for o in outs)
    if k > 1:
        assert engine.metrics.acceptance_length > 2.0
