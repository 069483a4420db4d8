"""markov_greedy_draft, the greedy Markov stage of a DSpark draft as an op (kernels/markov/): the
reference against the float64 argmax chain, the drafter's use of it against the per-slot loop it
replaced, and the errors. The Triton kernel: tests/test_triton_interpreter.py on the CPU,
tests/gpu/test_triton_kernels_gpu.py on the GPU."""
import dataclasses

import pytest
import torch

from dspark.config import SamplingParams
from dspark.drafters.dspark.config import K3_TINY_DSPARK
from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.drafters.dspark.model import DSparkModel
from dspark.kernels import ops
from dspark.kernels.markov import reference
from triton_interpret_checks import check_markov


def reference_into(base, anchors, w1, w2, out):
    out.copy_(reference.markov_greedy_draft(base, anchors, w1, w2))
    return out


def test_the_reference_takes_the_float64_argmax_chain_and_the_lower_id_of_a_tie():
    check_markov(torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()))), draft=reference_into)


def test_the_check_fails_on_a_draft_that_ignores_the_previous_token():
    def anchors_only(base, anchors, w1, w2, out):  # every slot biased by the anchor
        for k in range(base.shape[1]):
            out[:, k] = (base[:, k] + torch.nn.functional.embedding(anchors, w1) @ w2.T).argmax(-1)
        return out

    with pytest.raises(SystemExit, match="not argmaxes"):
        check_markov(torch.Generator().manual_seed(5), draft=anchors_only)


def test_the_drafters_greedy_block_equals_the_per_slot_loop():
    config = dataclasses.replace(K3_TINY_DSPARK, markov_rank=24).validate()
    torch.manual_seed(0)
    table = torch.randn(config.vocab_size, config.hidden_size)
    model = DSparkModel(config, table, table.clone() * 0.1)
    with torch.no_grad():  # a head that matters: W1 rows far from torch's N(0, 1) default
        model.markov_head.markov_w1.weight.mul_(3.0)
    drafter = DSparkDrafter(model, 2, max_seq_len=64)
    g = torch.Generator().manual_seed(2)
    for slot, length in ((0, 17), (1, 30)):
        drafter.start(slot, torch.randint(0, config.vocab_size, (length,), generator=g),
                      {layer: torch.randn(length, config.target_hidden_size, generator=g)
                       for layer in config.target_layer_ids})
    anchors = torch.tensor([5, 200])
    greedy = [SamplingParams(temperature=0.0)] * 2
    got = drafter.draft([0, 1], anchors, greedy, [None, None])
    # the loop the op replaced, over the same hidden states
    index = torch.tensor([0, 1])
    lengths = drafter._lengths_device.index_select(0, index)
    context = 30
    rows = [cache[:, :context].index_select(0, index) for cache in drafter._cache]
    visible = (torch.arange(context) < lengths[:, None]).unsqueeze(1)
    positions = (lengths[:, None] + torch.arange(config.block_size)).unsqueeze(1)
    with torch.no_grad():
        hidden = model.backbone(model.block_inputs(anchors).unsqueeze(1), positions, rows, visible, inference=True)[:, 0]
        base, prev, tokens, conf = model.base_logits(hidden), anchors, [], []
        for k in range(config.block_size):
            e = model.markov_head.embed_previous(prev)
            tokens.append((base[:, k] + model.markov_head.bias(e, hidden[:, k]).float()).argmax(-1))
            conf.append(model.confidence_head(hidden[:, k], e).float())
            prev = tokens[-1]
    assert torch.equal(got.tokens, torch.stack(tokens, 1))
    torch.testing.assert_close(got.confidence_logits, torch.stack(conf, 1), rtol=1e-5, atol=1e-6)
    assert got.probs is None


@pytest.mark.parametrize("args, message", [
    (((2, 7), (2,), (50, 8), (40, 8)), r"base must be \[B, G, V\] floating"),
    (((2, 7, 40), (3,), (50, 8), (40, 8)), r"anchors must be \[2\] integer ids"),
    (((2, 7, 40), (2,), (50, 8), (40, 6)), r"w1 \[V1, r\] and w2 \[V, r\] must share r"),
    (((2, 7, 40), (2,), (50, 8), (41, 8)), "w2 has 41 rows for base's 40 logits per slot"),
    (((2, 7, 40), (2,), (30, 8), (40, 8)), "w1 has 30 rows, fewer than the 40 ids a draft can emit"),
])
def test_bad_arguments_are_named(args, message):
    base, anchors, w1, w2 = args
    with pytest.raises(ValueError, match=message):
        ops.markov_greedy_draft(torch.randn(base), torch.zeros(anchors, dtype=torch.long), torch.randn(w1),
                                torch.randn(w2))
