"""Bytes, FLOPs and bandwidth floors of a Kimi K3 decode or verify step.

Every byte count is derived from the tensor shapes of a K3Config (docs/kimi-k3.md §1.3);
the model and its assumptions are those of docs/kimi-k3.md §6:
- every weight is read once per forward, whatever the number of tokens in the step;
- routed experts are MXFP4 (4-bit codes + one 8-bit E8M0 scale per group of 32 = 4.25 bit/weight)
  and only the distinct experts the step's tokens route to are read;
- the MLA latent KV of every request is read once per step (all query tokens share the pages);
- KDA recurrent state (fp32) and conv window (bf16) are read and written once per plain decode
  step; a verify step either writes a snapshot after every token ("native", vLLM) or writes one
  state plus per-token replay records ("replay", ReplaySSM / RecoverSSM), docs/kimi-k3.md §2.3 and §6.4;
- the draft pass reads the drafter's weights, the target's lm_head and the drafter's context cache;
- no activation, communication or launch costs: these are floors.

`dspark roofline` (configure_parser / main) prints the byte breakdown and the floors. With
`--measured` of a k3-rank step (experiments/step_bench.py) it adds the batch-1 PROJECTION to 8 and
16 GB300 of dspark/rank_projection.py (docs/kimi-k3.md §8.4). With `--comm` and/or `--measured`
of a k3-slice step it adds a batch-1 PROJECTION to 16 GB300 at AL 6, beside the seed's
">840 tok/s": the floor scaled by the floor fraction a step reached on one H200 (step_bench.json),
plus the collectives of a TP16 or TP+EP16 layout timed from a latency table (comm_bench.json, or
a labelled model of NVLink 5). Floor, fraction and communication are each shown apart.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
from dataclasses import dataclass, field

import torch

from dspark.drafters.dspark.config import PRESETS as DRAFTER_PRESETS
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.config import get_preset as get_drafter_preset
from dspark.drafters.dspark.model import DSparkModel
from dspark.targets.kimi_k3.config import K3, K3Config, get_preset
from dspark.targets.kimi_k3.sharding import Shard
from dspark.targets.kimi_k3.sizes import (FP32, log_comb, distinct_experts, expected_max_experts_per_rank,  # noqa: F401
                                          expert_bytes, expert_params, trunk_elements)

# Bytes per element of the dense tensors. FP8 block scales (one fp32 per 128x128 block, +0.02%)
# are left out.
DTYPE_BYTES = {"bf16": 2.0, "fp8": 1.0}
BF16 = 2.0
KDA_STATE_MODES = ("native", "replay")
GB = 1e9


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: must be one of {list(choices)}")


def _check_positive_int(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}")


# ---- weights (docs/kimi-k3.md §1.3 shapes, §6.1 table) -----------------------------------------------------

def trunk_weight_bytes(cfg: K3Config = K3, trunk_dtype: str = "bf16") -> dict[str, float]:
    """Bytes of every non-routed weight read by one forward, per component (docs/kimi-k3.md §6.1).

    `trunk_dtype` applies to every projection matrix of KDA, MLA, the router and latent down/up
    projections, the shared experts and the dense FFN; lm_head stays bf16 and the vectors keep
    their dtype. With "fp8" this is docs/kimi-k3.md §6.1's requantized trunk (82.6 GB of weights per token).
    """
    _check_choice("trunk_dtype", trunk_dtype, DTYPE_BYTES)
    per_kind = {"proj": DTYPE_BYTES[trunk_dtype], "matmul_bf16": BF16, "bf16": BF16, "fp32": FP32}
    return {
        component: float(sum(count * per_kind[kind] for kind, count in kinds.items()))
        for component, kinds in trunk_elements(cfg).items()
    }


def trunk_matmul_params(cfg: K3Config = K3) -> int:
    """Matmul weights of the trunk (each costs one multiply-add per token)."""
    return sum(kinds.get("proj", 0) + kinds.get("matmul_bf16", 0) for kinds in trunk_elements(cfg).values())


# The component of a checkpoint tensor by its name (relative to `layers.{i}.`), for rank_weight_bytes.
_COMPONENT_OF_MODULE = (("self_attn.", None), ("mlp.", "dense_ffn"), ("block_sparse_moe.shared_experts.", "shared_experts"),
                        ("block_sparse_moe.experts.", "routed_experts"), ("block_sparse_moe.", "router_latent"))


def _component(cfg: K3Config, name: str) -> str:
    from dspark.targets.kimi_k3 import weights as layout

    if name == layout.EMBED:
        return "embedding"
    if name == layout.LM_HEAD:
        return "lm_head"
    prefix = f"{layout.PREFIX}.layers."
    if not name.startswith(prefix):
        return "norms_attnres"  # the final norm and the output AttnRes norm / pseudo-query
    layer, _, rest = name[len(prefix):].partition(".")
    for module, component in _COMPONENT_OF_MODULE:
        if rest.startswith(module):
            return component or cfg.layer_type(int(layer))
    return "norms_attnres"


def rank_weight_bytes(cfg: K3Config = K3, shard: Shard | None = None) -> dict[str, float]:
    """Bytes of the weights rank `shard` holds (the whole model without one), per component, summed
    over the tensors it holds (weights.tensor_specs; dspark/targets/kimi_k3/sharding.py says which
    part of each): the trunk components of trunk_weight_bytes, "embedding" (held, but a step reads
    only its tokens' rows) and "routed_experts" (all the experts it holds)."""
    return dict(_rank_weight_bytes(cfg, shard or Shard()))


@functools.lru_cache(maxsize=32)
def _rank_weight_bytes(cfg: K3Config, shard: Shard) -> dict[str, float]:
    """rank_weight_bytes, once per (config, shard): K3's specs list half a million expert tensors."""
    from dspark.targets.kimi_k3.weights import tensor_specs

    per_element = {"float": BF16, "fp32": FP32, "u8": 1.0}
    totals: dict[str, float] = {}
    for name, (shape, kind) in tensor_specs(cfg, shard).items():
        component = _component(cfg, name)
        totals[component] = totals.get(component, 0.0) + math.prod(shape) * per_element[kind]
    return totals


# ---- the drafter's pass ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=16)
def _meta_drafter(draft: DSparkConfig) -> DSparkModel:
    """The real drafter module built on the meta device (nothing allocated), to count its parameters."""
    with torch.device("meta"):
        shared = torch.empty(draft.vocab_size, draft.hidden_size)
        return DSparkModel(draft, shared, shared)


def draft_params(draft: DSparkConfig) -> int:
    """Parameters a DSpark drafter reads per pass, counted on the real module: its layers, tap
    projection, norms, Markov and confidence heads. Embeddings and lm_head are the target's
    (docs/dspark-algorithm.md §2.4), buffers there, so not counted; a published checkpoint's embed
    copy is never read at serving time."""
    return sum(p.numel() for p in _meta_drafter(draft).parameters())


def draft_pass_bytes(draft: DSparkConfig, context: int, dtype_bytes: float = BF16) -> float:
    """Bytes one greedy drafting pass of one request reads (experiments/drafter_bench.py's floor):
    the layers' weights, the lm_head once (one product for the whole block), the Markov head's W2
    once per block slot (each slot's product needs the previous slot's token) and every layer's
    `context` cache rows. Of a rank's share when `draft` is one (config.rank_share)."""
    model = _meta_drafter(draft)
    layers = sum(p.numel() for p in model.layers.parameters())
    head = draft.vocab_size * draft.hidden_size + draft.block_size * model.markov_head.markov_w2.weight.numel()
    rows = draft.num_layers * draft_cache_width(draft) * context
    return (layers + head + rows) * dtype_bytes


def draft_cache_width(draft: DSparkConfig) -> int:
    """Elements of one context row of the drafter's cache per layer (drafters/dspark/model.py):
    MLA [RMSNorm(c_kv) | k_pe], GQA [k | v]."""
    if draft.attention_type == "mla":
        return draft.kv_lora_rank + draft.qk_rope_head_dim
    return 2 * draft.num_kv_heads * draft.head_dim


def default_draft(cfg: K3Config) -> DSparkConfig | None:
    """The drafter preset that drafts for this target (same hidden size and vocabulary), if any."""
    for draft in DRAFTER_PRESETS.values():
        if draft.hidden_size == cfg.hidden_size and draft.vocab_size == cfg.vocab_size:
            return draft
    return None


# ---- one step -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepCost:
    """Bytes and FLOPs of one target step (plus the draft pass if any), summed over the batch."""

    label: str
    batch: int
    tokens_per_request: int
    context: int
    bytes: dict[str, float]
    flops: dict[str, float]
    distinct_experts: float  # per MoE layer
    num_moe_layers: int
    expert_bytes: float
    num_experts: int

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    @property
    def routed_bytes(self) -> float:
        return self.bytes["routed_experts"]

    def as_dict(self) -> dict:
        return {
            "label": self.label, "batch": self.batch, "tokens_per_request": self.tokens_per_request,
            "context": self.context, "bytes": dict(self.bytes), "total_bytes": self.total_bytes,
            "flops": dict(self.flops), "total_flops": self.total_flops,
            "distinct_experts_per_layer": self.distinct_experts,
        }


def step_cost(
    cfg: K3Config = K3,
    *,
    batch: int = 1,
    tokens_per_request: int = 1,
    context: int = 8192,
    trunk_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    kda_state: str = "native",
    expert_dedup: float | None = None,
    draft: DSparkConfig | None = None,
    label: str | None = None,
    shard: Shard | None = None,
    routed_experts: float | None = None,
) -> StepCost:
    """One target forward of `tokens_per_request` tokens for each of `batch` requests whose
    committed context is `context` tokens. tokens_per_request = 1 without a draft is a plain
    decode step; a verify of k drafts feeds T = k + 1 (anchor + drafts). With `draft`, the
    drafter's pass for the next block is added (docs/kimi-k3.md §6.4 "spec step").

    `shard`: the step of that rank (docs/kimi-k3.md §8): the weights it holds and reads
    (rank_weight_bytes; its embedding rows aside), its heads' KDA state, the whole MLA cache
    (replicated), and the experts of the busiest rank (expected_max_experts_per_rank) unless
    `routed_experts` says how many it touched; bf16 trunk, no draft. FLOPs: the rank's matmul
    weights (its bf16 matrix bytes / 2, vectors included) and the whole model's attention, KDA
    and routed-expert FLOPs over the ranks. `routed_experts`: the distinct experts per MoE layer
    the step read (a measured mean), instead of the uniform-routing expectation."""
    shard = (shard or Shard()).validate(cfg)
    ranked = shard.world > 1
    if ranked and (trunk_dtype != "bf16" or draft is not None or expert_dedup is not None):
        raise ValueError(f"shard={shard}: a rank's step is modelled with a bf16 trunk, no draft and no expert_dedup "
                         f"(got trunk_dtype={trunk_dtype!r}, draft={'set' if draft else None}, "
                         f"expert_dedup={expert_dedup!r})")
    held_experts = cfg.num_experts // shard.world
    if routed_experts is not None and not (isinstance(routed_experts, (int, float)) and 0 <= routed_experts <= held_experts):
        raise ValueError(f"routed_experts={routed_experts!r}: must be a number in [0, {held_experts}]")
    _check_positive_int("batch", batch)
    _check_positive_int("tokens_per_request", tokens_per_request)
    _check_positive_int("context", context, minimum=0)
    _check_choice("kv_dtype", kv_dtype, DTYPE_BYTES)
    _check_choice("kda_state", kda_state, KDA_STATE_MODES)
    T = tokens_per_request
    tokens = batch * T
    d = cfg.hidden_size
    num_kda, num_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    num_moe = cfg.num_layers - cfg.first_k_dense

    if ranked:
        held = rank_weight_bytes(cfg, shard)
        nbytes = {name: b for name, b in held.items() if name not in ("embedding", "routed_experts")}
        matmul_params = sum(b for name, b in nbytes.items() if name != "norms_attnres") / BF16
        distinct = float(expected_max_experts_per_rank(cfg.num_experts, shard.world, distinct_experts(cfg, tokens)))
    else:
        nbytes = trunk_weight_bytes(cfg, trunk_dtype)
        matmul_params = trunk_matmul_params(cfg)
        distinct = distinct_experts(cfg, tokens, expert_dedup)
    if routed_experts is not None:
        distinct = float(routed_experts)
    share = 1.0 / shard.world  # a rank's part of the heads (KDA state, attention FLOPs)
    e_bytes = expert_bytes(cfg)
    nbytes["routed_experts"] = num_moe * distinct * e_bytes

    # MLA latent KV: read the committed context once, write the T new rows (docs/kimi-k3.md §3, §6.2).
    kv_row = cfg.kv_cache_width * DTYPE_BYTES[kv_dtype] * num_mla
    nbytes["mla_kv"] = batch * (context + T) * kv_row

    # KDA per request and layer: fp32 state H x K x V and a bf16 conv window of (conv-1) taps on q, k, v (docs/kimi-k3.md §2.1).
    state = cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * FP32
    conv = (cfg.kda_conv_size - 1) * cfg.kda_width * 3 * BF16
    # A replay record per head and token: u in fp32 plus k and the raw gate in bf16 (RecoverSSM, docs/kimi-k3.md §2.3).
    record = cfg.kda_num_heads * (cfg.kda_head_dim * FP32 + 2 * cfg.kda_head_dim * BF16)
    verifying = T > 1
    if verifying and kda_state == "native":
        kda_traffic = (1 + T) * (state + conv)  # read 1, write a snapshot after each token
    elif verifying:
        kda_traffic = 2 * (state + conv) + T * record  # read 1 + write 1, records for the T tokens
    else:
        kda_traffic = 2 * (state + conv)  # plain decode: read 1, write 1
    nbytes["kda_state"] = batch * num_kda * kda_traffic * share

    # FLOPs: 2 per multiply-add of every matmul, plus the attention and recurrence cores.
    # Elementwise work (norms, gates, activations, AttnRes mixing) is left out.
    # MLA absorbed decode (docs/kernels.md §2): per head, query and key, 576 MACs for the score and 512 for the output.
    keys = sum(context + t + 1 for t in range(T))
    flops = {
        "trunk_matmuls": 2.0 * matmul_params * tokens,
        "routed_experts": 2.0 * num_moe * cfg.num_experts_per_token * expert_params(cfg) * tokens * share,
        "mla_attention": 2.0 * batch * num_mla * cfg.mla_num_heads * keys * (cfg.kv_cache_width + cfg.kv_lora_rank) * share,
        # per head and token: decay K*V, S^T k 2KV, rank-1 update 2KV, S^T q 2KV (docs/kimi-k3.md §2.1 step 5), and the
        # depthwise conv on q, k, v.
        "kda_recurrence": float(tokens * num_kda * (
            cfg.kda_num_heads * 7 * cfg.kda_head_dim * cfg.kda_head_dim + 2 * 3 * cfg.kda_width * cfg.kda_conv_size
        )) * share,
    }

    if draft is not None:
        # The drafter reads its own weights (bf16), the target's lm_head for its block_size
        # positions (counted again: it is a second pass) and its context cache.
        for name in ("hidden_size", "vocab_size"):
            if getattr(draft, name) != getattr(cfg, name):
                raise ValueError(f"draft.{name}={getattr(draft, name)!r}: must equal the target's {getattr(cfg, name)}")
        params = draft_params(draft)
        width = draft_cache_width(draft)
        draft_tokens = batch * draft.block_size
        nbytes["draft_weights"] = params * BF16
        nbytes["draft_lm_head"] = cfg.vocab_size * d * BF16
        nbytes["draft_kv"] = batch * (context + draft.block_size) * width * DTYPE_BYTES[kv_dtype] * draft.num_layers
        # Attention: every block query sees the context and the whole block (non-causal, §2.3);
        # MLA absorbed like the target (score over the cache row + kv_lora_rank output), GQA
        # q.k + p.v per head.
        per_key = width + draft.kv_lora_rank if draft.attention_type == "mla" else 2 * draft.head_dim
        draft_keys = draft.block_size * (context + draft.block_size)
        flops["draft"] = (
            2.0 * (params + cfg.vocab_size * d) * draft_tokens
            + 2.0 * batch * draft.num_layers * draft.num_heads * draft_keys * per_key
        )

    if label is None:
        label = "plain decode" if T == 1 and draft is None else f"verify T={T}" + (" + draft" if draft else "")
        label = f"rank {shard.rank}/{shard.world} {label}" if ranked else label
    return StepCost(
        label=label, batch=batch, tokens_per_request=T, context=context, bytes=nbytes, flops=flops,
        distinct_experts=distinct, num_moe_layers=num_moe, expert_bytes=e_bytes, num_experts=cfg.num_experts,
    )


# ---- floors -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth: float  # bytes/s of HBM
    peak_flops: float | None = None  # dense bf16 FLOP/s, for the compute floor; None = bandwidth only


# Datasheet figures: H200 4.8 TB/s, 989 TFLOP/s dense bf16; GB300 8 TB/s (docs/kimi-k3.md §6.5,
# docs/kernels.md §0). A measured bandwidth (the H200 copies at 4.3 TB/s) replaces the datasheet one.
GPUS = {
    "h200": GPU("H200", 4.8e12, 989e12),
    "gb300": GPU("GB300", 8.0e12, None),
}


def get_gpu(name: str, bandwidth_tbs: float | None = None) -> GPU:
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"gpu={name!r}: known GPUs are {sorted(GPUS)}")
    gpu = GPUS[key]
    if bandwidth_tbs is None:
        return gpu
    if not isinstance(bandwidth_tbs, (int, float)) or not bandwidth_tbs > 0:
        raise ValueError(f"bandwidth_tbs={bandwidth_tbs!r}: must be a number > 0 (TB/s)")
    return GPU(f"{gpu.name}@{bandwidth_tbs:g}TB/s", bandwidth_tbs * 1e12, gpu.peak_flops)


