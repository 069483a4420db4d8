"""Fixtures shared by the step tests on the CPU (tests/test_step.py: the eager runner, k3-tiny) and
on the GPU (tests/gpu/test_graph_step_gpu.py, test_engine_graphs_gpu.py: the graphed runner,
k3-slice): the same reference step, state comparison and stepping loop for both runners."""
from __future__ import annotations

import torch

from dspark.kernels import ops
from dspark.sampling import SamplingTensors


def state(target, slots):
    """A K3Target's committed state of these slots: KDA state, conv window, lengths, MLA rows."""
    rows = []
    for s in slots:
        n = int(target.lengths[s])
        rows.append(target.mla_cache[s, :, :n].clone())
    return (target.kda_state[slots].clone(), target.conv_state[slots].clone(), target.lengths[slots].clone(), rows)


def assert_same_state(a, b, what):
    for x, y, name in zip(a[:3], b[:3], ("kda_state", "conv_state", "lengths")):
        assert torch.equal(x, y), f"{what}: {name} differs"
    for r, (x, y) in enumerate(zip(a[3], b[3])):
        assert torch.equal(x, y), f"{what}: MLA rows of request {r} differ"


def pad(x, rows, value=0):
    """x with rows of `value` appended up to `rows` (a graph's bucket)."""
    extra = x.new_full((rows - x.shape[0], *x.shape[1:]), value)
    return torch.cat([x, extra])


def reference_step(target, slots, pad_slots, anchors, drafts, num_drafts, sampling, uniforms, noise):
    """One step written out as the engine ran it before the device step was one function: verify
    [anchor, drafts] of the batch padded with `pad_slots` (padding rows verify 0 tokens), accept
    with ops.rejection_sample, commit each request's accepted drafts + 1 (padding rows 0).
    Returns (accepted, next tokens) of the requests' rows as lists."""
    device = target.device
    B, rows = len(slots), len(slots) + len(pad_slots)
    valid = pad(torch.ones(B, dtype=torch.long, device=device), rows)
    drafts, num_drafts = pad(drafts, rows), pad(num_drafts, rows)
    tokens = torch.cat([pad(torch.tensor(anchors, device=device), rows)[:, None], drafts], dim=1)
    sampling = SamplingTensors(pad(sampling.temperature, rows), pad(sampling.top_k, rows),
                               pad(sampling.top_p, rows, 1.0), sampling.all_greedy, sampling.filters)
    out = target.verify(slots + pad_slots, tokens, (1 + num_drafts) * valid)
    num_acc, nxt = ops.rejection_sample(out.logits, drafts, num_drafts, None, sampling, pad(uniforms, rows),
                                        pad(noise, rows, 1.0))
    target.commit(slots + pad_slots, (num_acc + 1) * valid)
    return num_acc[:B].tolist(), nxt[:B].tolist()


def run_steps(engine, prompts, params, enter_at=None, drain_at=None):
    """Step `engine` until every request is done, collecting each request's streamed tokens. The
    last prompt enters after step `enter_at` (None: all at the start); `drain_at`: a drain
    after that step, as a phased sweep does between phases. Every slot is free at the end."""
    first = len(prompts) - (enter_at is not None)
    ids = [engine.add_request(p, q) for p, q in zip(prompts[:first], params[:first])]
    outs, step = {}, 0
    while engine.has_unfinished() or (enter_at is not None and step <= enter_at):
        if step == enter_at:
            ids.append(engine.add_request(prompts[-1], params[-1]))
        for event in engine.step() + (engine.drain() if step == drain_at else []):
            outs.setdefault(event.request_id, []).extend(event.new_token_ids)
        step += 1
    assert sorted(engine.requests.free_slots) == list(range(engine.target.max_slots)), "a slot was not released"
    return [outs[i] for i in ids]
