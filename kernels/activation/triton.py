"""SiTU-GLU and the sigmoid output gate as one Triton launch each (contracts: reference.py).

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


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """out: an optional contiguous buffer of gate's shape and dtype (tests poison it first)."""
    g, u = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device) if out is None else out.view(g.shape)
    if out.numel():
        _kernels().situ_glu_kernel[_grid(g)](g, u, g.stride(0), u.stride(0), out, out.stride(0), g.shape[1],
                                              float(beta), float(linear_beta), BLOCK=BLOCK, **pdl_options(),
                                              num_warps=4)
    return out.view(gate.shape)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    xr, gr = x.reshape(-1, x.shape[-1]), gate.reshape(-1, gate.shape[-1])
    out = torch.empty(xr.shape, dtype=x.dtype, device=x.device) if out is None else out.view(xr.shape)
    if out.numel():
        _kernels().sigmoid_gate_kernel[_grid(xr)](xr, gr, xr.stride(0), gr.stride(0), out, out.stride(0), xr.shape[1],
                                                   BLOCK=BLOCK, **pdl_options(), num_warps=4)
    return out.view(x.shape)


def _pair(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, row-major last dimension (rows may be strided: column slices of a fused GEMM)."""
    return (a.shape == b.shape and a.dim() >= 1 and a.dtype in _DTYPES and b.dtype in _DTYPES
            and a.stride(-1) == 1 and b.stride(-1) == 1)


register("situ_glu", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=lambda gate, up: _pair(gate, up))(situ_glu)
register("sigmoid_gate", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=lambda x, gate: _pair(x, gate))(sigmoid_gate)