def step_time(
    cost: StepCost,
    gpu: GPU,
    num_gpus: int = 1,
    expert_parallel: bool = False,
    max_experts_per_rank: float | None = None,
) -> float:
    """Seconds of the floor of one step on `num_gpus` GPUs.

    Ideal sharding: every byte is split evenly (total / (G * bandwidth)). Expert parallel: the
    non-routed bytes (trunk, KV, state, draft) are still split evenly (trunk TP-sharded over all
    G), but each rank owns num_experts/G contiguous experts and the busiest rank bounds the step:
    it reads E[max experts per rank] experts per MoE layer (docs/kimi-k3.md §6.5). `max_experts_per_rank`
    takes a measured figure instead of the uniform-routing expectation. The compute floor
    (FLOPs / (G * peak)) applies when the GPU has a peak figure; the floor is the larger one.

    docs/kimi-k3.md §6.5's EP16 column leaves the KV and KDA-state bytes off the busiest rank; here they are
    split over the ranks like the trunk, so these floors come out 0.7-1.0% slower than that column.
    """
    _check_positive_int("num_gpus", num_gpus)
    if expert_parallel:
        if max_experts_per_rank is None:
            max_experts_per_rank = expected_max_experts_per_rank(cost.num_experts, num_gpus, cost.distinct_experts)
        elif not max_experts_per_rank > 0:
            raise ValueError(f"max_experts_per_rank={max_experts_per_rank!r}: must be > 0")
        busiest = (cost.total_bytes - cost.routed_bytes) / num_gpus + (
            max_experts_per_rank * cost.num_moe_layers * cost.expert_bytes
        )
        memory_time = busiest / gpu.bandwidth
    else:
        memory_time = cost.total_bytes / (num_gpus * gpu.bandwidth)
    if gpu.peak_flops is None:
        return memory_time
    return max(memory_time, cost.total_flops / (num_gpus * gpu.peak_flops))


