"""SiTU-GLU, the sigmoid output gate and the drafter's silu * up as one Triton launch each (contracts: reference.py).

Why: the references concatenate their two inputs, cast them to fp32 and apply several
elementwise kernels; on the few rows of a verify step each is a launch of a few microseconds.
"""

import torch

from ..registry import register
from ..triton_common import MAX_PARTS, kernel_module, pdl_options, triton_available
from .reference import check_partials

BLOCK = 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    return kernel_module(__package__)


def _grid(rows: torch.Tensor) -> tuple[int, int]:
    return rows.shape[0], -(-rows.shape[1] // BLOCK)


def _rowwise(kernel_name: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, *scalars,
             **constexprs) -> torch.Tensor:
    """One launch of an elementwise kernel over the rows of a and b (same shape), into out (default a
    fresh tensor of a's dtype; tests pass a poisoned contiguous one)."""
    ar, br = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    out = torch.empty(ar.shape, dtype=a.dtype, device=a.device) if out is None else out.view(ar.shape)
    if out.numel():
        getattr(_kernels(), kernel_name)[_grid(ar)](ar, br, ar.stride(0), br.stride(0), out, out.stride(0), ar.shape[1],
                                                    *scalars, BLOCK=BLOCK, **constexprs, **pdl_options(), num_warps=4)
    return out.view(a.shape)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    return _rowwise("situ_glu_kernel", gate, up, out, float(beta), float(linear_beta))


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _rowwise("sigmoid_gate_kernel", x, gate, out)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """dtype: gate and up are split-K partials [S, ..., n] (reference.silu_mul)."""
    if dtype is None:
        return _rowwise("silu_mul_kernel", gate, up, out, 0, 0, PARTS=1)
    check_partials(gate, up, dtype)
    parts, shape = gate.shape[0], gate.shape[1:]
    g, u = gate.reshape(parts, -1, gate.shape[-1]), up.reshape(parts, -1, up.shape[-1])
    out = torch.empty(g.shape[1:], dtype=dtype, device=gate.device) if out is None else out.view(g.shape[1:])
    if out.numel():
        _kernels().silu_mul_kernel[_grid(out)](g, u, g.stride(1), u.stride(1), out, out.stride(0), out.shape[1],
                                               g.stride(0), u.stride(0), BLOCK=BLOCK, PARTS=parts, **pdl_options(),
                                               num_warps=4)
    return out.view(shape)


def _pair(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, row-major last dimension (rows may be strided: column slices of a fused GEMM)."""
    return (a.shape == b.shape and a.dim() >= 1 and a.dtype in _DTYPES and b.dtype in _DTYPES
            and a.stride(-1) == 1 and b.stride(-1) == 1)


register("situ_glu", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=lambda gate, up: _pair(gate, up))(situ_glu)
register("sigmoid_gate", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=lambda x, gate: _pair(x, gate))(sigmoid_gate)
register("silu_mul", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=lambda gate, up, dtype=None: _pair(gate, up) and gate.dtype == up.dtype
         and (dtype is None or (dtype in _DTYPES and gate.dim() >= 3 and gate.shape[0] <= MAX_PARTS)))(silu_mul)
