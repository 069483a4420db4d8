"""The Triton kernels on the GPU at K3's widths and dtypes against their references
(kernels/rmsnorm, kernels/activation, the router selection of kernels/moe), with the output
poisoned (NaN) before each run.

Tolerance: bf16 outputs of O(1) values. The kernels round exactly where the references do, but
their fp32 reductions run in another order, which can move a value across a bf16 rounding
boundary at each rounding of the chain: per element at most one bf16 ulp of the output (ulp(v) =
2^(floor(log2 |v|) - 7)) per rounding, plus 1e-3, and a mean error under 1e-3. RMSNorm and the
activations round twice (2 ulps); the AttnRes mix + RMSNorm rounds three times (the mix, the
normalised row, the weighted output: 3 ulps; a 3-ulp element was seen on the H200 at f5b1a21, 64 rows
and 9 checkpoints, where the old bound of 2^-6 |ref| allowed only 2.5 ulps at that value).
"""
import pytest
import torch

from dspark.kernels import registry
from dspark.kernels.activation import reference as act_ref
from dspark.kernels.activation import triton as act_triton
from dspark.kernels.moe import triton as moe_triton
from dspark.kernels.numerics import sum_partials
from dspark.kernels.rmsnorm import reference as norm_ref
from dspark.kernels.rmsnorm import triton as norm_triton

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def gen():
    return torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))


def _poisoned(like):
    return torch.full(like.shape, float("nan"), dtype=like.dtype, device=like.device)


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(v.float().abs().clamp(min=2.0**-126))) - 7)


def _close(got, want, what, roundings: int = 2):
    assert torch.isfinite(got).all(), f"{what}: unwritten (NaN) or non-finite output"
    err = (got.float() - want.float()).abs()
    bound = roundings * _bf16_ulp(want) + 1e-3
    assert (err <= bound).all(), f"{what}: max error {err.max().item():.3e} ({(err / bound).max().item():.2f}x the bound)"
    assert err.mean().item() < 1e-3, f"{what}: mean error {err.mean().item():.3e}"


@pytest.mark.parametrize("tiles", [False, True])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_rms_norm_and_mix_norm_match_references(gen, rows, tiles, monkeypatch):
    """tiles: the mix scores its checkpoints in 2-D tiles (norm_triton.MIX_SCORE_TILES; 4 in one tile of
    four, 9 in tiles of two, the last with a padding row)."""
    monkeypatch.setattr(norm_triton, "MIX_SCORE_TILES", tiles)
    d = 7168
    x = (torch.randn(rows, d + 512, device="cuda", generator=gen) * 2).bfloat16()[:, 256 : 256 + d]
    weight = (torch.rand(d, device="cuda", generator=gen) + 0.5).bfloat16()
    out = _poisoned(torch.empty(rows, d, dtype=torch.bfloat16, device="cuda"))
    _close(norm_triton.rms_norm(x, weight, 1e-6, out=out), norm_ref.rms_norm(x, weight, 1e-6), "rms_norm")
    assert registry.select("rms_norm", x, weight).name == "triton"
    routed = torch.randn(rows, 3584, device="cuda", generator=gen) * 2  # the MoE's fp32 sum, normed into bf16
    latent_norm = weight[:3584]
    out = _poisoned(torch.empty(rows, 3584, dtype=torch.bfloat16, device="cuda"))
    got = norm_triton.rms_norm(routed, latent_norm, 1e-6, out_dtype=torch.bfloat16, out=out)
    _close(got, norm_ref.rms_norm(routed, latent_norm, 1e-6).bfloat16(), "rms_norm fp32 -> bf16", roundings=1)
    current = (torch.randn(rows, d, device="cuda", generator=gen) * 3).bfloat16()
    for num_checkpoints in (1, 4, 9):
        ckpts = (torch.randn(num_checkpoints, rows, d, device="cuda", generator=gen) * 2).bfloat16()
        mix_norm, mix_proj, out_norm = ((torch.rand(d, device="cuda", generator=gen) + 0.5).bfloat16() for _ in range(3))
        mix_proj = (mix_proj / d**0.5).bfloat16()  # scores of order 1: every candidate weighs in, none takes all
        out = _poisoned(current)
        got = norm_triton.attn_res_mix_norm(current, ckpts, mix_norm, mix_proj, out_norm, 1e-6, out=out)
        want = norm_ref.attn_res_mix_norm(current, ckpts, mix_norm, mix_proj, out_norm, 1e-6)
        _close(got, want, f"attn_res_mix_norm, {num_checkpoints} checkpoints, tiles {tiles}", roundings=3)
        delta = (torch.randn(rows, d, device="cuda", generator=gen) * 3).bfloat16()
        out, total = _poisoned(current), _poisoned(current)
        got, got_total = norm_triton.add_attn_res_mix_norm(current, delta, ckpts, mix_norm, mix_proj, out_norm, 1e-6,
                                                           out=out, total=total)
        want, want_total = norm_ref.add_attn_res_mix_norm(current, delta, ckpts, mix_norm, mix_proj, out_norm, 1e-6)
        assert torch.equal(got_total, want_total), "add_attn_res_mix_norm: the sum differs from torch's bf16 add"
        _close(got, want, f"add_attn_res_mix_norm, {num_checkpoints} checkpoints, tiles {tiles}", roundings=3)
        assert registry.select("add_attn_res_mix_norm", current, delta, ckpts, mix_norm, mix_proj,
                               out_norm).name == "triton"