def tokens_per_second(acceptance_length: float, seconds_per_step: float) -> float:
    """Tokens/s of one request: AL tokens per step (AL = 1 for plain decode)."""
    if not acceptance_length >= 1:
        raise ValueError(f"acceptance_length={acceptance_length!r}: must be >= 1 (includes the bonus token)")
    if not seconds_per_step > 0:
        raise ValueError(f"seconds_per_step={seconds_per_step!r}: must be > 0")
    return acceptance_length / seconds_per_step


# ---- communication (issue 16) -------------------------------------------------------------------

COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# Layouts of the sharded model; each uses the bytes floor of the sharding beside it.
COMM_LAYOUTS = {"tp": "ideal", "tp_ep": "ep"}


@dataclass(frozen=True)
class Collective:
    """`count` collectives of one kind in a step. nbytes: the whole tensor for all-reduce,
    all-gather (its output) and reduce-scatter (its input); for all-to-all, the bytes the
    busiest rank sends."""

    op: str
    nbytes: float
    count: int
    what: str


def dispatch_bytes(cfg: K3Config, rows: int, num_gpus: int, row_bytes: float) -> float:
    """Bytes the busiest rank sends in one EP dispatch (or gets back in the combine): each of its
    ceil(rows / G) tokens goes once to every other rank that holds at least one of the token's
    top-k experts; a rank owns N/G experts, so it is hit with probability 1 - C(N - N/G, k) / C(N, k)
    under uniform routing."""
    n, k = cfg.num_experts, cfg.num_experts_per_token
    per_rank = n // num_gpus
    p_hit = 1.0 - math.exp(log_comb(n - per_rank, k) - log_comb(n, k))
    return math.ceil(rows / num_gpus) * (num_gpus - 1) * p_hit * row_bytes


