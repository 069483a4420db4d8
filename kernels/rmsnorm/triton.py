"""RMSNorm, the AttnRes mix + RMSNorm (with or without the residual add before it) and the
drafter's residual add + RMSNorm as one Triton launch each (contracts: reference.py).

Why: in a batch-1 step each of these was a chain of small torch kernels (casts, a mean, an
rsqrt, products; the mix adds a score GEMV per candidate, a softmax and a weighted sum), about
forty launches per mix, each a few microseconds on a handful of rows (docs/kernels.md §5).
"""

import torch

from ..numerics import is_partials_of
from ..registry import register
from ..triton_common import kernel_module, pdl_options, triton_available

MAX_WIDTH = 16384  # the row lives in registers: 16384 fp32 over 16 warps is 32 per thread
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# The AttnRes mix scores its checkpoints in 2-D tiles (score_tile), one reduction round a tile, where
# the per-checkpoint loop takes one round a checkpoint: at batch 1 the mix is one program whose
# reductions, not its bytes, set its time (experiments/notes/rank.md, "Eighth round"). Off until
# experiments/glue_bench.py and the step have timed it (--setting mix_tiles=1).
MIX_SCORE_TILES = False


def _kernels():
    return kernel_module(__package__)


def score_tile(checkpoints: int) -> int:
    """How many checkpoints the mix scores at once (0: one at a time, the loop). All in one tile up to
    four; past four, tiles of two: ptxas overlaps two tiles of four and spills at 16 warps, where
    tiles of two fit (tests/test_mix_norm_compile.py)."""
    if not MIX_SCORE_TILES or checkpoints == 0:
        return 0
    return 1 << (checkpoints - 1).bit_length() if checkpoints <= 4 else 2


def _launch_shape(width: int) -> tuple[int, int]:
    block = triton_block(width)
    return block, min(16, max(1, block // 512))


def triton_block(width: int) -> int:
    return 1 << (width - 1).bit_length()


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None,
             out: torch.Tensor | None = None, scale_in_fp32: bool = False) -> torch.Tensor:
    """out: an optional contiguous buffer of x's shape and out_dtype (default x's; tests poison it
    first). The kernel rounds as the reference does in x's dtype and casts when it stores;
    scale_in_fp32: as rms_norm_scaled_in_fp32 rounds instead (once, after the scale)."""
    rows = _rows(x)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device) if out is None else out.view(rows.shape)
    block, warps = _launch_shape(rows.shape[1])
    if rows.shape[0]:
        _kernels().rms_norm_kernel[(rows.shape[0],)](rows, rows.stride(0), weight, out, out.stride(0), rows.shape[1],
                                                     float(eps), BLOCK=block, SCALE_IN_FP32=scale_in_fp32,
                                                     **pdl_options(), num_warps=warps)
    return out.view(x.shape)


def rms_norm_scaled_in_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """ops.rms_norm_scaled_in_fp32, reading strided 2-D rows in place (a column slice of a paired GEMM's
    output), where F.rms_norm copies them to a contiguous tensor first."""
    return rms_norm(x, weight, eps, out=out, scale_in_fp32=True)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None, total: torch.Tensor | None = None):
    """out, total: optional contiguous buffers of residual's shape and dtype (tests poison them). delta:
    residual's shape, or split-K partials [S, *residual.shape] that the kernel adds in split order
    (reference.add_rms_norm), in place of the GEMM's reduction launch."""
    r = _rows(residual)
    partials = is_partials_of(delta, residual)
    parts = delta.reshape(delta.shape[0], -1, delta.shape[-1]) if partials else _rows(delta)[None]
    out = torch.empty(r.shape, dtype=residual.dtype, device=residual.device) if out is None else out.view(r.shape)
    total = torch.empty(r.shape, dtype=residual.dtype, device=residual.device) if total is None else total.view(r.shape)
    block, warps = _launch_shape(r.shape[1])
    if r.shape[0]:
        _kernels().add_rms_norm_kernel[(r.shape[0],)](r, r.stride(0), parts, parts.stride(0), parts.stride(1), weight,
                                                      out, out.stride(0), total, total.stride(0), r.shape[1],
                                                      float(eps), DELTA_PARTS=parts.shape[0], BLOCK=block,
                                                      **pdl_options(), num_warps=warps)
    return out.view(residual.shape), total.view(residual.shape)


