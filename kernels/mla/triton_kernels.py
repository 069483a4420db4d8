"""Triton kernels of the MLA layer's glue: the cache write and the absorptions (imported on first use)."""
import triton
import triton.language as tl

from ..triton_partials import split_k_sum
from ..triton_pdl import prologue


@triton.jit
def summed(ptr, offs, keep, stride_s, PARTS: tl.constexpr, ROUND: tl.constexpr):
    """split_k_sum, rounded to ROUND where there are PARTS > 1 partials, as the GEMM's reduction would
    have stored them."""
    x = split_k_sum(ptr, offs, keep, stride_s, PARTS)
    if PARTS > 1:
        x = x.to(ROUND).to(tl.float32)
    return x


@triton.jit
def rotate_pairs(src, dst, cos, sin, pairs, keep, P, ROUND: tl.constexpr, INTERLEAVED: tl.constexpr,
                 stride_s=0, PARTS: tl.constexpr = 1):
    """The rope columns at src (pointers to each row's first one; PARTS > 1: split-K partials, summed())
    rotated into dst as the rotary op rotates them: pair i of a row, (2i, 2i + 1) INTERLEAVED or else
    (i, i + P/2), by its row's cos[i] / sin[i] (cos, sin: pointers to each row's tables), in fp32, rounded
    to ROUND, stored in dst's dtype. pairs and keep: the pair indices and their mask, broadcast against
    the row pointers."""
    if INTERLEAVED:
        first, second = 2 * pairs, 2 * pairs + 1
    else:
        first, second = pairs, pairs + P // 2
    a = summed(src, first, keep, stride_s, PARTS, ROUND)
    b = summed(src, second, keep, stride_s, PARTS, ROUND)
    c = tl.load(cos + pairs, mask=keep, other=0.0)
    s = tl.load(sin + pairs, mask=keep, other=0.0)
    out = dst.dtype.element_ty
    tl.store(dst + first, (a * c - b * s).to(ROUND).to(out), mask=keep)
    tl.store(dst + second, (a * s + b * c).to(ROUND).to(out), mask=keep)


