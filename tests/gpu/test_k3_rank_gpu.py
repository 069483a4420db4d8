"""k3-rank (one GPU's share of K3 on 16, docs/kimi-k3.md §8) on CUDA at real dims: its first four
layers (KDA + dense FFN, two KDA + latent MoE, one gated MLA + latent MoE) with the kernels the
registry picks (CuTe DSL / Triton) against the same model on the plain-torch reference kernels,
a verify of 8 tokens over an 8k context laid down at random (never zeros). The busiest-rank
routing is a fixed table, so both runs read the same experts.

Both bf16 runs are measured against a float32 twin of the model (the same weights, cast up) on
the reference kernels. Tolerance: the fast kernels' relative L2 error of the logits at most 1.5x
the bf16 reference kernels' own (bf16 activations through four layers; the fast kernels round
in other places: the fused MoE output GEMM once where the reference rounds twice, split-K
reductions in fp32) and under 5e-2. Two bf16 runs differ from each other by ~3e-2 on random
inputs, which is why neither is the other's reference. The kernels' own GPU tests bound each op;
this checks that they take the rank's shapes: 6 heads, 56 experts, 224-wide latent slices. A
wrong shard shape or a kernel that ignores the rank's strides gives errors of order 1.
"""
import dataclasses

import pytest
import torch

from dspark.kernels import registry
from dspark.targets.kimi_k3 import K3, K3Target, load_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONTEXT, T = 8192, 8
OPS = ("linear", "linear_partials", "linear_heads", "kda_verify", "mla_verify_attention", "mla_cache_rows",
       "mla_absorb_q", "mla_absorb_output", "moe_router_logits", "moe_dispatch_inputs", "moe_route_logits",
       "moe_experts", "moe_tail_inputs", "rms_norm", "attn_res_mix_norm", "add_attn_res_mix_norm", "situ_glu",
       "sigmoid_gate")


@pytest.fixture(scope="module")
def rank_model():
    return load_target("k3-rank", max_slots=1, max_seq_len=CONTEXT + 16, dtype=torch.bfloat16, device="cuda",
                       layers=4).model


def _copy_into(src, dst) -> int:
    """Copy every tensor of `src` into the tensor at the same place in `dst` (dicts, tuples,
    lists, dataclasses), casting; returns how many were copied."""
    if isinstance(src, torch.Tensor):
        assert dst.shape == src.shape, (dst.shape, src.shape)
        dst.copy_(src)
        return 1
    if isinstance(src, dict):
        assert src.keys() == dst.keys()
        return sum(_copy_into(src[k], dst[k]) for k in src)
    if isinstance(src, (tuple, list)):
        return sum(_copy_into(a, b) for a, b in zip(src, dst, strict=True))
    if dataclasses.is_dataclass(src):
        return sum(_copy_into(getattr(src, f.name), getattr(dst, f.name)) for f in dataclasses.fields(src))
    return 0


@pytest.fixture(scope="module")
def float32_twin(rank_model):
    """The rank model's weights in float32: a float32 build of the preset, every weight then
    overwritten by the bf16 model's (cast up exactly; the MXFP4 experts copied as they are)."""
    twin = load_target("k3-rank", max_slots=1, max_seq_len=CONTEXT + 16, dtype=torch.float32, device="cuda",
                       layers=4).model
    copied = sum(_copy_into(getattr(rank_model, name), getattr(twin, name))
                 for name in ("tensors", "moe", "conv_weights", "mla_absorbed", "fused_inputs", "ffn_inputs"))
    assert copied > 40
    return twin


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_rank_layers_match_the_reference_kernels(rank_model, float32_twin, batch):
    """At B = 2 and 4 the MLA layer's cache pool holds several slots: the CuTe kernel must take it
    (the registry records no fallback to a host-reading implementation)."""
    target = K3Target(rank_model, max_slots=batch, max_seq_len=CONTEXT + 16)
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    target.kda_state.normal_(0.0, 0.02, generator=gen)
    target.conv_state.normal_(0.0, 1.0, generator=gen)
    target.mla_cache[:, :, :CONTEXT].normal_(0.0, 1.0, generator=gen)
    target.lengths[:] = CONTEXT
    slots, lengths = list(range(batch)), torch.full((batch,), T)
    tokens = torch.randint(0, K3.vocab_size, (batch, T), device="cuda", generator=gen)
    with registry.record_selections() as selections:
        fast = target.verify(slots, tokens, lengths).logits.clone()
    assert not [str(s) for s in selections if s.blocks_capture]
    assert {s.chosen.name for s in selections if s.op == "mla_verify_attention"} == {"cute_sm90"}
    # the router | latent-down GEMM (DISPATCH_IN_ONE_GEMM): CuTe partials, added and gathered in Triton
    assert {s.chosen.name for s in selections if s.op == "moe_dispatch_inputs"} == {"triton"}
    with registry.scoped(tuple((op, "reference") for op in OPS)):
        reference = target.verify(slots, tokens, lengths).logits
    twin = K3Target(float32_twin, max_slots=batch, max_seq_len=CONTEXT + 16)
    for name in ("kda_state", "conv_state", "mla_cache", "lengths"):
        getattr(twin, name).copy_(getattr(target, name))
    with registry.scoped(tuple((op, "reference") for op in OPS)):
        exact = twin.verify(slots, tokens, lengths).logits
    assert torch.isfinite(fast).all() and torch.isfinite(exact).all()
    fast_error, reference_error = ((x.float() - exact).norm() / exact.norm() for x in (fast, reference))
    print(f"k3-rank 4 layers, B={batch}, verify T={T} at {CONTEXT}: relative L2 error against float32 "
          f"{fast_error:.2e} (bf16 reference kernels {reference_error:.2e})")
    assert fast_error <= 1.5 * reference_error and fast_error < 5e-2


def test_split_k_partials_into_the_norms_change_no_bit(rank_model, monkeypatch):
    """SPLIT_K_INTO_CONSUMERS (the default): the GEMMs' partials added by their consumers give the logits of
    the two-kernel path bit for bit (the norm adds the splits in the reduction kernel's order and rounds as
    it does), with the CuTe GEMM keeping partials of more than one split."""
    from dspark.targets.kimi_k3 import model as k3_model

    target = K3Target(rank_model, max_slots=1, max_seq_len=CONTEXT + 16)
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    target.kda_state.normal_(0.0, 0.02, generator=gen)
    target.conv_state.normal_(0.0, 1.0, generator=gen)
    target.mla_cache[:, :, :CONTEXT].normal_(0.0, 1.0, generator=gen)
    target.lengths[:] = CONTEXT
    tokens = torch.randint(0, K3.vocab_size, (1, T), device="cuda", generator=gen)
    monkeypatch.setattr(k3_model, "SPLIT_K_INTO_CONSUMERS", False)
    plain = target.verify([0], tokens, torch.full((1,), T)).logits.clone()
    monkeypatch.setattr(k3_model, "SPLIT_K_INTO_CONSUMERS", True)
    with registry.record_selections() as selections:
        split = target.verify([0], tokens, torch.full((1,), T)).logits
    assert {s.chosen.name for s in selections if s.op == "linear_partials"} == {"cute_sm90"}
    assert torch.isfinite(split).all() and torch.equal(split, plain)
