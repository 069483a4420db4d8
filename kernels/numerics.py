"""Token-invariant elementwise helpers shared by the op references and the models built on them.

Why per row: on the CPU, torch's elementwise kernels run a vectorised loop and finish the tail
with a scalar loop, and transcendental functions (exp, sigmoid, tanh) differ by an ulp between
the two; inner reductions also change their accumulation pattern with the tensor's size. So a
token's value could depend on where it sits in a batch. Applying such functions to one token's
row at a time gives every token the same shapes, hence the same bits, however many tokens share
the call. On the GPU results are compared to tolerance, so the batched call is used there.
"""
from __future__ import annotations

from typing import Callable

import torch


def splits_rows(device: torch.device) -> bool:
    """Whether per_row runs row by row on this device (the CPU, where bitwise invariance is promised)."""
    return device.type == "cpu"


def per_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn applied to each row x[..., :] separately on the CPU (fn(x) at once elsewhere, so fn
    must work on [..., N] as well as on one row [N])."""
    if not splits_rows(x.device):
        return fn(x)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.stack([fn(row) for row in rows])
    return out.reshape(*x.shape[:-1], out.shape[-1])


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in fp32 (no weight)."""
    return per_row(lambda row: row.float() * torch.rsqrt(row.float().pow(2).mean(-1, keepdim=True) + eps), x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """K3's RMSNorm (docs/kimi-k3.md §1.2; the Kimi norm of modeling_kimi_linear.py): normalise in fp32,
    cast back to x.dtype, then scale by the weight."""
    return weight.to(x.dtype) * rms_normalise(x, eps).to(x.dtype)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU (docs/kimi-k3.md §1.2 hidden_act): b1*tanh(g/b1)*sigmoid(g) * b2*tanh(u/b2), fp32
    math, result in gate.dtype."""
    width = gate.shape[-1]

    def act(row: torch.Tensor) -> torch.Tensor:
        g, u = row[..., :width].float(), row[..., width:].float()
        return (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (linear_beta * torch.tanh(u / linear_beta))

    return per_row(act, torch.cat([gate, up], dim=-1)).to(gate.dtype)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) in fp32, result in x.dtype (the output gates of KDA and gated MLA)."""
    width = x.shape[-1]

    def apply(row: torch.Tensor) -> torch.Tensor:
        return row[..., :width].float() * torch.sigmoid(row[..., width:].float())

    return per_row(apply, torch.cat([x, gate.to(x.dtype)], dim=-1)).to(x.dtype)


# split-K partials as ops.linear_partials leaves them: float32, float64 for a float64 GEMM
PARTIAL_DTYPES = (torch.float32, torch.float64)


def is_partials_of(delta: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether delta is split-K partials [S, *residual.shape] of a GEMM's output (ops.linear_partials,
    its rows viewed in residual's shape) rather than one tensor of residual's shape."""
    return delta.dim() == residual.dim() + 1 and delta.shape[1:] == residual.shape


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S, M, N] split-K partials -> [M, N] in `dtype`: added in split order in float32 (float64 when
    either is), rounded once, as the CuTe GEMM's own reduction kernel does (cute_parts.reduce)."""
    wide = torch.float64 if torch.float64 in (partials.dtype, dtype) else torch.float32
    total = partials[0].to(wide)
    for part in partials[1:]:
        total = total + part.to(wide)
    return total.to(dtype)