@triton.jit
def cache_rows_kernel(kv_ptr, stride_kv, w_ptr, cache_ptr, stride_slot, stride_row, slots_ptr, cache_lens_ptr,
                      lengths_ptr, cos_ptr, sin_ptr, stride_rope, q_ptr, stride_q, q_w_ptr, q_out_ptr, T, R, P, Q,
                      spare, eps, stride_kv_s, stride_q_s, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_Q: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, Q_NORM: tl.constexpr,
                      PARTS: tl.constexpr, PDL: tl.constexpr):
    """One program per token (b, j): RMSNorm of its c_kv (rms_norm_kernel's rounding: the
    normalised row and the weighted one each rounded to kv's dtype) and its k_pe, raw or (ROPE)
    rotated by its row of the cos / sin tables (the rotary op's pairs: (2i, 2i + 1) INTERLEAVED, else
    (i, i + P/2); fp32, rounded to kv's dtype), stored at row cache_lens[b] + j of slot slots[b], or
    at the spare row for a padding token. Q_NORM: the token's row of the query's c_q too (q_ptr, rows
    stride_q apart), RMSNorm'd by q_w as rms_norm_kernel does K3's norm (rounded to c_q's dtype twice)
    into the contiguous q_out, a padding token's row as well (the caller reads every row). PARTS > 1: kv
    and c_q are a GEMM's split-K partials (stride_kv_s / stride_q_s apart), summed in split order in fp32
    and rounded to the cache's / q_out's dtype (as the GEMM's reduction would have) before all of that."""
    prologue(PDL)
    token = tl.program_id(0)
    if Q_NORM:  # first: its loads do not wait on the cache row's position
        q_dtype = q_out_ptr.dtype.element_ty if PARTS > 1 else q_ptr.dtype.element_ty
        q_offs = tl.arange(0, BLOCK_Q)
        q_inside = q_offs < Q
        xq = summed(q_ptr + token * stride_q, q_offs, q_inside, stride_q_s, PARTS, q_dtype)
        yq = (xq * tl.rsqrt(tl.sum(xq * xq, axis=0) / Q + eps)).to(q_dtype).to(tl.float32)
        wq = tl.load(q_w_ptr + q_offs, mask=q_inside, other=0.0).to(q_dtype).to(tl.float32)
        tl.store(q_out_ptr + token * Q + q_offs, (wq * yq).to(q_dtype).to(q_out_ptr.dtype.element_ty), mask=q_inside)
    b = token // T
    j = token % T
    dtype = cache_ptr.dtype.element_ty if PARTS > 1 else kv_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + b).to(tl.int64)
    position = tl.where(j < tl.load(lengths_ptr + b), tl.load(cache_lens_ptr + b) + j, spare).to(tl.int64)
    row = cache_ptr + slot * stride_slot + position * stride_row
    offs = tl.arange(0, BLOCK_R)
    inside = offs < R
    x = summed(kv_ptr + token * stride_kv, offs, inside, stride_kv_s, PARTS, dtype)
    y = (x * tl.rsqrt(tl.sum(x * x, axis=0) / R + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(dtype).to(tl.float32)
    tl.store(row + offs, (w * y).to(dtype).to(cache_ptr.dtype.element_ty), mask=inside)
    if ROPE:
        pairs = tl.arange(0, BLOCK_P // 2)
        rotate_pairs(kv_ptr + token * stride_kv + R, row + R, cos_ptr + token * stride_rope,
                     sin_ptr + token * stride_rope, pairs, pairs < P // 2, P, dtype, INTERLEAVED, stride_kv_s, PARTS)
    else:
        pe = tl.arange(0, BLOCK_P)
        pe_inside = pe < P
        if PARTS > 1:
            k_pe = summed(kv_ptr + token * stride_kv + R, pe, pe_inside, stride_kv_s, PARTS, dtype)
        else:
            k_pe = tl.load(kv_ptr + token * stride_kv + R + pe, mask=pe_inside, other=0.0)
        tl.store(row + R + pe, k_pe.to(cache_ptr.dtype.element_ty), mask=pe_inside)


@triton.jit
def absorb_kernel(x_ptr, stride_xm, stride_xh, w_ptr, stride_wh, stride_wn, out_ptr, stride_om, stride_oh, gate_ptr,
                  stride_gm, pe_ptr, stride_pm, stride_ph, cos_ptr, sin_ptr, stride_rope, M, N, K, P, stride_gs,
                  HAS_GATE: tl.constexpr, COPY_PE: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, GATE_PARTS: tl.constexpr,
                  PDL: tl.constexpr):
    """Program (h, nb): out[:, h, nb-th 64 columns] = x[:, h, :K] . w[h, those rows, :]^T over all M
    rows (fp32 accumulation, rounded to out's dtype, as a GEMM does); with HAS_GATE the result
    times sigmoid(gate) in fp32, rounded again (sigmoid_gate_kernel's arithmetic; GATE_PARTS > 1: the gate
    as its GEMM's split-K partials, stride_gs apart, summed() and rounded to out's dtype first); with COPY_PE
    program (h, 0) also copies x[:, h, K:K + P] to pe[:, h, :], rotated with ROPE by each row's cos /
    sin tables as cache_rows_kernel rotates k_pe."""
    prologue(PDL)
    h = tl.program_id(0)
    nb = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows[:, None] < M
    col_in = cols[:, None] < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = ks[None, :] < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + h * stride_xh + ks[None, :], mask=row_in & k_in, other=0.0)
        w = tl.load(w_ptr + h * stride_wh + cols[:, None] * stride_wn + ks[None, :], mask=col_in & k_in, other=0.0)
        acc += tl.dot(x, tl.trans(w))
    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype)
    keep = row_in & (cols[None, :] < N)
    if HAS_GATE:
        g = summed(gate_ptr + rows[:, None] * stride_gm + h * N, cols[None, :], keep, stride_gs, GATE_PARTS, dtype)
        y = (y.to(tl.float32) * tl.sigmoid(g.to(dtype).to(tl.float32))).to(dtype)
    tl.store(out_ptr + rows[:, None] * stride_om + h * stride_oh + cols[None, :], y, mask=keep)
    if COPY_PE:
        if nb == 0:
            source = x_ptr + rows[:, None] * stride_xm + h * stride_xh + K
            target = pe_ptr + rows[:, None] * stride_pm + h * stride_ph
            if ROPE:
                pairs = tl.arange(0, BLOCK_P // 2)[None, :]
                rotate_pairs(source, target, cos_ptr + rows[:, None] * stride_rope, sin_ptr + rows[:, None] * stride_rope,
                             pairs, row_in & (pairs < P // 2), P, dtype, INTERLEAVED)
            else:
                ps = tl.arange(0, BLOCK_P)
                pe_keep = row_in & (ps[None, :] < P)
                tl.store(target + ps[None, :], tl.load(source + ps[None, :], mask=pe_keep, other=0.0), mask=pe_keep)
