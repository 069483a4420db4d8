"""The kernels added for the K3 rank's launch count (docs/kimi-k3.md §8.5), on the GPU at the
rank's and the whole model's shapes, outputs poisoned (NaN) before each run, fresh random inputs:

- moe_tail_inputs (Triton) against its reference and float64. Tolerance: bf16 outputs of O(1)
  values; the kernel rounds once where the reference does (the store), its fp32 reductions run
  in another order: at most 1 bf16 ulp of the output per element plus 1e-3. Mean: under 1e-3
  against the bf16 reference (the bound of tests/gpu/test_triton_kernels_gpu.py for one
  rounding); against float64, which the store's rounding alone moves by up to half an ulp (the
  SiTU-GLU half reaches values of ~10, ulp 1/16), under half the mean ulp plus 1e-3.
- mla_cache_rows (Triton) against its reference on a layer's pool of slots, a ragged batch: the
  normalised c_kv to 2 bf16 ulps (rms_norm's two roundings, the same bound), k_pe and every row
  it must not touch bit for bit; with the query's norm in the launch (K3's q=(c_q, q_a_layernorm)),
  the normalised c_q to the same bound.
- the skinny GEMM's fused split-K reduction (cute_host.FUSED_REDUCE) at the rank's split shapes,
  against float64: relative Frobenius error <= 1e-2 (bf16 output rounding alone is ~2e-3), the
  bound of tests/gpu/test_linear_gpu.py; every element written; twice in a row (the arrival
  counters must re-arm).
- mla_absorb_q / mla_absorb_output (Triton) at the rank's 6 heads against float64: relative
  Frobenius error <= 1e-2 (bf16 output rounding alone is ~2e-3, the GEMM tests' bound), q_pe
  copied bit for bit, every element written.
- the Triton kernels under programmatic dependent launch (triton_common.PDL) in a CUDA graph: a
  chain of dependent kernels replayed gives the eager, plain-launch results bit for bit (the same
  kernels on the same inputs; a missing wait would read a predecessor's output early).
"""
import pytest
import torch

from dspark.kernels import cute_common, ops, registry
from dspark.kernels.moe import reference as moe_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def gen():
    return torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(v.float().abs().clamp(min=2.0**-126))) - 7)


def _close(got, want, what, roundings: int = 1, exact: bool = False):
    """`exact`: `want` is unrounded (float64), so the mean error may reach half the mean ulp."""
    assert torch.isfinite(got).all(), f"{what}: unwritten (NaN) or non-finite output"
    err = (got.float() - want.float()).abs()
    ulp = _bf16_ulp(want)
    bound = roundings * ulp + 1e-3
    assert (err <= bound).all(), f"{what}: max error {err.max().item():.3e} ({(err / bound).max().item():.2f}x the bound)"
    mean_bound = 0.5 * ulp.mean().item() + 1e-3 if exact else 1e-3
    assert err.mean().item() < mean_bound, f"{what}: mean error {err.mean().item():.3e} (bound {mean_bound:.3e})"


# (latent, window start, window width, shared): a rank of 16 (rank 3's window) and the whole model
TAIL_SHAPES = [(3584, 3 * 224, 224, 384), (3584, 0, 3584, 6144)]


