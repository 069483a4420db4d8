"""The K3 router in two Triton launches per call (contract: reference.moe_route).

Why: the reference widens the bf16 router weight to float32 on every call (a copy of 2x its
size), runs an fp32 GEMM on it (a SIMT sgemm at 8 rows) and selects with sigmoid, add, topk,
gather, sum, divide and scale, each its own launch, in every MoE layer of a batch-1 step. Here,
for up to FUSED_ROWS tokens, one kernel reads the weight as it is and writes split-K partial
sums of the fp32 logits, and one program per token adds them up and selects. More rows (a
prefill) take the fp32 `linear` op for the logits, as the reference does.

The default on CUDA: checked under Triton's interpreter (tests/triton_interpret_checks.py) and on
the H200 (docs/kernels.md §10.6).
"""
import torch

from .. import ops
from ..registry import register
from ..triton_common import kernel_module, triton_available
from .reference import check_route

FUSED_ROWS = 64  # tokens up to which the logits come from router_partials_kernel (a decode or verify step)
PARTIAL_EXPERTS = 16  # experts per program of the partial-sum kernel
PARTIAL_WIDTH = 512  # columns of x per program: 14 splits of K3's 7168


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def route_logits(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                 ids: torch.Tensor | None = None, weights: torch.Tensor | None = None):
    """(ids [M, k] long, weights [M, k] fp32) from router logits: [M, E] fp32 (rows may be
    strided), or [S, M, E] contiguous partial sums that add up to them (in order). ids and
    weights: optional contiguous outputs (tests poison them first)."""
    parts = logits if logits.dim() == 3 else logits.unsqueeze(0)
    num_parts, M, E = parts.shape
    ids = torch.empty(M, top_k, dtype=torch.long, device=logits.device) if ids is None else ids
    weights = torch.empty(M, top_k, dtype=torch.float32, device=logits.device) if weights is None else weights
    if M:
        kernel_module(__package__).route_kernel[(M,)](
            parts, parts.stride(1), num_parts, parts.stride(0), bias, ids, weights, E, float(scaling), TOP_K=top_k,
            BLOCK_E=_pow2(E), BLOCK_K=_pow2(top_k), num_warps=4)
    return ids, weights


def router_partials(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """[S, M, E] fp32 split-K partial sums of x [M, K] @ gate_weight[E, K]^T, both read in their
    own dtype (rows may be strided, columns contiguous), S = ceil(K / PARTIAL_WIDTH)."""
    M, K = x.shape
    E = gate_weight.shape[0]
    if x.stride(-1) != 1 or gate_weight.stride(-1) != 1:
        raise ValueError("router_partials: x and gate_weight need contiguous rows")
    splits = -(-K // PARTIAL_WIDTH)
    partials = torch.empty(splits, M, E, dtype=torch.float32, device=x.device)
    kernel_module(__package__).router_partials_kernel[(-(-E // PARTIAL_EXPERTS), splits)](
        x, x.stride(0), gate_weight, gate_weight.stride(0), partials, M, E, K,
        BLOCK_E=PARTIAL_EXPERTS, BLOCK_K=PARTIAL_WIDTH, num_warps=4)
    return partials


@register("moe_route", "triton", devices=("cuda",), priority=10, available=triton_available)
def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    check_route(gate_weight, bias, top_k)
    if 0 < x.shape[0] <= FUSED_ROWS and x.stride(-1) == 1 and gate_weight.stride(-1) == 1:
        logits = router_partials(x, gate_weight)  # the fp32 router GEMM (docs/kimi-k3.md §1.2), split
    else:
        logits = ops.linear(x.float(), gate_weight.float())
    return route_logits(logits, bias.float().contiguous(), top_k, scaling)
