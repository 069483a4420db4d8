"""Reference K3 latent MoE FFN and router, the contracts of the `latent_moe` and `moe_route` ops.

Spec kimi-k3.md §1.2-1.3, per token x [D]:
    router: logits = x @ gate^T (fp32), scores = sigmoid(logits); the top-k experts by
            scores + e_score_correction_bias (the bias chooses, it does not weigh);
            weights = the chosen raw scores / their sum * routed_scaling_factor
    h = latent_down x                                    [latent]
    routed = sum over the chosen experts, in top-k order, of weight_e * w2_e situ(w1_e h, w3_e h)
    out = latent_up RMSNorm(routed; routed_expert_norm) + shared_down situ(shared_gate x, shared_up x)
Routed experts are MXFP4 (dspark/targets/kimi_k3/mxfp4.py); only the touched ones are
dequantised, once per call. Token invariance: projections go through the row-invariant
`linear` op and elementwise math is per row (numerics.per_row).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.targets.kimi_k3.mxfp4 import dequantise
from dspark.targets.kimi_k3.numerics import per_row, rms_norm, situ

from .. import ops
from ..registry import register


@dataclass
class LatentMoEWeights:
    """One MoE layer. Dense tensors in the model dtype (router bias fp32); routed experts are
    stacked MXFP4: w1/w3 [E, I, latent/2] + scales [E, I, latent/32], w2 [E, latent, I/2] +
    scales [E, latent, I/32]."""

    gate: torch.Tensor  # [E, D] router
    score_bias: torch.Tensor  # [E] fp32 e_score_correction_bias
    latent_down: torch.Tensor  # [latent, D]
    latent_norm: torch.Tensor  # [latent]
    latent_up: torch.Tensor  # [D, latent]
    shared_gate: torch.Tensor  # [S, D]
    shared_up: torch.Tensor  # [S, D]
    shared_down: torch.Tensor  # [D, S]
    w1_packed: torch.Tensor
    w1_scale: torch.Tensor
    w3_packed: torch.Tensor
    w3_scale: torch.Tensor
    w2_packed: torch.Tensor
    w2_scale: torch.Tensor

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dequantised (w1, w3, w2) of expert e."""
        return (
            dequantise(self.w1_packed[e], self.w1_scale[e], dtype),
            dequantise(self.w3_packed[e], self.w3_scale[e], dtype),
            dequantise(self.w2_packed[e], self.w2_scale[e], dtype),
        )


@register("moe_route", "reference", priority=0)
def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    num_experts = gate_weight.shape[0]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: {top_k} outside [1, {num_experts}]")
    if tuple(bias.shape) != (num_experts,):
        raise ValueError(f"bias: expected shape ({num_experts},), got {tuple(bias.shape)}")
    logits = ops.linear(x.float(), gate_weight.float())  # fp32 router (spec §1.2)
    selection_bias = bias.float()

    def route(rows: torch.Tensor) -> torch.Tensor:  # [..., E] -> [..., 2k]: ids | weights
        scores = torch.sigmoid(rows)
        ids = torch.topk(scores + selection_bias, top_k, dim=-1).indices
        chosen = scores.gather(-1, ids)
        weights = chosen / chosen.sum(-1, keepdim=True) * scaling
        return torch.cat([ids.float(), weights], dim=-1)  # ids < 2^24 are exact in fp32

    routed = per_row(route, logits)
    return routed[:, :top_k].long(), routed[:, top_k:]


@register("latent_moe", "reference", priority=0)
def latent_moe(x: torch.Tensor, weights: LatentMoEWeights, cfg) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != weights.gate.shape[1]:
        raise ValueError(f"x: expected [M, {weights.gate.shape[1]}], got {tuple(x.shape)}")
    ids, route_weights = moe_route(
        x, weights.gate, weights.score_bias, cfg.num_experts_per_token, cfg.routed_scaling_factor
    )
    latent = ops.linear(x, weights.latent_down)  # [M, latent]
    # Each touched expert runs once on the tokens routed to it (row-invariant linear: a token's
    # bits do not depend on which other tokens share the call); outputs land at (token, slot).
    expert_out = torch.zeros(*ids.shape, latent.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        w1, w3, w2 = weights.expert(e, x.dtype)
        h = latent[rows]
        act = situ(ops.linear(h, w1), ops.linear(h, w3), cfg.situ_beta, cfg.situ_linear_beta)
        expert_out[rows, slots] = ops.linear(act, w2).float()
    routed = route_weights[:, :1] * expert_out[:, 0]
    for slot in range(1, ids.shape[1]):  # fixed order: the top-k order
        routed = routed + route_weights[:, slot : slot + 1] * expert_out[:, slot]
    routed = rms_norm(routed, weights.latent_norm, cfg.rms_norm_eps).to(x.dtype)
    shared = situ(
        ops.linear(x, weights.shared_gate), ops.linear(x, weights.shared_up), cfg.situ_beta, cfg.situ_linear_beta
    )
    return ops.linear(routed, weights.latent_up) + ops.linear(shared, weights.shared_down)
