"""Sizes of a Kimi K3 model (docs/kimi-k3.md §1.3, §6): element counts of the trunk weights, the
bytes of one MXFP4 routed expert, and how many distinct experts a step's tokens touch, in all and
on the busiest expert-parallel rank. The roofline (dspark/roofline.py) prices them; the targets
use them to size a build and to route a rank's step, so they live on the models' floor."""
from __future__ import annotations

import functools
import math

import numpy as np
from scipy.special import gammaln

from .config import K3, K3Config

FP32 = 4.0  # bytes of a float32 vector element

def _check_positive_int(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}")


# ---- weights (docs/kimi-k3.md §1.3 shapes, §6.1 table) -----------------------------------------------------

# Kinds of trunk tensors: "proj" matmul weights stored in the trunk dtype; "matmul_bf16" matmul
# weights kept bf16 in every mode (lm_head); "bf16" and "fp32" vectors (norms, AttnRes
# pseudo-queries, KDA conv taps, dt_bias, A_log, o_norm, the router's correction bias).
def trunk_elements(cfg: K3Config = K3) -> dict[str, dict[str, int]]:
    """Element counts of every non-routed weight read by one forward, per component and kind."""
    d = cfg.hidden_size
    width = cfg.kda_width
    num_kda, num_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    num_moe = cfg.num_layers - cfg.first_k_dense
    h = cfg.mla_num_heads
    # KDA layer: q, k, v, g [W, d] and o [d, W]; low-rank decay f_a [r, d], f_b [W, r]; beta b [H, d];
    # fp32 conv taps [W, 1, conv] on q, k, v, dt_bias [W], A_log [a_log_size], o_norm [head_dim].
    kda_proj = 5 * width * d + cfg.kda_gate_rank * d + width * cfg.kda_gate_rank + cfg.kda_num_heads * d
    kda_fp32 = 3 * width * cfg.kda_conv_size + width + cfg.kda_a_log_size + cfg.kda_head_dim
    # Gated MLA layer: q_a [q_lora, d], q_b [H*192, q_lora], kv_a [576, d], kv_b [H*(128+128), kv_lora],
    # g [H*v, d], o [d, H*v]; q_a and kv_a layernorms.
    mla_proj = (
        cfg.q_lora_rank * d
        + h * cfg.qk_head_dim * cfg.q_lora_rank
        + cfg.kv_cache_width * d
        + h * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank
        + 2 * h * cfg.v_head_dim * d
    )
    return {
        "kda": {"proj": num_kda * kda_proj, "fp32": num_kda * kda_fp32},
        "mla": {"proj": num_mla * mla_proj, "bf16": num_mla * (cfg.q_lora_rank + cfg.kv_lora_rank)},
        # Router gate [N, d], latent down [L, d] and up [d, L]; correction bias [N]; routed_expert_norm [L].
        "router_latent": {
            "proj": num_moe * (cfg.num_experts + 2 * cfg.latent_size) * d,
            "fp32": num_moe * cfg.num_experts,
            "bf16": num_moe * cfg.latent_size,
        },
        # Shared experts, fused: gate/up [S, d], down [d, S].
        "shared_experts": {"proj": num_moe * 3 * cfg.shared_intermediate_size * d},
        "dense_ffn": {"proj": cfg.first_k_dense * 3 * cfg.intermediate_size * d},
        "lm_head": {"matmul_bf16": cfg.vocab_size * d},
        # Every layer: 4 RMSNorms [d] and 2 AttnRes pseudo-queries [1, d]; the model: final norm and
        # the output AttnRes norm/proj. (The embedding is a row gather: one row per token, ignored.)
        "norms_attnres": {"bf16": cfg.num_layers * 6 * d + 3 * d},
    }


def expert_params(cfg: K3Config = K3) -> int:
    """Weights of one routed expert: w1, w3 [I, L] and w2 [L, I] in latent space (docs/kimi-k3.md §1.3)."""
    return 3 * cfg.moe_intermediate_size * cfg.latent_size


def expert_bytes(cfg: K3Config = K3) -> float:
    """MXFP4 bytes of one routed expert: 4-bit codes + one uint8 scale per group (docs/kimi-k3.md §1.3:
    17,547,264 B for K3)."""
    p = expert_params(cfg)
    return p / 2 + p / cfg.mxfp4_group_size


