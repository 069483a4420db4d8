"""The engine on the GPU with CUDA graphs (k3-slice: real dimensions, every op on its kernel).

- Graph replay against the same engine run eagerly (cuda_graphs=False): the same kernels at the
  same shapes, so outputs and acceptance are identical token for token, greedy and seeded
  sampling, with requests of different lengths leaving mid-run (the batch moves from bucket 4
  to bucket 2 to bucket 1).
- Steps launched ahead (before the step before them is read back) against steps read back first:
  identical outputs, with EOS and max_tokens stops and a request entering mid-run.
- Greedy speculative decoding against plain decoding: the GPU kernels are equal to a tolerance
  across T (a verify of 8 tokens and a decode of 1 use different GEMM splits), so the outputs
  must agree until a position where the two tokens the paths chose are within that tolerance
  of each other in plain decoding's logits there (MARGIN on logits of unit scale; bf16 GEMMs
  over 7168-wide rows differ by about 1e-2; the bound is not yet measured, hence generous).
"""
from collections import Counter

import pytest
import torch

from dspark.config import SamplingParams, SpecConfig
from dspark.drafters.uniform import UniformDrafter
from dspark.engine import Engine
from dspark.targets.kimi_k3 import K3_SLICE, K3Model, K3Target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MARGIN = 0.1


@pytest.fixture(scope="module")
def model():
    return K3Model.random(K3_SLICE, seed=int(torch.randint(0, 2**31 - 1, ())), dtype=torch.bfloat16, device="cuda")


