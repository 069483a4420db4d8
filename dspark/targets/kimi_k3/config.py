"""Kimi K3 model configuration and presets.

Values of the `k3` preset are the released `config.json` (text_config) as tabulated in
docs/kimi-k3.md §1.2-1.3. `k3-tiny` keeps the structure (layer pattern, dense first
layer, latent MoE, AttnRes blocks) with dims small enough for a CPU test; `k3-slice` keeps the
real dims with only the first four layers (three KDA, one MLA) so it fits one H200.

`k3-rank` (RANK_PRESETS) is not a model of its own: it is one GPU's share of `k3` served on 16
(docs/kimi-k3.md §8), built by load_target with a sharding.Shard.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class K3Config:
    name: str = "k3"
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_layers: int = 93
    # 0-based indices of the gated-MLA layers; every other layer is KDA (docs/kimi-k3.md §1.2).
    mla_layers: tuple[int, ...] = tuple(range(3, 93, 4)) + (92,)
    # KDA (Kimi Delta Attention)
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_conv_size: int = 4
    kda_gate_rank: int = 128  # f_a_proj [128, hidden] -> f_b_proj [H*D, 128]
    kda_gate_lower_bound: float = -5.0
    kda_a_log_size: int = 128  # A_log is stored [128]; the first num_heads entries are used
    # Gated MLA (NoPE)
    mla_num_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # FFN / MoE
    first_k_dense: int = 1
    intermediate_size: int = 33792  # dense layer 0
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    latent_size: int = 3584  # routed_expert_hidden_size
    routed_scaling_factor: float = 1.0
    situ_beta: float = 4.0  # activation_situ_beta
    situ_linear_beta: float = 25.0  # activation_situ_linear_beta
    mxfp4_group_size: int = 32
    # Residual stream
    attn_res_block_size: int = 12
    rms_norm_eps: float = 1e-5
    l2_norm_eps: float = 1e-6
    max_position_embeddings: int = 1_048_576
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    tie_word_embeddings: bool = False

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def kda_width(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_width(self) -> int:
        """Latent KV row per token per MLA layer: 512 compressed + 64 shared key dims."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.mla_layers)

    def layer_type(self, i: int) -> str:
        return "mla" if i in self.mla_layers else "kda"

    def ffn_type(self, i: int) -> str:
        return "dense" if i < self.first_k_dense else "moe"

    # Integer fields for which 0 is meaningful (no dense layer, no shared experts, token id 0).
    _MAY_BE_ZERO = ("first_k_dense", "num_shared_experts", "bos_token_id", "eos_token_id", "pad_token_id")

    def validate(self) -> "K3Config":
        def bad(field_name, value, why):
            raise ValueError(f"K3Config.{field_name}={value!r}: {why}")

        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
                bad(f.name, value, "must be an integer")
            minimum = 0 if f.name in self._MAY_BE_ZERO else 1
            if f.type == "int" and value < minimum:
                bad(f.name, value, f"must be >= {minimum}")
        for i in self.mla_layers:
            if not 0 <= i < self.num_layers:
                bad("mla_layers", self.mla_layers, f"layer {i} outside [0, {self.num_layers})")
        if self.num_experts_per_token > self.num_experts:
            bad("num_experts_per_token", self.num_experts_per_token, f"exceeds num_experts={self.num_experts}")
        for name in ("latent_size", "moe_intermediate_size"):
            if getattr(self, name) % self.mxfp4_group_size:
                bad(name, getattr(self, name), f"must be a multiple of mxfp4_group_size={self.mxfp4_group_size}")
        if self.kda_a_log_size < self.kda_num_heads:
            bad("kda_a_log_size", self.kda_a_log_size, f"smaller than kda_num_heads={self.kda_num_heads}")
        return self


K3 = K3Config().validate()

K3_TINY = dataclasses.replace(
    K3,
    name="k3-tiny",
    vocab_size=256,
    hidden_size=64,
    num_layers=9,
    mla_layers=(3, 7, 8),  # every 4th layer and the last, as in the real layout
    kda_num_heads=4,
    kda_head_dim=16,
    kda_gate_rank=16,
    kda_a_log_size=8,
    mla_num_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    intermediate_size=128,
    num_experts=16,
    num_experts_per_token=4,
    num_shared_experts=2,
    moe_intermediate_size=32,
    latent_size=32,
    attn_res_block_size=3,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
).validate()

K3_SLICE = dataclasses.replace(
    K3,
    name="k3-slice",
    num_layers=4,
    mla_layers=(3,),  # layers 0-2 KDA (layer 0 with the dense FFN), layer 3 MLA, as in K3
).validate()

PRESETS: dict[str, K3Config] = {c.name: c for c in (K3, K3_TINY, K3_SLICE)}

# One rank of a deployment: (the model, the GPUs it is served on). docs/kimi-k3.md §8: TP16
# attention and dense FFN, EP16 experts (56 per rank), vocabulary-parallel embedding and lm_head.
RANK_PRESETS: dict[str, tuple[K3Config, int]] = {"k3-rank": (K3, 16)}


def first_layers(cfg: K3Config, layers: int) -> K3Config:
    """The first `layers` layers of `cfg` (K3_SLICE is K3's first four), for a model that does
    not fit a GPU whole; per-layer figures of it are per-layer figures of `cfg`."""
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= cfg.num_layers:
        raise ValueError(f"layers={layers!r}: must be an integer in [1, {cfg.num_layers}]")
    return dataclasses.replace(cfg, num_layers=layers, mla_layers=tuple(i for i in cfg.mla_layers if i < layers)
                               ).validate()


def get_preset(name: str) -> K3Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown target preset {name!r}; known presets: {sorted(PRESETS)}") from None
