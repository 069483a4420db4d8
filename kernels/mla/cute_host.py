"""Host side shared by the CuTe DSL MLA verify kernels (sm_90a, sm_100a/sm_103a): argument checks,
the split-KV heuristic and workspace. Imports no cutlass (the registry asks `supports` anywhere).

The op (docs/kernels.md §2, docs/kimi-k3.md §3 "absorbed decode form"; contract: reference.py): the
T verify queries of request b, H heads each, attend over the latent cache rows
[c_kv (512) | k_pe (64)] of slot slots[b]; query j sees rows < cache_lens[b] + j + 1 (bottom-right
causal); queries j >= lengths[b] are padding and return zeros.

Both kernels pack heads x tokens into the MMA M dimension: request b's queries are the
rows r = j * H + h of q_latent[b] viewed as [T*H, 512] (contiguous in the [B, T, H, 512] layout),
tiled by 64 rows. The keys are split over `splits` CTAs per row tile (flash-decoding); each
split writes its normalised partial output and its log2-sum-exp, and the combine kernel
(cute_sm90.py) merges them:
    o = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m),   m = max_s lse_s.
With one split the attention kernel writes the bf16 output itself and no combine runs.
"""
import math

import torch


LATENT = 512  # c_kv width = kv_lora_rank (docs/kimi-k3.md §3)
ROPE = 64  # k_pe width = qk_rope_head_dim
HEAD_DIM = LATENT + ROPE  # one cache row
ROWS_PER_TILE = 64  # query rows (head x token) per CTA: one m64 MMA tile
KV_TILE = 64  # cache rows per pipeline stage
MAX_TOKENS = 16  # verify width T supported (k <= 15 drafts)
# Split heuristic, from the split sweep on the H200 (experiments/notes/mla.md): 2 KV tiles
# per split still paid at 1k keys for T <= 4, and T = 1 at 32k was faster with 32 splits than 64.
SPLITS_CAP = 32
MIN_TILES_PER_SPLIT = 2
MAX_SPLITS = 64  # what a caller may force (benchmarks)
COMBINE_THREADS = LATENT // 4  # four output columns per thread
COMBINE_UNROLL = 8  # splits whose partials the combine loads before it waits (a power of 2 <= SPLITS_CAP)
INDEX_DTYPES = (torch.int32, torch.int64)
H200_SMS = 132


def row_tiles(tokens: int, heads: int) -> int:
    return math.ceil(tokens * heads / ROWS_PER_TILE)


def choose_splits(batch: int, tokens: int, heads: int, max_len: int, num_sms: int = H200_SMS) -> int:
    """KV splits per row tile so that batch x row tiles x splits CTAs fill one wave of the SMs
    (one CTA per SM: the kernel uses ~226 KB of shared memory), with at least MIN_TILES_PER_SPLIT
    KV tiles per split and at most SPLITS_CAP (each split costs a 64x512 fp32 partial write).
    max_len (the cache capacity) bounds the context: the real lengths live on the GPU and reading
    them would cost a sync."""
    base = batch * row_tiles(tokens, heads)
    kv_tiles = math.ceil(max_len / KV_TILE)
    by_sms = max(1, num_sms // base)
    by_work = max(1, kv_tiles // MIN_TILES_PER_SPLIT)
    return max(1, min(by_sms, by_work, SPLITS_CAP))


def check_arguments(q_latent, q_pe, kv_cache, slots, cache_lens, lengths) -> None:
    """ValueError naming the field for anything the CuTe kernels cannot take."""
    if q_latent.dim() != 4 or q_latent.shape[-1] != LATENT:
        raise ValueError(f"q_latent: expected [B, T, H, {LATENT}], got {tuple(q_latent.shape)}")
    B, T, H, _ = q_latent.shape
    if tuple(q_pe.shape) != (B, T, H, ROPE):
        raise ValueError(f"q_pe: expected shape {(B, T, H, ROPE)}, got {tuple(q_pe.shape)}")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != HEAD_DIM:
        raise ValueError(f"kv_cache: expected [slots, max_len, {HEAD_DIM}], got {tuple(kv_cache.shape)}")
    if not 1 <= T <= MAX_TOKENS:
        raise ValueError(f"q_latent: T={T} tokens, the CuTe MLA kernels take 1..{MAX_TOKENS}")
    for name, tensor in (("q_latent", q_latent), ("q_pe", q_pe), ("kv_cache", kv_cache)):
        if tensor.dtype != torch.bfloat16:
            raise ValueError(f"{name}: dtype {tensor.dtype}, the CuTe MLA kernels take bfloat16")
        if not tensor.is_contiguous() or tensor.data_ptr() % 16:
            raise ValueError(f"{name}: must be contiguous and 16-byte aligned (TMA)")
    for name, tensor in (("slots", slots), ("cache_lens", cache_lens), ("lengths", lengths)):
        if tuple(tensor.shape) != (B,):
            raise ValueError(f"{name}: expected shape ({B},), got {tuple(tensor.shape)}")
        if tensor.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype}, expected int32 or int64")
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
    if len({slots.dtype, cache_lens.dtype, lengths.dtype}) != 1:
        raise ValueError(f"slots/cache_lens/lengths: dtypes differ ({slots.dtype}, {cache_lens.dtype}, {lengths.dtype})")
    devices = {t.device for t in (q_latent, q_pe, kv_cache, slots, cache_lens, lengths)}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"all tensors must be on one CUDA device, got {sorted(map(str, devices))}")


def supports(q_latent, q_pe, kv_cache, slots, cache_lens, lengths) -> bool:
    """Registry predicate: bf16 contiguous K3 shapes (R=512, P=64), T <= 16, on CUDA."""
    try:
        check_arguments(q_latent, q_pe, kv_cache, slots, cache_lens, lengths)
    except ValueError:
        return False
    return True


def workspace(batch: int, tokens: int, heads: int, splits: int, device,
              partial_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV partials: o [B, splits, rows_pad, 512] fp32 and lse [B, splits, rows_pad] fp32, rows
    padded to whole pairs of 64-row tiles (the cluster-pair kernel may run one tile past T*H) so
    that the attention kernel stores without bounds checks. With one split they are never touched
    (the caching allocator makes the allocation free)."""
    rows_pad = math.ceil(row_tiles(tokens, heads) / 2) * 2 * ROWS_PER_TILE
    o_partial = torch.empty((batch, splits, rows_pad, LATENT), dtype=partial_dtype, device=device)
    lse = torch.empty((batch, splits, rows_pad), dtype=torch.float32, device=device)
    return o_partial, lse
