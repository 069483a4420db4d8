"""SiTU-GLU, the sigmoid output gate and the drafter's silu * up as one Triton launch each (contracts: reference.py).

Why: the references concatenate their two inputs, cast them to fp32 and apply several
elementwise kernels; on the few rows of a verify step each is a launch of a few microseconds.
"""

import torch

from ..registry import register
from ..triton_common import kernel_module, pdl_options, triton_available

BLOCK = 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    return kernel_module(__package__)


def _grid(rows: torch.Tensor) -> tuple[int, int]:
    return rows.shape[0], -(-rows.shape[1] // BLOCK)


def _rowwise(kernel_name: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, *scalars) -> torch.Tensor:
    """One launch of an elementwise kernel over the rows of a and b (same shape), into out (default a
    fresh tensor of a's dtype; tests pass a poisoned contiguous one)."""
    ar, br = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    out = torch.empty(ar.shape, dtype=a.dtype, device=a.device) if out is None else out.view(ar.shape)
    if out.numel():
        getattr(_kernels(), kernel_name)[_grid(ar)](ar, br, ar.stride(0), br.stride(0), out, out.stride(0), ar.shape[1],
                                                    *scalars, BLOCK=BLOCK, **pdl_options(), num_warps=4)
    return out.view(a.shape)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    return _rowwise("situ_glu_kernel", gate, up, out, float(beta), float(linear_beta))


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _rowwise("sigmoid_gate_kernel", x, gate, out)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _rowwise("silu_mul_kernel", gate, up, out)


def _pair(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, row-major last dimension (rows may be strided: column slices of a fused GEMM)."""
    return (a.shape == b.shape and a.dim() >= 1 and a.dtype in _DTYPES and b.dtype in _DTYPES
            and a.stride(-1) == 1 and b.stride(-1) == 1)


register("situ_glu", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=lambda gate, up: _pair(gate, up))(situ_glu)
register("sigmoid_gate", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=lambda x, gate: _pair(x, gate))(sigmoid_gate)
register("silu_mul", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=lambda gate, up: _pair(gate, up) and gate.dtype == up.dtype)(silu_mul)