@pytest.mark.parametrize("parts", [1, 2, 5])
def test_mix_norm_adds_split_k_partials_as_the_reduction_kernel_would(gen, parts):
    """delta as a GEMM's fp32 split-K partials (ops.linear_partials): the sum and the norm equal, bit for
    bit, the same launch given the partials already summed and rounded (what the GEMM's reduction
    kernel writes), and the float64 reference to the mix's bound."""
    rows, d = 4, 7168
    current = (torch.randn(rows, d, device="cuda", generator=gen) * 3).bfloat16()
    ckpts = (torch.randn(3, rows, d, device="cuda", generator=gen) * 2).bfloat16()
    weights = [(torch.rand(d, device="cuda", generator=gen) + 0.5).bfloat16() for _ in range(3)]
    weights[1] = (weights[1] / d**0.5).bfloat16()  # the pseudo-query: scores of order 1
    partials = torch.randn(parts, rows, d, device="cuda", generator=gen) * 2
    assert registry.select("add_attn_res_mix_norm", current, partials, ckpts, *weights).name == "triton"
    out, total = _poisoned(current), _poisoned(current)
    got, got_total = norm_triton.add_attn_res_mix_norm(current, partials, ckpts, *weights, 1e-6, out=out, total=total)
    summed = sum_partials(partials, torch.bfloat16)
    want, want_total = norm_triton.add_attn_res_mix_norm(current, summed, ckpts, *weights, 1e-6)
    assert torch.equal(got_total, want_total) and torch.equal(got, want)
    exact, exact_total = norm_ref.add_attn_res_mix_norm(current, partials, ckpts, *weights, 1e-6)
    assert torch.equal(got_total, exact_total)
    _close(got, exact, f"add_attn_res_mix_norm of {parts} partials", roundings=3)


def test_situ_glu_and_sigmoid_gate_match_references(gen):
    rows, n = 8, 18432
    fused = (torch.randn(rows, 2 * n, device="cuda", generator=gen) * 3).bfloat16()
    gate, up = fused.split(n, dim=-1)  # strided column slices, as from the fused gate|up GEMM
    out = _poisoned(torch.empty(rows, n, dtype=torch.bfloat16, device="cuda"))
    _close(act_triton.situ_glu(gate, up, 3.0, 5.0, out=out), act_ref.situ_glu(gate, up, 3.0, 5.0), "situ_glu")
    x = (torch.randn(rows, n, device="cuda", generator=gen)).bfloat16()
    out = _poisoned(x)
    _close(act_triton.sigmoid_gate(x, gate, out=out), act_ref.sigmoid_gate(x, gate), "sigmoid_gate")


