"""Reference K3 router and MXFP4 routed experts, the contracts of the `moe_route` and
`moe_experts` ops (the latent-MoE block built on them: dspark/targets/kimi_k3/moe.py).

docs/kimi-k3.md §1.2-1.3, per token:
    router: logits = x @ gate^T (fp32), scores = sigmoid(logits); the top-k experts by
            scores + e_score_correction_bias (the bias chooses, it does not weigh);
            weights = the chosen raw scores / their sum * routed_scaling_factor
    experts, on the latent h [latent]:
            routed = sum over the chosen experts, in top-k order, of weight_e * w2_e situ(w1_e h, w3_e h)
Routed experts are MXFP4 (kernels/mxfp4.py); only the touched ones are dequantised, once per
call. Token invariance: projections go through the row-invariant `linear` op and elementwise
math is per row (numerics.per_row).
"""
from __future__ import annotations

import weakref

import torch

from .. import ops
from ..mxfp4 import dequantise
from ..numerics import per_row, rms_norm, situ, sum_partials
from ..registry import register


def check_route(gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int) -> None:
    """The arguments moe_route takes (every implementation checks the same contract)."""
    num_experts = gate_weight.shape[0]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: {top_k} outside [1, {num_experts}]")
    if tuple(bias.shape) != (num_experts,):
        raise ValueError(f"bias: expected shape ({num_experts},), got {tuple(bias.shape)}")


@register("moe_router_logits", "reference", priority=0)
def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits: both operands widened to fp32 first (the CPU has no bf16 GEMM with fp32
    output), through the row-invariant linear."""
    if x.dim() != 2 or gate_weight.dim() != 2 or x.shape[1] != gate_weight.shape[1]:
        raise ValueError(f"x / gate_weight: expected [M, D] and [E, D], got {tuple(x.shape)} and "
                         f"{tuple(gate_weight.shape)}")
    return ops.linear(x.float(), gate_weight.float())  # fp32 router (docs/kimi-k3.md §1.2)


@register("moe_route", "reference", priority=0)
def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    check_route(gate_weight, bias, top_k)
    return route_logits(router_logits(x, gate_weight), bias, top_k, scaling)


@register("moe_route_logits", "reference", priority=0)
def route_logits(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """The router's selection from fp32 logits [M, E] (the contract of `moe_route_logits`)."""
    if not 1 <= top_k <= logits.shape[-1] or tuple(bias.shape) != (logits.shape[-1],):
        raise ValueError(f"top_k / bias: top_k={top_k} and bias {tuple(bias.shape)} for {logits.shape[-1]} experts")
    selection_bias = bias.float()

    def route(rows: torch.Tensor) -> torch.Tensor:  # [..., E] -> [..., 2k]: ids | weights
        scores = torch.sigmoid(rows)
        ids = torch.topk(scores + selection_bias, top_k, dim=-1).indices
        chosen = scores.gather(-1, ids)
        weights = chosen / chosen.sum(-1, keepdim=True) * scaling
        return torch.cat([ids.float(), weights], dim=-1)  # ids < 2^24 are exact in fp32

    routed = per_row(route, logits.float())
    return routed[:, :top_k].long(), routed[:, top_k:]


def check_dispatch_inputs(partials: torch.Tensor, router_width: int, dtype: torch.dtype, copies: int) -> None:
    """The arguments moe_dispatch_inputs takes (every implementation checks the same contract)."""
    if partials.dim() != 3 or partials.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"partials: expected split-K partials [S, M, N] in float32 (float64: a reference run), "
                         f"got {partials.dtype} {tuple(partials.shape)}")
    if not 0 < router_width < partials.shape[2]:
        raise ValueError(f"router_width: {router_width} must leave router and latent columns in the partials' "
                         f"{partials.shape[2]}")
    if not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies: {copies!r} must be a positive integer")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype: {dtype} is not a floating-point type")


@register("moe_dispatch_inputs", "reference", priority=0)
def moe_dispatch_inputs(partials: torch.Tensor, router_width: int, dtype: torch.dtype, copies: int):
    """The router's fp32 logits and the latent in `dtype`, each repeated `copies` times along the last
    dimension, from the router | latent-down GEMM's split-K partials (ops.moe_dispatch_inputs)."""
    check_dispatch_inputs(partials, router_width, dtype, copies)
    total = sum_partials(partials, partials.dtype)  # float32 (float64 partials: a reference run)
    logits, latent = total[:, :router_width], total[:, router_width:].to(dtype)
    return logits.float().repeat(1, copies), latent.repeat(1, copies)


