"""The device step (dspark/step.py) on the CPU, through the fixtures of the graph GPU tests
(tests/step_fixtures.py; tests/gpu/test_graph_step_gpu.py and test_engine_graphs_gpu.py run the
graphed runner through the same ones on k3-slice).

- The eager runner against the step written out as the engine ran it before (verify,
  rejection_sample, commit of accepted + 1): the same ops at the same shapes, so accepted counts,
  next tokens, anchors and every piece of committed state are bitwise equal, with a request
  leaving mid-run.
- DeviceStep.run with a graph's row masks (what the graphed runner captures): padding rows and a
  gated run (live = 0, a capture's warm-up) change no state, no anchor and commit nothing of a
  drafter that commits on the device.
- An eager engine stepped as the GPU tests step a graphed one (a drain mid-run, a request
  entering mid-run, an EOS stop): every request emits what it emits alone. On the CPU the
  reference kernels are batch-invariant, so this holds token for token.
"""
import dataclasses

import pytest
import torch

from dspark.config import SamplingParams, SpecConfig
from dspark.drafters.uniform import UniformDrafter
from dspark.engine import Engine
from dspark.protocols import Drafter
from dspark.sampling import SamplingTensors
from dspark.step import DeviceStep, EagerRunner, StepBatch, StepInputs
from dspark.targets.kimi_k3 import K3_TINY, K3Model, K3Target
from step_fixtures import assert_same_state, reference_step, run_steps, state

K = 3  # T = 4
SLOTS = 6


@pytest.fixture(scope="module")
def model():
    return K3Model.random(K3_TINY, seed=int(torch.randint(0, 2**31 - 1, ())), dtype=torch.float32, device="cpu")


def _no_marks(phase: str) -> None:
    pass


def _random_inputs(gen, B, params):
    V = K3_TINY.vocab_size
    sampling = SamplingTensors.from_params(params, "cpu")
    drafts = torch.randint(0, V, (B, K), generator=gen)
    num_drafts = torch.randint(0, K + 1, (B,), generator=gen)
    uniforms = torch.rand(B, K, generator=gen)
    noise = torch.empty(B, V).exponential_(generator=gen)
    return sampling, drafts, num_drafts, uniforms, noise


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_eager_runner_equals_the_step_written_out_with_a_leaving_request(model, temperature):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    reference, stepped = (K3Target(model, max_slots=SLOTS, max_seq_len=96) for _ in range(2))
    slots = [4, 0, 2]
    prompts = [torch.randint(0, K3_TINY.vocab_size, (n,), generator=gen) for n in (7, 3, 11)]
    for t in (reference, stepped):
        t.prefill(slots, prompts)
    runner = EagerRunner(DeviceStep(stepped, ()), _no_marks)
    anchors = torch.randint(0, K3_TINY.vocab_size, (3,), generator=gen).tolist()
    runner.set_anchors(slots, torch.tensor(anchors))
    params = [SamplingParams(temperature=temperature)] * 3
    for step in range(6):
        if step == 3:  # a request finishes
            for t in (reference, stepped):
                t.release([0])
            slots, anchors, params = [4, 2], [anchors[0], anchors[2]], params[:2]
        B = len(slots)
        sampling, drafts, num_drafts, uniforms, noise = _random_inputs(gen, B, params)
        want = reference_step(reference, slots, [], anchors, drafts, num_drafts, sampling, uniforms, noise)
        free = [s for s in range(SLOTS) if s not in slots]
        got = runner.launch(StepBatch(slots, free, drafts, num_drafts, None, sampling, uniforms, noise, None)).result()
        assert (got.num_accepted, got.next_token) == want, f"step {step}: accepted/next differ"
        assert runner.step.anchors[slots].tolist() == got.next_token, f"step {step}: the anchors"
        assert got.drafts == drafts.tolist() and got.num_drafts == num_drafts.tolist()
        assert got.nonfinite == [False] * B
        assert_same_state(state(stepped, slots), state(reference, slots), f"step {step}")
        anchors = got.next_token


class _CountingDrafter(Drafter):
    """Commits on the device by adding each row's kept count to its slot's total."""

    commits_on_device = True

    def __init__(self):
        self.kept = torch.zeros(SLOTS, dtype=torch.long)

    def start(self, slot, prompt, taps):
        pass

    def propose(self, slots, anchors, k, sampling, generators):
        raise AssertionError("not drafted here")

    def commit(self, slots, tokens, num_tokens, taps):
        raise AssertionError("commits on the device")

    def commit_on_device(self, index, tokens, num_tokens, taps):
        self.kept.index_add_(0, index, num_tokens)

    def release(self, slots):
        pass


