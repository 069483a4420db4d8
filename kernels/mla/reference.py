"""Reference absorbed-MLA verify attention, the contract of the `mla_verify_attention` op.

docs/kimi-k3.md §3 (absorbed form, NoPE) and docs/kernels.md §2: every cache row is
[c_kv (R) | k_pe (P)]; query j of request b sees cache positions < cache_lens[b] + j + 1
(bottom-right causal: the T new rows are already written at cache_lens[b] .. + T - 1) and
    score = (q_latent . c_kv + q_pe . k_pe) * scale,   o_latent = softmax(score) . c_kv
in fp32 (float64 for float64 inputs). Queries past lengths[b] are padding and return zeros.

Token invariance: each query is computed alone over exactly the keys it sees, with the shapes
of one-token decoding at that position.
"""
from __future__ import annotations

import torch

from .. import ops
from ..numerics import PARTIAL_DTYPES, rms_norm, sum_partials
from ..registry import register


@register("mla_verify_attention", "reference", priority=0, reads_device_values=True)
def mla_verify_attention(q_latent, q_pe, kv_cache, slots, cache_lens, lengths, scale: float) -> torch.Tensor:
    B, T, H, R = q_latent.shape
    P = q_pe.shape[-1]
    if tuple(q_pe.shape) != (B, T, H, P):
        raise ValueError(f"q_pe: expected shape {(B, T, H, P)}, got {tuple(q_pe.shape)}")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != R + P:
        raise ValueError(f"kv_cache: expected [slots, max_len, {R + P}], got {tuple(kv_cache.shape)}")
    for name, tensor in (("slots", slots), ("cache_lens", cache_lens), ("lengths", lengths)):
        if tuple(tensor.shape) != (B,):
            raise ValueError(f"{name}: expected shape ({B},), got {tuple(tensor.shape)}")
    max_len = kv_cache.shape[1]
    compute = torch.float64 if q_latent.dtype == torch.float64 else torch.float32
    out = torch.zeros(B, T, H, R, dtype=q_latent.dtype, device=q_latent.device)
    for b in range(B):
        slot, start, n = int(slots[b]), int(cache_lens[b]), int(lengths[b])
        if not 0 <= slot < kv_cache.shape[0]:
            raise ValueError(f"slots: {slot} outside [0, {kv_cache.shape[0]})")
        if not 0 <= n <= T or start < 0 or start + n > max_len:
            raise ValueError(f"cache_lens/lengths: {start} + {n} tokens do not fit max_len {max_len} (T={T})")
        for j in range(n):
            rows = kv_cache[slot, : start + j + 1].to(compute)
            c_kv, k_pe = rows[:, :R], rows[:, R:]
            scores = (q_latent[b, j].to(compute) @ c_kv.t() + q_pe[b, j].to(compute) @ k_pe.t()) * scale  # [H, L]
            out[b, j] = (torch.softmax(scores, dim=-1) @ c_kv).to(out.dtype)
    return out


def check_cache_rows(kv, norm_weight, cache, slots, cache_lens, lengths, q=None) -> int:
    """The arguments mla_cache_rows takes (every implementation checks the same contract) -> T."""
    B = slots.shape[0] if slots.dim() == 1 else -1
    for name, tensor in (("slots", slots), ("cache_lens", cache_lens), ("lengths", lengths)):
        if tuple(tensor.shape) != (B,) or tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected an int32/int64 [B] tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    R = norm_weight.shape[0] if norm_weight.dim() == 1 else -1
    if kv.dim() != 2 or kv.shape[1] <= R or R < 1 or B < 1 or kv.shape[0] % B:
        raise ValueError(f"kv / norm_weight: expected [B*T, R + P] rows for B={B} and [R], got {tuple(kv.shape)} "
                         f"and {tuple(norm_weight.shape)}")
    if cache.dim() != 3 or cache.shape[2] != kv.shape[1] or cache.shape[1] < 2:
        raise ValueError(f"cache: expected [slots, max_len + 1, {kv.shape[1]}], got {tuple(cache.shape)}")
    if q is not None:
        check_q(q, kv.shape[0])
    return kv.shape[0] // B


