"""Triton kernel of the MLA cache write (imported on first use)."""
import triton
import triton.language as tl

from ..triton_pdl import prologue


@triton.jit
def cache_rows_kernel(kv_ptr, stride_kv, w_ptr, cache_ptr, stride_slot, stride_row, slots_ptr, cache_lens_ptr,
                      lengths_ptr, T, R, P, spare, eps, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                      PDL: tl.constexpr):
    """One program per token (b, j): RMSNorm of its c_kv (rms_norm_kernel's rounding: the
    normalised row and the weighted one each rounded to kv's dtype) and its raw k_pe, stored at
    row cache_lens[b] + j of slot slots[b], or at the spare row for a padding token."""
    prologue(PDL)
    token = tl.program_id(0)
    b = token // T
    j = token % T
    dtype = kv_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + b).to(tl.int64)
    position = tl.where(j < tl.load(lengths_ptr + b), tl.load(cache_lens_ptr + b) + j, spare).to(tl.int64)
    row = cache_ptr + slot * stride_slot + position * stride_row
    offs = tl.arange(0, BLOCK_R)
    inside = offs < R
    x = tl.load(kv_ptr + token * stride_kv + offs, mask=inside, other=0.0).to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, axis=0) / R + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(dtype).to(tl.float32)
    tl.store(row + offs, (w * y).to(dtype).to(cache_ptr.dtype.element_ty), mask=inside)
    pe = tl.arange(0, BLOCK_P)
    pe_inside = pe < P
    k_pe = tl.load(kv_ptr + token * stride_kv + R + pe, mask=pe_inside, other=0.0)
    tl.store(row + R + pe, k_pe.to(cache_ptr.dtype.element_ty), mask=pe_inside)
