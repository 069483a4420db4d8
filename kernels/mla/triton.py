"""The MLA layer's glue in one Triton launch each (contracts: reference.py).

Why: a rank's MLA layer did its cache write in seven launches (the norm of c_kv, a cat, an arange,
a compare, an add, a where and the scatter), each absorption in two (a batched GEMM and the copy of
its head-major result) and the rope part's copy and the output gate in one each, every one a few
microseconds on a handful of rows (docs/kimi-k3.md §8.5):
- mla_cache_rows: one program per token normalises its row, reads its request's slot, length and
  committed length on the device, and stores the row; given the query's c_q, it also normalises the
  token's c_q row (q_a_layernorm), in place of an rms_norm launch of its own;
- mla_absorb_q / mla_absorb_output: one program per (head, 64 output columns) multiplies all the
  rows by its weight tile (tl.dot, fp32 accumulation) and writes the token-major result; the first
  column block of each head also copies q_pe out, or the epilogue applies the sigmoid gate.
  Taken for few heads (a rank's 6): the whole model's 96 keep cuBLAS's batched GEMM until measured.
- linear_heads: the same kernel with neither (the DSpark drafter's ungated W_UV at a rank's share,
  whose reference is cuBLAS's batched GEMM and the copy of its head-major result).
"""
import torch

from ..registry import register
from ..triton_common import MAX_PARTS, kernel_module, pdl_options, triton_available
from .reference import check_absorb_output, check_absorb_q, check_cache_rows, check_reduced, check_rope

MAX_WIDTH = 4096  # R, P and Q (the query's c_q) each live in one program's registers


def _rope_args(rope, rows: int, width: int, unused: torch.Tensor) -> tuple:
    """(cos, sin, row stride) and the constexprs ROPE, INTERLEAVED of a kernel call; without rope the
    pointers are `unused` (never read: the ROPE branch is compiled out)."""
    if rope is None:
        return (unused, unused, 0), {"ROPE": False, "INTERLEAVED": False}
    check_rope(rope, rows, width)
    cos, sin, interleaved = rope
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"rope: cos and sin need the same strides with contiguous rows, got {cos.stride()} and "
                         f"{sin.stride()}")
    return (cos, sin, cos.stride(0)), {"ROPE": True, "INTERLEAVED": interleaved}


def mla_cache_rows(kv, norm_weight, eps: float, cache, slots, cache_lens, lengths, rope=None, *, q=None,
                   dtype: torch.dtype | None = None, q_out: torch.Tensor | None = None) -> torch.Tensor | None:
    """q = (c_q, q_norm_weight): token i's program also normalises row i of c_q (Q_NORM) into q_out, an
    optional contiguous [M, Q] buffer (tests poison it first), returned; without q, None. dtype: kv and
    c_q are split-K partials [S, M, ...] (the reference's contract), summed in the program (PARTS)."""
    check_reduced(kv, q, dtype, cache)
    parts = kv.shape[0] if dtype is not None else 1
    rows = kv[0] if dtype is not None else kv  # one partial's layout: every partial's
    T = check_cache_rows(rows, norm_weight, cache, slots, cache_lens, lengths,
                         None if q is None else (q[0][0] if dtype is not None else q[0], q[1]))
    M, R, P = rows.shape[0], norm_weight.shape[0], rows.shape[1] - norm_weight.shape[0]
    rope_args, rope_flags = _rope_args(rope, M, P, kv)
    if q is None:  # not read: the Q_NORM branch is compiled out
        if q_out is not None:
            raise ValueError(f"q_out: a {q_out.dtype} {tuple(q_out.shape)} buffer given without q")
        q_args, Q, stride_q_s = (kv, 0, norm_weight, kv), 1, 0
    else:
        c_q, q_weight = q
        Q, out_dtype = c_q.shape[-1], dtype or c_q.dtype
        if q_out is None:
            q_out = torch.empty(M, Q, dtype=out_dtype, device=c_q.device)
        elif q_out.shape != (M, Q) or q_out.dtype != out_dtype or not q_out.is_contiguous():
            raise ValueError(f"q_out: expected a contiguous {out_dtype} {(M, Q)} buffer, got "
                             f"{q_out.dtype} {tuple(q_out.shape)} with strides {q_out.stride()}")
        q_args, stride_q_s = (c_q, c_q.stride(-2), q_weight, q_out), (c_q.stride(0) if parts > 1 else 0)
    if M:
        kernel_module(__package__).cache_rows_kernel[(M,)](
            kv, rows.stride(0), norm_weight, cache, cache.stride(0), cache.stride(1), slots, cache_lens, lengths,
            *rope_args, *q_args, T, R, P, Q, cache.shape[1] - 1, float(eps), kv.stride(0) if parts > 1 else 0,
            stride_q_s, BLOCK_R=1 << (R - 1).bit_length(), BLOCK_P=1 << (P - 1).bit_length(),
            BLOCK_Q=1 << (Q - 1).bit_length(), **rope_flags, Q_NORM=q is not None, PARTS=parts, **pdl_options(),
            num_warps=4)
    return q_out


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(kv, norm_weight, cache, slots, cache_lens, lengths, c_q=None, q_weight=None) -> bool:
    """c_q, q_weight: the op's q when given (its shapes are the op's check's: ValueError there). kv (and
    c_q) of three dimensions: split-K partials, fp32, at most MAX_PARTS of them."""
    partials = kv.dim() == 3
    return ((kv.dim() == 2 or (partials and kv.dtype == torch.float32 and kv.shape[0] <= MAX_PARTS))
            and kv.stride(-1) == 1 and cache.dim() == 3 and cache.stride(-1) == 1
            and norm_weight.dim() == 1 and norm_weight.is_contiguous()
            and norm_weight.shape[0] <= MAX_WIDTH and kv.shape[-1] - norm_weight.shape[0] <= MAX_WIDTH
            and kv.dtype in _DTYPES
            and all(t.is_contiguous() for t in (slots, cache_lens, lengths))
            and (c_q is None or c_q.dtype in _DTYPES and c_q.dim() == kv.dim() and c_q.shape[-1] <= MAX_WIDTH
                 and q_weight.is_contiguous()))