def step_collectives(cost: StepCost, cfg: K3Config, layout: str, num_gpus: int,
                     draft: DSparkConfig | None = None) -> list[Collective]:
    """The collectives of one step of `cost` (plain, verify, or verify + draft when `draft` is
    given) with the model sharded over `num_gpus` GPUs, bf16 activations.

    Both layouts shard attention by heads (row-parallel output: one all-reduce of [rows, d]), the
    dense FFN and the shared experts by their intermediate size, the embedding and lm_head by
    vocabulary (an all-reduce of the embedded rows, an all-gather of the logits). The router and
    the latent down projection are column-parallel: one all-gather of their outputs (latent rows
    plus fp32 router scores) per MoE layer. Then:
    - "tp": routed experts sharded by intermediate size; their partial latent sums are
      reduce-scattered before the row-parallel latent up projection, whose output is summed with
      the shared experts' in one all-reduce of [rows, d];
    - "tp_ep" (TP attention + EP experts, as vLLM serves K3): whole experts on N/G ranks; an
      all-to-all dispatch sends each token's latent row from its owner rank to the ranks of its
      experts and an all-to-all combine brings the weighted results back, in place of the
      reduce-scatter. With the latent already gathered on every rank the dispatch could be
      skipped; the EP MoE kernels move the rows anyway, so this is what is counted.
    Each collective depends on its layer's output, so at batch 1 none overlaps the bytes."""
    _check_choice("layout", layout, COMM_LAYOUTS)
    _check_positive_int("num_gpus", num_gpus, minimum=2)
    if layout == "tp_ep" and cfg.num_experts % num_gpus:
        raise ValueError(f"num_gpus={num_gpus!r}: must divide num_experts={cfg.num_experts} for layout 'tp_ep'")
    rows = cost.batch * cost.tokens_per_request
    d, latent = cfg.hidden_size, cfg.latent_size
    num_moe = cfg.num_layers - cfg.first_k_dense
    hidden = rows * d * BF16
    collectives = [
        Collective("all_reduce", hidden, 1, "embedding (vocab-parallel)"),
        Collective("all_reduce", hidden, cfg.num_layers, "attention output"),
        Collective("all_reduce", hidden, cfg.first_k_dense, "dense FFN output"),
        Collective("all_gather", rows * (latent * BF16 + cfg.num_experts * FP32), num_moe,
                   "router scores + latent down"),
    ]
    if layout == "tp":
        collectives.append(Collective("reduce_scatter", rows * latent * BF16, num_moe, "routed experts' latent sums"))
    else:
        moved = dispatch_bytes(cfg, rows, num_gpus, latent * BF16)
        collectives.append(Collective("all_to_all", moved, num_moe, "EP dispatch"))
        collectives.append(Collective("all_to_all", moved, num_moe, "EP combine"))
    collectives.append(Collective("all_reduce", hidden, num_moe, "latent up + shared experts"))
    collectives.append(Collective("all_gather", rows * cfg.vocab_size * BF16, 1, "lm_head logits"))
    if draft is not None:
        # The drafter's block: its layers sharded like the target's dense layers, the target's
        # embedding and lm_head shared.
        block_rows = cost.batch * draft.block_size
        block = block_rows * draft.hidden_size * BF16
        collectives += [
            Collective("all_reduce", block, 1, "draft: embedding"),
            Collective("all_reduce", block, 2 * draft.num_layers, "draft: attention + FFN outputs"),
            Collective("all_gather", block_rows * cfg.vocab_size * BF16, 1, "draft: lm_head logits"),
        ]
    return [c for c in collectives if c.count]