def attn_res_mix_norm(current, checkpoints, mix_norm, mix_proj, out_norm, eps: float,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(current.shape, dtype=current.dtype, device=current.device) if out is None else out
    _mix_norm(current, None, None, checkpoints, mix_norm, mix_proj, out_norm, eps, out)
    return out


def add_attn_res_mix_norm(residual, delta, checkpoints, mix_norm, mix_proj, out_norm, eps: float,
                          out: torch.Tensor | None = None, total: torch.Tensor | None = None):
    """out, total: optional contiguous buffers of residual's shape and dtype (tests poison them)."""
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device) if out is None else out
    total = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device) if total is None else total
    _mix_norm(residual, delta, total, checkpoints, mix_norm, mix_proj, out_norm, eps, out)
    return out, total


def _mix_norm(current, delta, total, checkpoints, mix_norm, mix_proj, out_norm, eps, out) -> None:
    M, d = current.shape
    block, warps = _launch_shape(d)
    has_delta = delta is not None
    parts = delta if delta is None or delta.dim() == 3 else delta[None]  # [S, M, d]: a 2-D delta is one part
    if has_delta:
        delta_args = (parts, parts.stride(0), parts.stride(1), total, total.stride(0))
    else:  # not read: the kernel's HAS_DELTA branch is compiled out
        delta_args = (current, 0, current.stride(0), out, out.stride(0))
    if M:
        _kernels().attn_res_mix_norm_kernel[(M,)](
            checkpoints, checkpoints.stride(0), checkpoints.stride(1), current, current.stride(0), *delta_args,
            mix_norm, mix_proj, out_norm, out, out.stride(0), d, float(eps), NUM_CKPT=checkpoints.shape[0],
            TILE=score_tile(checkpoints.shape[0]), BLOCK=block, HAS_DELTA=has_delta,
            DELTA_PARTS=parts.shape[0] if has_delta else 1, **pdl_options(), num_warps=warps)


def _row_major(x: torch.Tensor) -> bool:
    return x.dtype in _DTYPES and x.shape[-1] <= MAX_WIDTH and x.stride(-1) == 1


def supports_rms_norm(x, weight) -> bool:
    """Rows may be strided (a column slice of a fused GEMM's output) when x is 2-D."""
    return (_row_major(x) and (x.dim() == 2 or x.is_contiguous()) and weight.is_contiguous()
            and weight.shape == x.shape[-1:])


def supports_attn_res_mix_norm(current, checkpoints, mix_norm, mix_proj, out_norm) -> bool:
    d = current.shape[-1]
    return (current.dim() == 2 and _row_major(current) and checkpoints.dim() == 3 and checkpoints.stride(-1) == 1
            and checkpoints.shape[1:] == current.shape and checkpoints.dtype == current.dtype
            and all(w.is_contiguous() and w.numel() == d for w in (mix_norm, mix_proj, out_norm)))


def supports_add_attn_res_mix_norm(residual, delta, checkpoints, mix_norm, mix_proj, out_norm) -> bool:
    """delta [M, d] in residual's dtype, or split-K partials [S, M, d] (fp32, or residual's dtype)."""
    return ((delta.shape == residual.shape and delta.dtype == residual.dtype
             or is_partials_of(delta, residual) and delta.dtype in (residual.dtype, torch.float32))
            and delta.stride(-1) == 1 and supports_attn_res_mix_norm(residual, checkpoints, mix_norm, mix_proj, out_norm))


def supports_add_rms_norm(residual, delta, weight) -> bool:
    """delta of residual's shape and dtype (rows may be strided when 2-D), or contiguous split-K partials
    [S, *residual.shape] (fp32, or residual's dtype)."""
    if is_partials_of(delta, residual):
        return (delta.dtype in (residual.dtype, torch.float32) and delta.is_contiguous()
                and supports_rms_norm(residual, weight))
    return (delta.shape == residual.shape and delta.dtype == residual.dtype and supports_rms_norm(residual, weight)
            and _row_major(delta) and (delta.dim() == 2 or delta.is_contiguous()))


register("rms_norm", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=supports_rms_norm)(rms_norm)
register("rms_norm_scaled_in_fp32", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=supports_rms_norm)(rms_norm_scaled_in_fp32)
register("attn_res_mix_norm", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=supports_attn_res_mix_norm)(attn_res_mix_norm)
register("add_attn_res_mix_norm", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=supports_add_attn_res_mix_norm)(add_attn_res_mix_norm)
register("add_rms_norm", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=supports_add_rms_norm)(add_rms_norm)