def _prompts(gen, lengths):
    return [torch.randint(0, K3_SLICE.vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_graph_engine_equals_eager_engine(model, temperature, speculative):
    """Batch 1 (the bucket of 1: the same shapes as eager); batches with padding rows are checked
    bitwise at the graph level (tests/gpu/test_graph_step_gpu.py). Plain decoding (no drafter)
    runs the T = 1 graph alone, which skips the draft inputs and the drafter's commit."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompts = _prompts(gen, (5, 9))
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=11 + n) for n in (30, 12)]
    spec = (SpecConfig(num_speculative_tokens=5, rejection_sample_method="synthetic", synthetic_acceptance_length=3.5)
            if speculative else SpecConfig(num_speculative_tokens=0))
    outs = []
    for graphs in (True, False):
        target = K3Target(model, max_slots=4, max_seq_len=128)
        drafter = UniformDrafter(K3_SLICE.vocab_size) if speculative else None
        engine = Engine(target, drafter, spec, cuda_graphs=graphs)
        assert (engine._graphs is not None) == graphs
        outs.append([(o.token_ids, o.num_accepted_drafts) for p, q in zip(prompts, params)
                     for o in engine.generate([p], q)])
    assert outs[0] == outs[1]
    assert [len(t) for t, _ in outs[0]] == [30, 12]


def test_a_batch_leaving_mid_run_replays_smaller_buckets(model):
    """Four requests of different lengths: buckets 4, 2 and 1 in turn, padding rows on free slots;
    every request gets its tokens and the engine ends with every slot free."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    target = K3Target(model, max_slots=4, max_seq_len=128)
    spec = SpecConfig(num_speculative_tokens=3, rejection_sample_method="synthetic", synthetic_acceptance_length=2.5)
    engine = Engine(target, UniformDrafter(K3_SLICE.vocab_size), spec)
    lengths = (25, 4, 17, 9)
    outs = engine.generate(_prompts(gen, (6, 4, 8, 3)),
                           [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths])
    assert [len(o.token_ids) for o in outs] == list(lengths)
    assert all(0 <= t < K3_SLICE.vocab_size for o in outs for t in o.token_ids)
    assert sorted(engine._free_slots) == [0, 1, 2, 3] and not engine.has_unfinished()
    assert {key.batch for key in engine._graphs.replays} == {1, 2, 4}


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_steps_launched_ahead_emit_what_steps_read_back_first_emit(model, temperature, speculative):
    """The same requests on two graphed engines, one launching each step before the one before it
    is read back (launch_ahead, the default) and one reading every step back first: the same
    kernels and the same draws from each request's generator, so each request's output is
    identical token for token. One request stops at an EOS (seen one step late by the first
    engine, whose next step's row for it is discarded), the others at max_tokens, and one enters
    after the first step. The batch stays in the bucket of 4 until the EOS stop (the engines
    reach it with different batch compositions there, and a row's result does not depend on the
    other rows of the same graph, while another bucket's GEMM shapes could round differently)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompts = _prompts(gen, (5, 9, 7, 6))
    spec = (SpecConfig(num_speculative_tokens=5, rejection_sample_method="synthetic", synthetic_acceptance_length=3.5)
            if speculative else SpecConfig(num_speculative_tokens=0))

    def run(ahead: bool, eos: tuple[int, ...]):
        engine = Engine(K3Target(model, max_slots=4, max_seq_len=160),
                        UniformDrafter(K3_SLICE.vocab_size) if speculative else None, spec,
                        eos_token_ids=eos, cuda_graphs=True, launch_ahead=ahead)
        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=not eos, seed=5 + n)
                  for n in (40, 23, 31, 27)]
        ids = [engine.add_request(p, q) for p, q in zip(prompts[:3], params[:3])]
        outs = {}
        step = 0
        while engine.has_unfinished() or step < 2:
            if step == 1:  # enters after the first step (with launch-ahead, while one is in flight)
                ids.append(engine.add_request(prompts[3], params[3]))
            # A drain mid-run (as a phased sweep does between phases) reads the step launched ahead.
            for event in engine.step() + (engine.drain() if step == 6 else []):
                outs.setdefault(event.request_id, []).extend(event.new_token_ids)
            step += 1
        assert sorted(engine._free_slots) == [0, 1, 2, 3]
        return [outs[i] for i in ids], engine.metrics.num_launched_ahead

    first, _ = run(False, ())
    # The EOS: a token of request 0's that occurs nowhere else in any output, past its 16th token.
    seen = Counter(t for out in first for t in out)
    picks = [t for t in first[0][16:] if seen[t] == 1]
    if not picks:
        pytest.skip("every token of request 0 past its 16th repeats somewhere: no EOS to pick")
    eos = (picks[0],)
    want, none_ahead = run(False, eos)
    got, ahead = run(True, eos)
    assert got == want
    assert want[0] == first[0][: first[0].index(eos[0]) + 1] and [len(o) for o in want[1:]] == [23, 31, 27]
    # Not the last steps of a request that max_tokens may end, nor while one waits to enter.
    assert none_ahead == 0 and ahead >= 3, f"{ahead} steps launched ahead"


def _plain_logit_gap(model, prompt, emitted, position, a, b):
    """|logit(a) - logit(b)| where plain decoding chose the token at `position` of its output:
    the prompt prefilled, then the output fed one token at a time, as plain decoding did."""
    target = K3Target(model, max_slots=1, max_seq_len=256)
    logits = target.prefill([0], [torch.tensor(prompt)]).logits[0, -1]
    for token in emitted[:position]:
        logits = target.verify([0], torch.tensor([[token]], device="cuda"), [1]).logits[0, 0]
        target.commit([0], [1])
    return float((logits[a] - logits[b]).abs())


class OracleDrafter:
    """Drafts plain decoding's own continuation with every fourth draft wrong, so steps accept
    several drafts and also reject: both paths of the acceptance run."""

    tap_layers = ()

    def __init__(self, continuation: list[int], vocab_size: int):
        self.continuation, self.vocab_size, self.position = continuation, vocab_size, 0

    def start(self, slot, prompt, taps):
        self.position = 0  # the anchor is continuation[0]

    def propose(self, slots, anchors, k, sampling, generators):
        from dspark.protocols import Proposal

        ahead = self.continuation[self.position + 1 : self.position + 1 + k]
        ahead = ahead + [0] * (k - len(ahead))
        drafts = [(t + 1) % self.vocab_size if j % 4 == 3 else t for j, t in enumerate(ahead)]
        device = anchors.device
        return Proposal(torch.tensor([drafts], device=device), torch.tensor([k], device=device))

    def commit(self, slots, tokens, num_tokens, taps):
        self.position += int(num_tokens[0])

    def release(self, slots):
        pass


@pytest.mark.xfail(strict=False, reason=(
    "the T = 8 and T = 1 kernels round differently; on some seeds a near tie that flips a MoE routing "
    "choice moves a later token's logits by more than MARGIN (experiments/notes/step.md)"))
def test_greedy_speculative_output_matches_plain_decoding(model):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompt = _prompts(gen, (12,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = Engine(K3Target(model, max_slots=1, max_seq_len=256)).generate([prompt], params)[0].token_ids
    engine = Engine(K3Target(model, max_slots=1, max_seq_len=256), OracleDrafter(plain, K3_SLICE.vocab_size),
                    SpecConfig(num_speculative_tokens=7))
    assert engine._graphs is not None
    speculative = engine.generate([prompt], params)[0].token_ids
    for j, (a, b) in enumerate(zip(speculative, plain)):
        if a != b:
            gap = _plain_logit_gap(model, prompt, plain, j, a, b)
            assert gap < MARGIN, f"first difference at token {j}: tokens {a} and {b} are {gap:.3f} apart"
            return
    assert len(speculative) == len(plain)
    assert engine.metrics.num_steps < len(speculative) // 2, "the oracle's drafts were not accepted"