class AlphaBetaComm:
    """Collective latency = alpha (a fixed cost per collective) + the bytes each rank puts on the
    wire / its link bandwidth, with NCCL's bus-bandwidth accounting (all-reduce 2(G-1)/G of the
    tensor; all-gather and reduce-scatter (G-1)/G; all-to-all the bytes a rank sends)."""

    def __init__(self, label: str, link_bytes_per_s: float, alpha_s: dict[str, float], assumptions: str):
        self.label, self.link_bytes_per_s, self.alpha_s, self.assumptions = label, link_bytes_per_s, alpha_s, assumptions
        self.is_model = True

    def latency(self, op: str, nbytes: float, num_gpus: int) -> float:
        _check_choice("op", op, COMM_OPS)
        share = (num_gpus - 1) / num_gpus
        wire = {"all_reduce": 2 * share * nbytes, "all_gather": share * nbytes,
                "reduce_scatter": share * nbytes, "all_to_all": nbytes}[op]
        return self.alpha_s[op] + wire / self.link_bytes_per_s

    def describe(self, num_gpus: int) -> str:
        return f"{self.label}: MODEL, not measured. {self.assumptions}"


# No multi-GPU figure has been measured yet; these are round assumptions to be replaced by
# experiments/comm_bench.py's measurement, which `--comm` takes once a multi-GPU machine has run it.
GB300_NVLINK5_MODEL = AlphaBetaComm(
    "GB300 NVLink 5 model",
    link_bytes_per_s=900e9,
    alpha_s={"all_reduce": 8e-6, "all_gather": 6e-6, "reduce_scatter": 6e-6, "all_to_all": 10e-6},
    assumptions=("Assumed: 900 GB/s per GPU and direction (NVLink 5's 1.8 TB/s per GPU, both directions); "
                 "a fixed cost per collective inside a CUDA graph of 8 us (all-reduce), 6 us (all-gather, "
                 "reduce-scatter) and 10 us (all-to-all), the order of small-message NCCL collectives on one "
                 "NVLink domain; all 16 GPUs in one NVLink domain (NVL72)."),
)