def distinct_experts(cfg: K3Config, num_tokens: int, expert_dedup: float | None = None) -> float:
    """Expected distinct routed experts per MoE layer touched by `num_tokens` tokens.

    Uniform independent routing (docs/kimi-k3.md §6.3): N * (1 - (1 - k/N)^T), the pessimistic case.
    `expert_dedup` is a measured overlap factor instead: routed (token, expert) pairs per distinct
    expert, so distinct = k*T / dedup (1 = no sharing; colibri measured 2.7 in 32-token chunks).
    """
    _check_positive_int("num_tokens", num_tokens)
    n, k = cfg.num_experts, cfg.num_experts_per_token
    if expert_dedup is None:
        return n * (1.0 - (1.0 - k / n) ** num_tokens)
    if not isinstance(expert_dedup, (int, float)) or not 1.0 <= expert_dedup <= num_tokens:
        raise ValueError(f"expert_dedup={expert_dedup!r}: must be in [1, num_tokens={num_tokens}]")
    distinct = k * num_tokens / expert_dedup
    if distinct > n:
        raise ValueError(f"expert_dedup={expert_dedup!r}: gives {distinct:.1f} distinct experts > num_experts={n}")
    return distinct


# ---- expert-parallel imbalance (docs/kimi-k3.md §6.5, EP16 column) ---------------------------------------------

@functools.lru_cache(maxsize=256)
def _expected_max_per_rank_integer(num_experts: int, num_ranks: int, distinct: int) -> float:
    """E[max over ranks of the experts a rank holds] when `distinct` experts out of `num_experts`
    are touched uniformly at random and rank r owns the contiguous block of num_experts/num_ranks
    (FlashInfer MegaMoE layout). The per-rank counts are multivariate hypergeometric. P(max <= m)
    comes from placing the ranks one at a time: with `pool` experts not yet assigned and r touched
    ones among them, the next rank takes j of them with probability
    C(per_rank, j) C(pool - per_rank, r - j) / C(pool, r); E[max] = sum over m of (1 - P(max <= m))."""
    per_rank = num_experts // num_ranks
    left = np.arange(distinct + 1)[:, None]  # r: touched experts still to place
    took = np.arange(min(per_rank, distinct) + 1)[None, :]  # j: how many land on this rank
    transitions = []
    for rank in range(num_ranks):
        pool = num_experts - rank * per_rank
        log_num = log_comb(per_rank, took) + log_comb(pool - per_rank, left - took)
        log_den = np.broadcast_to(log_comb(pool, left), log_num.shape)
        # Impossible (r, j) pairs (numerator -inf) and states with more left than the pool (never
        # reached, denominator -inf) get probability 0.
        possible = np.isfinite(log_num) & np.isfinite(log_den)
        log_p = np.full(log_num.shape, -np.inf)
        np.subtract(log_num, log_den, out=log_p, where=possible)
        transitions.append(np.exp(log_p))  # [r, j]
    expected = 0.0
    for m in range(min(per_rank, distinct)):
        prob = np.zeros(distinct + 1)  # P(r left to place and every rank so far holds <= m)
        prob[distinct] = 1.0
        for pmf in transitions:
            new = np.zeros(distinct + 1)
            for j in range(min(m, pmf.shape[1] - 1) + 1):
                new[: distinct + 1 - j] += prob[j:] * pmf[j:, j]
            prob = new
        expected += 1.0 - prob[0]
        if 1.0 - prob[0] < 1e-12:
            break
    return expected


def log_comb(n, k) -> np.ndarray:
    """log C(n, k) elementwise, -inf where k < 0 or k > n."""
    n, k = np.broadcast_arrays(np.asarray(n, dtype=float), np.asarray(k, dtype=float))
    valid = (k >= 0) & (k <= n)
    safe_k = np.where(valid, k, 0.0)
    safe_n = np.where(valid, n, 0.0)
    return np.where(valid, gammaln(safe_n + 1) - gammaln(safe_k + 1) - gammaln(safe_n - safe_k + 1), -np.inf)


def expected_max_experts_per_rank(num_experts: int, num_ranks: int, distinct: float) -> float:
    """Expected experts on the busiest of `num_ranks` expert-parallel ranks when `distinct`
    experts per layer are touched (docs/kimi-k3.md §6.5: 3.05 for 16 experts on 16 ranks of 56, 12.28 for the
    120.28 of an 8-token verify). Non-integer `distinct` interpolates linearly between its
    neighbours."""
    _check_positive_int("num_ranks", num_ranks)
    if num_experts % num_ranks:
        raise ValueError(f"num_ranks={num_ranks!r}: must divide num_experts={num_experts}")
    if not 0 <= distinct <= num_experts:
        raise ValueError(f"distinct={distinct!r}: must be in [0, num_experts={num_experts}]")
    lo = math.floor(distinct)
    hi = min(lo + 1, num_experts)
    e_lo = _expected_max_per_rank_integer(num_experts, num_ranks, lo)
    if distinct == lo:
        return e_lo
    e_hi = _expected_max_per_rank_integer(num_experts, num_ranks, hi)
    return e_lo + (distinct - lo) * (e_hi - e_lo)
