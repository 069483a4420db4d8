"""The DSpark drafter's backbone on the GPU: its fused block attention (one masked
scaled_dot_product_attention call, drafters/dspark/model.py) under the bf16 autocast the trainer
uses, against the float64 per-block reference; and a training step without recomputation against
one with it."""
import copy

import pytest
import torch

from dspark.drafters.dspark.model import DSparkModel
from dspark.drafters.dspark.train import TrainConfig, capture, train_step_loss
from dspark_fixtures import SyntheticTarget, small_config
from test_dspark_model import reference_block_hidden

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("attention_type", ["gqa", "mla"])
def test_backbone_under_bf16_autocast_matches_the_float64_reference(attention_type):
    target = SyntheticTarget(seed=11)
    torch.manual_seed(11)
    model = DSparkModel(small_config(target, attention_type), *target.embedding_weights())
    ref = copy.deepcopy(model).double()
    gpu = model.cuda()
    gpu.autocast_dtype = torch.bfloat16
    B, A, S, G = 3, 5, 40, model.config.block_size
    tokens = torch.randint(0, target.vocab_size, (B, S))
    taps = {layer: torch.randn(B, S, target.hidden_size) for layer in model.config.target_layer_ids}
    anchors = torch.stack([torch.randperm(S - 1)[:A].sort().values for _ in range(B)])
    anchors[0, 0] = 0  # a block with no context row at all
    block = gpu.block_inputs(tokens.gather(1, anchors))
    positions = anchors[..., None] + torch.arange(G)
    with torch.no_grad():
        fused = gpu.fuse_taps({k: v.cuda() for k, v in taps.items()})
        rows = gpu.context_rows(fused, torch.arange(S, device="cuda").expand(B, S))
        visible = torch.arange(S) < anchors[..., None]
        hidden = gpu.backbone(block.cuda(), positions.cuda(), rows, visible.cuda()).float().cpu()
        fused64 = ref.fuse_taps({k: v.double() for k, v in taps.items()})
        errors = torch.stack([(hidden[b, a].double() - reference_block_hidden(ref, fused64[b], int(anchors[b, a]),
                                                                             block[b, a])).abs().max()
                              for b in range(B) for a in range(A)])
    # bf16 keeps 8 bits of mantissa: a unit-scale (final-normed) hidden is off by ~1e-2 after a
    # few bf16 projections; a wrong mask or a wrong block would be off by O(1).
    assert torch.isfinite(hidden).all()
    assert errors.max() < 0.1, errors.max()
    assert errors.mean() < 0.03, errors.mean()


def test_a_step_without_recompute_equals_one_with_it():
    target = SyntheticTarget(seed=12)
    data = [torch.randint(0, target.vocab_size, (n,)) for n in (30, 41, 25)]
    torch.manual_seed(12)
    model = DSparkModel(small_config(target, "gqa"), *target.embedding_weights()).cuda()
    model.autocast_dtype = torch.bfloat16
    captured = capture(target, data, model.config.target_layer_ids)
    results = []
    for recompute in (True, False):
        model.zero_grad(set_to_none=True)
        cfg = TrainConfig(num_anchors=12, anchor_chunk=4, recompute=recompute)
        loss, _ = train_step_loss(model, captured, data, [torch.ones_like(s) for s in data], cfg,
                                  torch.Generator().manual_seed(5))
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss0, g0), (loss1, g1) = results
    # The loss is the same forward either way; the gradients differ only by the order of atomic
    # float32 accumulations (the attention's and the embedding's backward are not deterministic).
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for name in g0:
        assert (g1[name] - g0[name]).norm() <= 1e-3 * g0[name].norm() + 1e-9, name
    assert any(g.abs().max() > 0 for g in g0.values())
