"""K3's latent-MoE FFN block (docs/kimi-k3.md §1.2-1.3), written once over the kernel ops.

Per token x [D]:
    ids, weights = moe_route(x)                                  (top-k of the sigmoid router)
    h = latent_down x                                            [latent]
    routed = moe_experts(h, ids, weights)                        (MXFP4 experts, weighted, summed)
    out = latent_up RMSNorm(routed; routed_expert_norm) + shared_down situ(shared_gate x, shared_up x)
Every projection is `ops.linear`; the elementwise parts are per row (kernels/numerics.py), so on
the CPU a token's output does not depend on the tokens beside it, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.kernels import ops

from .config import K3Config

# Whether the shared experts run on a side stream, concurrently with the routed path (they need
# only x). Eagerly that saved 36 us per block at T = 8 (experiments/notes/moe.md); inside the
# CUDA graph of a whole k3-slice step it cost 0.36 ms per step (4.98 ms against 4.62 ms at T = 8,
# experiments/results/h200/step_bench_ab_shared_overlap_{on,off}.json), so it is off.
OVERLAP_SHARED = False


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

    @property
    def experts(self) -> tuple[torch.Tensor, ...]:
        """The routed experts in ops.moe_experts' argument order."""
        return (self.w1_packed, self.w1_scale, self.w3_packed, self.w3_scale, self.w2_packed, self.w2_scale)


def latent_moe(x: torch.Tensor, weights: LatentMoEWeights, cfg: K3Config) -> torch.Tensor:
    """The K3 latent-MoE FFN: x [M, D] -> [M, D] in x.dtype."""
    if x.dim() != 2 or x.shape[1] != weights.gate.shape[1]:
        raise ValueError(f"x: expected [M, {weights.gate.shape[1]}], got {tuple(x.shape)}")
    overlap = OVERLAP_SHARED and x.is_cuda
    if overlap:
        main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            shared = shared_experts(x, weights, cfg)
    ids, route_weights = ops.moe_route(
        x, weights.gate, weights.score_bias, cfg.num_experts_per_token, cfg.routed_scaling_factor
    )
    latent = ops.linear(x, weights.latent_down)
    routed = ops.moe_experts(latent, ids, route_weights, *weights.experts, cfg.situ_beta, cfg.situ_linear_beta)
    routed = ops.rms_norm(routed, weights.latent_norm, cfg.rms_norm_eps).to(x.dtype)
    if overlap:
        # Join. `shared` was allocated on the side stream and is read here on the main one; its
        # memory can only be reused by later side-stream work, which always starts by waiting
        # for the main stream (above), so no record_stream is needed.
        main.wait_stream(side)
    else:
        shared = shared_experts(x, weights, cfg)
    return ops.linear(routed, weights.latent_up) + shared


def shared_experts(x: torch.Tensor, weights: LatentMoEWeights, cfg: K3Config) -> torch.Tensor:
    act = ops.situ_glu(ops.linear(x, weights.shared_gate), ops.linear(x, weights.shared_up), cfg.situ_beta,
                       cfg.situ_linear_beta)
    return ops.linear(act, weights.shared_down)


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream
