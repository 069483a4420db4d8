"""The ops the models call. Each dispatches through the registry on its first tensor's device,
so an implementation is swapped (config, DSPARK_KERNELS, `registry.use`) without touching model
code. The contract of each op is its reference implementation (kernels/<op>/reference.py)."""
from __future__ import annotations

import torch

from .registry import select


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y[M, N] = x[M, K] @ weight[N, K]^T."""
    return select("linear", x, weight).fn(x, weight)
