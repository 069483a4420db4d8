"""SiTU-GLU and the sigmoid output gate as ops: the definitions (docs/kimi-k3.md §1.2, §2, §3),
per row on the CPU (kernels/numerics.py); and the DSpark drafter's silu * up (docs/kernels.md §10.11)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..numerics import sigmoid_gate as _sigmoid_gate
from ..numerics import PARTIAL_DTYPES, sum_partials
from ..numerics import situ
from ..registry import register


@register("situ_glu", "reference", priority=0)
def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    return situ(gate, up, beta, linear_beta)


@register("sigmoid_gate", "reference", priority=0)
def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return _sigmoid_gate(x, gate)


def check_partials(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> None:
    """silu_mul's partials form: ValueError naming the first bad argument."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"silu_mul: dtype must be a floating torch.dtype, got {dtype!r}")
    for name, t in (("gate", gate), ("up", up)):
        if t.dim() < 3 or t.dtype not in PARTIAL_DTYPES or t.shape != gate.shape:
            raise ValueError(f"silu_mul: with dtype, {name} must be split-K partials [S, ..., n] (float32 or float64, "
                             f"gate's shape), got {t.dtype} {tuple(t.shape)}")


@register("silu_mul", "reference", priority=0)
def silu_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """silu(gate) * up as torch computes it in their dtype: silu rounded to it, then the product (the
    DSpark drafter's SwiGLU, drafters/dspark/model.py). dtype given: gate and up are a GEMM's split-K
    partials [S, ..., n], each summed in split order and rounded to dtype first (sum_partials)."""
    if dtype is not None:
        check_partials(gate, up, dtype)
        gate, up = (sum_partials(t.reshape(t.shape[0], -1, t.shape[-1]), dtype).view(t.shape[1:]) for t in (gate, up))
    return F.silu(gate) * up
