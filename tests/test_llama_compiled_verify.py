"""LlamaTarget(compiled_verify=True): a batched verify's layers through torch.compile give the eager
batched path's logits and taps, over prefill and ragged verifies whose batch, width and context change
from step to step, without a graph per layer or per step."""
import pytest
import torch

from dspark.targets.llama import LlamaTarget
from test_dspark_train_fast import SEED, tiny_llama


def _poisoned_pair(seed: int) -> tuple[LlamaTarget, LlamaTarget]:
    eager = tiny_llama(seed, max_slots=4, max_seq_len=64)
    eager = LlamaTarget(eager.config, eager.weights, max_slots=4, max_seq_len=64, attention="batched")
    compiled = LlamaTarget(eager.config, eager.weights, max_slots=4, max_seq_len=64, attention="batched",
                           compiled_verify=True)
    for target in (eager, compiled):  # rows no request wrote must never count
        target.k_cache.fill_(float("nan"))
        target.v_cache.fill_(float("nan"))
    return eager, compiled


def test_compiled_verify_equals_the_eager_batched_one():
    """Prefill of three prompts, then verifies of 3, 2 and 1 requests at widths 5, 3 and 4 with ragged
    lengths and partial commits: logits and taps (every tap layer, the LM head's input included) agree to
    float32 rounding of the fused elementwise work, bound 1e-4 on values of O(1-10); a stale cache row
    (NaN) reaching a result would make it NaN. The graphs compiled over the whole run number at most
    eight (two functions, each static then symbolic, and the size-1 specialisations), not one per layer
    (4) per step (5)."""
    eager, compiled = _poisoned_pair(SEED)
    g = torch.Generator().manual_seed(SEED)
    vocab, taps = eager.vocab_size, (-1, 1, eager.num_layers)

    def tokens(*shape):
        return torch.randint(0, vocab, shape, generator=g)

    prompts = [tokens(n) for n in (9, 4, 13)]
    steps = [([0, 1, 3], tokens(3, 5), [5, 3, 1], [2, 3, 1]),
             ([3, 0], tokens(2, 3), [3, 2], [3, 1]),
             ([1], tokens(1, 4), [4], [4])]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    outputs = {}
    for name, target in (("eager", eager), ("compiled", compiled)):
        runs = [target.prefill([0, 1, 3], prompts, taps)]
        for slots, fed, lengths, kept in steps:
            runs.append(target.verify(slots, fed, torch.tensor(lengths), taps))
            target.commit(slots, torch.tensor(kept))
        outputs[name] = runs
        assert target.cache_lengths == [9 + 2 + 1, 4 + 3 + 4, 0, 13 + 1 + 3]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs <= 8
    fed_lengths = [[len(p) for p in prompts]] + [lengths for _, _, lengths, _ in steps]
    for step, (want, got, lengths) in enumerate(zip(outputs["eager"], outputs["compiled"], fed_lengths)):
        for r, n in enumerate(lengths):
            rows = min(n, want.logits.shape[1])  # prefill returns the last position's logits
            assert torch.isfinite(got.logits[r, :rows]).all(), (SEED, step, r)
            torch.testing.assert_close(got.logits[r, :rows], want.logits[r, :rows], rtol=1e-4, atol=1e-4,
                                       msg=f"seed {SEED}: step {step}, request {r}, logits")
            for layer in taps:
                torch.testing.assert_close(got.taps[layer][r, :n], want.taps[layer][r, :n], rtol=1e-4, atol=1e-4,
                                           msg=f"seed {SEED}: step {step}, request {r}, tap {layer}")


def test_compiled_verify_needs_the_batched_path():
    tiny = tiny_llama(SEED)
    with pytest.raises(ValueError, match="compiled_verify=True: needs attention='batched', got 'per_query'"):
        LlamaTarget(tiny.config, tiny.weights, max_slots=1, max_seq_len=8, compiled_verify=True)
