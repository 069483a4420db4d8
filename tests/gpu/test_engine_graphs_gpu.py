"""The engine on the GPU with CUDA graphs (k3-slice: real dimensions, every op on its kernel).

- Graph replay against the same engine run eagerly (cuda_graphs=False): the same kernels at the
  same shapes, so outputs and acceptance are identical token for token, greedy and seeded
  sampling, with requests of different lengths leaving mid-run (the batch moves from bucket 4
  to bucket 2 to bucket 1).
- Steps launched ahead (before the step before them is read back) against steps read back first:
  identical outputs, with max_tokens stops, a drain, and an EOS stop; a request entering while a
  step is in flight.
- The stepping (run_steps) is tests/step_fixtures.py's, which tests/test_step.py runs through an
  eager engine on the CPU.
- Greedy speculative decoding against plain decoding: the GPU kernels are equal to a tolerance
  across T (a verify of 8 tokens and a decode of 1 use different GEMM splits), so the outputs
  must agree until a position where the two tokens the paths chose are within that tolerance
  of each other in plain decoding's logits there (MARGIN on logits of unit scale; bf16 GEMMs
  over 7168-wide rows differ by about 1e-2; the bound is not yet measured, hence generous).
"""
import dataclasses

import pytest
import torch

from dspark.config import SamplingParams, SpecConfig
from dspark.drafters.uniform import UniformDrafter
from dspark.engine import Engine
from dspark.graph_step import GraphedRunner
from dspark.protocols import Drafter, Proposal
from dspark.targets.kimi_k3 import K3_SLICE, K3Model, K3Target
from step_fixtures import run_steps

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
        assert isinstance(engine.runner, GraphedRunner) == graphs
        outs.append([(o.token_ids, o.num_accepted_drafts) for p, q in zip(prompts, params)
                     for o in engine.generate([p], q)])
    assert outs[0] == outs[1]
    assert [len(t) for t, _ in outs[0]] == [30, 12]


