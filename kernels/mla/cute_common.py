"""Host side and split-KV combine shared by the CuTe DSL MLA verify kernels (sm_90a, sm_100a/sm_103a).

The op (spec: kernels.md §2, kimi-k3.md §3 "absorbed decode form"; contract: reference.py): the
T verify queries of request b, H heads each, attend over the latent cache rows
[c_kv (512) | k_pe (64)] of slot slots[b]; query j sees rows < cache_lens[b] + j + 1 (bottom-right
causal); queries j >= lengths[b] are padding and return zeros.

Both kernels pack heads x tokens into the MMA M dimension: request b's queries are the
rows r = j * H + h of q_latent[b] viewed as [T*H, 512] (contiguous in the [B, T, H, 512] layout),
tiled by 64 rows. The keys are split over `splits` CTAs per row tile (flash-decoding); each
split writes its normalised partial output and its log2-sum-exp, and `combine` merges them:
    o = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m),   m = max_s lse_s.
With one split the attention kernel writes the bf16 output itself and no combine runs.
"""
# No `from __future__ import annotations`: CuTe DSL evaluates the device functions' annotations.

import functools
import math

import torch

from .. import cute_common

LATENT = 512  # c_kv width = kv_lora_rank (kimi-k3.md §3)
ROPE = 64  # k_pe width = qk_rope_head_dim
HEAD_DIM = LATENT + ROPE  # one cache row
ROWS_PER_TILE = 64  # query rows (head x token) per CTA: one m64 MMA tile
KV_TILE = 64  # cache rows per pipeline stage
MAX_TOKENS = 16  # verify width T supported (k <= 15 drafts)
# Split heuristic, from the round-1 split sweep on the H200 (experiments/notes/mla.md): 2 KV tiles
# per split still paid at 1k keys for T <= 4, and T = 1 at 32k was faster with 32 splits than 64.
SPLITS_CAP = 32
MIN_TILES_PER_SPLIT = 2
MAX_SPLITS = 64  # what a caller may force (benchmarks)
COMBINE_THREADS = LATENT // 4  # four output columns per thread
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


def index_dtype(dtype: torch.dtype):
    import cutlass

    return {torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}[dtype]


@functools.cache
def _combine_launcher():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    @cute.kernel
    def combine_kernel(o_partial: cute.Tensor, lse_partial: cute.Tensor, lengths: cute.Tensor, out: cute.Tensor,
                       heads: cutlass.Constexpr):
        """One CTA per (query row, request); thread t owns output columns 4t .. 4t+3."""
        cute.arch.griddepcontrol_wait()  # the partials come from the attention kernel
        tidx, _, _ = cute.arch.thread_idx()
        row, b, _ = cute.arch.block_idx()
        splits = o_partial.shape[1]
        top = cutlass.Float32(-math.inf)
        for s in cutlass.range(splits, unroll=1):
            top = cute.arch.fmax(top, lse_partial[b, s, row])
        acc = cute.make_rmem_tensor((4,), cutlass.Float32)
        acc.fill(0.0)
        total = cutlass.Float32(0.0)
        # a padding query (token >= lengths[b]) or a row that saw no key keeps zeros
        if row // heads < lengths[b].to(cutlass.Int32) and top != cutlass.Float32(-math.inf):
            for s in cutlass.range(splits, unroll=1):
                # an empty split (or one whose keys this row cannot see) has lse = -inf: weight 0
                weight = cute.arch.exp2(lse_partial[b, s, row] - top)
                total += weight
                for c in cutlass.range_constexpr(4):
                    acc[c] = acc[c] + weight * o_partial[b, s, row, tidx * 4 + c].to(cutlass.Float32)
            for c in cutlass.range_constexpr(4):
                acc[c] = acc[c] / total
        for c in cutlass.range_constexpr(4):
            out[b, row, tidx * 4 + c] = acc[c].to(out.element_type)

    @cute.jit
    def launch(o_partial: cute.Tensor, lse_partial: cute.Tensor, lengths: cute.Tensor, out: cute.Tensor,
               heads: cutlass.Constexpr, stream: cuda.CUstream):
        """o_partial [B, splits, rows_pad, 512] fp32, lse_partial [B, splits, rows_pad] fp32 (log2
        units), out [B, T, H, 512] bf16 (written as [B, T*H, 512])."""
        batch, tokens = out.shape[0], out.shape[1]
        rows = tokens * heads
        out_rows = cute.make_tensor(
            out.iterator, cute.make_layout((batch, rows, LATENT), stride=(rows * LATENT, LATENT, 1))
        )
        combine_kernel(o_partial, lse_partial, lengths, out_rows, heads).launch(
            grid=(rows, batch, 1), block=[COMBINE_THREADS, 1, 1], stream=stream, use_pdl=True
        )

    return launch


def fake_arguments(heads: int, index: torch.dtype, partial_dtype: torch.dtype = torch.float32) -> tuple:
    """Compile-time stand-ins for (q_latent, q_pe, kv_cache, slots, cache_lens, lengths, out,
    o_partial, lse): B, T, slots, max_len, splits and padded rows are symbolic."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    batch, tokens, num_slots, max_len, splits, rows_pad = (cute.sym_int() for _ in range(6))
    bf16 = cutlass.BFloat16
    q_latent = make_fake_compact_tensor(bf16, (batch, tokens, heads, LATENT), stride_order=(3, 2, 1, 0), assumed_align=16)
    q_pe = make_fake_compact_tensor(bf16, (batch, tokens, heads, ROPE), stride_order=(3, 2, 1, 0), assumed_align=16)
    kv_cache = make_fake_compact_tensor(bf16, (num_slots, max_len, HEAD_DIM), stride_order=(2, 1, 0), assumed_align=16)
    idx = index_dtype(index)
    align = torch.empty((), dtype=index).element_size()  # a slice like cache_lens[1:] is allowed
    slots, cache_lens, lengths = (make_fake_compact_tensor(idx, (batch,), assumed_align=align) for _ in range(3))
    out = make_fake_compact_tensor(bf16, (batch, tokens, heads, LATENT), stride_order=(3, 2, 1, 0), assumed_align=16)
    o_partial = make_fake_compact_tensor(
        cute_common.torch_to_cutlass_dtype(partial_dtype), (batch, splits, rows_pad, LATENT), stride_order=(3, 2, 1, 0),
        assumed_align=16,
    )
    lse = make_fake_compact_tensor(cutlass.Float32, (batch, splits, rows_pad), stride_order=(2, 1, 0), assumed_align=16)
    return q_latent, q_pe, kv_cache, slots, cache_lens, lengths, out, o_partial, lse


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