register("mla_cache_rows", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=supports)(mla_cache_rows)


ABSORB_BLOCK_N, ABSORB_BLOCK_K = 64, 64
ABSORB_MAX_ROWS = 64  # all of a step's rows in one tile (B x T <= 8 x 8)
ABSORB_MAX_HEADS = 16


def _absorb(x, w, out, K, gate=None, pe=None, rope=None) -> None:
    """out[:, h, n] = x[:, h, :K] . w[h, n, :] for every head (w [H, N, K], its rows strided as a view
    of a wider weight may have them), gated by gate [M, H*N] (or its GEMM's split-K partials [S, M, H*N])
    when given; pe: the rope columns
    x[:, :, K:] copied there when given, rotated by rope's tables when that is given too."""
    M, H = x.shape[0], x.shape[1]
    N = w.shape[1]
    P = x.shape[2] - K
    parts = gate.shape[0] if gate is not None and gate.dim() == 3 else 1  # a gate GEMM's split-K partials
    gate_args = (gate, gate.stride(-2)) if gate is not None else (out, 0)
    pe_args = (pe, pe.stride(0), pe.stride(1)) if pe is not None else (out, 0, 0)
    rope_args, rope_flags = _rope_args(rope, M, P, x)
    if M:
        kernel_module(__package__).absorb_kernel[(H, -(-N // ABSORB_BLOCK_N))](
            x, x.stride(0), x.stride(1), w, w.stride(0), w.stride(1), out, out.stride(0), N, *gate_args, *pe_args,
            *rope_args, M, N, K, P, gate.stride(0) if parts > 1 else 0,
            HAS_GATE=gate is not None, COPY_PE=pe is not None, **rope_flags, BLOCK_M=max(16, 1 << (M - 1).bit_length()),
            BLOCK_N=ABSORB_BLOCK_N, BLOCK_K=ABSORB_BLOCK_K, BLOCK_P=max(16, 1 << max(P - 1, 0).bit_length()),
            GATE_PARTS=parts, **pdl_options(), num_warps=4)


def mla_absorb_q(q, w_uk_t, rope=None, out=None, pe=None):
    """out / pe: optional contiguous [M, H, R] / [M, H, P] buffers (tests poison them first)."""
    check_absorb_q(q, w_uk_t)
    M, H, width = q.shape
    R, nope = w_uk_t.shape[1], w_uk_t.shape[2]
    out = torch.empty(M, H, R, dtype=q.dtype, device=q.device) if out is None else out
    pe = torch.empty(M, H, width - nope, dtype=q.dtype, device=q.device) if pe is None else pe
    _absorb(q, w_uk_t, out, nope, pe=pe, rope=rope)
    return out, pe


def mla_absorb_output(o_latent, w_uv, gate, out=None):
    """out: an optional contiguous [M, H*V] buffer (tests poison it first)."""
    check_absorb_output(o_latent, w_uv, gate)
    M, H, V = o_latent.shape[0], w_uv.shape[0], w_uv.shape[1]
    out = torch.empty(M, H * V, dtype=o_latent.dtype, device=o_latent.device) if out is None else out
    _absorb(o_latent, w_uv, out.view(M, H, V), o_latent.shape[2], gate=gate)
    return out


def _absorbs(x, w) -> bool:
    return (x.dim() == 3 and w.dim() == 3 and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
            and x.stride(-1) == 1 and w.stride(-1) == 1 and x.shape[0] <= ABSORB_MAX_ROWS
            and x.shape[1] <= ABSORB_MAX_HEADS and w.shape[1] % 16 == 0 and w.shape[2] % 16 == 0)


def linear_heads(x, weight, out=None):
    """ops.linear_heads (kernels/linear/reference.py); out: an optional contiguous [M, H, N] buffer
    (tests poison it first)."""
    M, H, N = x.shape[0], weight.shape[0], weight.shape[1]
    out = torch.empty(M, H, N, dtype=x.dtype, device=x.device) if out is None else out
    _absorb(x, weight, out, x.shape[2])
    return out


register("linear_heads", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=lambda x, weight: _absorbs(x, weight) and x.shape[2] == weight.shape[2]
         and weight.shape[0] == x.shape[1])(linear_heads)
register("mla_absorb_q", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=lambda q, w_uk_t: _absorbs(q, w_uk_t))(mla_absorb_q)
register("mla_absorb_output", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=lambda o, w_uv, gate: _absorbs(o, w_uv) and gate.stride(-1) == 1
         and ((gate.dim() == 2 and gate.dtype == o.dtype)
              or (gate.dim() == 3 and gate.dtype == torch.float32 and gate.shape[0] <= MAX_PARTS)))(mla_absorb_output)
