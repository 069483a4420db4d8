"""DSpark drafter configuration, its config.json form, and presets.

The config.json keys are those of the published Kimi K3 DSpark drafter (`K3DSparkModel`,
`model_type` "k3_dspark"; docs/kimi-k3.md §4), so a checkpoint written in that layout
loads here and one written here loads there. Keys this package adds (`block_size`,
`attention_type`, `head_dim`, `rope_interleaved`, `confidence_temperatures`, ...) are extra keys
that other loaders ignore.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path


def _bad(name: str, value, why: str) -> None:
    raise ValueError(f"DSparkConfig.{name}={value!r}: {why}")


@dataclass(frozen=True)
class DSparkConfig:
    name: str = "custom"
    vocab_size: int = 163840
    hidden_size: int = 7168  # = the target's hidden size (embeddings and lm_head are shared)
    num_layers: int = 5
    num_heads: int = 64
    intermediate_size: int = 14336
    hidden_act: str = "silu"  # SwiGLU MLP
    # "mla": DeepSeek/Kimi latent attention (the published K3 drafter); "gqa": grouped-query
    # attention with per-head q/k RMSNorm (Qwen3 style), cheaper for small configs.
    attention_type: str = "mla"
    # MLA dims
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # GQA dims
    num_kv_heads: int = 64
    head_dim: int = 128
    # Positions (docs/dspark-algorithm.md §2.2: block slots continue from the anchor's position)
    use_rope: bool = True
    rope_theta: float = 50000.0
    rope_interleaved: bool = True  # DeepSeek-style pairs (x0,x1),(x2,x3)...; False = rotate halves
    rope_scaling: dict | None = field(default=None, hash=False, compare=True)  # YaRN parameters or None
    max_position_embeddings: int = 1_048_576
    rms_norm_eps: float = 1e-5
    # Conditioning on the target (docs/dspark-algorithm.md §2.1)
    target_hidden_size: int = 7168
    target_num_layers: int = 93
    target_layer_ids: tuple[int, ...] = (2, 23, 47, 71, 89)
    # Block and heads (docs/dspark-algorithm.md §2.2, §2.5, §2.6)
    block_size: int = 7
    # The block's mask input (docs/dspark-algorithm.md §2.2): a row of the target's embedding (K3 reserves 163837),
    # or vocab_size for a dedicated row past the vocabulary when every id is a real token.
    mask_token_id: int = 163837
    markov_rank: int = 256
    markov_head_type: str = "vanilla"  # or "gated"
    confidence_head_with_markov: bool = True
    confidence_bias: bool = True
    # Sequential temperature scaling of the confidence logits, one per block position
    # (docs/dspark-algorithm.md §5.2); None until `calibrate` has fitted them.
    confidence_temperatures: tuple[float, ...] | None = None

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention_type == "mla" else self.head_dim

    @property
    def rope_dim(self) -> int:
        """How many dims of each query/key head are rotated."""
        return self.qk_rope_head_dim if self.attention_type == "mla" else self.head_dim

    def validate(self) -> "DSparkConfig":
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "target_hidden_size", "target_num_layers", "block_size", "markov_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                _bad(name, value, "must be an integer >= 1")
        if self.hidden_act != "silu":
            _bad("hidden_act", self.hidden_act, "only 'silu' (SwiGLU) is implemented")
        if self.attention_type not in ("mla", "gqa"):
            _bad("attention_type", self.attention_type, "must be 'mla' or 'gqa'")
        if self.attention_type == "gqa":
            if self.num_heads % self.num_kv_heads:
                _bad("num_kv_heads", self.num_kv_heads, f"must divide num_heads={self.num_heads}")
            if self.use_rope and self.head_dim % 2:
                _bad("head_dim", self.head_dim, "must be even for RoPE")
        elif self.use_rope and self.qk_rope_head_dim % 2:
            _bad("qk_rope_head_dim", self.qk_rope_head_dim, "must be even for RoPE")
        if not self.target_layer_ids:
            _bad("target_layer_ids", self.target_layer_ids, "needs at least one tapped layer")
        for layer in self.target_layer_ids:
            # docs/dspark-algorithm.md §2.1: the last target layer must not be tapped; -1 means the embeddings
            if not -1 <= layer < self.target_num_layers - 1:
                _bad("target_layer_ids", self.target_layer_ids,
                     f"layer {layer} outside [-1, target_num_layers - 1) = [-1, {self.target_num_layers - 1})")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            _bad("target_layer_ids", self.target_layer_ids, "has duplicates")
        # vocab_size itself is the dedicated mask id: one embedding row past the target's
        # vocabulary, which no lm_head row can emit (DSparkModel.mask_embedding).
        if not 0 <= self.mask_token_id <= self.vocab_size:
            _bad("mask_token_id", self.mask_token_id,
                 f"outside [0, vocab_size={self.vocab_size}] (vocab_size = the dedicated mask row)")
        if self.markov_head_type not in ("vanilla", "gated"):
            _bad("markov_head_type", self.markov_head_type, "must be 'vanilla' or 'gated'")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") != "yarn":
            _bad("rope_scaling", self.rope_scaling, "only rope_type 'yarn' is implemented")
        temps = self.confidence_temperatures
        if temps is not None:
            if len(temps) != self.block_size:
                _bad("confidence_temperatures", temps, f"needs block_size={self.block_size} entries")
            if any(not t > 0 for t in temps):
                _bad("confidence_temperatures", temps, "every temperature must be > 0")
        return self

    # ---- config.json -------------------------------------------------------------------------
    def to_json_dict(self) -> dict:
        d = {
            "architectures": ["K3DSparkModel"] if self.attention_type == "mla" else ["DSparkDraftModel"],
            "model_type": "k3_dspark" if self.attention_type == "mla" else "dspark",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "attention_type": self.attention_type,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "head_dim": self.head_dim,
            "mla_use_nope": not self.use_rope,
            "mla_use_output_gate": False,
            "rope_interleaved": self.rope_interleaved,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "num_target_layers": self.num_taps,
            "target_hidden_size": self.target_hidden_size,
            "target_num_hidden_layers": self.target_num_layers,
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
            "enable_confidence_head": True,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "confidence_bias": self.confidence_bias,
            "tie_word_embeddings": False,
            "dspark_name": self.name,
        }
        if self.rope_scaling is not None:
            d["rope_parameters"] = {**self.rope_scaling, "rope_theta": self.rope_theta}
        if self.confidence_temperatures is not None:
            d["confidence_temperatures"] = list(self.confidence_temperatures)
        return d

    @classmethod
    def from_json_dict(cls, d: dict) -> "DSparkConfig":
        def need(key):
            if key not in d:
                raise ValueError(f"drafter config.json: missing required key {key!r}")
            return d[key]

        if not d.get("enable_confidence_head", True):
            raise ValueError("drafter config.json: enable_confidence_head=False is not supported")
        if d.get("mla_use_output_gate", False):
            raise ValueError("drafter config.json: mla_use_output_gate=True is not supported")
        if d.get("draft_vocab_size", d.get("vocab_size")) != d.get("vocab_size"):
            raise ValueError(f"drafter config.json: draft_vocab_size={d.get('draft_vocab_size')!r} differs from "
                             f"vocab_size={d.get('vocab_size')!r}; pruned draft vocabularies are not supported")
        attention = d.get("attention_type", "mla")
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        rope_scaling = None
        if rope is not None and rope.get("rope_type", rope.get("type")) not in (None, "default"):
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        taps = tuple(int(x) for x in need("target_layer_ids"))
        if "num_target_layers" in d and d["num_target_layers"] != len(taps):
            raise ValueError(f"drafter config.json: num_target_layers={d['num_target_layers']!r} but "
                             f"target_layer_ids has {len(taps)} entries")
        temps = d.get("confidence_temperatures")
        default = cls()
        return cls(
            name=d.get("dspark_name", "loaded"),
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=need("num_attention_heads"),
            intermediate_size=need("intermediate_size"),
            hidden_act=d.get("hidden_act", "silu"),
            attention_type=attention,
            q_lora_rank=d.get("q_lora_rank", default.q_lora_rank),
            kv_lora_rank=d.get("kv_lora_rank", default.kv_lora_rank),
            qk_nope_head_dim=d.get("qk_nope_head_dim", default.qk_nope_head_dim),
            qk_rope_head_dim=d.get("qk_rope_head_dim", default.qk_rope_head_dim),
            v_head_dim=d.get("v_head_dim", default.v_head_dim),
            num_kv_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            head_dim=d.get("head_dim", default.head_dim),
            use_rope=not d.get("mla_use_nope", False),
            rope_theta=float((rope or {}).get("rope_theta", d.get("rope_theta", default.rope_theta))),
            rope_interleaved=d.get("rope_interleaved", attention == "mla"),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", default.max_position_embeddings),
            rms_norm_eps=d.get("rms_norm_eps", default.rms_norm_eps),
            target_hidden_size=d.get("target_hidden_size", d["hidden_size"]),
            target_num_layers=need("target_num_hidden_layers"),
            target_layer_ids=taps,
            block_size=d.get("block_size", default.block_size),
            mask_token_id=need("mask_token_id"),
            markov_rank=need("markov_rank"),
            markov_head_type=d.get("markov_head_type", "vanilla"),
            confidence_head_with_markov=d.get("confidence_head_with_markov", True),
            confidence_bias=d.get("confidence_bias", True),
            confidence_temperatures=tuple(float(t) for t in temps) if temps is not None else None,
        ).validate()

    def save(self, directory: str | Path) -> None:
        Path(directory, "config.json").write_text(json.dumps(self.to_json_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "DSparkConfig":
        return cls.from_json_dict(json.loads(Path(directory, "config.json").read_text()))


# The published Kimi K3 DSpark drafter (Inferact/Kimi-K3-DSpark; docs/kimi-k3.md §4): 5 dense MLA
# layers, 64 heads, hidden 7168, FFN 14336, q/kv LoRA 1536/512, nope/rope/v 128/64/128, block 7,
# taps [2, 23, 47, 71, 89], vanilla Markov rank 256, mask token 163837, YaRN x32 over 32768.
K3_DSPARK = DSparkConfig(
    name="k3_dspark",
    rope_scaling={
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 32768,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
).validate()

# The same layout at dims a CPU test can afford, drafting for the k3-tiny target (hidden 64,
# 9 layers, vocab 256; dspark/targets/kimi_k3/config.py).
K3_TINY_DSPARK = dataclasses.replace(
    K3_DSPARK,
    name="k3-tiny_dspark",
    vocab_size=256,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    intermediate_size=128,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    target_hidden_size=64,
    target_num_layers=9,
    target_layer_ids=(1, 4, 7),
    mask_token_id=253,
    markov_rank=32,
    max_position_embeddings=1024,
    rope_scaling={**K3_DSPARK.rope_scaling, "factor": 4.0, "original_max_position_embeddings": 256},
).validate()

PRESETS: dict[str, DSparkConfig] = {c.name: c for c in (K3_DSPARK, K3_TINY_DSPARK)}


def preset_for_target(hidden_size: int, vocab_size: int, num_layers: int, *, drafter_layers: int | None = None) -> DSparkConfig:
    """The preset drafting for a target of this width and vocabulary (K3's for k3 and k3-slice,
    k3-tiny's for k3-tiny), its taps spread over the target's `num_layers` layers (never the last:
    its output is the logits' input, not a tap), with `drafter_layers` backbone layers if given:
    what a benchmark or test with random drafter weights drafts with."""
    base = next((c for c in PRESETS.values() if (c.target_hidden_size, c.vocab_size) == (hidden_size, vocab_size)), None)
    if base is None:
        raise ValueError(f"no DSpark preset drafts for a target of hidden size {hidden_size} and vocabulary {vocab_size}")
    if num_layers < 2:
        raise ValueError(f"num_layers={num_layers}: the target needs a layer besides its last to tap")
    count = min(len(base.target_layer_ids), num_layers - 1)
    taps = tuple(sorted({round(i * (num_layers - 2) / max(1, count - 1)) for i in range(count)}))
    return dataclasses.replace(base, target_num_layers=num_layers, target_layer_ids=taps,
                               num_layers=drafter_layers or base.num_layers).validate()


def get_preset(name: str) -> DSparkConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown drafter preset {name!r}; known presets: {sorted(PRESETS)}") from None


def rank_share(config: DSparkConfig, world: int) -> DSparkConfig:
    """One tensor-parallel rank's share of a drafter, as a config the same model code builds
    (docs/kimi-k3.md §8.6): the attention heads (MLA's q_b / kv_b / o_proj), the FFN and the
    vocabulary (embedding, lm_head and the Markov head's W2 rows) divided by `world`; hidden size,
    the LoRA ranks and the Markov rank whole (MLA's q_a / kv_a and the latent cache are replicated,
    as on the target's ranks). The Markov head's W1 is divided with the vocabulary although a real
    rank keeps it whole (every rank needs all of W1[previous token]): a lookup reads one row of
    either. It is the last rank's share, which holds the mask token's row, so the mask id is that
    row's local id. The collectives between the shares are not part of it."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r}: must be an integer >= 1")
    divided = {"num_heads": config.num_heads, "intermediate_size": config.intermediate_size,
               "vocab_size": config.vocab_size}
    if config.attention_type == "gqa":
        divided["num_kv_heads"] = config.num_kv_heads
    for name, size in divided.items():
        if size % world:
            raise ValueError(f"world={world}: does not divide DSparkConfig.{name}={size}")
    if world == 1:
        return config
    share = config.vocab_size // world
    if config.mask_token_id == config.vocab_size:
        mask = share  # the dedicated row past the vocabulary, past the last rank's rows too
    else:
        mask = config.mask_token_id - (world - 1) * share
        if mask < 0:
            raise ValueError(f"world={world}: mask_token_id={config.mask_token_id} is not in the last rank's "
                             f"rows [{(world - 1) * share}, {config.vocab_size})")
    return dataclasses.replace(config, name=f"{config.name}_tp{world}", mask_token_id=mask,
                               **{name: size // world for name, size in divided.items()}).validate()
