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