def test_weighted_combine_matches_float64():
    """kernels/moe/triton.py:weighted_combine at K3's latent width and a verify step's 8 tokens x
    top-16, by the interpreter's float64 check (tolerance 1e-4, tests/triton_interpret_checks.py)."""
    from triton_interpret_checks import check_combine

    check_combine(torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()))), "cuda", tokens=8, width=3584)


def test_router_selection_matches_float64():
    """kernels/moe/triton.py on the GPU, by the interpreter's float64 checks (tolerance 1e-5,
    tests/triton_interpret_checks.py) and against the reference at K3's router shape (bf16 tokens
    and weight: the bf16 GEMM with fp32 output), for a decode, a verify and a prefill's rows; the
    default on CUDA."""
    from triton_interpret_checks import check_route, check_selection

    check_route(torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()))), "cuda")
    for rows in (1, 8, 100):
        x = torch.randn(rows, 7168, device="cuda").bfloat16()
        gate = (torch.randn(896, 7168, device="cuda") / 7168**0.5).bfloat16()  # logits ~ N(0, 1)
        bias = torch.randn(896, device="cuda") * 0.1
        impl = registry.select("moe_route", x, gate, bias)
        assert impl.name == "triton"
        ids, weights = impl.fn(x, gate, bias, 16, 2.5)
        check_selection(ids.cpu(), weights.cpu(), x.cpu().double() @ gate.cpu().double().T, bias.cpu(), 16,
                        f"moe_route at K3's shape, {rows} rows")
        want_ids, want_weights = registry.implementations("moe_route")["reference"].fn(x, gate, bias, 16, 2.5)
        assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)  # the same experts (random logits: no near tie)
        order = ids.argsort(-1)
        torch.testing.assert_close(weights.gather(-1, order), want_weights.gather(-1, want_ids.argsort(-1)),
                                   rtol=1e-5, atol=0)


def test_router_logits_in_one_launch_match_float64_and_select_the_same_experts(monkeypatch):
    """router_logits_gemv (kernels/moe/triton.py, moe_router_logits at 1-4 rows under GEMV_MAX_ROWS) on
    the GPU: the interpreter's float64 checks, then bf16 tokens and weight at a TP16/EP16 rank's 56 router
    rows and at the full 896 against float64 (tolerance 1e-4: float32 sums of 7,168 exact products of
    O(1) logits), output poisoned; through the dispatch with the switch on, the same experts as
    cuBLAS's logits (random logits: no near tie)."""
    from triton_interpret_checks import check_router_logits_gemv

    check_router_logits_gemv(torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()))), "cuda")
    for experts in (56, 896):
        gate = (torch.randn(experts, 7168, device="cuda") / 7168**0.5).bfloat16()
        bias = torch.randn(experts, device="cuda") * 0.1
        for rows in range(1, moe_triton.GEMV_MAX_ROWS_BUILT + 1):
            x = torch.randn(rows, 7168, device="cuda").bfloat16()
            out = torch.full((rows, experts), float("nan"), device="cuda")
            moe_triton.router_logits_gemv(x, gate, out=out)
            want = x.double() @ gate.double().T
            assert (out.double() - want).abs().max().item() < 1e-4, (experts, rows)
            monkeypatch.setattr(moe_triton, "GEMV_MAX_ROWS", 0)
            cublas = moe_triton.router_logits(x, gate)
            monkeypatch.setattr(moe_triton, "GEMV_MAX_ROWS", moe_triton.GEMV_MAX_ROWS_BUILT)
            gemv = moe_triton.router_logits(x, gate)
            assert torch.equal(gemv, moe_triton.router_logits_gemv(x, gate))  # the dispatch took the one launch
            top_k = min(16, experts // 2)
            assert torch.equal(moe_triton.route_logits(gemv, bias, top_k, 2.5)[0].sort(-1).values,
                               moe_triton.route_logits(cublas, bias, top_k, 2.5)[0].sort(-1).values), (experts, rows)


def test_gather_tokens_equals_the_torch_composition():
    """kernels/moe/triton.py:gather_tokens (the expert kernels' B operand in one launch) in bf16
    at K3's latent width, both K orders: equal to permute_k + scale + gather
    (tests/triton_interpret_checks.py:check_gather_tokens)."""
    from triton_interpret_checks import check_gather_tokens

    check_gather_tokens(torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()))), "cuda", torch.bfloat16,
                        width=3584)


