"""rotary in one Triton launch (contract: reference.rotary).

Why: the torch formula is nine launches on the GPU (the widening, four products, a difference, a
sum, the stack and the narrowing back), and a DSpark drafter's pass rotates its queries and its
block's keys in every layer: ~90 launches of a K3 drafter's propose, on a few rows each
(docs/kimi-k3.md §8.6). One program per position rotates all its heads.

Numerics: the same float32 products and sums as the reference, then one rounding to x's dtype;
the compiler may contract a product and a sum into one fused multiply-add, so the float32 value
can differ from the reference's in the last bit before that rounding.
"""
import torch

from ..registry import register
from ..triton_common import kernel_module, pdl_options, triton_available
from .reference import check_rotary

MAX_HEADS_X_HALF = 8192  # one program holds heads x D/2 pairs in registers


def _rows(x: torch.Tensor):
    """x [..., H, D] as [N, H, D] without a copy, or None when its leading dims do not collapse."""
    try:
        return x.view(-1, *x.shape[-2:])
    except RuntimeError:
        return None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """out: an optional contiguous buffer of x's shape and dtype (tests poison it first)."""
    check_rotary(x, cos, sin)
    rows = _rows(x)
    if rows is None or rows.stride(-1) != 1:
        raise ValueError(f"rotary: x {tuple(x.shape)} stride {x.stride()} is not rows of [H, D] with contiguous D")
    N, H, D = rows.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"rotary: out must be a contiguous {x.dtype} {tuple(x.shape)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if N:
        half = D // 2
        kernel_module(__package__).rotary_kernel[(N,)](
            rows, rows.stride(0), rows.stride(1), cos.contiguous(), sin.contiguous(), out, H, half,
            INTERLEAVED=bool(interleaved), BLOCK_H=1 << (H - 1).bit_length(), BLOCK_HALF=1 << (half - 1).bit_length(),
            **pdl_options(), num_warps=4)
    return out


def supports_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    rows = _rows(x) if x.dim() >= 2 else None
    return (rows is not None and rows.stride(-1) == 1 and x.shape[-1] % 2 == 0
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.shape[-2] * x.shape[-1] // 2 <= MAX_HEADS_X_HALF)


register("rotary", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=supports_rotary)(rotary)
