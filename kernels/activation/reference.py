"""SiTU-GLU and the sigmoid output gate as ops: the definitions (docs/kimi-k3.md §1.2, §2, §3),
per row on the CPU (kernels/numerics.py); and the DSpark drafter's silu * up (docs/kernels.md §10.11)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..numerics import sigmoid_gate as _sigmoid_gate
from ..numerics import situ
from ..registry import register


@register("situ_glu", "reference", priority=0)
def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    return situ(gate, up, beta, linear_beta)


@register("sigmoid_gate", "reference", priority=0)
def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return _sigmoid_gate(x, gate)


@register("silu_mul", "reference", priority=0)
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up as torch computes it in their dtype: silu rounded to it, then the product (the
    DSpark drafter's SwiGLU, drafters/dspark/model.py)."""
    return F.silu(gate) * up
