"""Reference skinny GEMM.

On the CPU every row is computed by the same kernel whatever the row count (a batched matmul
of 1-row problems): a token's result then does not depend on how many tokens were verified
beside it, so speculative and plain decoding agree bit for bit and a committed KDA state equals
the sequentially decoded one exactly. One plain GEMM is not row-invariant on the CPU: MKL takes
a GEMV path for one row and blocked GEMM paths for several, which round differently.
On other devices it is a plain matmul (cuBLAS), the baseline the fast kernels are measured
against; GPU results are equal to tolerance, not bitwise.
"""
import torch

from ..registry import register


@register("linear", "reference", priority=0)
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        m = x.shape[0]
        return torch.bmm(x.unsqueeze(1), weight.t().unsqueeze(0).expand(m, -1, -1)).squeeze(1)
    return x @ weight.t()
