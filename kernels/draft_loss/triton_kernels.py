"""Triton kernels of draft_loss_terms (contract: reference.py; wrapper and why: triton.py)."""
import triton
import triton.language as tl


@triton.jit
def draft_loss_forward_kernel(logits_ptr, stride_l, probs_ptr, stride_p, rows_ptr, labels_ptr,
                              ce_ptr, l1_ptr, lse_ptr, signed_mass_ptr, V, BLOCK: tl.constexpr):
    """One program per position: an online max and sum over the row for log-sum-exp, then one
    more pass for the L1 distance and sum_v sign(p_v - t_v) p_v, which the backward needs."""
    n = tl.program_id(0).to(tl.int64)  # offsets in int64: a chunk of the recipe is already 0.7G logits
    base = logits_ptr + n * stride_l
    target = probs_ptr + tl.load(rows_ptr + n) * stride_p
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    l1 = tl.zeros([], tl.float32)
    signed_mass = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        p = tl.exp(tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) - lse)
        d = p - tl.load(target + offs, mask=mask, other=0.0).to(tl.float32)
        l1 += tl.sum(tl.abs(d), axis=0)
        signed_mass += tl.sum(tl.where(d > 0, p, tl.where(d < 0, -p, 0.0)), axis=0)
    tl.store(ce_ptr + n, lse - tl.load(base + tl.load(labels_ptr + n)).to(tl.float32))
    tl.store(l1_ptr + n, l1)
    tl.store(lse_ptr + n, lse)
    tl.store(signed_mass_ptr + n, signed_mass)


@triton.jit
def draft_loss_backward_kernel(logits_ptr, stride_l, probs_ptr, stride_p, rows_ptr, labels_ptr, lse_ptr,
                               signed_mass_ptr, grad_ce_ptr, grad_l1_ptr, grad_ptr, stride_g, V,
                               BLOCK: tl.constexpr):
    """d/dz_v of g_ce * ce + g_l1 * l1 = g_ce (p_v - [v = label]) + g_l1 p_v (sign(p_v - t_v) - S),
    S = sum_u sign(p_u - t_u) p_u (sign(0) = 0, as torch's abs backward); one block of a row per program."""
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    z = tl.load(logits_ptr + n * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - tl.load(lse_ptr + n))
    t = tl.load(probs_ptr + tl.load(rows_ptr + n) * stride_p + offs, mask=mask, other=0.0).to(tl.float32)
    d = p - t
    sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    label = tl.load(labels_ptr + n)
    grad = (tl.load(grad_ce_ptr + n) * (p - tl.where(offs == label, 1.0, 0.0))
            + tl.load(grad_l1_ptr + n) * p * (sign - tl.load(signed_mass_ptr + n)))
    tl.store(grad_ptr + n * stride_g + offs, grad.to(grad_ptr.dtype.element_ty), mask=mask)