def test_replays_read_the_draws_on_the_device_through_pool_refills(model):
    """At synthetic AL 1.5 a request takes ~100 steps for 150 tokens: its uniforms pool and the
    UniformDrafter's token pool each refill (64 steps a draw), and the graphs read both from their
    DrawMirror (GraphKey.draft_pools / uniform_pools), with no copy of the rows; the output equals
    the eager engine's, which reads the same pools' rows as tensors."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompt = _prompts(gen, (6,))[0]
    spec = SpecConfig(num_speculative_tokens=7, rejection_sample_method="synthetic", synthetic_acceptance_length=1.5)
    outs = []
    for graphs in (True, False):
        engine = Engine(K3Target(model, max_slots=2, max_seq_len=192), UniformDrafter(K3_SLICE.vocab_size), spec,
                        cuda_graphs=graphs)
        out = engine.generate([prompt], SamplingParams(temperature=0.9, max_tokens=150, ignore_eos=True, seed=3))[0]
        outs.append((out.token_ids, out.num_accepted_drafts))
        if graphs:
            pooled = {key: n for key, n in engine.runner.replays.items() if key.tokens == 8}
            assert sum(pooled.values()) > 64, pooled
            assert all(key.draft_pools == (64, 7) and key.uniform_pools == (64, 7) for key in pooled), pooled
    assert outs[0] == outs[1] and len(outs[0][0]) == 150


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
    assert sorted(engine.requests.free_slots) == [0, 1, 2, 3] and not engine.has_unfinished()
    assert {key.batch for key in engine.runner.replays} == {1, 2, 4}


def _spec(speculative: bool) -> SpecConfig:
    return (SpecConfig(num_speculative_tokens=5, rejection_sample_method="synthetic", synthetic_acceptance_length=3.5)
            if speculative else SpecConfig(num_speculative_tokens=0))


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_steps_launched_ahead_emit_what_steps_read_back_first_emit(model, temperature, speculative):
    """The same requests on two graphed engines, one launching each step before the one before it
    is read back (launch_ahead, the default) and one reading every step back first: the same
    kernels on the same batches and the same draws from each request's generator, so the outputs
    are identical token for token. Three requests that stop at max_tokens (no step is launched
    ahead of one that may end there), with a drain mid-run; then one request that stops at an
    EOS, seen one step late by the first engine, whose next step's row is discarded. (Batches
    are kept equal between the engines: a request entering mid-run, which meets the engines'
    other rows at different steps, has differed by a greedy token on the GPU: a row's logits
    there are not shown to be independent of the other rows of its batch.)"""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompts = _prompts(gen, (5, 9, 7))

    def engine(ahead: bool, eos=(), slots=4):
        drafter = UniformDrafter(K3_SLICE.vocab_size) if speculative else None
        return Engine(K3Target(model, max_slots=slots, max_seq_len=160), drafter, _spec(speculative),
                      eos_token_ids=eos, cuda_graphs=True, launch_ahead=ahead)

    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=5 + n) for n in (48, 36, 40)]
    runs = []
    for ahead in (False, True):
        e = engine(ahead)
        runs.append((run_steps(e, prompts, params, drain_at=4), e.metrics.num_launched_ahead))
    (want, none_ahead), (got, ahead) = runs
    assert got == want and [len(o) for o in want] == [48, 36, 40]
    assert none_ahead == 0 and ahead >= 3, f"{ahead} steps launched ahead"

    # The EOS: from request 0 run alone, its first token from its 9th on not emitted before.
    alone = run_steps(engine(False, slots=1), prompts[:1], params[:1])[0]
    eos = next((t for j, t in enumerate(alone) if j >= 8 and t not in alone[:j]), None)
    if eos is None:
        pytest.skip("request 0 repeats every token from its 9th on: no EOS to pick")
    stop = dataclasses.replace(params[0], ignore_eos=False)
    outs = [run_steps(engine(ahead, (eos,), slots=1), prompts[:1], [stop])[0] for ahead in (False, True)]
    assert outs[0] == outs[1] == alone[: alone.index(eos) + 1]


def test_a_request_entering_while_a_step_is_in_flight(model):
    """With launch-ahead, a request added while a step is in flight enters at the next step after
    that one is read back; every request gets its tokens and every slot is released."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    engine = Engine(K3Target(model, max_slots=4, max_seq_len=160), UniformDrafter(K3_SLICE.vocab_size), _spec(True),
                    cuda_graphs=True)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 21, 17)]
    outs = run_steps(engine, _prompts(gen, (5, 9, 6)), params, enter_at=1)
    assert [len(o) for o in outs] == [30, 21, 17]
    assert all(0 <= t < K3_SLICE.vocab_size for o in outs for t in o)
    assert engine.metrics.num_launched_ahead >= 3


def _plain_logit_gap(model, prompt, emitted, position, a, b):
    """|logit(a) - logit(b)| where plain decoding chose the token at `position` of its output:
    the prompt prefilled, then the output fed one token at a time, as plain decoding did."""
    target = K3Target(model, max_slots=1, max_seq_len=256)
    logits = target.prefill([0], [torch.tensor(prompt)]).logits[0, -1]
    for token in emitted[:position]:
        logits = target.verify([0], torch.tensor([[token]], device="cuda"), [1]).logits[0, 0]
        target.commit([0], [1])
    return float((logits[a] - logits[b]).abs())


class OracleDrafter(Drafter):
    """Drafts plain decoding's own continuation with every fourth draft wrong, so steps accept
    several drafts and also reject: both paths of the acceptance run."""

    def __init__(self, continuation: list[int], vocab_size: int):
        self.continuation, self.vocab_size, self.position = continuation, vocab_size, 0

    def start(self, slot, prompt, taps):
        self.position = 0  # the anchor is continuation[0]

    def propose(self, slots, anchors, k, sampling, generators):
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
    assert isinstance(engine.runner, GraphedRunner)
    speculative = engine.generate([prompt], params)[0].token_ids
    for j, (a, b) in enumerate(zip(speculative, plain)):
        if a != b:
            gap = _plain_logit_gap(model, prompt, plain, j, a, b)
            assert gap < MARGIN, f"first difference at token {j}: tokens {a} and {b} are {gap:.3f} apart"
            return
    assert len(speculative) == len(plain)
    assert engine.metrics.num_steps < len(speculative) // 2, "the oracle's drafts were not accepted"
