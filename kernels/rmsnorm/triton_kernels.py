"""Triton kernels of the K3 norms (imported on first use: importing triton is slow and CI's
CPU machines may not have it). One program per row; the whole row sits in registers (K3's
hidden size 7168 -> a block of 8192), so every statistic is one in-register reduction.
rsqrt(sum(x^2) / d + eps) is written out where used: Triton's CPU interpreter, which CI runs
these kernels under, cannot call tl.sum inside a nested @triton.jit helper."""
import triton
import triton.language as tl

from ..triton_partials import split_k_sum
from ..triton_pdl import prologue


@triton.jit
def rms_norm_kernel(x_ptr, stride_x, w_ptr, out_ptr, stride_o, d, eps, BLOCK: tl.constexpr,
                    SCALE_IN_FP32: tl.constexpr, PDL: tl.constexpr):
    prologue(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < d
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    if SCALE_IN_FP32:  # torch's RMSNorm (rms_norm_scaled_in_fp32): one rounding, after the scale
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, axis=0) / d + eps) * w
        tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # K3's: the reference rounds twice in x's dtype (the normalised row, then weight * row); the
        # store casts to the output's dtype (the same unless rms_norm's out_dtype asks for another)
        y = (x * tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (w * y).to(dtype).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_rms_norm_kernel(res_ptr, stride_r, delta_ptr, stride_dp, stride_dm, w_ptr, out_ptr, stride_o, total_ptr,
                        stride_t, d, eps, DELTA_PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """total = residual + delta rounded to their dtype (a torch add, bit for bit), stored; then the
    drafter's RMSNorm of it: statistics and scale in fp32, one rounding (add_rms_norm's reference).
    delta is DELTA_PARTS split-K partials (one: delta itself), added here in split order in fp32 and
    rounded to the residual's dtype as the GEMM's reduction kernel would have (ops.linear_partials)."""
    prologue(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < d
    dtype = total_ptr.dtype.element_ty
    delta = split_k_sum(delta_ptr + row * stride_dm, offs, mask, stride_dp, DELTA_PARTS)
    x = (tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
         + delta.to(dtype).to(tl.float32)).to(dtype)
    tl.store(total_ptr + row * stride_t + offs, x, mask=mask)
    x = x.to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / d + eps) * w
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_pair(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def attn_res_mix_norm_kernel(ckpt_ptr, stride_cc, stride_cm, cur_ptr, stride_m, delta_ptr, stride_dp, stride_dm,
                             total_ptr, stride_t, mix_norm_ptr, mix_proj_ptr, out_norm_ptr, out_ptr, stride_o, d, eps,
                             NUM_CKPT: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr,
                             HAS_DELTA: tl.constexpr, DELTA_PARTS: tl.constexpr, PDL: tl.constexpr):
    """AttnRes mix over {current, checkpoints[0..NUM_CKPT)} followed by RMSNorm, per row, in one pass
    over the candidates: each candidate's score takes one reduction (its dot with the pseudo-query and
    its sum of squares together) and folds into an online softmax, the running weighted sum and total
    rescaled when the largest score grows. Every candidate row is read once, and a row costs
    NUM_CKPT + 2 block-wide reductions (one per candidate, the norm's): at batch 1 one program runs
    the whole step's mix, and its reductions, not its bytes, set its time. The checkpoint count is a
    compile-time constant (a model has a handful: one build each), so the loop unrolls. TILE > 0 scores
    the checkpoints TILE at a time instead: one 2-D load and one reduction round for a tile's scores,
    folded into the softmax together, then the tile read again for the weighted sum (not kept in
    registers: at 16 warps a tile of four and the row's other vectors fill the 128 registers), so a row
    costs ceil(NUM_CKPT / TILE) + 2 reduction rounds (kernels/rmsnorm/triton.py score_tile). HAS_DELTA:
    current is cur + delta, rounded to the output dtype as a torch add would, and also stored to
    total (add_attn_res_mix_norm). DELTA_PARTS > 1: delta comes as a GEMM's split-K partials, added
    here in split order in fp32 and rounded to the output dtype as the GEMM's reduction kernel would
    have (ops.linear_partials), so this launch replaces that kernel bit for bit."""
    prologue(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < d
    dtype = out_ptr.dtype.element_ty
    score_w = (tl.load(mix_norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
               * tl.load(mix_proj_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    current = tl.load(cur_ptr + row * stride_m + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = split_k_sum(delta_ptr + row * stride_dm, offs, mask, stride_dp, DELTA_PARTS)
        current = (current + delta.to(dtype).to(tl.float32)).to(dtype)
        tl.store(total_ptr + row * stride_t + offs, current, mask=mask)
        current = current.to(tl.float32)
    dot, square = tl.reduce((current * score_w, current * current), 0, _sum_pair)
    best = dot * tl.rsqrt(square / d + eps)  # the largest score so far; current's weight is exp(0) = 1
    acc = current
    weights = 1.0
    if TILE == 0:
        for c in tl.static_range(0, NUM_CKPT):
            x = tl.load(ckpt_ptr + c * stride_cc + row * stride_cm + offs, mask=mask, other=0.0).to(tl.float32)
            dot, square = tl.reduce((x * score_w, x * x), 0, _sum_pair)
            score = dot * tl.rsqrt(square / d + eps)
            grown = tl.maximum(best, score)
            scale, weight = tl.exp(best - grown), tl.exp(score - grown)
            acc = acc * scale + weight * x
            weights = weights * scale + weight
            best = grown
    else:
        for first in tl.static_range(0, NUM_CKPT, TILE):
            c = first + tl.arange(0, TILE)
            tile = ckpt_ptr + c[:, None] * stride_cc + row * stride_cm + offs[None, :]
            inside = (c[:, None] < NUM_CKPT) & mask[None, :]
            x = tl.load(tile, mask=inside, other=0.0).to(tl.float32)
            dots, squares = tl.reduce((x * score_w[None, :], x * x), 1, _sum_pair)
            scores = tl.where(c < NUM_CKPT, dots * tl.rsqrt(squares / d + eps), float("-inf"))
            grown = tl.maximum(best, tl.max(scores, axis=0))
            scale, tile_weights = tl.exp(best - grown), tl.exp(scores - grown)  # a padding row's weight: 0
            # the second read carries another cache hint so the compiler cannot merge it with the first
            # and keep the tile in registers (it would spill)
            x = tl.load(tile, mask=inside, other=0.0, eviction_policy="evict_first").to(tl.float32)
            acc = acc * scale + tl.sum(tile_weights[:, None] * x, axis=0)
            weights = weights * scale + tl.sum(tile_weights, axis=0)
            best = grown
    mixed = (acc / weights).to(dtype).to(tl.float32)  # the mix's output is a tensor of current's dtype
    y = (mixed * tl.rsqrt(tl.sum(mixed * mixed, axis=0) / d + eps)).to(dtype).to(tl.float32)
    w = tl.load(out_norm_ptr + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y).to(dtype), mask=mask)