def _read_result_rows(path: str, flag: str, producer: str) -> tuple[dict, list]:
    """(the object, its non-empty 'rows' list) of a result JSON given with `flag`."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: cannot be read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {path!r}: not valid JSON ({e})") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{flag} {path!r}: expected an object with a non-empty 'rows' list ({producer} output)")
    return data, rows


class MeasuredComm:
    """Latencies from experiments/comm_bench.py's JSON: for an op, the rows of one world size
    and mode (graph preferred), uniform routing for all-to-all, interpolated linearly in bytes
    (below the smallest message: its latency; above the largest: its latency scaled by bytes).
    Rows of one size (the dispatch and the combine) are averaged."""

    def __init__(self, path: str):
        self.path = path
        self.is_model = False
        data, rows = _read_result_rows(path, "--comm", "comm_bench.py")
        self.device = data.get("device", "unknown device")
        self.points: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
        for i, row in enumerate(rows):
            try:
                op, size, mode = row["op"], int(row["world_size"]), row["mode"]
                nbytes, median = float(row["bytes"]), float(row["median_us"]) * 1e-6
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"--comm {path!r}: rows[{i}] lacks or mistypes op/world_size/mode/bytes/median_us "
                                 f"({e!r})") from None
            if op not in COMM_OPS or row.get("routing", "uniform") != "uniform":
                continue
            self.points.setdefault((op, size, mode), []).append((nbytes, median))
        for key, points in self.points.items():  # one latency per message size (dispatch and combine alike)
            by_size: dict[float, list[float]] = {}
            for nbytes, seconds in points:
                by_size.setdefault(nbytes, []).append(seconds)
            self.points[key] = sorted((nbytes, sum(ts) / len(ts)) for nbytes, ts in by_size.items())
        self.world_sizes = sorted({size for _, size, _ in self.points})
        self.label = f"measured on {self.device} ({path})"

    def _series(self, op: str, num_gpus: int) -> tuple[int, str, list[tuple[float, float]]]:
        sizes = [s for s in self.world_sizes if any(k[0] == op and k[1] == s for k in self.points)]
        if not sizes:
            raise ValueError(f"--comm {self.path!r}: no rows for op {op!r}")
        size = num_gpus if num_gpus in sizes else max(sizes)
        mode = "graph" if (op, size, "graph") in self.points else "eager"
        return size, mode, self.points[(op, size, mode)]

    def latency(self, op: str, nbytes: float, num_gpus: int) -> float:
        _, _, points = self._series(op, num_gpus)
        if nbytes <= points[0][0]:
            return points[0][1]
        for (b0, t0), (b1, t1) in zip(points, points[1:]):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        b_max, t_max = points[-1]
        return t_max * nbytes / b_max

    def describe(self, num_gpus: int) -> str:
        used = {op: self._series(op, num_gpus)[:2] for op in COMM_OPS if any(k[0] == op for k in self.points)}
        parts = [f"{op} at {size} GPUs ({mode})" for op, (size, mode) in used.items()]
        note = "" if all(size == num_gpus for size, _ in used.values()) else (
            f"; applied to {num_gpus} GPUs as measured (fewer ranks, another interconnect: an approximation)")
        return f"{self.label}: " + ", ".join(parts) + note


def comm_time(collectives: list[Collective], table, num_gpus: int) -> float:
    """Seconds of communication in a step: every collective in series."""
    return sum(c.count * table.latency(c.op, c.nbytes, num_gpus) for c in collectives)


def load_comm(source: str):
    """`--comm`: "model" for the GB300 NVLink 5 model, else a comm_bench.py JSON file."""
    return GB300_NVLINK5_MODEL if source == "model" else MeasuredComm(source)


# ---- measured fraction of the floor (issue 12 item 6) ----------------------------------------------

@dataclass(frozen=True)
class MeasuredFraction:
    """floor / measured step time of k3-slice on one GPU (experiments/step_bench.py), plain
    decode (T = 1) and verify (T = 8), batch 1, 8k context."""

    plain: float
    verify: float
    mode: str
    source: str
    note: str


def load_measured_fraction(path: str, context: int = 8192) -> MeasuredFraction:
    """The graph-replay rows of step_bench.json (eager rows when there is no graph row, said in
    `note`) for k3-slice, batch 1, `context`, T = 1 and T = 8, measured on the default kernels:
    rows of an A/B run under another setting (`--setting`, a non-empty "setting") are not the step."""
    _, rows = _read_result_rows(path, "--measured", "step_bench.py")
    picked, modes = {}, {}
    for T in (1, 8):
        for mode in ("graph", "eager"):
            match = [r for r in rows if isinstance(r, dict) and r.get("target") == "k3-slice" and r.get("batch") == 1
                     and r.get("context") == context and r.get("T") == T and r.get("mode") == mode
                     and not r.get("setting")]
            if len(match) > 1:
                raise ValueError(f"--measured {path!r}: {len(match)} rows for k3-slice batch 1 context {context} "
                                 f"T={T} mode {mode}; expected one")
            if match:
                picked[T], modes[T] = _row_fraction(path, match[0]), mode
                break
        else:
            raise ValueError(f"--measured {path!r}: no row for k3-slice, batch 1, context {context}, T={T} "
                             "(graph or eager)")
    eager = [f"T={T}" for T, mode in modes.items() if mode == "eager"]
    note = f"no graph row for {', '.join(eager)}: eager rows used" if eager else ""
    mode = "graph" if not eager else ("eager" if len(eager) == 2 else "graph/eager")
    return MeasuredFraction(plain=picked[1], verify=picked[8], mode=mode, source=path, note=note)


def _row_fraction(path: str, row: dict) -> float:
    """floor_ms / ms of one row, checked against its floor_fraction."""
    try:
        ms, floor_ms, fraction = float(row["ms"]), float(row["floor_ms"]), float(row["floor_fraction"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--measured {path!r}: row T={row.get('T')} {row.get('mode')} lacks or mistypes "
                         f"ms/floor_ms/floor_fraction ({e!r})") from None
    if not ms > 0 or not floor_ms > 0:
        raise ValueError(f"--measured {path!r}: row T={row.get('T')}: ms={ms!r}, floor_ms={floor_ms!r}: must be > 0")
    if abs(floor_ms / ms - fraction) > 0.01 * fraction:
        raise ValueError(f"--measured {path!r}: row T={row.get('T')}: floor_fraction={fraction!r} is not "
                         f"floor_ms / ms = {floor_ms / ms:.4g}")
    return floor_ms / ms


# ---- the projection to the seed's setting ------------------------------------------------------------

# The seed's batch-1 figure (unverified: docs/kimi-k3.md §5.1) and its setting.
SEED_TOKENS_PER_S = 840.0
SEED_AL = 6.0
PROJECTION_GPU, PROJECTION_NUM_GPUS = "gb300", 16


def build_projection(result: "Roofline", cfg: K3Config, draft: DSparkConfig | None, *, comm=None,
                     measured: MeasuredFraction | None = None, al: float = SEED_AL,
                     max_experts_per_rank: float | None = None) -> dict:
    """Batch-1 plain and spec steps on 16 GB300 for each layout: the bytes floor, the floor
    scaled by the measured fraction (if given), the communication (if given) and the projected
    tokens/s at `al`. The draft pass is scaled by the verify's fraction (not measured apart)."""
    if not 1 <= al <= result.verify.tokens_per_request:
        raise ValueError(f"acceptance length {al:g} of the projection: needs k + 1 >= {al:g}, "
                         f"got k = {result.verify.tokens_per_request - 1}")
    gpu, count = get_gpu(PROJECTION_GPU), PROJECTION_NUM_GPUS
    rows = []
    for layout, sharding in COMM_LAYOUTS.items():
        ep = sharding == "ep"
        floors = {name: step_time(cost, gpu, count, ep, max_experts_per_rank if ep else None) for name, cost in
                  (("plain", result.plain), ("spec", result.spec))}
        steps = dict(floors)
        if measured is not None:
            steps = {"plain": floors["plain"] / measured.plain, "spec": floors["spec"] / measured.verify}
        comm_s = {"plain": 0.0, "spec": 0.0}
        counts = {"plain": 0, "spec": 0}
        if comm is not None:
            for name, cost, d in (("plain", result.plain, None), ("spec", result.spec, draft)):
                collectives = step_collectives(cost, cfg, layout, count, d)
                comm_s[name] = comm_time(collectives, comm, count)
                counts[name] = sum(c.count for c in collectives)
        rows.append({
            "layout": layout, "sharding": sharding,
            "plain_floor_ms": floors["plain"] * 1e3, "spec_floor_ms": floors["spec"] * 1e3,
            "plain_scaled_ms": steps["plain"] * 1e3, "spec_scaled_ms": steps["spec"] * 1e3,
            "plain_comm_ms": comm_s["plain"] * 1e3, "spec_comm_ms": comm_s["spec"] * 1e3,
            "plain_collectives": counts["plain"], "spec_collectives": counts["spec"],
            "plain_tokens_per_s": tokens_per_second(1.0, steps["plain"] + comm_s["plain"]),
            "spec_tokens_per_s": tokens_per_second(al, steps["spec"] + comm_s["spec"]),
            "spec_tokens_per_s_without_comm": tokens_per_second(al, steps["spec"]),
        })
    return {
        "label": "PROJECTION (not a measurement)",
        "gpu": gpu.name, "num_gpus": count, "batch": result.plain.batch, "acceptance_length": al,
        "measured_fraction": None if measured is None else {
            "plain": measured.plain, "verify": measured.verify, "mode": measured.mode, "source": measured.source,
            "note": measured.note},
        "comm": None if comm is None else {"source": comm.describe(count), "is_model": comm.is_model},
        "seed_tokens_per_s": f">{SEED_TOKENS_PER_S:g} tok/s at AL {SEED_AL:g} (unverified: docs/kimi-k3.md §5.1)",
        "layouts": rows,
    }


