"""The K3 router's selection as one Triton launch per call (contract: reference.moe_route).

Why: the reference selects with sigmoid, add, topk, gather, sum, divide and scale, each its own
launch, for the one to eight tokens of a batch-1 step, in every MoE layer. Here the router
logits come from the same fp32 `linear` op, and one program per token does the rest.

The default on CUDA: checked under Triton's interpreter (tests/triton_interpret_checks.py) and on
the H200, where it takes 30 launches out of a k3-slice step at no cost in step time
(docs/kernels.md §10.6).
"""
import torch

from .. import ops
from ..registry import register
from ..triton_common import kernel_module, triton_available
from .reference import check_route


def route_logits(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                 ids: torch.Tensor | None = None, weights: torch.Tensor | None = None):
    """(ids [M, k] long, weights [M, k] fp32) from router logits [M, E] (fp32, rows may be
    strided); ids and weights: optional contiguous outputs (tests poison them first)."""
    M, E = logits.shape
    ids = torch.empty(M, top_k, dtype=torch.long, device=logits.device) if ids is None else ids
    weights = torch.empty(M, top_k, dtype=torch.float32, device=logits.device) if weights is None else weights
    if M:
        kernel_module(__package__).route_kernel[(M,)](
            logits, logits.stride(0), bias, ids, weights, E, float(scaling), TOP_K=top_k,
            BLOCK_E=max(16, 1 << (E - 1).bit_length()), BLOCK_K=max(16, 1 << (top_k - 1).bit_length()), num_warps=4)
    return ids, weights


@register("moe_route", "triton", devices=("cuda",), priority=10, available=triton_available)
def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    check_route(gate_weight, bias, top_k)
    logits = ops.linear(x.float(), gate_weight.float())  # the fp32 router GEMM (docs/kimi-k3.md §1.2)
    return route_logits(logits, bias.float().contiguous(), top_k, scaling)