@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("latent, start, width, shared", TAIL_SHAPES)
def test_moe_tail_inputs_match_the_reference(gen, rows, latent, start, width, shared):
    from dspark.kernels.moe import triton as moe_triton

    routed = torch.randn(rows, latent, device="cuda", generator=gen) * 2
    norm = (torch.rand(latent, device="cuda", generator=gen) + 0.5).bfloat16()
    gate_up = (torch.randn(rows, 2 * shared + 64, device="cuda", generator=gen) * 3).bfloat16()[:, 32 : 32 + 2 * shared]
    out = torch.full((rows, width + shared), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = moe_triton.moe_tail_inputs(routed, norm, gate_up, start, width, 1e-5, 4.0, 25.0, out=out)
    want = moe_ref.moe_tail_inputs(routed, norm, gate_up, start, width, 1e-5, 4.0, 25.0)
    _close(got, want, f"moe_tail_inputs rows {rows} [{start}, +{width}) shared {shared}")
    exact = moe_ref.moe_tail_inputs(routed.double(), norm.double(), gate_up.double(), start, width, 1e-5, 4.0, 25.0)
    _close(got, exact, "moe_tail_inputs against float64", exact=True)
    assert registry.select("moe_tail_inputs", routed, norm, gate_up).name == "triton"
    assert ops.moe_tail_inputs(routed, norm, gate_up, start, width, 1e-5, 4.0, 25.0).dtype == torch.bfloat16


@pytest.mark.parametrize("parts", [2, 7])
def test_moe_tail_inputs_add_split_k_partials_as_the_reduction_kernel_would(gen, parts):
    """shared gate|up as a GEMM's fp32 split-K partials (ops.linear_partials): the same bits as the launch
    given them summed and rounded (the GEMM reduction's output), in the model's dtype."""
    from dspark.kernels.moe import triton as moe_triton
    from dspark.kernels.numerics import sum_partials

    latent, start, width, shared = TAIL_SHAPES[0]
    routed = torch.randn(1, latent, device="cuda", generator=gen) * 2
    norm = (torch.rand(latent, device="cuda", generator=gen) + 0.5).bfloat16()
    partials = torch.randn(parts, 1, 2 * shared, device="cuda", generator=gen) * 2
    assert registry.select("moe_tail_inputs", routed, norm, partials).name == "triton"
    out = torch.full((1, width + shared), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = moe_triton.moe_tail_inputs(routed, norm, partials, start, width, 1e-5, 4.0, 25.0, out=out)
    want = moe_triton.moe_tail_inputs(routed, norm, sum_partials(partials, torch.bfloat16), start, width, 1e-5, 4.0,
                                      25.0)
    assert torch.isfinite(got).all() and torch.equal(got, want)


# k3-rank's split GEMMs (tests/test_linear_cute_compile.py RANK_SPLIT_SHAPES)
RANK_SPLIT_SHAPES = {"kda_in": (3208, 7168), "latent_down": (224, 7168), "shared_gate_up": (768, 7168),
                     "o_proj": (7168, 768), "moe_output": (7168, 608)}


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0)
                    or not cute_common.cutlass_available(), reason="the sm_90a skinny GEMM")