def test_lists_and_tokens_equal_the_torch_lists_and_operand():
    """kernels/moe/triton.py:lists_and_tokens in bf16 at K3's latent width, up to 256 pairs (16 tokens x 16
    experts): the lists equal build_expert_lists' and the operand the torch composition's
    (tests/triton_interpret_checks.py:check_lists_and_tokens)."""
    from triton_interpret_checks import LISTS_CASES_GPU, check_lists_and_tokens

    check_lists_and_tokens(torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()))), "cuda", torch.bfloat16,
                           width=3584, cases=LISTS_CASES_GPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_inputs_add_split_and_gather_the_partials(dtype):
    """kernels/moe/triton.py:moe_dispatch_inputs on the GPU: the interpreter's cases, then a TP16 rank's
    router | latent-down GEMM (56 + 224 columns, its CuTe partials at one and eight rows, 16 copies).
    The latent in bf16 equals the partials' fp32 sum rounded once (sum_partials), which is the GEMM's own
    reduction: bit for bit; the logits equal the fp32 sum (tests/triton_interpret_checks.py)."""
    from triton_interpret_checks import check_dispatch_inputs

    from dspark.kernels import ops
    from dspark.kernels.numerics import sum_partials

    check_dispatch_inputs(torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()))), "cuda", dtype)
    weight = (torch.randn(280, 7168, device="cuda") / 7168**0.5).bfloat16()
    for rows in (1, 8):
        partials = ops.linear_partials(torch.randn(rows, 7168, device="cuda").bfloat16(), weight)
        assert partials.dtype == torch.float32 and partials.shape[0] > 1
        logits, latent = moe_triton.moe_dispatch_inputs(partials, 56, dtype, 16)
        assert torch.equal(logits, sum_partials(partials, torch.float32)[:, :56].repeat(1, 16))
        assert torch.equal(latent, sum_partials(partials, dtype)[:, 56:].repeat(1, 16))


def test_the_ranks_inputs_gemm_feeds_the_dispatch_and_tail_kernels_through_column_windows():
    """INPUTS_IN_ONE_GEMM (dspark/targets/kimi_k3/moe.py): a TP16 rank's one GEMM over the MoE input
    (56 router + 224 latent + 768 shared gate|up rows), its CuTe partials split into column windows
    without a copy; the dispatch kernel's outputs bit for bit what it gives on a contiguous copy of its
    window, and the tail kernel's likewise, at one and eight rows."""
    from dspark.kernels import ops

    weight = (torch.randn(1048, 7168, device="cuda") / 7168**0.5).bfloat16()
    routed = torch.randn(8, 3584, device="cuda") * 3
    norm = (torch.rand(3584, device="cuda") + 0.5).bfloat16()
    for rows in (1, 8):
        partials = ops.linear_partials(torch.randn(rows, 7168, device="cuda").bfloat16(), weight)
        dispatch, gate_up = partials.split([280, 768], dim=-1)
        assert dispatch.data_ptr() == partials.data_ptr() and gate_up.stride(1) == 1048  # windows, not copies
        got = moe_triton.moe_dispatch_inputs(dispatch, 56, torch.bfloat16, 16)
        want = moe_triton.moe_dispatch_inputs(dispatch.contiguous(), 56, torch.bfloat16, 16)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        tail = moe_triton.moe_tail_inputs(routed[:rows], norm, gate_up, 3 * 224, 224, 1e-6, 3.0, 5.0)
        assert torch.equal(tail, moe_triton.moe_tail_inputs(routed[:rows], norm, gate_up.contiguous(), 3 * 224, 224,
                                                            1e-6, 3.0, 5.0))


