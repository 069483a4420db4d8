"""Which part of every K3 tensor one rank holds when K3 is served on `world` GPUs: attention and
the dense FFN tensor-parallel, the routed experts expert-parallel, the embedding and lm_head
vocabulary-parallel (docs/kimi-k3.md §8).

A rule per checkpoint tensor (its name relative to `layers.{i}.`, or the model-level name):
- ROWS: the output dimension is split (column-parallel: q/k/v/g projections by head, the
  short-conv taps, the KDA decay input f_b, write strengths b, dt_bias, MLA q_b and kv_b by
  head, the dense FFN's and shared experts' gate/up, the router and the latent down
  projection by expert / latent column, embedding and lm_head by vocabulary);
- COLUMNS: the input dimension is split (row-parallel, the partial outputs are summed by an
  all-reduce: attention o_proj, the FFN down projections, the latent up projection);
- REPLICATED: every rank holds it whole. Norm weights and AttnRes pseudo-queries (vectors); the
  router's correction bias (top-k needs all 896); KDA's f_a (the low-rank decay input: f_b's
  shards all need its whole output) and o_norm (per head-dim, shared by the heads); MLA's
  q_a / kv_a projections and their norms (every head reads the whole c_q and the shared latent
  c_kv; vLLM's MLA replicates them as well);
- HEADS: A_log, stored [128] with the first H entries used: the rank keeps its heads' entries;
- routed experts: rank r holds experts [r N/world, (r+1) N/world) (contiguous blocks, the
  layout of FlashInfer's MegaMoE and of the roofline's EP floor).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .config import K3Config

ROWS, COLUMNS, REPLICATED, HEADS = "rows", "columns", "replicated", "heads"

_ATTN = "self_attn."
_MOE = "block_sparse_moe."
LAYER_RULES = {
    **{f"{norm}.weight": REPLICATED for norm in
       ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm",
        "self_attention_res_proj", "mlp_res_proj")},
    # KDA (the g_proj and o_proj rules are gated MLA's as well)
    **{f"{_ATTN}{p}_proj.weight": ROWS for p in ("q", "k", "v", "g")},
    **{f"{_ATTN}{p}_conv1d.weight": ROWS for p in ("q", "k", "v")},
    f"{_ATTN}f_a_proj.weight": REPLICATED,
    f"{_ATTN}f_b_proj.weight": ROWS,
    f"{_ATTN}b_proj.weight": ROWS,
    f"{_ATTN}dt_bias": ROWS,
    f"{_ATTN}A_log": HEADS,
    f"{_ATTN}o_norm.weight": REPLICATED,
    f"{_ATTN}o_proj.weight": COLUMNS,
    # gated MLA
    f"{_ATTN}q_a_proj.weight": REPLICATED,
    f"{_ATTN}q_a_layernorm.weight": REPLICATED,
    f"{_ATTN}kv_a_proj_with_mqa.weight": REPLICATED,
    f"{_ATTN}kv_a_layernorm.weight": REPLICATED,
    f"{_ATTN}q_b_proj.weight": ROWS,
    f"{_ATTN}kv_b_proj.weight": ROWS,
    # dense FFN (layer 0)
    "mlp.gate_proj.weight": ROWS,
    "mlp.up_proj.weight": ROWS,
    "mlp.down_proj.weight": COLUMNS,
    # latent MoE
    f"{_MOE}gate.weight": ROWS,
    f"{_MOE}gate.e_score_correction_bias": REPLICATED,
    f"{_MOE}routed_expert_down_proj.weight": ROWS,
    f"{_MOE}routed_expert_norm.weight": REPLICATED,
    f"{_MOE}routed_expert_up_proj.weight": COLUMNS,
    f"{_MOE}shared_experts.gate_proj.weight": ROWS,
    f"{_MOE}shared_experts.up_proj.weight": ROWS,
    f"{_MOE}shared_experts.down_proj.weight": COLUMNS,
}
MODEL_RULES = {
    "language_model.model.embed_tokens.weight": ROWS,
    "language_model.lm_head.weight": ROWS,
    "language_model.model.norm.weight": REPLICATED,
    "language_model.model.output_attn_res_norm.weight": REPLICATED,
    "language_model.model.output_attn_res_proj.weight": REPLICATED,
}
_LAYER_TENSOR = re.compile(r"language_model\.model\.layers\.\d+\.(.+)")


def rule(name: str) -> str:
    """The sharding rule of a (non-expert) checkpoint tensor; ValueError for a name with none."""
    if name in MODEL_RULES:
        return MODEL_RULES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match.group(1) not in LAYER_RULES:
        raise ValueError(f"tensor {name!r}: no sharding rule (dspark/targets/kimi_k3/sharding.py)")
    return LAYER_RULES[match.group(1)]


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world`; world 1 is the whole model."""

    rank: int = 0
    world: int = 1

    def validate(self, cfg: K3Config) -> "Shard":
        for name in ("rank", "world"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"Shard.{name}={value!r}: must be an integer")
        if self.world < 1:
            raise ValueError(f"Shard.world={self.world}: must be >= 1")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"Shard.rank={self.rank}: outside [0, world={self.world})")
        sizes = {"kda_num_heads": cfg.kda_num_heads, "mla_num_heads": cfg.mla_num_heads,
                 "num_experts": cfg.num_experts, "vocab_size": cfg.vocab_size, "latent_size": cfg.latent_size,
                 "intermediate_size": cfg.intermediate_size,
                 "shared_intermediate_size": cfg.shared_intermediate_size}
        for name, size in sizes.items():
            if size % self.world:
                raise ValueError(f"Shard.world={self.world}: does not divide K3Config.{name}={size}")
        if self.world > 1 and cfg.num_experts // self.world < cfg.num_experts_per_token:
            # the exact routing (parallel.exact_local_pairs) gives a row's foreign pairs distinct
            # local experts of weight 0: it needs top_k of them
            raise ValueError(f"Shard.world={self.world}: leaves {cfg.num_experts // self.world} experts per rank, "
                             f"fewer than num_experts_per_token={cfg.num_experts_per_token}")
        return self

    def part(self, size: int) -> slice:
        """This rank's block of a dimension of `size` split evenly."""
        step = size // self.world
        return slice(self.rank * step, (self.rank + 1) * step)

    def experts(self, cfg: K3Config) -> range:
        block = self.part(cfg.num_experts)
        return range(block.start, block.stop)


def shard_shape(cfg: K3Config, shard: Shard, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape rank `shard` holds of the (non-expert) tensor `name` of full shape `shape`."""
    kind = rule(name)
    if shard.world == 1 or kind == REPLICATED:
        return tuple(shape)
    if kind == HEADS:
        return (cfg.kda_num_heads // shard.world,)
    dim = 0 if kind == ROWS else 1
    return tuple(size // shard.world if d == dim else size for d, size in enumerate(shape))


def shard_view(cfg: K3Config, shard: Shard, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Rank `shard`'s part of the full (non-expert) tensor `name`, a view."""
    kind = rule(name)
    if shard.world == 1 or kind == REPLICATED:
        return tensor
    if kind == HEADS:
        return tensor[: cfg.kda_num_heads][shard.part(cfg.kda_num_heads)]
    if kind == ROWS:
        return tensor[shard.part(tensor.shape[0])]
    return tensor[:, shard.part(tensor.shape[1])]
