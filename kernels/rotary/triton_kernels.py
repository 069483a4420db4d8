"""Triton kernel of rotary (kernels/rotary/triton.py says why and how)."""
import triton
import triton.language as tl

from ..triton_pdl import prologue


@triton.jit
def rotary_kernel(x_ptr, stride_xn, stride_xh, cos_ptr, sin_ptr, out_ptr, H, HALF,
                  INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    """Position pid 0, all its heads: each pair (a, b) to (a cos - b sin, a sin + b cos) in
    float32, stored in the output's dtype (out is contiguous [N, H, 2 * HALF])."""
    prologue(PDL)
    n = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)[:, None]
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    inside = (heads < H) & (pairs < HALF)
    if INTERLEAVED:
        first_at, second_at = 2 * pairs, 2 * pairs + 1
    else:
        first_at, second_at = pairs, pairs + HALF
    row = x_ptr + n * stride_xn + heads * stride_xh
    a = tl.load(row + first_at, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(row + second_at, mask=inside, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + n * HALF + pairs, mask=pairs < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + n * HALF + pairs, mask=pairs < HALF, other=0.0).to(tl.float32)
    out = out_ptr + (n * H + heads) * (2 * HALF)
    dtype = out_ptr.dtype.element_ty
    tl.store(out + first_at, (a * cos - b * sin).to(dtype), mask=inside)
    tl.store(out + second_at, (a * sin + b * cos).to(dtype), mask=inside)