@pytest.mark.parametrize("name", sorted(RANK_SPLIT_SHAPES))
@pytest.mark.parametrize("fused", [False, True])
def test_the_rank_split_gemms_with_either_reduction(gen, monkeypatch, name, fused):
    from dspark.kernels.linear import cute_host, cute_sm90

    monkeypatch.setattr(cute_host, "FUSED_REDUCE", fused)
    n, k = RANK_SPLIT_SHAPES[name]
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    for m in (1, 8, 16):
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        want = x.double() @ weight.double().t()
        for _ in range(2):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            cute_sm90.skinny_gemm(x, weight, out)
            torch.cuda.synchronize()
            assert not out.isnan().any(), f"{name} M={m} fused={fused}: elements not written"
            error = ((out.double() - want).norm() / want.norm()).item()
            assert error <= 1e-2, f"{name} M={m} fused={fused}: relative error {error:.2e}"


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("batch, tokens", [(1, 1), (1, 8), (4, 8), (8, 1)])
def test_mla_cache_rows_match_the_reference(gen, batch, tokens, with_q):
    """with_q: K3's call, the query's c_q (q_a_layernorm, Q = 1536) normalised in the same launch, c_q and kv
    column slices of one q_a | kv_a | gate GEMM output: every row (padding tokens' too) to 2 bf16 ulps of the
    reference's K3 rms_norm (its two roundings, the c_kv bound), into a poisoned buffer; through the op, the
    same bits."""
    from dspark.kernels.mla import reference as mla_ref
    from dspark.kernels.mla import triton as mla_triton
    from dspark.kernels.numerics import rms_norm

    R, P, Q, L = 512, 64, 1536, 1024
    pool = torch.full((batch + 2, L + 1, R + P), float("nan"), dtype=torch.bfloat16, device="cuda")
    fused = (torch.randn(batch * tokens, 2880, device="cuda", generator=gen) * 2).bfloat16()
    c_q, kv = fused[:, :Q], fused[:, Q : Q + R + P]
    weight = (torch.rand(R, device="cuda", generator=gen) + 0.5).bfloat16()
    q_weight = (torch.rand(Q, device="cuda", generator=gen) + 0.5).bfloat16()
    slots = torch.randperm(batch + 2, device="cuda", generator=gen)[:batch]
    cache_lens = torch.randint(0, L - tokens, (batch,), device="cuda", generator=gen)
    lengths = torch.randint(1, tokens + 1, (batch,), device="cuda", generator=gen)
    q = (c_q, q_weight) if with_q else None
    q_out = torch.full((batch * tokens, Q), float("nan"), dtype=torch.bfloat16, device="cuda") if with_q else None
    want = pool.clone()
    mla_ref.mla_cache_rows(kv, weight, 1e-5, want, slots, cache_lens, lengths)
    before = pool.clone()
    got_q = mla_triton.mla_cache_rows(kv, weight, 1e-5, pool, slots, cache_lens, lengths, q=q, q_out=q_out)
    assert registry.select("mla_cache_rows", kv, weight, pool, slots, cache_lens, lengths, *(q or ())).name == "triton"
    assert torch.equal(pool[:, :L].isnan(), want[:, :L].isnan()), "rows written differ from the reference's"
    written = ~want[:, :L].isnan().all(-1)
    _close(pool[:, :L][written][:, :R], want[:, :L][written][:, :R], "mla_cache_rows c_kv", roundings=2)
    assert torch.equal(pool[:, :L][written][:, R:], want[:, :L][written][:, R:]), "k_pe differs"
    if not with_q:
        assert got_q is None
        return
    assert got_q is q_out
    _close(got_q, rms_norm(c_q, q_weight, 1e-5), "mla_cache_rows c_q", roundings=2)
    through_op = ops.mla_cache_rows(kv, weight, 1e-5, before, slots, cache_lens, lengths, q=q)
    assert through_op.is_contiguous() and torch.equal(through_op, got_q)
    assert torch.equal(before[:, :L][written], pool[:, :L][written])