def check_q(q, rows: int) -> None:
    """q = (c_q, q_norm_weight): c_q [rows, Q] of a floating dtype, its rows' elements contiguous (the
    rows themselves may be strided: a column slice of the q_a | kv_a GEMM's output), q_norm_weight [Q]."""
    if not (isinstance(q, tuple) and len(q) == 2 and all(isinstance(t, torch.Tensor) for t in q)):
        def described(value):
            return f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__

        got = f"{type(q).__name__} of {[described(v) for v in q]}" if isinstance(q, (tuple, list)) else described(q)
        raise ValueError(f"q: expected a (c_q, q_norm_weight) pair of tensors, got {got}")
    c_q, weight = q
    if c_q.dim() != 2 or c_q.shape[0] != rows or c_q.shape[1] < 1:
        raise ValueError(f"q: c_q must be [{rows}, Q] (a row per kv row), got {tuple(c_q.shape)}")
    if not c_q.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"q: c_q and q_norm_weight must be floating point, got {c_q.dtype} and {weight.dtype}")
    if tuple(weight.shape) != (c_q.shape[1],):
        raise ValueError(f"q: q_norm_weight must be [{c_q.shape[1]}] for c_q {tuple(c_q.shape)}, got "
                         f"{tuple(weight.shape)}")
    if c_q.stride(1) != 1 and c_q.shape[1] > 1:
        raise ValueError(f"q: c_q's rows must be contiguous (stride 1 along Q), got strides {c_q.stride()}")


