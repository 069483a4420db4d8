"""Host side of the CuTe DSL skinny GEMMs (linear/cute_sm90.py, linear/cute_sm100.py): the shapes
they take, the split-K and pipeline-depth heuristics, the split-K counters. Imports no cutlass, so
the registry can ask `supports` on any machine."""
import math

import torch

WEIGHT_TILE = 128  # weight rows per CTA (two m64 WGMMAs)
K_TILE = 64  # 64 bf16 = 128 bytes: one 128B-swizzle row per stage
MAX_TOKENS = 16  # rows of every skinny kernel (the Blackwell one's N is 16)
TOKEN_TILES = (8, 16, 32, 64)  # WGMMA N of the Hopper kernel: up to 64 rows (a batch of 8 verifying 8 tokens)
# The rows the registry sends to the Hopper kernel. The tiles of 32 and 64 pass
# tests/gpu/test_linear_gpu.py, but on the rank's steps of 32 and 64 rows they did not beat the
# cuBLAS reference they would replace (experiments/step_bench.py --setting linear_hopper_rows=64,
# experiments/notes/rank.md): a step of more than 16 rows stays with the reference.
HOPPER_MAX_TOKENS = 16
# Pipeline depth (choose_stages). 4 x 18 KB of tiles per CTA lets three CTAs share an SM, so 396
# CTAs are resident at once; 5 stages allow two per SM (264 resident) with deeper prefetch each.
FEW_STAGES, MANY_STAGES = 4, 5
# K of at most 8 k-tiles (512): split-K lost at every M on MLA kv_b in bench run 2 (the pipeline
# ramp and the partials' traffic outweigh the extra parallelism), so such matrices are not split.
MIN_K_TILES_TO_SPLIT = 9
H200_SMS = 132
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# Split-K reduction: False sums the splits in a second small kernel (measured best at full-width
# K3 shapes on the H200, experiments/notes/skinny_gemm.md); True has the last CTA of each tile sum
# them in the GEMM kernel, one launch per linear instead of two, for steps whose GEMMs are so small
# that launches dominate (a TP16 rank: docs/kimi-k3.md §8.5). Measured there too, it lost at batch
# 1 (§8.5), so it stays off; experiments/step_bench.py --setting linear_fused_reduce=1 times it.
FUSED_REDUCE = False

# Kimi K3 trunk GEMMs (weight N x K; docs/kernels.md §0 shapes, §7 row 1): what the split-K
# heuristic is tuned for and what the GPU test and the bench cover. Shapes that occur twice
# (MLA o = KDA o_proj, shared gate+up = MLA g) are listed once, under both names.
K3_TRUNK_SHAPES = {
    "kda_qkvg": (49152, 7168),
    "kda_o/mla_o": (7168, 12288),
    "mla_q_a": (1536, 7168),
    "mla_in_fused": (14400, 7168),  # q_a | kv_a | g in one GEMM, as the K3 model runs them (K3Model._fuse_rows)
    "mla_q_b": (18432, 1536),
    "mla_kv_a": (576, 7168),
    "mla_kv_b": (24576, 512),
    "mla_g/shared_gate_up": (12288, 7168),
    "shared_down": (7168, 6144),
    "latent_down": (3584, 7168),
    "latent_up": (7168, 3584),
    "router": (896, 7168),
    "lm_head": (163840, 7168),
}


def token_tile(m: int) -> int:
    """WGMMA N for m tokens: the smallest of TOKEN_TILES that holds them (8 when it fits: half the B
    traffic and MMA work of 16)."""
    for tile in TOKEN_TILES:
        if m <= tile:
            return tile
    raise ValueError(f"m={m}: more tokens than the largest tile ({TOKEN_TILES[-1]})")