@pytest.mark.parametrize("dtype, base_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_markov_greedy_draft_takes_the_argmax_chain(dtype, base_dtype):
    """kernels/markov/triton.py at the tests' small shapes, at a TP16 rank's vocabulary and at K3's
    (B, G, V, r), fp32 and bf16 weights, the base logits in float32 or as the LM head's bf16 product,
    against the float64 argmax chain (tests/triton_interpret_checks.py:check_markov); the default on CUDA."""
    from triton_interpret_checks import check_markov

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    check_markov(gen, "cuda", dtype, cases=((3, 7, 1000, 48), (2, 7, 10240, 256), (1, 7, 163840, 256)),
                 base_dtype=base_dtype)
    base = torch.randn(1, 7, 300, device="cuda", dtype=base_dtype)
    w = torch.randn(300, 16, device="cuda", dtype=dtype)
    assert registry.select("markov_greedy_draft", base, torch.zeros(1, dtype=torch.long, device="cuda"), w, w).name \
        == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_confidence_matches_float64_and_the_models_torch_ops(dtype):
    """kernels/markov/triton.py's draft_confidence against float64 (tests/triton_interpret_checks.py:
    check_draft_confidence: with and without W1, bias and temperatures, d 64, 100, 7168 and 9000; a bf16
    logit within half a bf16 ulp of float64's, plus 1e-4), then at K3's drafter (G 7, d 7168, r 256,
    K3's vocabulary of W1 rows) against the reference on the GPU, the model's own torch ops (cuBLAS's
    product). Tolerance: the kernel's fp32 sums run in another order than cuBLAS's, each rounded once
    to hidden's dtype, so a bf16 logit is within one bf16 ulp of the reference's (float32: 1e-5
    relative); a probability within that over 4 T_k (sigmoid's slope is at most 1/4) plus 1e-6. cuBLAS
    sums in fp32 here: no TF32, and no bf16 reduction of its split-K partials (torch's default allows
    one, which would round the reference's logit more than once). The default on CUDA."""
    from triton_interpret_checks import check_draft_confidence

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    check_draft_confidence(gen, "cuda", dtype)
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_tf32 = matmul.allow_bf16_reduced_precision_reduction = False
    try:
        _draft_confidence_against_the_reference(gen, dtype)
    finally:
        matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction = saved


def _draft_confidence_against_the_reference(gen: torch.Generator, dtype: torch.dtype) -> None:
    from dspark.kernels.markov import reference as markov_ref
    from dspark.kernels.markov import triton as markov_triton

    B, G, d, r, V = 4, 7, 7168, 256, 163840
    hidden = torch.randn(B, G, d, generator=gen).to("cuda", dtype)
    anchors = torch.randint(0, V, (B,), generator=gen).cuda()
    tokens = torch.randint(0, V, (B, G), generator=gen).cuda()
    w1 = torch.randn(V, r, generator=gen).to("cuda", dtype)
    weight = (torch.randn(d + r, generator=gen) * 3 / (d + r) ** 0.5).to("cuda", dtype)  # logits of std ~3
    bias = torch.randn(1, generator=gen).to("cuda", dtype)
    temps = (torch.rand(G, generator=gen) * 2 + 0.5).cuda()
    for args in ((hidden, anchors, tokens, w1, weight, bias, temps),
                 (hidden, anchors, tokens, None, weight[:d], None, None)):
        want_logits, want_probs = markov_ref.draft_confidence(*args)
        out = (_poisoned(want_logits), _poisoned(want_probs))
        got_logits, got_probs = markov_triton.draft_confidence(*args, out=out)
        assert torch.isfinite(got_logits).all() and torch.isfinite(got_probs).all(), "unwritten (NaN) output"
        apart = (got_logits - want_logits).abs()
        if dtype == torch.bfloat16:
            bound = _bf16_ulp(torch.maximum(got_logits.abs(), want_logits.abs()))
        else:
            bound = 1e-5 * want_logits.abs() + 1e-5
        assert (apart <= bound).all(), f"logits: {apart.max().item():.3e} apart ({(apart / bound).max().item():.2f}x)"
        prob_bound = bound / (4 * (temps if args[-1] is not None else 1.0)) + 1e-6
        apart = (got_probs - want_probs).abs()
        assert (apart <= prob_bound).all(), f"probs: {apart.max().item():.3e} apart"
        assert registry.select("draft_confidence", *args).name == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_float64(dtype):
    """kernels/rotary/triton.py, both pair layouts, strided query rows and one key head, against
    float64 (tests/triton_interpret_checks.py:check_rotary); the default on CUDA."""
    from triton_interpret_checks import check_rotary

    check_rotary(torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()))), "cuda", dtype)
    x = torch.randn(1, 1, 7, 4, 64, device="cuda", dtype=dtype)
    table = torch.randn(1, 1, 7, 1, 32, device="cuda")
    assert registry.select("rotary", x, table, table).name == "triton"


