"""K3's latent-MoE FFN block (docs/kimi-k3.md §1.2-1.3), written once over the kernel ops.

Per token x [D]:
    ids, weights = moe_route(x)                                  (top-k of the sigmoid router)
    h = latent_down x                                            [latent]
    routed = moe_experts(h, ids, weights)                        (MXFP4 experts, weighted, summed)
    out = latent_up RMSNorm(routed; routed_expert_norm) + shared_down situ(shared_gate x, shared_up x)
The last line is one GEMM, [RMSNorm(routed) | situ(...)] against [latent_up | shared_down]
(ops.moe_tail_inputs builds its input in one launch): the two products are summed in the GEMM's
fp32 accumulator and rounded once, where two GEMMs and an add would round three times.
Every projection is `ops.linear`; the elementwise parts are per row (kernels/numerics.py), so on
the CPU a token's output does not depend on the tokens beside it, bit for bit.

`rank_latent_moe` is one rank's share of the block (docs/kimi-k3.md §8): the router and latent
down projection are column-parallel (their outputs gathered: the EP dispatch), the rank's experts
run on its pairs (parallel.RankParallel.local_pairs), their latent sums are all-reduced (the EP
combine) before the latent norm, and the latent up and shared-expert projections are row-parallel
(one all-reduce of the sum).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.kernels import ops

from .config import K3Config

# A rank's router and latent-down projections read the same x and are both gathered over the ranks
# (the EP dispatch's inputs): as one GEMM whose split-K partials one kernel adds, splits into fp32
# logits and the model-dtype latent, and gathers (parallel.RankParallel.dispatch_inputs), they take
# two launches where the router's GEMV, the latent GEMM, its reduction and the two gathers took five
# (docs/kimi-k3.md §8.5). experiments/step_bench.py --setting rank_dispatch_gemm=0 times the five.
DISPATCH_IN_ONE_GEMM = True
# With it, the shared experts' gate|up rows join that GEMM too (LatentMoEWeights.moe_inputs: every
# projection that reads the FFN's input): its partials' column windows go to the dispatch kernel and to
# moe_tail_inputs, one GEMM a MoE layer where there were two (docs/kimi-k3.md §8.5).
# experiments/step_bench.py --setting rank_inputs_gemm=0 times the two.
INPUTS_IN_ONE_GEMM = True


@dataclass
class LatentMoEWeights:
    """One MoE layer. Dense tensors in the model dtype (router bias fp32); routed experts are
    stacked MXFP4: w1/w3 [E, I, latent/2] + scales [E, I, latent/32], w2 [E, latent, I/2] +
    scales [E, latent, I/32].

    The shared experts' gate [S, D] and up [S, D] projections are held as one tensor
    `shared_gate_up` [2S, D] and run as one GEMM, as the dense FFN's are: at K3's size (12288 x
    7168) the H200 ran it at 0.88-0.94 of the read ceiling with 4 splits
    (experiments/results/h200/kernels_bench.json, "mla_g/shared_gate_up"), and a layer saves a
    GEMM and its split-K reduction. latent_down stays apart: fused with them, the heuristic would
    run the 15872-row matrix unsplit, one CTA per SM, which reached 0.74 of the ceiling on the
    12288-row one.

    The block's two output projections, latent up [D, latent] and shared down [D, S], are held
    side by side along K as `output_proj` [D, latent + S]: their sum is one GEMM of the
    concatenated inputs (ops.moe_tail_inputs), which saves a GEMM, the add after it, and on a
    rank the copy of its latent window (docs/kimi-k3.md §8.5). `from_parts` builds one from the
    separate matrices.

    Every projection that reads the block's input lies in one tensor, `moe_inputs` [E + latent + 2S, D]
    (gate | latent_down | shared_gate_up), and those three are its row views: built here, or by the
    caller (K3Model._fuse_rows, which keeps one copy of the checkpoint's rows). A rank runs them as
    one GEMM (rank_latent_moe); the whole model's path runs them apart."""

    gate: torch.Tensor  # [E, D] router (E a rank's experts)
    score_bias: torch.Tensor  # [E] fp32 e_score_correction_bias
    latent_down: torch.Tensor  # [latent, D]
    latent_norm: torch.Tensor  # [latent] (a rank's: the whole latent; it normalises the summed latent)
    shared_gate_up: torch.Tensor  # [2S, D]: shared_gate | shared_up
    output_proj: torch.Tensor  # [D, latent' + S]: latent_up | shared_down (latent' the rank's columns)
    w1_packed: torch.Tensor
    w1_scale: torch.Tensor
    w3_packed: torch.Tensor
    w3_scale: torch.Tensor
    w2_packed: torch.Tensor
    w2_scale: torch.Tensor
    moe_inputs: torch.Tensor | None = None  # [E + latent + 2S, D], see the class docstring

    def __post_init__(self):
        if self.shared_gate_up.dim() != 2 or self.shared_gate_up.shape[0] % 2:
            raise ValueError(f"LatentMoEWeights.shared_gate_up: expected [2S, D] (shared_gate | shared_up), "
                             f"got {tuple(self.shared_gate_up.shape)}")
        rows = [self.gate.shape[0], self.latent_down.shape[0], self.shared_gate_up.shape[0]]
        if self.moe_inputs is None:
            self.moe_inputs = torch.cat([self.gate, self.latent_down, self.shared_gate_up])
        elif self.moe_inputs.shape[0] != sum(rows):
            raise ValueError(f"LatentMoEWeights.moe_inputs: expected [{rows[0]} + {rows[1]} + {rows[2]}, D] (gate | "
                             f"latent_down | shared_gate_up), got {tuple(self.moe_inputs.shape)}")
        self.gate, self.latent_down, self.shared_gate_up = self.moe_inputs.split(rows)
        shared = self.shared_gate_up.shape[0] // 2
        if self.output_proj.dim() != 2 or self.output_proj.shape[1] <= shared:
            raise ValueError(f"LatentMoEWeights.output_proj: expected [D, latent + {shared}] (latent_up | "
                             f"shared_down), got {tuple(self.output_proj.shape)}")

    @classmethod
    def from_parts(cls, *, shared_gate, shared_up, latent_up, shared_down, **others) -> "LatentMoEWeights":
        """From the separate projections (copied into the fused tensors)."""
        return cls(shared_gate_up=torch.cat([shared_gate, shared_up]),
                   output_proj=torch.cat([latent_up, shared_down], dim=1), **others)

    @property
    def router_latent_down(self) -> torch.Tensor:
        """[E + latent, D]: gate | latent_down, the rank's dispatch GEMM (rank_latent_moe)."""
        return self.moe_inputs[: self.gate.shape[0] + self.latent_down.shape[0]]

    @property
    def shared_size(self) -> int:
        return self.shared_gate_up.shape[0] // 2

    @property
    def shared_gate(self) -> torch.Tensor:
        return self.shared_gate_up[: self.shared_size]

    @property
    def shared_up(self) -> torch.Tensor:
        return self.shared_gate_up[self.shared_size :]

    @property
    def latent_width(self) -> int:
        """The latent columns latent_up holds (all of them; a rank's share on a rank)."""
        return self.output_proj.shape[1] - self.shared_size

    @property
    def latent_up(self) -> torch.Tensor:
        return self.output_proj[:, : self.latent_width]

    @property
    def shared_down(self) -> torch.Tensor:
        return self.output_proj[:, self.latent_width :]

    @property
    def experts(self) -> tuple[torch.Tensor, ...]:
        """The routed experts in ops.moe_experts' argument order."""
        return (self.w1_packed, self.w1_scale, self.w3_packed, self.w3_scale, self.w2_packed, self.w2_scale)


def _output(x: torch.Tensor, routed: torch.Tensor, weights: LatentMoEWeights, cfg: K3Config,
            start: int, partials: bool, split_k_into_tail: bool, gate_up: torch.Tensor | None = None) -> torch.Tensor:
    """latent_up RMSNorm(routed)[start : start + latent'] + shared_down SiTU(shared_gate x, shared_up x)
    as one GEMM of [normed latent window | shared activation] against output_proj; `partials`: left as
    its split-K partials (ops.linear_partials) for the mix norm that adds it; `split_k_into_tail`: the
    shared gate|up GEMM's partials added by moe_tail_inputs instead of a reduction launch; `gate_up`: that
    GEMM's output (or partials) where the caller ran it."""
    if gate_up is None:
        gate_up = (ops.linear_partials if split_k_into_tail else ops.linear)(x, weights.shared_gate_up)
    tail = ops.moe_tail_inputs(routed, weights.latent_norm, gate_up, start, weights.latent_width, cfg.rms_norm_eps,
                               cfg.situ_beta, cfg.situ_linear_beta)
    return (ops.linear_partials if partials else ops.linear)(tail, weights.output_proj)


def latent_moe(x: torch.Tensor, weights: LatentMoEWeights, cfg: K3Config, record: list | None = None,
               partials: bool = False, split_k_into_tail: bool = False) -> torch.Tensor:
    """The K3 latent-MoE FFN: x [M, D] -> [M, D] in x.dtype (with `partials`, its split-K partials
    [S, M, D]: ops.linear_partials; `split_k_into_tail`: _output's). `record`: a list the expert ids
    [M, k] of the call are appended to (left on the device)."""
    if x.dim() != 2 or x.shape[1] != weights.gate.shape[1]:
        raise ValueError(f"x: expected [M, {weights.gate.shape[1]}], got {tuple(x.shape)}")
    ids, route_weights = ops.moe_route(
        x, weights.gate, weights.score_bias, cfg.num_experts_per_token, cfg.routed_scaling_factor
    )
    if record is not None:
        record.append(ids)
    latent = ops.linear(x, weights.latent_down)
    routed = ops.moe_experts(latent, ids, route_weights, *weights.experts, cfg.situ_beta, cfg.situ_linear_beta)
    # The shared experts run in line: on a side stream, concurrently with the routed path, they
    # cost more per k3-slice step inside the step's CUDA graph than they saved (the fork and
    # join; the A/B is in experiments/notes/step.md).
    return _output(x, routed, weights, cfg, 0, partials, split_k_into_tail)


def rank_latent_moe(x: torch.Tensor, weights: LatentMoEWeights, cfg: K3Config, parallel,
                    record: list | None = None, partials: bool = False, split_k_into_tail: bool = False) -> torch.Tensor:
    """One rank's share of the latent-MoE FFN: x [M, D] (the same on every rank) -> the rank's
    partial output, all-reduced by `parallel` (a parallel.RankParallel). `weights` holds the
    rank's parts: router and latent down rows, latent up and shared down columns, shared gate|up
    rows, its experts. `record` gets the local expert ids [M, k'] the rank's experts run on."""
    gate_up = None
    if DISPATCH_IN_ONE_GEMM:
        if INPUTS_IN_ONE_GEMM:  # the partials' column windows: gate | latent_down, then shared gate|up
            dispatch, gate_up = ops.linear_partials(x, weights.moe_inputs).split(
                [weights.router_latent_down.shape[0], weights.shared_gate_up.shape[0]], dim=-1)
        else:
            dispatch = ops.linear_partials(x, weights.router_latent_down)
        logits, latent = parallel.dispatch_inputs(dispatch, weights.gate.shape[0], x.dtype)
    else:
        logits = parallel.all_gather(ops.moe_router_logits(x, weights.gate))
        latent = parallel.all_gather(ops.linear(x, weights.latent_down))
    ids, route_weights = ops.moe_route_logits(logits, weights.score_bias, cfg.num_experts_per_token,
                                              cfg.routed_scaling_factor)
    local_ids, local_weights = parallel.local_pairs(ids, route_weights)
    if record is not None:
        record.append(local_ids)
    partial = ops.moe_experts(latent, local_ids, local_weights, *weights.experts, cfg.situ_beta, cfg.situ_linear_beta)
    return parallel.all_reduce(_output(x, parallel.all_reduce(partial), weights, cfg, parallel.latent.start, partials,
                                       split_k_into_tail, gate_up))
