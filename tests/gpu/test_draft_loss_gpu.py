"""kernels/draft_loss's Triton kernels on the GPU at the SmolLM2 recipe's vocabulary (49,152)
against the float64 reference under autograd: values and gradients, float32 and bf16 logits.

Tolerance: the kernels sum float32 terms over the vocabulary in another order than float64:
ce and l1 within 1e-3 absolute (O(1-10) values); the gradient within 1e-6 absolute plus what a
relative error of 1e-5 in float32's softmax moves it by, for bf16 logits (the gradient is
written in the logits' dtype) plus one bf16 rounding, 2^-8 |ref|; and where the draft and
target probabilities are equal to within float32's error, plus the jump of the derivative of
|p - t| there. The caching allocator is filled with NaN first, so an element the kernels do
not write shows up.

draft_head_loss (the head's GEMM fused in): the bounds are derived from its kernels' float32 and
bf16 arithmetic (tests/triton_interpret_checks.py, head_loss_expected); see its test."""
import pytest
import torch

from dspark.kernels.draft_loss import reference as loss_ref
from dspark.kernels.draft_loss import triton as loss_triton

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_loss_terms_match_float64(dtype):
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    positions, rows, vocab = 1024, 300, 49152
    torch.empty(8 * positions * vocab, device="cuda").fill_(float("nan"))  # freed: the next allocations reuse it
    logits = (torch.randn(positions, vocab, device="cuda", generator=gen) * 3).to(dtype)
    probs = torch.softmax(torch.randn(rows, vocab, device="cuda", generator=gen) * 2, dim=-1)
    which = torch.randint(0, rows, (positions,), device="cuda", generator=gen)
    labels = torch.randint(0, vocab, (positions,), device="cuda", generator=gen)
    up_ce, up_l1 = (torch.randn(positions, device="cuda", generator=gen, dtype=torch.float64) for _ in range(2))

    from triton_interpret_checks import draft_loss_with_gradient

    ce, l1, grad = draft_loss_with_gradient(loss_triton.draft_loss_terms, logits, probs, which, labels, up_ce, up_l1)
    want_ce, want_l1, want_grad = draft_loss_with_gradient(loss_ref.draft_loss_terms, logits.double(), probs.double(),
                                                           which, labels, up_ce, up_l1)
    for got, want, what in ((ce, want_ce, "ce"), (l1, want_l1, "l1")):
        assert torch.isfinite(got).all(), what
        err = (got.double() - want).abs().max().item()
        assert err < 1e-3, f"{what}: max abs error {err:.2e}"
    grad = grad.double()
    assert torch.isfinite(grad).all(), "gradient: unwritten (NaN) or non-finite"
    # float32's p = exp(z - lse) carries a relative error under 1e-5 (lse is a float32 sum over
    # 49,152 terms); the gradient is linear in p with slope at most |up_ce| + 2 |up_l1|.
    p = torch.softmax(logits.double(), dim=-1)
    slope = up_ce.abs()[:, None] + 2 * up_l1.abs()[:, None]
    bound = 1e-6 + 1e-5 * p * slope
    if dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * want_grad.abs()
    # |p - t| has a kink at p = t: where float32's p and float64's may fall on either side, either
    # one-sided derivative is right; they differ by 2 p |up_l1|. (The first H200 run failed on
    # such elements: 3e-6 apart in float32.)
    kink = (p - probs.double()[which]).abs() <= 1e-5 * p
    bound = bound + kink * 2 * p * up_l1.abs()[:, None]
    over = (grad - want_grad).abs() > bound
    assert not over.any(), (f"gradient: {int(over.sum())} elements out of bound, worst error "
                            f"{((grad - want_grad).abs() - bound).max().item():.2e} past it")


@pytest.mark.parametrize("operand_dtype,target_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                        (torch.bfloat16, None)])
def test_draft_head_loss_matches_float64_at_the_recipe_sizes(operand_dtype, target_dtype):
    """ops.draft_head_loss (the Triton implementation, the default on CUDA) at the SmolLM2
    recipe's step: N = 32,768 slots, d = 576, r = 256, V = 49,152, M = 12,288 target rows. The
    upstream gradients are random on 512 random slots and zero elsewhere, so the float64
    reference (on the bf16-rounded operands) is needed for those slots only: their ce, l1 and
    gradient rows, and markov_w2's whole gradient, within head_loss_expected's bounds (derived
    from the kernels' float32 and bf16 arithmetic); every other slot's gradient rows must be
    exactly zero. Every buffer the wrapper allocates starts as NaN, so an unwritten element shows.
    target_dtype None: the DFlash ablation's call, cross-entropy alone at r = 0 (no teacher, no
    Markov columns), against the reference with the L1 term's upstream gradient zero."""
    from triton_interpret_checks import (_PoisonedTorch, check_head_close, head_loss_expected, head_loss_inputs,
                                         head_loss_with_gradients)

    from dspark.kernels import ops, registry
    from dspark.kernels.draft_loss import head_triton

    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    teacher = target_dtype is not None
    N, M, V, d, r, checked = 32768, 12288, 49152, 576, 256 if teacher else 0, 512
    operands, target, rows, labels = head_loss_inputs(gen, N, M, V, d, r, operand_dtype, target_dtype or torch.float32)
    picked = torch.randperm(N, generator=gen, device="cuda")[:checked]
    up_ce, up_l1 = (torch.zeros(N, dtype=torch.float64, device="cuda") for _ in range(2))
    up_ce[picked] = torch.randn(checked, generator=gen, dtype=torch.float64, device="cuda")
    if teacher:
        up_l1[picked] = torch.randn(checked, generator=gen, dtype=torch.float64, device="cuda")
    given = (target, rows) if teacher else (None, None)
    assert registry.select("draft_head_loss", *operands, *given, labels).name == "triton"
    real_torch = head_triton.torch
    head_triton.torch = _PoisonedTorch()
    try:
        got = head_loss_with_gradients(ops.draft_head_loss, operands, *given, labels, up_ce, up_l1)
    finally:
        head_triton.torch = real_torch
    assert (got[1] is None) == (not teacher)
    others = torch.ones(N, dtype=torch.bool, device="cuda")
    others[picked] = False
    for grad, what in ((got[2], "d hidden"), (got[3], "d prev_embedding")):
        assert torch.equal(grad[others], torch.zeros_like(grad[others])), f"seed {seed}: {what} of unweighted slots"
    rounded = tuple(t.to(torch.bfloat16).double() for t in operands)
    sub = (rounded[0][picked], rounded[1][picked], rounded[2], rounded[3])
    want, bounds = head_loss_expected(sub, target[rows[picked]], None, labels[picked], up_ce[picked], up_l1[picked],
                                      vocab_steps=V // 64 + 64)
    got = (got[0][picked], got[1][picked] if teacher else None, got[2][picked], got[3][picked], got[4])
    try:
        check_head_close(got, want, bounds, (operand_dtype,) * 3, f"seed {seed}")
    except SystemExit as failure:  # the shared checks exit with their message (they also run as a script)
        pytest.fail(str(failure))