def test_padding_rows_and_a_gated_step_change_nothing(model):
    """Three requests in a bucket of 4 (slot 5 pads), run as the graphed runner captures the
    step: the requests' rows equal an eager step of the three; the padding slot's state and
    anchor stay, and the drafter commits nothing for it. With live = 0 (warm-up, capture) nothing
    changes at all. The padding slot's context is full: a padding row that verified a token
    would be refused (the CPU target checks each verify's room)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    eager_target, masked_target = (K3Target(model, max_slots=SLOTS, max_seq_len=32) for _ in range(2))
    slots, padding = [4, 0, 2], [5]
    prompts = [torch.randint(0, K3_TINY.vocab_size, (n,), generator=gen) for n in (7, 3, 11, 32)]
    for t in (eager_target, masked_target):
        t.prefill(slots + padding, prompts)
    eager = EagerRunner(DeviceStep(eager_target, ()), _no_marks)
    drafter = _CountingDrafter()
    masked = DeviceStep(masked_target, (), drafter)
    anchors = torch.randint(0, K3_TINY.vocab_size, (4,), generator=gen)
    eager.set_anchors(slots, anchors[:3])
    masked.anchors[slots + padding] = anchors
    params = [SamplingParams(temperature=0.8)] * 3
    sampling, drafts, num_drafts, uniforms, noise = _random_inputs(gen, 3, params)
    index = torch.tensor(slots + padding)
    valid = torch.tensor([1, 1, 1, 0])
    bucket = SamplingTensors.from_params(params + [SamplingParams()], "cpu")

    def masked_inputs(live):
        # The padding row's buffers hold a former request's inputs, drafts and all (a graph
        # writes only the requests' rows): the masks alone keep them out.
        return StepInputs(index, index, valid, live, torch.cat([drafts, drafts[:1]]), torch.cat([num_drafts, torch.tensor([K])]),
                          None, bucket, torch.cat([uniforms, uniforms[:1]]), torch.cat([noise, noise[:1]]), None)

    before = state(masked_target, slots + padding)
    masked.run(masked_inputs(torch.zeros(4, dtype=torch.long)))  # gated: a capture's warm-up
    assert_same_state(state(masked_target, slots + padding), before, "a gated step")
    assert masked.anchors[slots + padding].tolist() == anchors.tolist() and drafter.kept.tolist() == [0] * SLOTS
    want = eager.launch(StepBatch(slots, [], drafts, num_drafts, None, sampling, uniforms, noise, None)).result()
    out = masked.run(masked_inputs(valid))
    rows = out.packed.tolist()
    assert [r[0] for r in rows[:3]] == want.num_accepted and [r[1] for r in rows[:3]] == want.next_token
    assert rows[3][2] == 0, "the padding row verified drafts"
    assert_same_state(state(masked_target, slots), state(eager_target, slots), "the requests' rows")
    assert_same_state(state(masked_target, padding), [x[3:] for x in before[:3]] + [before[3][3:]], "the padding row")
    assert masked.anchors[slots].tolist() == want.next_token and masked.anchors[5] == anchors[3]
    kept = [0] * SLOTS
    for slot, a in zip(slots, want.num_accepted):
        kept[slot] = a + 1
    assert drafter.kept.tolist() == kept


def _tiny_engine(model, speculative, slots=4, eos=()):
    spec = (SpecConfig(num_speculative_tokens=5, rejection_sample_method="synthetic", synthetic_acceptance_length=3.5)
            if speculative else SpecConfig(num_speculative_tokens=0))
    drafter = UniformDrafter(K3_TINY.vocab_size) if speculative else None
    return Engine(K3Target(model, max_slots=slots, max_seq_len=160), drafter, spec, eos_token_ids=eos)


@pytest.mark.parametrize("speculative", [True, False])
def test_an_eager_engine_through_the_graph_tests_steps_emits_each_request_as_alone(model, speculative):
    """The GPU tests' stepping (a drain mid-run, then a request entering while others run) on an
    eager engine: greedy, so with synthetic acceptance the draws decide the acceptance lengths
    and the target's argmax every token; each request's tokens equal its run alone."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompts = [torch.randint(0, K3_TINY.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 7)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=5 + n) for n in (24, 18, 20)]
    engine = _tiny_engine(model, speculative)
    assert isinstance(engine.runner, EagerRunner)
    drained = run_steps(engine, prompts, params, drain_at=2)
    entering = run_steps(_tiny_engine(model, speculative), prompts, params, enter_at=1)
    alone = [run_steps(_tiny_engine(model, speculative, slots=1), [p], [q])[0] for p, q in zip(prompts, params)]
    assert drained == entering == alone and [len(o) for o in alone] == [24, 18, 20]
    if speculative:
        assert 1.5 < engine.metrics.acceptance_length < 5.5  # synthetic AL 3.5, cut by max_tokens
    # An EOS: request 0's first token from its 6th on not emitted before ends it there.
    eos = next((t for j, t in enumerate(alone[0]) if j >= 5 and t not in alone[0][:j]), None)
    if eos is None:
        pytest.skip("request 0 repeats every token from its 6th on: no EOS to pick")
    stop = dataclasses.replace(params[0], ignore_eos=False)
    out = run_steps(_tiny_engine(model, speculative, eos=(eos,)), prompts[:2], [stop, params[1]])
    assert out == [alone[0][: alone[0].index(eos) + 1], alone[1]]
