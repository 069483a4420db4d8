"""Split-K partials handed to the kernel that reads a GEMM's output next (ops.linear_partials,
SPLIT_K_INTO_CONSUMERS; docs/kimi-k3.md §8.5) on the CPU: the reference ops' contract, and the K3 forward's
wiring. On the GPU the CuTe GEMM's
partials and the Triton norm are checked bit for bit against the two-kernel path
(tests/gpu/test_linear_gpu.py, tests/gpu/test_triton_kernels_gpu.py, tests/gpu/test_k3_rank_gpu.py)."""
import pytest
import torch

from dspark.kernels import ops
from dspark.kernels.linear import reference as linear_reference
from dspark.kernels.numerics import sum_partials
from dspark.targets.kimi_k3 import K3_TINY, K3Model, K3Target, Shard
from dspark.targets.kimi_k3 import model as k3_model


def test_sum_partials_adds_in_split_order_in_float32_and_rounds_once():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    partials = torch.randn(3, 4, 40, generator=gen) * torch.tensor([1.0, 1e4, -1e4])[:, None, None]
    got = sum_partials(partials, torch.bfloat16)
    want = ((partials[0] + partials[1]) + partials[2]).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    # another order rounds differently somewhere: the order is part of the contract
    assert not torch.equal(((partials[2] + partials[1]) + partials[0]).to(torch.bfloat16).float(),
                           ((partials[0] + partials[1]) + partials[2]).float())
    assert sum_partials(partials.double(), torch.bfloat16).dtype == torch.bfloat16


def test_the_reference_partial_is_linear_unrounded_and_the_norm_adds_partials():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x, w = torch.randn(3, 64, generator=gen).bfloat16(), torch.randn(32, 64, generator=gen).bfloat16()
    partials = ops.linear_partials(x, w)
    assert partials.shape == (1, 3, 32) and partials.dtype == torch.float32
    assert torch.equal(partials[0].bfloat16(), ops.linear(x, w))
    assert not torch.equal(partials[0], partials[0].bfloat16().float())  # not rounded before the consumer
    residual = torch.randn(3, 32, generator=gen).bfloat16()
    ckpts = torch.randn(2, 3, 32, generator=gen).bfloat16()
    weights = [(torch.rand(32, generator=gen) + 0.5).bfloat16() for _ in range(3)]
    split = torch.randn(4, 3, 32, generator=gen)
    got = ops.add_attn_res_mix_norm(residual, split, ckpts, *weights, 1e-6)
    want = ops.add_attn_res_mix_norm(residual, sum_partials(split, torch.bfloat16), ckpts, *weights, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    dropped = ops.add_attn_res_mix_norm(residual, sum_partials(split[:3], torch.bfloat16), ckpts, *weights, 1e-6)
    assert not torch.equal(got[1], dropped[1])


def test_the_tail_inputs_take_the_shared_gate_up_as_partials():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    routed, norm = torch.randn(3, 48, generator=gen), (torch.rand(48, generator=gen) + 0.5).bfloat16()
    split = torch.randn(3, 3, 40, generator=gen) * 2
    got = ops.moe_tail_inputs(routed, norm, split, 8, 16, 1e-6, 4.0, 25.0)
    want = ops.moe_tail_inputs(routed, norm, sum_partials(split, torch.bfloat16), 8, 16, 1e-6, 4.0, 25.0)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 36) and torch.equal(got, want)
    with pytest.raises(ValueError, match="shared_gate_up"):
        ops.moe_tail_inputs(routed, norm, split[:, :2], 8, 16, 1e-6, 4.0, 25.0)


def _three_exact_partials(x, weight):
    """The reference's unrounded product y as three fp32 partials that sum to it exactly in split order: half
    and half of y rounded to bf16 (exact halves), then the rounding's remainder (exact in fp32). A consumer
    that drops or double-counts a half changes the result; the router's fp32 logits (a rank's dispatch GEMM)
    see the remainder too."""
    y = linear_reference.linear_partials(x, weight)[0]
    head = y.bfloat16().float()
    return torch.stack([0.5 * head, 0.5 * head, y - head])


@pytest.mark.parametrize("world", [1, 4])
def test_the_forward_with_partials_equals_it_without(world, monkeypatch):
    """k3-tiny (one AttnRes seal at layer 0, KDA and MLA layers, dense and MoE FFNs), whole and rank 0 of 4
    with the busiest rank's routing, taps at a middle layer and the head: the logits and taps are the same
    bits with the GEMMs' partials handed to the kernels that read them next, three partials each."""
    model = K3Model.random(K3_TINY, seed=int(torch.randint(0, 2**31 - 1, ())), dtype=torch.bfloat16,
                           shard=Shard(0, world), routing="busiest" if world > 1 else "exact")
    target = K3Target(model, max_slots=2, max_seq_len=32)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    target.prefill([0, 1], [torch.randint(0, K3_TINY.vocab_size, (n,), generator=gen) for n in (6, 3)])
    tokens = torch.randint(0, K3_TINY.vocab_size, (2, 5), generator=gen)
    taps = (3, K3_TINY.num_layers)

    def verify():
        return target.verify([0, 1], tokens, [5, 4], taps)

    monkeypatch.setattr(k3_model, "SPLIT_K_INTO_CONSUMERS", False)
    plain = verify()
    monkeypatch.setattr(k3_model, "SPLIT_K_INTO_CONSUMERS", True)
    monkeypatch.setattr(ops, "linear_partials", _three_exact_partials)
    split = verify()
    assert torch.equal(split.logits, plain.logits)
    for layer in taps:
        assert split.taps[layer].shape == plain.taps[layer].shape and torch.equal(split.taps[layer], plain.taps[layer])
