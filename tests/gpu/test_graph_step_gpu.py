"""The device step as a CUDA-graph replay (dspark.graph_step.GraphedRunner) against the same step
run eagerly (tests/step_fixtures.py, whose reference step tests/test_step.py also holds the eager
runner to on the CPU).

Same weights, same prompts, same drafts: the replay runs exactly the kernels of the eager step,
so accepted counts, next tokens, logits-derived decisions and every piece of committed state
must be bitwise equal, including a batch padded into a larger bucket and a request that leaves
mid-run; the graph advances each live slot's anchor on the device and leaves padding slots'
anchors alone. Steady-state replays, two launched before either is read, raise nothing under
torch's sync-debug mode "error".
"""
import pytest
import torch

from dspark.config import SamplingParams
from dspark.graph_step import GraphedRunner
from dspark.sampling import DrawPool, SamplingTensors
from dspark.step import DeviceStep, StepBatch
from dspark.targets.kimi_k3 import K3_SLICE, K3Model, K3Target
from step_fixtures import assert_same_state, reference_step, state

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

K = 3  # T = 4
SLOTS = 6


@pytest.fixture(scope="module")
def model():
    """k3-slice: real dimensions, so every op runs on its GPU kernel (the references of KDA and
    MLA loop over lengths on the host and cannot be captured)."""
    return K3Model.random(K3_SLICE, seed=int(torch.randint(0, 2**31 - 1, ())), dtype=torch.bfloat16, device="cuda")


def _targets(model):
    """Two targets over one (stateless) model: one stepped eagerly, one by graph replay."""
    return [K3Target(model, max_slots=SLOTS, max_seq_len=96) for _ in range(2)]


def _runner(target) -> GraphedRunner:
    return GraphedRunner(DeviceStep(target, ()), lambda phase: None)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_replay_equals_eager_step_with_padding_and_a_leaving_request(model, temperature):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    eager, graphed = _targets(model)
    slots = [4, 0, 2]  # three requests: bucket 4, one padding row on a free slot
    prompts = [torch.randint(0, K3_SLICE.vocab_size, (n,), generator=gen) for n in (7, 3, 11)]
    for t in (eager, graphed):
        t.prefill(slots, prompts)
    runner = _runner(graphed)
    anchors = torch.randint(0, K3_SLICE.vocab_size, (3,), generator=gen).tolist()
    params = [SamplingParams(temperature=temperature)] * 3
    for step in range(6):
        if step == 3:  # a request finishes: the batch of 2 replays the bucket-2 graph
            for t in (eager, graphed):
                t.release([0])
            slots, anchors, params = [4, 2], [anchors[0], anchors[2]], params[:2]
        B = len(slots)
        free = [s for s in range(SLOTS) if s not in slots]
        pad = free[: runner.bucket(B) - B]
        before_pad = state(graphed, pad)
        sampling = SamplingTensors.from_params(params, "cuda")
        drafts = torch.randint(0, K3_SLICE.vocab_size, (B, K), generator=gen).cuda()
        num_drafts = torch.randint(0, K + 1, (B,), generator=gen).cuda()
        uniforms = torch.rand(B, K, generator=gen).cuda()
        noise = torch.empty(B, K3_SLICE.vocab_size).exponential_(generator=gen).cuda()
        want = reference_step(eager, slots, pad, anchors, drafts, num_drafts, sampling, uniforms, noise)
        if step in (0, 3):  # the slots' anchors on the device; later steps find the graph's own
            runner.set_anchors(slots, torch.tensor(anchors, device="cuda"))
        anchors_now = runner.step.anchors
        pad_anchors = anchors_now[pad].tolist()
        got = runner.launch(StepBatch(slots, free, drafts, num_drafts, None, sampling, uniforms, noise, None)).result()
        assert (got.num_accepted, got.next_token) == want, f"step {step}: accepted/next differ"
        assert anchors_now[slots].tolist() == got.next_token, f"step {step}: the graph's anchors"
        assert anchors_now[pad].tolist() == pad_anchors, f"step {step}: a padding slot's anchor changed"
        assert got.drafts == drafts.tolist() and got.num_drafts == num_drafts.tolist()
        assert_same_state(state(graphed, slots), state(eager, slots), f"step {step}")
        assert_same_state(state(graphed, pad), before_pad, f"step {step}: a padding slot changed")
        anchors = got.next_token


def test_steady_state_replay_does_not_synchronise(model):
    _, target = _targets(model)
    target.prefill([1], [torch.randint(0, K3_SLICE.vocab_size, (9,))])
    runner = _runner(target)
    sampling = SamplingTensors.from_params([SamplingParams(temperature=0.0)], "cuda")
    drafts = torch.randint(0, K3_SLICE.vocab_size, (1, K), device="cuda")
    num = torch.full((1,), K, device="cuda")
    free = [s for s in range(SLOTS) if s != 1]
    batch = StepBatch([1], free, drafts, num, None, sampling, None, None, None)
    runner.set_anchors([1], torch.tensor([3], device="cuda"))
    runner.launch(batch).result()  # captures
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            pending = [runner.launch(batch) for _ in range(2)]
            got = pending[0].result(), pending[1].result()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for one in got:
        assert 0 <= one.num_accepted[0] <= K and 0 <= one.next_token[0] < K3_SLICE.vocab_size


def test_replays_reading_draws_from_their_mirror_through_refills_do_not_synchronise(model):
    """Drafts and uniforms as DrawPool rows (pools of 3 steps: a refill and a block copy every
    third step) at T = 4 with synthetic acceptance: steady-state launches, two before either is
    read, raise nothing under sync-debug "error", and each step verified the pool's rows."""
    _, target = _targets(model)
    target.prefill([2], [torch.randint(0, K3_SLICE.vocab_size, (9,))])
    runner = _runner(target)
    sampling = SamplingTensors.from_params([SamplingParams(temperature=0.0)], "cuda")
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    token_pool = DrawPool.tokens(gen, K, K3_SLICE.vocab_size, steps=3)
    uniform_pool = DrawPool.uniform(gen, K + 2, steps=3)  # wider than the drafts: the first K are read
    num = torch.full((1,), K, device="cuda")
    rates = torch.tensor([1.0, 0.5, 0.0], device="cuda")
    free = [s for s in range(SLOTS) if s != 2]
    runner.set_anchors([2], torch.tensor([3], device="cuda"))

    def launch():
        drafts, uniforms = token_pool.next(), uniform_pool.next()
        return runner.launch(StepBatch([2], free, drafts, num, None, sampling, uniforms, None, rates,
                                       draft_pools=(token_pool,), uniform_pools=(uniform_pool,))), drafts

    launch()[0].result()  # captures
    checked = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            steps = [launch() for _ in range(2)]
            checked += [(pending.result(), drafts) for pending, drafts in steps]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, drafts in checked:  # the rows the graph verified are the pools' (read back, no sync)
        assert got.drafts[0] == drafts[0].tolist()
    assert runner.replays and all(key.draft_pools == (3, K) and key.uniform_pools == (3, K + 2)
                                  for key in runner.replays)