@pytest.mark.parametrize("shape", [(1, 1, 7, 448), (1, 1, 7, 7168), (4, 1, 7, 7168)])
def test_the_drafters_add_rms_norm_and_silu_mul_match_their_torch_ops(gen, shape):
    """The drafting pass's fused glue (drafters/dspark/model.py) in bf16 at the K3 drafter's widths, a
    rank's share and the full one: the sum bit for bit a torch add, the norm within the chain's one
    rounding of torch's RMSNorm (F.rms_norm, what the unfused pass runs) and of the float64 reference,
    silu * up within its two roundings of torch's two ops (Triton's exp is not CUDA's expf)."""
    import torch.nn.functional as F

    residual, delta = ((torch.randn(*shape, device="cuda", generator=gen) * 2).bfloat16() for _ in range(2))
    weight = (torch.rand(shape[-1], device="cuda", generator=gen) + 0.5).bfloat16()
    out, total = norm_triton.add_rms_norm(residual, delta, weight, 1e-6, out=_poisoned(residual),
                                          total=_poisoned(residual))
    assert torch.equal(total, residual + delta)
    # both round one fp32 value once: at most one ulp apart wherever their fp32 sums differ in order
    torch_norm = F.rms_norm(residual + delta, weight.shape, weight, 1e-6)
    apart = (out.float() - torch_norm.float()).abs()
    assert torch.isfinite(out).all() and (apart <= _bf16_ulp(torch_norm) + 1e-3).all(), \
        f"add_rms_norm against F.rms_norm: {apart.max().item():.3e} apart"
    # the op normalises the bf16 sum it returns, so float64 starts from that sum, not from the exact one
    total_f64 = total.double()
    want = (total_f64 * torch.rsqrt(total_f64.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * weight.double()).bfloat16()
    _close(out, want, "add_rms_norm against float64", roundings=1)
    assert registry.select("add_rms_norm", residual, delta, weight).name == "triton"
    gate, up = (torch.randn(*shape[:-1], 3 * shape[-1], device="cuda", generator=gen).bfloat16() for _ in range(2))
    got = act_triton.silu_mul(gate, up, out=_poisoned(gate))
    torch_act = F.silu(gate) * up  # two roundings each: at most an ulp apart at each
    apart = (got.float() - torch_act.float()).abs()
    assert torch.isfinite(got).all() and (apart <= 2 * _bf16_ulp(torch_act) + 1e-3).all(), \
        f"silu_mul against torch's two ops: {apart.max().item():.3e} apart"
    _close(got, act_ref.silu_mul(gate.double(), up.double()), "silu_mul against float64")
    assert registry.select("silu_mul", gate, up).name == "triton"


@pytest.mark.parametrize("parts, rows, width", [(14, 7, 2304), (4, 28, 36864)])
def test_silu_mul_of_split_k_partials_matches_the_reduced_gemm(gen, parts, rows, width):
    """silu_mul of a gate | up GEMM's fp32 split-K partials in bf16 at a TP16 share's and the full
    drafter's widths: the sums bit for bit sum_partials (the reduction's rounding), then within silu's
    two roundings of torch's ops on those sums."""
    import torch.nn.functional as F

    partials = torch.randn(parts, rows, 2 * width, device="cuda", generator=gen)
    gate, up = partials.chunk(2, dim=-1)
    got = act_triton.silu_mul(gate, up, torch.bfloat16, out=_poisoned(torch.empty(rows, width, device="cuda",
                                                                                  dtype=torch.bfloat16)))
    torch_act = F.silu(sum_partials(gate, torch.bfloat16)) * sum_partials(up, torch.bfloat16)
    apart = (got.float() - torch_act.float()).abs()
    assert torch.isfinite(got).all() and (apart <= 2 * _bf16_ulp(torch_act) + 1e-3).all(), \
        f"silu_mul of partials against the reduced GEMM's torch ops: {apart.max().item():.3e} apart"
    assert registry.select("silu_mul", gate, up, torch.bfloat16).name == "triton"


@pytest.mark.parametrize("rows,inner", [(7, 512), (7, 1152), (14, 4096)])
def test_the_drafters_add_rms_norm_adds_a_gemms_partials_as_its_reduction_would(gen, rows, inner):
    """The drafting pass's o_proj and down GEMMs left as their split-K partials (ops.linear_partials) and
    added in the norm after them (drafters/dspark/model.py): the sum bit for bit the residual plus the
    GEMM's own reduced output (ops.linear), the norm bit for bit the kernel's on that delta; at a TP16
    share's and the full drafter's inner widths, over 7 rows (a block) and 14 (two), both the Hopper
    GEMM's (at most HOPPER_MAX_TOKENS rows)."""
    from dspark.kernels import ops

    x = (torch.randn(rows, inner, device="cuda", generator=gen) * 0.5).bfloat16()
    w = (torch.randn(7168, inner, device="cuda", generator=gen) / inner**0.5).bfloat16()
    residual = (torch.randn(1, rows // 7, 7, 7168, device="cuda", generator=gen) * 2).bfloat16()
    weight = (torch.rand(7168, device="cuda", generator=gen) + 0.5).bfloat16()
    partials = ops.linear_partials(x, w)
    assert partials.dtype == torch.float32 and partials.shape[1:] == (rows, 7168)
    out, total = norm_triton.add_rms_norm(residual, partials.view(partials.shape[0], *residual.shape), weight, 1e-6,
                                          out=_poisoned(residual), total=_poisoned(residual))
    delta = ops.linear(x, w).view(residual.shape)
    assert torch.equal(total, residual + delta)
    want_out, want_total = norm_triton.add_rms_norm(residual, delta, weight, 1e-6)
    assert torch.equal(total, want_total) and torch.equal(out, want_out)
    assert registry.select("add_rms_norm", residual, partials.view(partials.shape[0], *residual.shape),
                           weight).name == "triton"


@pytest.mark.parametrize("width", [1536, 7168])
def test_the_drafters_norm_reads_strided_rows_in_place(gen, width):
    """ops.rms_norm_scaled_in_fp32 on a column slice of a paired GEMM's output (the drafter's q_a norm:
    q_a | kv_a as one GEMM): one launch reading the rows where they are, within one bf16 ulp of torch's
    RMSNorm (F.rms_norm, which copies the rows to a contiguous tensor first) and of float64."""
    import torch.nn.functional as F

    from dspark.kernels import ops

    x = (torch.randn(7, width + 576, device="cuda", generator=gen) * 2).bfloat16()[:, :width]
    weight = (torch.rand(width, device="cuda", generator=gen) + 0.5).bfloat16()
    assert registry.select("rms_norm_scaled_in_fp32", x, weight).name == "triton"
    out = norm_triton.rms_norm_scaled_in_fp32(x, weight, 1e-6, out=_poisoned(x.contiguous()))
    torch_norm = F.rms_norm(x, weight.shape, weight, 1e-6)
    apart = (out.float() - torch_norm.float()).abs()
    assert torch.isfinite(out).all() and (apart <= _bf16_ulp(torch_norm) + 1e-3).all(), \
        f"against F.rms_norm: {apart.max().item():.3e} apart"
    # float64 rounded once to bf16: the best bf16 answer, which the kernel's fp32 chain may miss by one
    # rounding (against the unrounded float64 the output's own rounding alone averages ~1e-3 at |v| ~ 1).
    exact = norm_ref.rms_norm_scaled_in_fp32(x.double(), weight.double(), 1e-6).bfloat16()
    _close(out, exact, "against float64 rounded to bf16", roundings=1)
    assert torch.equal(ops.rms_norm_scaled_in_fp32(x, weight, 1e-6), out)
