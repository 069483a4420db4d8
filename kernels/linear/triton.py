"""linear for fp32 operands and a few rows: the K3 router (x [T, 7168] fp32 against the fp32 gate
[896, 7168], docs/kimi-k3.md §1.2). The CuTe skinny GEMM is bf16-only, and cuBLAS picks a SIMT
sgemm for these shapes that read the 25.7 MB gate at about a sixth of the memory bandwidth on
the H200 (experiments/results/h200/step_bench.json). Exact fp32 FMAs, no TF32: routing
decisions compare these logits."""
import functools
import importlib.util

import torch

from ..registry import register

MAX_ROWS = 16
BLOCK_N, BLOCK_K = 8, 64


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def linear_f32(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out: an optional [M, N] fp32 buffer (tests poison it first)."""
    from . import triton_kernels  # imports triton: only on first use

    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=torch.float32, device=x.device) if out is None else out
    block_m = max(2, 1 << (M - 1).bit_length())
    triton_kernels.skinny_f32_kernel[(-(-N // BLOCK_N),)](x, weight, y, M, N, x.stride(0), weight.stride(0),
                                                          y.stride(0), K=K, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
                                                          BLOCK_K=BLOCK_K, num_warps=4)
    return y


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and weight.dim() == 2 and x.dtype == weight.dtype == torch.float32
            and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == weight.shape[1]
            and x.stride(1) == 1 and weight.stride(1) == 1)


register("linear", "triton_f32", devices=("cuda",), priority=5, available=triton_available,
         supports=supports)(linear_f32)