def check_rope(rope, rows: int, width: int) -> None:
    """rope = (cos, sin, interleaved): float32 tables [rows, width / 2], one row per token."""
    cos, sin, interleaved = rope
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (rows, width // 2) or table.dtype != torch.float32 or width % 2:
            raise ValueError(f"rope: {name} must be float32 [{rows}, {width // 2}] for a rope part of {width}, got "
                             f"{table.dtype} {tuple(table.shape)}")
    if not isinstance(interleaved, bool):
        raise ValueError(f"rope: interleaved must be a bool, got {interleaved!r}")


def rotated(pe: torch.Tensor, rope) -> torch.Tensor:
    """pe [M, H, P] (or [M, P], one head) rotated by the rotary op with rope's per-token tables."""
    cos, sin, interleaved = rope
    heads = pe.unsqueeze(1) if pe.dim() == 2 else pe
    return ops.rotary(heads, cos[:, None], sin[:, None], interleaved).reshape(pe.shape)


def check_reduced(kv, q, dtype, cache) -> None:
    """mla_cache_rows' partials form (dtype given): kv [S, M, R + P] and c_q [S, M, Q] float32 split-K
    partials of one GEMM, dtype the GEMM's (and the cache's); ValueError naming the bad argument."""
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype != cache.dtype:
        raise ValueError(f"dtype: with partials, the GEMM's floating dtype, the cache's {cache.dtype}; got {dtype!r}")
    if kv.dim() != 3 or kv.dtype not in PARTIAL_DTYPES:
        raise ValueError(f"kv: with dtype, float32 split-K partials [S, M, R + P], got {kv.dtype} {tuple(kv.shape)}")
    if q is not None and isinstance(q, tuple) and len(q) == 2 and isinstance(q[0], torch.Tensor):
        c_q = q[0]
        if c_q.dim() != 3 or c_q.dtype not in PARTIAL_DTYPES or c_q.shape[:2] != kv.shape[:2]:
            raise ValueError(f"q: with dtype, c_q must be float32 split-K partials [{kv.shape[0]}, {kv.shape[1]}, Q] "
                             f"(kv's), got {c_q.dtype} {tuple(c_q.shape)}")


@register("mla_cache_rows", "reference", priority=0)
def mla_cache_rows(kv, norm_weight, eps: float, cache, slots, cache_lens, lengths, rope=None, *, q=None, dtype=None):
    """The rows in one scatter with no host read of the lengths: the spare row L of each slot (never
    read) takes the padding tokens' rows; k_pe rotated first with rope. q = (c_q, q_norm_weight):
    also returns rms_norm(c_q, q_norm_weight, eps), K3's norm (kernels/numerics.py), every row (a
    padding token's too), contiguous in c_q's dtype; without q, None. dtype: kv and c_q are one GEMM's
    split-K partials, each summed in split order and rounded to dtype (sum_partials) first."""
    check_reduced(kv, q, dtype, cache)
    if dtype is not None:
        kv = sum_partials(kv, dtype)
        if q is not None:
            q = (sum_partials(q[0], dtype), q[1])
    T = check_cache_rows(kv, norm_weight, cache, slots, cache_lens, lengths, q)
    B, R = slots.shape[0], norm_weight.shape[0]
    k_pe = kv[:, R:]
    if rope is not None:
        check_rope(rope, kv.shape[0], k_pe.shape[1])
        k_pe = rotated(k_pe, rope)
    rows = torch.cat([rms_norm(kv[:, :R], norm_weight, eps), k_pe], dim=-1).view(B, T, -1)
    spare = cache.shape[1] - 1
    offsets = torch.arange(T, device=kv.device)
    valid = offsets[None, :] < lengths[:, None]
    positions = torch.where(valid, cache_lens[:, None] + offsets[None, :], spare)
    cache.index_put_((slots[:, None].expand(B, T), positions), rows.to(cache.dtype))
    return None if q is None else rms_norm(q[0], q[1], eps).contiguous()


def check_absorb_q(q, w_uk_t) -> None:
    if q.dim() != 3 or w_uk_t.dim() != 3 or w_uk_t.shape[0] != q.shape[1] or w_uk_t.shape[2] >= q.shape[2]:
        raise ValueError(f"q / w_uk_t: expected [M, H, nope + P] and [H, R, nope], got {tuple(q.shape)} and "
                         f"{tuple(w_uk_t.shape)}")


@register("mla_absorb_q", "reference", priority=0)
def mla_absorb_q(q, w_uk_t, rope=None):
    """linear_heads on the nope part, the rope part copied out (rotated with rope)."""
    check_absorb_q(q, w_uk_t)
    nope = w_uk_t.shape[2]
    if rope is None:
        return ops.linear_heads(q[:, :, :nope], w_uk_t), q[:, :, nope:].contiguous()
    check_rope(rope, q.shape[0], q.shape[2] - nope)
    return ops.linear_heads(q[:, :, :nope], w_uk_t), rotated(q[:, :, nope:], rope)


def check_absorb_output(o_latent, w_uv, gate) -> None:
    if (o_latent.dim() != 3 or w_uv.dim() != 3 or w_uv.shape[0] != o_latent.shape[1]
            or w_uv.shape[2] != o_latent.shape[2]):
        raise ValueError(f"o_latent / w_uv: expected [M, H, R] and [H, V, R], got {tuple(o_latent.shape)} and "
                         f"{tuple(w_uv.shape)}")
    M, H, V = o_latent.shape[0], w_uv.shape[0], w_uv.shape[1]
    if gate.dim() == 3:  # its GEMM's split-K partials
        if tuple(gate.shape[1:]) != (M, H * V) or gate.dtype not in PARTIAL_DTYPES:
            raise ValueError(f"gate: as split-K partials, expected float32 [S, {M}, {H * V}], got {gate.dtype} "
                             f"{tuple(gate.shape)}")
    elif tuple(gate.shape) != (M, H * V):
        raise ValueError(f"gate: expected shape {(M, H * V)}, got {tuple(gate.shape)}")


@register("mla_absorb_output", "reference", priority=0)
def mla_absorb_output(o_latent, w_uv, gate):
    """linear_heads, then the sigmoid output gate; a gate as its GEMM's split-K partials [S, M, H*V] is
    summed in split order and rounded to o_latent's dtype first (sum_partials)."""
    check_absorb_output(o_latent, w_uv, gate)
    if gate.dim() == 3:
        gate = sum_partials(gate, o_latent.dtype)
    o = ops.linear_heads(o_latent, w_uv).reshape(o_latent.shape[0], -1)
    return ops.sigmoid_gate(o, gate)