def choose_splits(n: int, k: int, num_sms: int = H200_SMS) -> int:
    """Split-K factor that balances weight bytes over the SMs.

    Cost per SM = (CTAs it runs) x (k-tiles per CTA + a fixed ramp of ~2 k-tiles for the pipeline
    fill and the epilogue); the fp32 partials are a few % of the weight bytes and are ignored.
    Ties go to fewer splits (less workspace traffic).
    """
    weight_tiles = math.ceil(n / WEIGHT_TILE)
    k_tiles = math.ceil(k / K_TILE)
    if k_tiles < MIN_K_TILES_TO_SPLIT:
        return 1
    best, best_cost = 1, None
    for splits in range(1, min(k_tiles, 32) + 1):
        per_split = math.ceil(k_tiles / splits)
        if math.ceil(k_tiles / per_split) != splits:  # would leave an empty split
            continue
        cost = math.ceil(weight_tiles * splits / num_sms) * (per_split + 2)
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


def choose_stages(n: int, splits: int, num_sms: int = H200_SMS) -> int:
    """Pipeline depth, from bench run 2 (experiments/notes/skinny_gemm.md): unsplit matrices whose
    CTAs all fit at three per SM (KDA q/k/v/g: 384 CTAs, MLA kv_b: 192) run best with 4 stages
    (no partial second wave); the many-wave LM head (1280 CTAs) and every split matrix were
    measured best (or only) with 5."""
    ctas = math.ceil(n / WEIGHT_TILE) * splits
    return FEW_STAGES if splits == 1 and ctas <= 3 * num_sms else MANY_STAGES


def shape_supported(m: int, n: int, k: int, dtype: torch.dtype, weight_stride: tuple[int, int],
                    max_tokens: int = MAX_TOKENS) -> bool:
    """The problems a kernel computes: M <= max_tokens, bf16/fp16, a row-major weight whose rows
    are 16-byte multiples (TMA needs 16-byte-aligned strides)."""
    return (
        1 <= m <= max_tokens
        and dtype in SUPPORTED_DTYPES
        and k % 8 == 0
        and n % 8 == 0
        and n >= 1
        and tuple(weight_stride) == (k, 1)
    )


# Token rows read where they lie when TMA can (x_rows_supported); False copies every non-contiguous x
# first, as the kernel did before (experiments/step_bench.py --setting linear_strided_tokens=0).
STRIDED_TOKENS = True


def x_rows_supported(x: torch.Tensor) -> bool:
    """Whether the Hopper kernel's TMA reads x [M, K] where it lies: unit column stride, a row stride
    of whole 16-byte units, a 16-byte-aligned base (a column slice of a fused GEMM's output, as KDA's
    f_a, qualifies when its offset and the row are multiples of 8 elements). Otherwise it takes a copy."""
    if not STRIDED_TOKENS and not x.is_contiguous():
        return False
    return (x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.stride(0) >= x.shape[1] and x.data_ptr() % 16 == 0
            and x.element_size() == 2)


def supports(x: torch.Tensor, weight: torch.Tensor, max_tokens: int = MAX_TOKENS) -> bool:
    """Registry predicate (of the Blackwell kernel; supports_hopper the Hopper one's): anything
    else must go to another implementation."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and x.is_cuda
        and weight.device == x.device
        and weight.dtype == x.dtype
        and x.shape[1] == weight.shape[1]
        and weight.data_ptr() % 16 == 0
        and shape_supported(x.shape[0], weight.shape[0], weight.shape[1], x.dtype, weight.stride(), max_tokens)
    )


def supports_hopper(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The Hopper kernel's registry predicate: up to HOPPER_MAX_TOKENS rows (read at each call, so a
    bench setting can raise it)."""
    return supports(x, weight, HOPPER_MAX_TOKENS)


_counters: dict[tuple, torch.Tensor] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Per-tile arrival counters of the fused split-K reduction, zeroed once and re-armed to zero by
    the kernel itself. One buffer per (device, stream, tile count): calls on one stream run in
    order, so they never share counters concurrently. (Two CUDA graphs that captured the same
    stream and are replayed concurrently would; capture them on different streams.)"""
    stream = torch.cuda.current_stream(device).cuda_stream
    tiles = math.ceil(n / WEIGHT_TILE)
    key = (device, stream, tiles)
    counters = _counters.get(key)
    if counters is None:
        counters = _counters[key] = torch.zeros(tiles, dtype=torch.int32, device=device)
    return counters
