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
        if x.dtype in (torch.bfloat16, torch.float16):
            # The CPU's half-precision bmm is not row-invariant (its kernel depends on the batch
            # count: 2 of 20 seeds of tests/test_k3_target.py's bf16 case differed). Products of
            # half-precision values are exact in float32 and summed there, as a half GEMM does;
            # the result is rounded once.
            return linear(x.float(), weight.float()).to(x.dtype)
        return torch.bmm(x.unsqueeze(1), weight.t().unsqueeze(0).expand(m, -1, -1)).squeeze(1)
    return x @ weight.t()


@register("linear_partials", "reference", priority=0)
def linear_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear's product as the one partial [1, M, N] in float32 (float64 for float64 operands), unrounded
    (a GEMM that does not split K has nothing to add): rounded to x's dtype it is linear's result, bit
    for bit on the CPU."""
    if x.dtype in (torch.float32, torch.float64):  # a float64 GEMM's partial stays float64
        return linear(x, weight)[None]
    if x.device.type == "cpu":
        return linear(x.float(), weight.float())[None]
    return torch.mm(x, weight.t(), out_dtype=torch.float32)[None]


@register("linear_heads", "reference", priority=0)
def linear_heads(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y[M, H, N] = x[M, H, K] @ weight[H, N, K]^T per head (MLA's absorbed W_UK / W_UV).

    On the CPU each head goes through the row-invariant `linear` above (so a token's bits do not
    depend on the tokens beside it); elsewhere it is one batched matmul over the heads.
    """
    if x.dim() != 3 or weight.dim() != 3 or x.shape[1] != weight.shape[0] or x.shape[2] != weight.shape[2]:
        raise ValueError(f"x/weight: expected [M, H, K] and [H, N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.device.type == "cpu":
        return torch.stack([linear(x[:, h].contiguous(), weight[h]) for h in range(x.shape[1])], dim=1)
    return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1).contiguous()