def check_experts(latent, ids, route_weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale) -> None:
    """The shapes moe_experts takes (every implementation checks the same contract)."""
    num_experts, inter, half_latent = w1_packed.shape
    expected = {
        "w1_scale": (w1_scale, (num_experts, inter, half_latent // 16)),
        "w3_packed": (w3_packed, (num_experts, inter, half_latent)),
        "w3_scale": (w3_scale, (num_experts, inter, half_latent // 16)),
        "w2_packed": (w2_packed, (num_experts, half_latent * 2, inter // 2)),
        "w2_scale": (w2_scale, (num_experts, half_latent * 2, inter // 32)),
    }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} (from w1_packed {tuple(w1_packed.shape)}), "
                             f"got {tuple(tensor.shape)}")
    if latent.dim() != 2 or latent.shape[1] != half_latent * 2:
        raise ValueError(f"latent: expected [M, {half_latent * 2}], got {tuple(latent.shape)}")
    if ids.dim() != 2 or ids.shape[0] != latent.shape[0] or tuple(route_weights.shape) != tuple(ids.shape):
        raise ValueError(f"ids / route_weights: expected [{latent.shape[0]}, k] each, got {tuple(ids.shape)} "
                         f"and {tuple(route_weights.shape)}")


# A CPU run of a small model (k3-tiny: the tests, the README's examples) spent a sixth of its step
# dequantising the same experts again at every call. Expert weights do not change between calls, so the
# CPU reference keeps each small expert's dequantised matrix on the stacked tensor it came from, checked
# against both tensors' versions (an in-place write rebuilds it). Larger experts (a whole K3 on the CPU)
# are dequantised per call as before: keeping them would double the weights' memory.
CACHED_EXPERT_ELEMENTS = 1 << 20


def _expert_weight(packed: torch.Tensor, scale: torch.Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
    """dequantise(packed[e], scale[e], dtype), kept for the next call where it is small and on the CPU."""
    if packed.device.type != "cpu" or packed[e].numel() * 2 > CACHED_EXPERT_ELEMENTS:
        return dequantise(packed[e], scale[e], dtype)
    kept = packed.__dict__.setdefault("_dspark_dequantised", {})
    entry = kept.get((e, dtype))
    if entry is not None:
        versions, scale_ref, weight = entry
        if versions == (packed._version, scale._version) and scale_ref() is scale:
            return weight
    weight = dequantise(packed[e], scale[e], dtype)
    kept[(e, dtype)] = ((packed._version, scale._version), weakref.ref(scale), weight)
    return weight


@register("moe_experts", "reference", priority=0, reads_device_values=True)
def moe_experts(latent, ids, route_weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                situ_beta: float, situ_linear_beta: float) -> torch.Tensor:
    check_experts(latent, ids, route_weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale)
    # Each touched expert runs once on the tokens routed to it (row-invariant linear: a token's
    # bits do not depend on which other tokens share the call); outputs land at (token, slot).
    expert_out = torch.zeros(*ids.shape, latent.shape[1], dtype=torch.float32, device=latent.device)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        w1, w3, w2 = (_expert_weight(packed, scale, e, latent.dtype)
                      for packed, scale in ((w1_packed, w1_scale), (w3_packed, w3_scale), (w2_packed, w2_scale)))
        h = latent[rows]
        act = situ(ops.linear(h, w1), ops.linear(h, w3), situ_beta, situ_linear_beta)
        expert_out[rows, slots] = ops.linear(act, w2).float()
    routed = route_weights[:, :1] * expert_out[:, 0]
    for slot in range(1, ids.shape[1]):  # fixed order: the top-k order
        routed = routed + route_weights[:, slot : slot + 1] * expert_out[:, slot]
    return routed


def check_tail_inputs(routed, latent_norm, shared_gate_up, start: int, width: int) -> None:
    """The arguments moe_tail_inputs takes (every implementation checks the same contract)."""
    if routed.dim() != 2 or routed.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"routed: expected fp32 (float64: a reference run) [M, L], got {routed.dtype} "
                         f"{tuple(routed.shape)}")
    M, L = routed.shape
    if tuple(latent_norm.shape) != (L,):
        raise ValueError(f"latent_norm: expected shape ({L},), got {tuple(latent_norm.shape)}")
    if shared_gate_up.dim() not in (2, 3) or shared_gate_up.shape[-2] != M or shared_gate_up.shape[-1] % 2:
        raise ValueError(f"shared_gate_up: expected [{M}, 2S] or split-K partials [splits, {M}, 2S], "
                         f"got {tuple(shared_gate_up.shape)}")
    if not (isinstance(start, int) and isinstance(width, int) and 0 <= start and 1 <= width and start + width <= L):
        raise ValueError(f"start / width: columns [{start}, {start} + {width}) outside the latent's [0, {L})")


def tail_dtype(latent_norm: torch.Tensor, shared_gate_up: torch.Tensor) -> torch.dtype:
    """moe_tail_inputs' result dtype: shared_gate_up's; latent_norm's (the model's) when gate|up comes as
    split-K partials, which are fp32."""
    return latent_norm.dtype if shared_gate_up.dim() == 3 else shared_gate_up.dtype


@register("moe_tail_inputs", "reference", priority=0)
def moe_tail_inputs(routed: torch.Tensor, latent_norm: torch.Tensor, shared_gate_up: torch.Tensor, start: int,
                    width: int, eps: float, situ_beta: float, situ_linear_beta: float) -> torch.Tensor:
    """rms_norm's and situ_glu's references, side by side: [M, width + S] in shared_gate_up's dtype.
    shared_gate_up may be split-K partials [splits, M, 2S] (ops.linear_partials): summed and rounded to
    latent_norm's dtype first, as the GEMM's reduction would, and the result takes that dtype."""
    check_tail_inputs(routed, latent_norm, shared_gate_up, start, width)
    if shared_gate_up.dim() == 3:
        shared_gate_up = sum_partials(shared_gate_up, latent_norm.dtype)
    normed = rms_norm(routed, latent_norm, eps).to(shared_gate_up.dtype)[:, start : start + width]
    gate, up = shared_gate_up.chunk(2, dim=-1)
    return torch.cat([normed, situ(gate, up, situ_beta, situ_linear_beta)], dim=-1)