@pytest.mark.parametrize("rope", [False, True])
def test_mla_cache_rows_of_split_k_partials_match_the_reduced_gemms(gen, rope):
    """The drafter's call with INPUTS_AS_PARTIALS_ON: kv and c_q as 7 float32 split-K partials of one
    q_a | kv_a GEMM (the TP16 share's split at K = 7168; column slices of each partial), dtype bf16: the
    cache rows and the normalised c_q bit for bit the Triton launch's on the reduced GEMM's output
    (sum_partials: the same fp32 sums in split order, rounded once), with and without the rope tables."""
    from dspark.kernels.mla import triton as mla_triton
    from dspark.kernels.numerics import sum_partials

    S, B, T, R, P, Q, L = 7, 1, 7, 512, 64, 1536, 256
    fused = torch.randn(S, B * T, Q + R + P, device="cuda", generator=gen)
    c_q, kv = fused[..., :Q], fused[..., Q:]
    weight = (torch.rand(R, device="cuda", generator=gen) + 0.5).bfloat16()
    q_weight = (torch.rand(Q, device="cuda", generator=gen) + 0.5).bfloat16()
    slots, cache_lens = torch.tensor([1], device="cuda"), torch.tensor([40], device="cuda")
    lengths = torch.tensor([T], device="cuda")
    angles = torch.rand(B * T, P // 2, device="cuda", generator=gen) * 6.3
    tables = (angles.cos(), angles.sin(), True) if rope else None
    want, got = (torch.full((3, L + 1, R + P), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2))
    want_q = mla_triton.mla_cache_rows(sum_partials(kv, torch.bfloat16), weight, 1e-6, want, slots, cache_lens, lengths,
                                       tables, q=(sum_partials(c_q, torch.bfloat16), q_weight))
    got_q = mla_triton.mla_cache_rows(kv, weight, 1e-6, got, slots, cache_lens, lengths, tables, q=(c_q, q_weight),
                                      dtype=torch.bfloat16, q_out=torch.full((B * T, Q), float("nan"),
                                                                             dtype=torch.bfloat16, device="cuda"))
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert torch.equal(got_q, want_q)
    assert registry.select("mla_cache_rows", kv, weight, got, slots, cache_lens, lengths, c_q, q_weight).name == "triton"


def test_mla_absorb_output_of_a_gates_split_k_partials_matches_the_reduced_gate(gen):
    """The K3 target's MLA output with SPLIT_K_INTO_CONSUMERS: the gate as its input GEMM's 7 float32 split-K
    partials (column slices of each) at a rank's 6 heads: bit for bit the launch on the reduced gate
    (sum_partials), through the Triton kernel."""
    from dspark.kernels.mla import triton as mla_triton
    from dspark.kernels.numerics import sum_partials

    M, H, V, R = 8, 6, 128, 512
    o_latent = torch.randn(M, H, R, device="cuda", generator=gen).bfloat16()
    w_uv = (torch.randn(H, V, R, device="cuda", generator=gen) * R**-0.5).bfloat16()
    parts = torch.randn(7, M, H * V + 64, device="cuda", generator=gen)[..., 32 : 32 + H * V]
    want = mla_triton.mla_absorb_output(o_latent, w_uv, sum_partials(parts, torch.bfloat16))
    got = mla_triton.mla_absorb_output(o_latent, w_uv, parts, out=_poisoned(want))
    assert torch.equal(got, want)
    assert registry.select("mla_absorb_output", o_latent, w_uv, parts).name == "triton"


def test_a_graph_of_dependent_triton_kernels_under_pdl_equals_plain_launches(gen, monkeypatch):
    from dspark.kernels import triton_common

    x = torch.randn(8, 7168, device="cuda", generator=gen).bfloat16()
    w = (torch.rand(7168, device="cuda", generator=gen) + 0.5).bfloat16()
    latent_norm = (torch.rand(3584, device="cuda", generator=gen) + 0.5).bfloat16()
    shared_w = (torch.randn(768, 7168, device="cuda", generator=gen) / 7168**0.5).bfloat16()

    def chain():
        h = ops.rms_norm(x, w, 1e-5)  # each kernel reads the one before it
        gate_up = ops.linear(h, shared_w)
        routed = ops.rms_norm(h[:, :3584], latent_norm, 1e-5, out_dtype=torch.float32)
        tail = ops.moe_tail_inputs(routed, latent_norm, gate_up, 224, 224, 1e-5, 4.0, 25.0)
        return ops.sigmoid_gate(tail, tail)

    want = chain().clone()
    monkeypatch.setattr(triton_common, "PDL", True)
    chain()  # compile the PDL variants outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_mla_absorptions_at_the_rank_heads(gen, rows):
    H, R, nope, P, V = 6, 512, 128, 64, 128
    q = torch.randn(rows, H, nope + P, device="cuda", generator=gen).bfloat16()
    w_uk_t = (torch.randn(H, R, nope, device="cuda", generator=gen) / nope**0.5).bfloat16()
    assert registry.select("mla_absorb_q", q, w_uk_t).name == "triton"
    q_latent, q_pe = ops.mla_absorb_q(q, w_uk_t)
    want = torch.einsum("mhk,hrk->mhr", q[:, :, :nope].double(), w_uk_t.double())
    assert torch.isfinite(q_latent).all() and ((q_latent.double() - want).norm() / want.norm()).item() <= 1e-2
    assert torch.equal(q_pe, q[:, :, nope:])
    o_latent = torch.randn(rows, H, R, device="cuda", generator=gen).bfloat16()
    w_uv = (torch.randn(H, V, R, device="cuda", generator=gen) / R**0.5).bfloat16()
    gate = (torch.randn(rows, 2880, device="cuda", generator=gen) * 2).bfloat16()[:, 2112 : 2112 + H * V]
    assert registry.select("mla_absorb_output", o_latent, w_uv, gate).name == "triton"
    out = ops.mla_absorb_output(o_latent, w_uv, gate)
    want = (torch.einsum("mhr,hvr->mhv", o_latent.double(), w_uv.double()).reshape(rows, H * V)
            * torch.sigmoid(gate.double()))
    assert torch.isfinite(out).all() and ((out.double() - want).norm() / want.norm()).item() <= 1e-2


@pytest.mark.parametrize("rows", [7, 28])
def test_linear_heads_at_the_drafters_tp16_share(gen, rows):
    """The DSpark drafter's ungated W_UV at its TP16 share (4 heads): one Triton launch writing the
    token-major result (where cuBLAS's batched GEMM and a copy ran), within one bf16 rounding of the
    reference and of float64; the attention output's rows and the weight's strided as views have them."""
    from dspark.kernels.linear import reference as linear_ref
    from dspark.kernels.mla import triton as mla_triton

    H, R, V = 4, 512, 128
    o_latent = torch.randn(rows, H, R + 64, device="cuda", generator=gen).bfloat16()[:, :, :R]
    # W_UV as the drafter passes it: a view of kv_b_proj's weight, [H, nope + V, R] split on dim 1
    w_uv = (torch.randn(H, 128 + V, R, device="cuda", generator=gen) / R**0.5).bfloat16()[:, 128:]
    assert registry.select("linear_heads", o_latent, w_uv).name == "triton"
    out = mla_triton.linear_heads(o_latent, w_uv, out=torch.full((rows, H, V), float("nan"), device="cuda",
                                                                 dtype=torch.bfloat16))
    _close(out, torch.einsum("mhr,hvr->mhv", o_latent.double(), w_uv.double()), "linear_heads against float64",
           exact=True)
    _close(out, linear_ref.linear_heads(o_latent, w_uv), "linear_heads against cuBLAS's batched GEMM")


@pytest.mark.parametrize("interleaved", [False, True])
def test_the_drafters_rope_inside_absorb_q_and_cache_rows(gen, interleaved):
    """The DSpark drafter's RoPE done in MLA's absorb and cache-row launches (its TP16 share: 4 heads,
    7 block rows), bf16, against the reference ops on float64 inputs (the rotary op's formula, unrounded):
    q_pe and k_pe within their one bf16 rounding, the outputs poisoned first."""
    from dspark.kernels.mla import reference as mla_ref
    from dspark.kernels.mla import triton as mla_triton

    M, H, R, nope, P, L = 7, 4, 512, 128, 64, 64
    angles = torch.rand(M, P // 2, device="cuda", generator=gen) * 8000  # positions far into a context
    rope = (angles.cos() * 1.2, angles.sin() * 1.2, interleaved)
    q = (torch.randn(M, H, nope + P, device="cuda", generator=gen) * 2).bfloat16()
    w_uk_t = (torch.randn(H, R, nope, device="cuda", generator=gen) / nope**0.5).bfloat16()
    pe = torch.full((M, H, P), float("nan"), dtype=torch.bfloat16, device="cuda")
    mla_triton.mla_absorb_q(q, w_uk_t, rope, pe=pe)
    _close(pe, mla_ref.mla_absorb_q(q.double(), w_uk_t.double(), rope)[1], "absorb_q's rotated q_pe", exact=True)
    kv = (torch.randn(M, R + P, device="cuda", generator=gen) * 2).bfloat16()
    weight = (torch.rand(R, device="cuda", generator=gen) + 0.5).bfloat16()
    slots, cache_lens, lengths = (torch.tensor([v], device="cuda") for v in (1, 20, M))
    pool = torch.full((3, L + 1, R + P), float("nan"), dtype=torch.bfloat16, device="cuda")
    want = pool.double()
    mla_ref.mla_cache_rows(kv.double(), weight.double(), 1e-6, want, slots, cache_lens, lengths, rope)
    mla_triton.mla_cache_rows(kv, weight, 1e-6, pool, slots, cache_lens, lengths, rope)
    _close(pool[1, 20 : 20 + M, R:], want[1, 20 : 20 + M, R:], "cache_rows' rotated k_pe", exact=True)
