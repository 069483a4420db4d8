"""k3-rank (one GPU's share of K3 on 16, docs/kimi-k3.md §8) on CUDA at real dims: its first four
layers (KDA + dense FFN, two KDA + latent MoE, one gated MLA + latent MoE) with the kernels the
registry picks (CuTe DSL / Triton) against the same model on the plain-torch reference kernels,
a verify of 8 tokens over an 8k context laid down at random (never zeros). The busiest-rank
routing is a fixed table, so both runs read the same experts.

Tolerance: relative L2 error of the logits 3e-2: bf16 activations through four layers of
different GEMM and reduction orders (the kernels' own GPU tests bound each op; this checks that
they take the rank's shapes: 6 heads, 56 experts, 224-wide latent slices); a wrong shard shape or
a kernel that ignores the rank's strides gives errors of order 1.
"""
import pytest
import torch

from dspark.kernels import registry
from dspark.targets.kimi_k3 import K3, K3Target, load_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONTEXT, T = 8192, 8
OPS = ("linear", "linear_heads", "kda_verify", "mla_verify_attention", "mla_cache_rows", "mla_absorb_q",
       "mla_absorb_output", "moe_router_logits", "moe_route_logits", "moe_experts", "moe_tail_inputs", "rms_norm",
       "attn_res_mix_norm", "add_attn_res_mix_norm", "situ_glu", "sigmoid_gate")


@pytest.fixture(scope="module")
def rank_model():
    return load_target("k3-rank", max_slots=1, max_seq_len=CONTEXT + 16, dtype=torch.bfloat16, device="cuda",
                       layers=4).model


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_rank_layers_match_the_reference_kernels(rank_model, batch):
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
    with registry.scoped(tuple((op, "reference") for op in OPS)):
        reference = target.verify(slots, tokens, lengths).logits
    assert torch.isfinite(fast).all()
    error = (fast - reference).norm() / reference.norm()
    print(f"k3-rank 4 layers, B={batch}, verify T={T} at {CONTEXT}: relative L2 error {error:.2e}")
    assert error < 3e-2
