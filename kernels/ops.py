"""The ops the models call. Each dispatches through the registry on its first tensor's device,
so an implementation is swapped (config, DSPARK_KERNELS, `registry.use`) without touching model
code. The contract of each op is its reference implementation (kernels/<op>/reference.py)."""
from __future__ import annotations

import torch

from .registry import select


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y[M, N] = x[M, K] @ weight[N, K]^T."""
    return select("linear", x, weight).fn(x, weight)


def linear_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear(x, weight) left as its split-K partials [S, M, N], for a consumer that adds them in its own
    pass (add_attn_res_mix_norm's delta) instead of a reduction launch: fp32 partials (float64 for float64
    operands) whose sum in split order, rounded to x's dtype, is what linear returns; a GEMM that does not
    split gives its one unrounded partial [1, M, N]. S depends on the shape and the kernel
    (docs/kimi-k3.md §8.5)."""
    return select("linear_partials", x, weight).fn(x, weight)


def linear_heads(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y[M, H, N] = x[M, H, K] @ weight[H, N, K]^T, one small matrix per head."""
    return select("linear_heads", x, weight).fn(x, weight)


def kda_verify(q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, A_log, dt_bias,
               o_norm_weight, state, lengths, *, lower_bound: float, eps: float,
               slots: torch.Tensor | None = None, records=None):
    """KDA over T tokens per request from the committed state, output-only -> (o [B,T,W], records).
    slots [B] int64: state and conv_state are pools and request b reads row slots[b]. records: buffers
    to fill (one layer's views of kda.reference.allocate_records(leading=(L,)), for kda_commit_layers),
    else allocated."""
    args = (q_in, k_in, v_in, f, beta_in, gate_in, conv_weight, conv_state, A_log, dt_bias,
            o_norm_weight, state, lengths)
    return select("kda_verify", *args).fn(*args, lower_bound=lower_bound, eps=eps, slots=slots, records=records)


def kda_commit(state: torch.Tensor, conv_state: torch.Tensor, records, num_tokens: torch.Tensor,
               slots: torch.Tensor | None = None) -> None:
    """In place: advance state/conv_state by the first num_tokens[b] positions of `records`
    (with slots [B] int64: rows slots[b] of the pools state/conv_state)."""
    return select("kda_commit", state, conv_state).fn(state, conv_state, records, num_tokens, slots=slots)


def kda_commit_layers(states: torch.Tensor, conv_states: torch.Tensor, records, num_tokens: torch.Tensor,
                      slots: torch.Tensor | None = None) -> None:
    """kda_commit of L layers at once: states [L, S, H, D, D], conv_states [L, S, 3, W, 3] (any layer
    and slot strides), records stacked with a leading L, num_tokens [B] shared by the layers."""
    return select("kda_commit_layers", states, conv_states).fn(states, conv_states, records, num_tokens, slots=slots)


def mla_verify_attention(q_latent, q_pe, kv_cache, slots, cache_lens, lengths, scale: float) -> torch.Tensor:
    """Absorbed MLA attention of T queries per request over the latent cache -> o_latent [B,T,H,R]."""
    args = (q_latent, q_pe, kv_cache, slots, cache_lens, lengths)
    return select("mla_verify_attention", *args).fn(*args, scale)


def mla_cache_rows(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cache: torch.Tensor, slots: torch.Tensor,
                   cache_lens: torch.Tensor, lengths: torch.Tensor, rope=None, *, q=None,
                   dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """In place: the latent rows [RMSNorm(c_kv) | k_pe] of B requests' T new tokens (kv [B*T, R + P],
    norm_weight [R]) into a layer's cache pool [slots, L + 1, R + P] at slots[b], rows
    cache_lens[b] + j; padding tokens (j >= lengths[b]) write the slot's spare row L (which of
    them lands there last is unspecified: nothing reads it). rope = (cos, sin, interleaved), float32
    [B*T, P/2] tables: k_pe rotated as the rotary op would (the DSpark drafter's RoPE; K3 has none).
    q = (c_q [B*T, Q], q_norm_weight [Q]): the query's norm in the same launch, returned as a new
    contiguous [B*T, Q] tensor in c_q's dtype, every row (padding tokens' too): rms_norm(c_q,
    q_norm_weight, eps), K3's RMSNorm with the kv norm's eps. c_q's rows may be strided (a column slice
    of the q_a | kv_a GEMM's output), its last dim contiguous. Without q: None. dtype: kv [S, B*T, R + P]
    and c_q [S, B*T, Q] are that GEMM's float32 split-K partials (linear_partials), each summed in split
    order and rounded to dtype (the cache's) first, as its reduction would have: no reduction launch."""
    args = (kv, norm_weight, cache, slots, cache_lens, lengths)
    if isinstance(q, tuple) and len(q) == 2 and all(isinstance(t, torch.Tensor) for t in q):
        args += q  # implementations' `supports` see c_q and q_norm_weight (a malformed q: the op's check names it)
    return select("mla_cache_rows", *args).fn(kv, norm_weight, eps, cache, slots, cache_lens, lengths, rope, q=q,
                                              dtype=dtype)


def mla_absorb_q(q: torch.Tensor, w_uk_t: torch.Tensor, rope=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated MLA's absorbed queries (docs/kimi-k3.md §3): q [M, H, nope + P] (q_b's output by head),
    w_uk_t [H, R, nope] -> (q_latent [M, H, R] = W_UK_h^T q_nope_h, q_pe [M, H, P]), both contiguous.
    rope = (cos, sin, interleaved), float32 [M, P/2] tables: q_pe rotated as the rotary op would."""
    return select("mla_absorb_q", q, w_uk_t).fn(q, w_uk_t, rope)


def mla_absorb_output(o_latent: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated MLA's output before o_proj: o_latent [M, H, R], w_uv [H, V, R], gate [M, H*V] ->
    sigmoid_gate(W_UV_h o_latent_h by head, as [M, H*V], gate). gate may be its GEMM's float32 split-K
    partials [S, M, H*V] (linear_partials), summed in split order and rounded to o_latent's dtype first,
    as the GEMM's reduction would have."""
    return select("mla_absorb_output", o_latent, w_uv, gate).fn(o_latent, w_uv, gate)


def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """K3 router -> (expert ids [M, k] long, weights [M, k] fp32)."""
    return select("moe_route", x, gate_weight, bias).fn(x, gate_weight, bias, top_k, scaling)


def moe_router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """The router's fp32 logits [M, E] = x [M, D] @ gate_weight [E, D]^T (docs/kimi-k3.md §1.2): what
    moe_route selects from, computed alone where the selection needs other ranks' logits too."""
    return select("moe_router_logits", x, gate_weight).fn(x, gate_weight)


def moe_route_logits(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """moe_route's selection from router logits [M, E] fp32 (computed elsewhere: a rank of a
    sharded router gathers them) -> (expert ids [M, k] long, weights [M, k] fp32)."""
    return select("moe_route_logits", logits, bias).fn(logits, bias, top_k, scaling)


def moe_dispatch_inputs(partials: torch.Tensor, router_width: int, dtype: torch.dtype, copies: int):
    """A rank's router | latent-down GEMM, from its split-K partials [S, M, R + L] (linear_partials), to
    the dispatch's inputs -> (logits [M, copies * R] fp32, latent [M, copies * L] in `dtype`): the
    partials added in split order in fp32, the R router columns kept in fp32 (the router is fp32,
    docs/kimi-k3.md §1.2), the L latent columns rounded once to `dtype` (what linear returns), each
    part written `copies` times side by side: one GPU's stand-in for all-gathering them over the
    ranks (dspark/targets/kimi_k3/parallel.py), in one launch where the GEMM's reduction and the
    two gathers took three (docs/kimi-k3.md §8.5)."""
    return select("moe_dispatch_inputs", partials).fn(partials, router_width, dtype, copies)


def moe_experts(latent: torch.Tensor, ids: torch.Tensor, route_weights: torch.Tensor, w1_packed, w1_scale,
                w3_packed, w3_scale, w2_packed, w2_scale, situ_beta: float, situ_linear_beta: float) -> torch.Tensor:
    """The routed MXFP4 experts, combined: latent [M, L], ids / route_weights [M, k] ->
    sum_j route_weights[:, j] * w2_e situ(w1_e h, w3_e h) for e = ids[:, j], fp32 [M, L].
    Experts are stacked MXFP4 (w1/w3 [E, I, L/2] + scales [E, I, L/32], w2 [E, L, I/2] +
    scales [E, L, I/32]); implementations' `supports` see every tensor (a kernel tiles only
    some expert shapes)."""
    tensors = (latent, ids, route_weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale)
    return select("moe_experts", *tensors).fn(*tensors, situ_beta, situ_linear_beta)


def moe_tail_inputs(routed: torch.Tensor, latent_norm: torch.Tensor, shared_gate_up: torch.Tensor, start: int,
                    width: int, eps: float, situ_beta: float, situ_linear_beta: float) -> torch.Tensor:
    """The input of the latent MoE's output GEMM, [M, width + S] in shared_gate_up's dtype: columns
    [start, start + width) of RMSNorm(routed [M, L] fp32; latent_norm) (normalised over all L),
    then situ_glu of shared_gate_up [M, 2S]'s halves. Against [latent_up | shared_down] it gives
    latent_up RMSNorm(routed) + shared_down SiTU(...) as one GEMM (dspark/targets/kimi_k3/moe.py).
    shared_gate_up may be its GEMM's split-K partials [splits, M, 2S] (linear_partials): added and
    rounded to latent_norm's dtype first, which is then the result's."""
    args = (routed, latent_norm, shared_gate_up)
    return select("moe_tail_inputs", *args).fn(*args, start, width, eps, situ_beta, situ_linear_beta)


def rejection_sample(target_logits, draft_tokens, num_drafts, draft_probs, sampling, uniforms, race_noise):
    """Lossless acceptance of one verified block -> (num_accepted [B], next_token [B]) on the
    logits' device; contract: kernels/acceptance/reference.py. Dispatch sees the tensors only
    (draft_probs when there are some): the registry's `supports` and messages take tensors."""
    tensors = (target_logits, draft_tokens, num_drafts, uniforms, race_noise)
    tensors += () if draft_probs is None else (draft_probs,)
    return select("rejection_sample", *tensors).fn(
        target_logits, draft_tokens, num_drafts, draft_probs, sampling, uniforms, race_noise)


def synthetic_sample(target_logits, draft_tokens, num_drafts, cond_rates, sampling, uniforms, race_noise):
    """LOSSY forced-acceptance sampler (speed measurement); contract: kernels/acceptance/reference.py."""
    tensors = (target_logits, draft_tokens, num_drafts, uniforms, race_noise, cond_rates)
    return select("synthetic_sample", *tensors).fn(
        target_logits, draft_tokens, num_drafts, cond_rates, sampling, uniforms, race_noise)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """K3's RMSNorm over the last dimension: normalise in fp32, round to x's dtype, scale; the
    result cast to out_dtype where given (the cast in the same launch on the GPU)."""
    return select("rms_norm", x, weight).fn(x, weight, eps, out_dtype)


def rms_norm_scaled_in_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's RMSNorm (F.rms_norm, the DSpark drafter's): the statistics and the weight's scale in fp32,
    one rounding to x's dtype; K3's rms_norm rounds before it scales."""
    return select("rms_norm_scaled_in_fp32", x, weight).fn(x, weight, eps)


def attn_res_mix_norm(current: torch.Tensor, checkpoints: torch.Tensor, mix_norm: torch.Tensor,
                      mix_proj: torch.Tensor, out_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(out_norm) of Block AttnRes's mix of {checkpoints [C, M, d], current [M, d]} -> [M, d]."""
    args = (current, checkpoints, mix_norm, mix_proj, out_norm)
    return select("attn_res_mix_norm", *args).fn(*args, eps)


def add_attn_res_mix_norm(residual: torch.Tensor, delta: torch.Tensor, checkpoints: torch.Tensor,
                          mix_norm: torch.Tensor, mix_proj: torch.Tensor, out_norm: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """total = residual + delta ([M, d], one dtype), then (attn_res_mix_norm(total, checkpoints, ...),
    total): the residual add fused into the norm that follows it. delta may be a GEMM's split-K
    partials [S, M, d] (linear_partials): the norm adds them, rounded to residual's dtype, first."""
    args = (residual, delta, checkpoints, mix_norm, mix_proj, out_norm)
    return select("add_attn_res_mix_norm", *args).fn(*args, eps)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """total = residual + delta (one dtype), then (torch's RMSNorm of total scaled by weight, total): the
    statistics and the scale in fp32, one rounding, as F.rms_norm (the DSpark drafter's layers); K3's
    rms_norm rounds before it scales."""
    return select("add_rms_norm", residual, delta, weight).fn(residual, delta, weight, eps)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU: b1*tanh(g/b1)*sigmoid(g) * b2*tanh(u/b2) in fp32, result in gate's dtype."""
    return select("situ_glu", gate, up).fn(gate, up, beta, linear_beta)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """silu(gate) * up, each rounded to their dtype as torch's two ops round (the drafter's SwiGLU). With
    dtype, gate and up are a GEMM's split-K partials [S, ..., n] (fp32, linear_partials: the two column
    halves of one gate | up GEMM), each summed in split order and rounded to dtype, as the GEMM's
    reduction would have, before the activation: one launch where the reduction was one more."""
    if dtype is None:
        return select("silu_mul", gate, up).fn(gate, up)
    return select("silu_mul", gate, up, dtype).fn(gate, up, dtype)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) in fp32, result in x's dtype (KDA's and gated MLA's output gates)."""
    return select("sigmoid_gate", x, gate).fn(x, gate)


def draft_loss_terms(draft_logits: torch.Tensor, target_probs: torch.Tensor, rows: torch.Tensor | None,
                     labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per drafted position n: cross-entropy at labels[n] and the L1 distance between the draft's
    softmax and target_probs[rows[n]] (rows None: row n), both float32 [N], differentiable in
    draft_logits [N, V] (the DSpark loss's vocabulary-wide terms)."""
    args = (draft_logits, target_probs, rows, labels)
    return select("draft_loss_terms", *args).fn(*args)


def draft_head_loss(hidden: torch.Tensor, prev_embedding: torch.Tensor, lm_head: torch.Tensor,
                    markov_w2: torch.Tensor, target_probs: torch.Tensor | None, rows: torch.Tensor | None,
                    labels: torch.Tensor, *, indices_checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_loss_terms of the draft logits z = hidden lm_head^T + prev_embedding markov_w2^T
    ([N, d], [V, d], [N, r], [V, r]) without materialising them: (ce [N], l1 [N]) float32,
    differentiable in hidden, prev_embedding and markov_w2 (lm_head is frozen: one requiring
    grad is a ValueError). target_probs [M, V] float32 or bf16, or None (with rows None) for the
    cross-entropy alone: (ce, None), the L1 pass skipped; contract: kernels/draft_loss/head_reference.py.
    indices_checked: the caller has checked labels against [0, V) and rows against [0, M) itself (on
    the host, before copying them): the op skips its own check, the one read back from the device."""
    args = (hidden, prev_embedding, lm_head, markov_w2, target_probs, rows, labels)
    return select("draft_head_loss", *args).fn(*args, indices_checked=indices_checked)


def markov_greedy_draft(base: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The greedy Markov stage of a DSpark draft: base logits [B, G, V] (float32, or the LM head's
    bf16/fp16 product, widened where read), anchors [B],
    the vanilla Markov head's W1 [V1, r] and W2 [V, r] -> tokens [B, G] long, slot k the argmax of
    base[:, k] + W2 W1[slot k - 1's token] (the anchor before slot 0)."""
    return select("markov_greedy_draft", base, anchors, w1, w2).fn(base, anchors, w1, w2)


def draft_confidence(hidden: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor, w1: torch.Tensor | None,
                     weight: torch.Tensor, bias: torch.Tensor | None,
                     temperatures: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The DSpark confidence head of a greedy block -> (logits [B, G] float32, probs [B, G] float32):
    hidden [B, G, d], anchors [B] and tokens [B, G] integer ids (markov_greedy_draft's), the vanilla
    Markov head's W1 [V1, r] (None: a head without the Markov input), the head's Linear weight [d + r]
    ([d] without w1) and bias [1] (or None), all in hidden's dtype, and temperatures [G] float32 (or
    None). x_{k-1} = the anchor for slot 0, else tokens[:, k - 1]; logits[:, k] = w . [hidden[:, k] ;
    W1[x_{k-1}]] + b in hidden's dtype (the Linear's output), widened; probs = sigmoid(logits /
    temperatures) in float32 (sigmoid(logits) without). Fast kernels: the bf16 logit within one unit
    in the last place of the reference's (their fp32 sums run in another order)."""
    args = (hidden, anchors, tokens, w1, weight, bias, temperatures)
    return select("draft_confidence", *args).fn(*args)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE of x [..., H, D] by cos / sin [..., 1, D/2] (per position, shared by the heads), in
    float32, returned in x's dtype; pairs (x[2j], x[2j+1]) when interleaved, else (x[j], x[j+D/2])."""
    return select("rotary", x, cos, sin).fn(x, cos, sin, interleaved)