def _format_projection(p: dict) -> str:
    al = format(p["acceptance_length"], "g")
    lines = ["", "", f"{p['label']}: batch {p['batch']} on {p['num_gpus']}x {p['gpu']}, spec step = verify T=k+1 + draft, "
             f"AL {al}; seed figure {p['seed_tokens_per_s']}"]
    if p["measured_fraction"]:
        m = p["measured_fraction"]
        lines.append(f"  step = bytes floor / measured floor fraction (k3-slice, 1 GPU, {m['mode']}): plain "
                     f"{m['plain']:.1%}, verify {m['verify']:.1%}, from {m['source']}" + (f"; {m['note']}" if m["note"] else ""))
    else:
        lines.append("  step = bytes floor (no --measured fraction: kernels, launches and host assumed free)")
    if p["comm"]:
        lines.append(f"  communication: {p['comm']['source']}")
    else:
        lines.append("  communication: not included (no --comm)")
    lines.append(f"  {'layout':<8}{'floor ms':>17}{'scaled ms':>17}{'comm ms':>17}{'collectives':>15}"
                 f"{'plain tok/s':>13}{'tok/s AL=' + al:>14}{'(no comm)':>11}")
    lines.append(f"  {'':<8}" + f"{'plain / spec':>17}" * 3 + f"{'plain / spec':>15}")
    for r in p["layouts"]:
        lines.append(
            f"  {r['layout']:<8}{r['plain_floor_ms']:>8.3f} /{r['spec_floor_ms']:>7.3f}"
            f"{r['plain_scaled_ms']:>8.3f} /{r['spec_scaled_ms']:>7.3f}"
            f"{r['plain_comm_ms']:>8.3f} /{r['spec_comm_ms']:>7.3f}"
            f"{r['plain_collectives']:>7d} /{r['spec_collectives']:>6d}"
            f"{r['plain_tokens_per_s']:>13.0f}{r['spec_tokens_per_s']:>14.0f}{r['spec_tokens_per_s_without_comm']:>11.0f}"
        )
    return "\n".join(lines)


# ---- report -----------------------------------------------------------------------------------------

@dataclass
class Roofline:
    """The plain-decode step, the verify step (k drafts) and the spec step (verify + draft), with
    floors for each (GPU, count, sharding) and tokens/s per acceptance length."""

    plain: StepCost
    verify: StepCost
    spec: StepCost
    acceptance_lengths: tuple[float, ...]
    floors: list[dict] = field(default_factory=list)


def build_roofline(
    cfg: K3Config = K3,
    *,
    k: int = 7,
    batch: int = 1,
    context: int = 8192,
    acceptance_lengths: tuple[float, ...] = (6.0, 3.84),
    trunk_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    kda_state: str = "native",
    expert_dedup: float | None = None,
    draft: DSparkConfig | None | str = "auto",
    gpus: tuple[GPU, ...] = (GPUS["h200"], GPUS["gb300"]),
    gpu_counts: tuple[int, ...] = (1, 16),
    max_experts_per_rank: float | None = None,
) -> Roofline:
    _check_positive_int("k", k)
    for al in acceptance_lengths:
        if not 1 <= al <= k + 1:
            raise ValueError(f"acceptance_lengths={acceptance_lengths!r}: {al} outside [1, k+1={k + 1}]")
    if draft == "auto":
        draft = default_draft(cfg)
    common = dict(batch=batch, context=context, trunk_dtype=trunk_dtype, kv_dtype=kv_dtype, kda_state=kda_state)
    plain = step_cost(cfg, tokens_per_request=1, **common)  # no dedup: one token has none
    verify = step_cost(cfg, tokens_per_request=k + 1, expert_dedup=expert_dedup, **common)
    spec = step_cost(cfg, tokens_per_request=k + 1, expert_dedup=expert_dedup, draft=draft,
                     label=f"verify T={k + 1} + draft" if draft else f"verify T={k + 1}", **common)
    result = Roofline(plain, verify, spec, tuple(acceptance_lengths))
    for gpu in gpus:
        for count in gpu_counts:
            shardings = ["ideal"]
            if count > 1 and cfg.num_experts % count == 0:
                shardings.append("ep")
            for sharding in shardings:
                ep = sharding == "ep"
                t_plain = step_time(plain, gpu, count, ep, max_experts_per_rank if ep else None)
                t_verify = step_time(verify, gpu, count, ep, max_experts_per_rank if ep else None)
                t_spec = step_time(spec, gpu, count, ep, max_experts_per_rank if ep else None)
                result.floors.append({
                    "gpu": gpu.name, "num_gpus": count, "sharding": sharding,
                    "bandwidth_tbs": gpu.bandwidth / 1e12,
                    "plain_ms": t_plain * 1e3,
                    "plain_tokens_per_s": tokens_per_second(1.0, t_plain),
                    "verify_ms": t_verify * 1e3,
                    "spec_ms": t_spec * 1e3,
                    "spec_tokens_per_s": {al: tokens_per_second(al, t_spec) for al in acceptance_lengths},
                    # all requests of the batch together
                    "plain_aggregate_tokens_per_s": batch * tokens_per_second(1.0, t_plain),
                    "spec_aggregate_tokens_per_s": {al: batch * tokens_per_second(al, t_spec) for al in acceptance_lengths},
                })
    return result


def _format_table(result: Roofline) -> str:
    steps = (result.plain, result.verify, result.spec)
    names = sorted({name for s in steps for name in s.bytes}, key=lambda n: list(result.spec.bytes).index(n))
    # GB and TFLOPs for K3; MB and GFLOPs for the small test presets
    unit, scale = ("GB", GB) if result.plain.total_bytes >= GB else ("MB", 1e6)
    f_unit, f_scale = ("TFLOPs", 1e12) if result.plain.total_flops >= 1e12 else ("GFLOPs", 1e9)
    lines = [f"{'bytes per step (' + unit + ')':<22}" + "".join(f"{s.label:>24}" for s in steps)]
    for name in names:
        lines.append(f"{name:<22}" + "".join(f"{s.bytes.get(name, 0.0) / scale:>24.3f}" for s in steps))
    lines.append(f"{'total':<22}" + "".join(f"{s.total_bytes / scale:>24.2f}" for s in steps))
    lines.append(f"{f_unit:<22}" + "".join(f"{s.total_flops / f_scale:>24.2f}" for s in steps))
    lines.append(f"{'distinct experts/layer':<22}" + "".join(f"{s.distinct_experts:>24.2f}" for s in steps))
    lines.append("")
    lines.append(f"floors: bandwidth (and compute, where the GPU has a peak) time of one step; tok/s per request"
                 + (f", x{result.plain.batch} requests for the aggregate" if result.plain.batch > 1 else ""))
    al_heads = "".join(f"{'tok/s AL=' + format(al, 'g'):>16}" for al in result.acceptance_lengths)
    lines.append(f"{'floor':<30}{'plain ms':>10}{'tok/s':>10}{'verify ms':>11}{'spec ms':>10}" + al_heads)
    for f in result.floors:
        name = f"{f['num_gpus']}x {f['gpu']} {f['sharding']}"
        lines.append(
            f"{name:<30}{f['plain_ms']:>10.4g}{f['plain_tokens_per_s']:>10.1f}{f['verify_ms']:>11.4g}"
            f"{f['spec_ms']:>10.4g}" + "".join(f"{f['spec_tokens_per_s'][al]:>16.1f}" for al in result.acceptance_lengths)
        )
    return "\n".join(lines)


