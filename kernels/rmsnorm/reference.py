"""RMSNorm and Block AttnRes's mix as ops: the definitions (docs/kimi-k3.md §1.2, §7); and the
DSpark drafter's residual add + RMSNorm (docs/kernels.md §10.11), computed as the drafter's own norm is,
not per row: a draft needs no token invariance, the target's verify does.

Per row on the CPU (kernels/numerics.py), so a token's value does not depend on its batch.
attn_res_mix_norm is the mix followed by the RMSNorm that always comes after it in K3 (the
layer's input norm, the FFN's norm, the final norm): one op, so a GPU kernel does both in one
pass over the candidates. add_attn_res_mix_norm also does the residual add that comes before it.
"""
from __future__ import annotations

import torch

from ..numerics import is_partials_of, per_row, rms_normalise, sum_partials
from ..numerics import rms_norm as _rms_norm
from ..ops import linear
from ..registry import register


@register("rms_norm", "reference", priority=0)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    y = _rms_norm(x, weight, eps)
    return y if out_dtype is None else y.to(out_dtype)


def attn_res_mix(current: torch.Tensor, checkpoints: list[torch.Tensor], norm_weight: torch.Tensor,
                 proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Candidates {checkpoints..., current} in that order, score = RMSNorm(v) . (norm_weight *
    proj) in fp32, softmax over the candidates, weighted sum of the raw candidates in fp32,
    result in current's dtype."""
    candidates = checkpoints + [current]
    score_weight = (norm_weight.float() * proj_weight.float().view(-1)).view(1, -1)
    scores = torch.cat([linear(rms_normalise(v, eps), score_weight) for v in candidates], dim=-1)
    weights = per_row(lambda row: torch.softmax(row, dim=-1), scores)
    out = weights[..., :1] * candidates[0].float()
    for j in range(1, len(candidates)):
        out = out + weights[..., j : j + 1] * candidates[j].float()
    return out.to(current.dtype)


@register("attn_res_mix_norm", "reference", priority=0)
def attn_res_mix_norm(current: torch.Tensor, checkpoints: torch.Tensor, mix_norm: torch.Tensor,
                      mix_proj: torch.Tensor, out_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(attn_res_mix(current, checkpoints), out_norm); checkpoints [C, M, d] (C >= 0)."""
    mixed = attn_res_mix(current, list(checkpoints.unbind(0)), mix_norm, mix_proj, eps)
    return _rms_norm(mixed, out_norm, eps)


@register("add_attn_res_mix_norm", "reference", priority=0)
def add_attn_res_mix_norm(residual: torch.Tensor, delta: torch.Tensor, checkpoints: torch.Tensor,
                          mix_norm: torch.Tensor, mix_proj: torch.Tensor, out_norm: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add before a norm, with it: total = residual + delta (in their dtype), then
    (attn_res_mix_norm(total, checkpoints, ...), total). The model keeps `total` as its running
    sum; a GPU kernel computes both in the norm's one pass over the row. delta may come as a GEMM's
    split-K partials [S, M, d] (ops.linear_partials): their sum, rounded to residual's dtype, is the delta."""
    if is_partials_of(delta, residual):
        delta = sum_partials(delta, residual.dtype)
    total = residual + delta
    return attn_res_mix_norm(total, checkpoints, mix_norm, mix_proj, out_norm, eps), total


@register("add_rms_norm", "reference", priority=0)
def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """total = residual + delta (in their dtype), then (torch's RMSNorm of total, total): the statistics
    and the weight's scale in fp32, one rounding at the end, as F.rms_norm computes it. This is the
    DSpark drafter's norm (drafters/dspark/model.py), not K3's rms_norm, which rounds before it scales.
    delta may come as a GEMM's split-K partials [S, *residual.shape] (ops.linear_partials): their sum,
    rounded to residual's dtype, is the delta."""
    if is_partials_of(delta, residual):
        delta = sum_partials(delta.flatten(1, -2), residual.dtype).view(residual.shape)
    total = residual + delta
    return rms_norm_scaled_in_fp32(total, weight, eps), total


@register("rms_norm_scaled_in_fp32", "reference", priority=0)
def rms_norm_scaled_in_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's RMSNorm (F.rms_norm): the statistics and the weight's scale in fp32, one rounding to x's
    dtype. The drafter's RMSNorm where F.rms_norm does not serve (the CPU, mixed dtypes)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)