def _parse_gpu(text: str) -> GPU:
    """NAME or NAME=TBPS, the second form with a measured bandwidth in TB/s."""
    name, _, bw = text.partition("=")
    if not bw:
        return get_gpu(name)
    try:
        value = float(bw)
    except ValueError:
        raise ValueError(f"gpu={text!r}: bandwidth after '=' must be a number in TB/s") from None
    return get_gpu(name, value)


def _parse_draft(name: str) -> DSparkConfig | None | str:
    if name in ("auto", "none"):
        return None if name == "none" else name
    return get_drafter_preset(name)


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--preset", default="k3", help="target preset (k3, k3-tiny, k3-slice)")
    parser.add_argument("--batch", type=int, default=1, help="requests per step")
    parser.add_argument("--context", type=int, default=8192, help="committed context per request, tokens")
    parser.add_argument("--k", type=int, default=7, help="drafts verified per request (T = k + 1)")
    parser.add_argument("--al", type=float, nargs="+", default=[6.0, 3.84], help="acceptance lengths for tokens/s")
    parser.add_argument("--trunk-dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    parser.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    parser.add_argument("--kda-state", choices=KDA_STATE_MODES, default="native",
                        help="verify writes a state per token (native) or one state + replay records (replay)")
    parser.add_argument("--expert-dedup", type=float, default=None,
                        help="measured (token, expert) pairs per distinct expert; default uniform routing")
    parser.add_argument("--draft", default="auto",
                        help="drafter preset for the draft pass (auto = the one matching the target, none = no draft): "
                             + ", ".join(sorted(DRAFTER_PRESETS)))
    parser.add_argument("--gpu", nargs="+", default=["h200", "gb300"],
                        help="GPUs, each NAME or NAME=TBPS with a measured bandwidth (e.g. h200=4.3)")
    parser.add_argument("--num-gpus", type=int, nargs="+", default=[1, 16], help="GPU counts to floor for")
    parser.add_argument("--max-experts-per-rank", type=float, default=None,
                        help="measured busiest-rank experts per layer for the EP floor (default: uniform expectation)")
    parser.add_argument("--comm", default=None, metavar="FILE|model",
                        help="add communication to the batch-1 projection on 16 GB300: the JSON that "
                             "experiments/comm_bench.py writes on a multi-GPU machine (none has run it yet), or "
                             "'model' (the GB300 NVLink 5 model)")
    parser.add_argument("--measured", default=None, metavar="FILE",
                        help="a step_bench.py result: of k3-rank, project batch-1 tokens/s on 8 and 16 GB300 from the "
                             "rank's measured step plus cited communication (docs/kimi-k3.md §8.4); of k3-slice, scale "
                             "the 16 GB300 floors by its measured floor fraction")
    parser.add_argument("--measured-draft", default=None, metavar="FILE",
                        help="with --measured of a rank: an experiments/drafter_bench.py result (a --world share, graphed) "
                             "whose propose replaces the modelled draft pass of the projection")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return parser


def main(args: argparse.Namespace) -> int:
    cfg = get_preset(args.preset)
    draft = _parse_draft(args.draft)
    result = build_roofline(
        cfg,
        k=args.k, batch=args.batch, context=args.context, acceptance_lengths=tuple(args.al),
        trunk_dtype=args.trunk_dtype, kv_dtype=args.kv_dtype, kda_state=args.kda_state,
        expert_dedup=args.expert_dedup, draft=draft,
        gpus=tuple(_parse_gpu(g) for g in args.gpu), gpu_counts=tuple(args.num_gpus),
        max_experts_per_rank=args.max_experts_per_rank,
    )
    projection = None
    if args.measured is not None and rank_projection().is_rank_result(args.measured):
        # a rank's measured step (experiments/step_bench.py --target k3-rank): docs/kimi-k3.md §8.4
        if args.comm is not None:
            raise ValueError(f"--comm {args.comm!r}: the projection from a rank's step ({args.measured!r}) uses "
                             "cited communication figures (docs/kimi-k3.md §8.4), not --comm")
        draft_measurement = (None if args.measured_draft is None
                             else rank_projection().load_draft_measurement(args.measured_draft, args.context))
        projection = rank_projection().project(rank_projection().load_rank_measurement(args.measured, args.context),
                                               acceptance_lengths=tuple(args.al), draft_measurement=draft_measurement)
    elif args.measured_draft is not None:
        raise ValueError(f"--measured-draft {args.measured_draft!r}: goes with --measured of a rank's step "
                         "(experiments/step_bench.py --target k3-rank)")
    elif args.comm is not None or args.measured is not None:
        projection = build_projection(
            result, cfg, default_draft(cfg) if draft == "auto" else draft,
            comm=None if args.comm is None else load_comm(args.comm),
            measured=None if args.measured is None else load_measured_fraction(args.measured),
            max_experts_per_rank=args.max_experts_per_rank,
        )
    if args.json:
        payload = {
            "preset": args.preset,
            "steps": [s.as_dict() for s in (result.plain, result.verify, result.spec)],
            "floors": [
                {**f, **{key: {str(al): v for al, v in f[key].items()}
                         for key in ("spec_tokens_per_s", "spec_aggregate_tokens_per_s")}}
                for f in result.floors
            ],
        }
        if projection is not None:
            payload["projection"] = projection
        print(json.dumps(payload, indent=2))
    else:
        text = "" if projection is None else (rank_projection().format_projection(projection) if "rows" in projection
                                              else _format_projection(projection))
        print(_format_table(result) + text)
    return 0


def rank_projection():
    """dspark.rank_projection, imported when used (it imports this module)."""
    from dspark import rank_projection as module

    return module
