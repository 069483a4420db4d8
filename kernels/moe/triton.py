"""The K3 router with its selection in one Triton launch per call (contract: reference.moe_route).

Why: the reference widens the bf16 router weight to a float32 copy on every call (12.8 MB read,
25.7 MB written for K3), runs a cuBLAS fp32 GEMM on it (a SIMT sgemm at 8 rows) and selects with
sigmoid, add, topk, gather, sum, divide and scale, each its own launch, in every MoE layer of a
batch-1 step. Here bf16 tokens and weight multiply as they are in a cuBLAS bf16 GEMM with fp32
output (bf16 products are exact in fp32 and summed in fp32: the reference's logits up to
summation order; at one row router_logits_kernel, one launch, takes cuBLAS's place: GEMV_MAX_ROWS),
and one program per token does the rest.

The default on CUDA: checked under Triton's interpreter (tests/triton_interpret_checks.py) and on
the H200 (docs/kernels.md §10.6).
"""
import torch

from .. import ops
from ..registry import register
from ..triton_common import kernel_module, pdl_options, triton_available
from .expert_layout import check_device_list_ids, empty_device_lists
from .reference import check_dispatch_inputs, check_route, check_tail_inputs, tail_dtype

# Whether bf16 (or fp16) tokens and weight take the low-precision-input GEMM with fp32 output
# (False: both widened to fp32 first, as the reference does). experiments/router_bench.py.
LOW_PRECISION_GEMM = True

# Rows up to which the router's logits take router_logits_kernel (one launch: a program per expert
# reads its weight row once and sums in float32) where cuBLAS's bf16 GEMM with fp32 output splits K
# and adds the splits in a second kernel at decode's few rows. 1: the one launch beat cuBLAS at one
# row and tied or lost at 2-4 (docs/kernels.md §10.6). Other values stay for measuring
# (experiments/step_bench.py --setting router_gemv_rows=0|1|2|4; experiments/router_bench.py).
GEMV_MAX_ROWS = 1
GEMV_MAX_ROWS_BUILT = 4  # the widest row tile the kernel is built and checked for (BLOCK_M below)
GEMV_ELEMENTS = 4096  # a program's float32 products in flight, BLOCK_M x BLOCK_K: 32 registers a thread at 4 warps


def route_logits(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                 ids: torch.Tensor | None = None, weights: torch.Tensor | None = None):
    """(ids [M, k] long, weights [M, k] fp32) from router logits [M, E] (fp32, rows may be
    strided); ids and weights: optional contiguous outputs (tests poison them first)."""
    M, E = logits.shape
    ids = torch.empty(M, top_k, dtype=torch.long, device=logits.device) if ids is None else ids
    weights = torch.empty(M, top_k, dtype=torch.float32, device=logits.device) if weights is None else weights
    if M:
        kernel_module(__package__).route_kernel[(M,)](
            logits, logits.stride(0), bias, ids, weights, E, float(scaling), TOP_K=top_k,
            BLOCK_E=max(16, 1 << (E - 1).bit_length()), BLOCK_K=max(16, 1 << (top_k - 1).bit_length()),
            # 4 warps: each of the k picks is a block-wide argmax across them (shared memory and a
            # barrier), which beat 1 and 2 warps (one warp's shuffles alone) at K3's 896 logits
            # (docs/kernels.md §10.6)
            **pdl_options(), num_warps=4)
    return ids, weights


def router_logits_gemv(x: torch.Tensor, gate_weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits [M, E] = x [M, D] @ gate_weight [E, D]^T for M <= GEMV_MAX_ROWS_BUILT rows in one
    launch (router_logits_kernel); rows of x and gate_weight may be strided. out: an optional
    contiguous output (tests poison it first)."""
    M, D = x.shape
    E = gate_weight.shape[0]
    if not 1 <= M <= GEMV_MAX_ROWS_BUILT or x.stride(1) != 1 or gate_weight.stride(1) != 1:
        raise ValueError(f"x: router_logits_gemv takes 1 to {GEMV_MAX_ROWS_BUILT} rows with unit column stride, got "
                         f"{tuple(x.shape)} strides {x.stride()} (weight strides {gate_weight.stride()})")
    if gate_weight.shape[1] != D:
        raise ValueError(f"gate_weight: expected [E, {D}], got {tuple(gate_weight.shape)}")
    if out is None:
        out = torch.empty(M, E, dtype=torch.float32, device=x.device)
    elif tuple(out.shape) != (M, E) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out: expected a float32 [{M}, {E}] tensor with unit column stride, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    block_m = 1 << (M - 1).bit_length()
    kernel_module(__package__).router_logits_kernel[(E,)](
        x, x.stride(0), gate_weight, gate_weight.stride(0), out, out.stride(0), M, D,
        BLOCK_M=block_m, BLOCK_K=GEMV_ELEMENTS // block_m, **pdl_options(), num_warps=4)
    return out


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits [M, E] = x [M, D] @ gate_weight [E, D]^T (docs/kimi-k3.md §1.2)."""
    if LOW_PRECISION_GEMM and x.dtype == gate_weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
        if 1 <= x.shape[0] <= min(GEMV_MAX_ROWS, GEMV_MAX_ROWS_BUILT) and x.stride(1) == gate_weight.stride(1) == 1:
            return router_logits_gemv(x, gate_weight)
        return torch.mm(x, gate_weight.t(), out_dtype=torch.float32)
    return ops.linear(x.float(), gate_weight.float())


def supports_router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    return x.dim() == 2 and gate_weight.dim() == 2 and x.shape[1] == gate_weight.shape[1]


# The router GEMM alone (a rank gathers the logits before selecting): cuBLAS's bf16 GEMM with fp32
# output, as moe_route's first half.
register("moe_router_logits", "cublas", devices=("cuda",), priority=10, supports=supports_router_logits)(router_logits)


@register("moe_route", "triton", devices=("cuda",), priority=10, available=triton_available)
def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    check_route(gate_weight, bias, top_k)
    return route_logits(router_logits(x, gate_weight), bias.float().contiguous(), top_k, scaling)


@register("moe_route_logits", "triton", devices=("cuda",), priority=10, available=triton_available)
def moe_route_logits(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    if not 1 <= top_k <= logits.shape[-1] or tuple(bias.shape) != (logits.shape[-1],):
        raise ValueError(f"top_k / bias: top_k={top_k} and bias {tuple(bias.shape)} for {logits.shape[-1]} experts")
    return route_logits(logits.float(), bias.float().contiguous(), top_k, scaling)


COMBINE_BLOCK = 1024  # columns per program: 4 blocks of K3's latent 3584


def weighted_combine(rows: torch.Tensor, position: torch.Tensor, route_weights: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """[T, latent] fp32: each token's expert outputs, read where the expert pass wrote them
    (rows [P, latent], the pair (t, j) at row position[t, j]; or [splits, P, latent], an output the
    sum of its row in every split, as pass 2 writes a K split), weighted and added in top-k order,
    the reference's order (expert_layout.weighted_sum gathers, multiplies and reduces in three
    launches). out: an optional contiguous output (tests poison it first)."""
    T, top_k = position.shape
    if tuple(route_weights.shape) != (T, top_k):
        raise ValueError(f"route_weights: expected shape {(T, top_k)}, got {tuple(route_weights.shape)}")
    if rows.dim() not in (2, 3) or rows.stride(-1) != 1:
        raise ValueError(f"rows: expected [P, latent] or [splits, P, latent] with contiguous columns, got "
                         f"shape {tuple(rows.shape)}, strides {rows.stride()}")
    splits = rows.shape[0] if rows.dim() == 3 else 1
    split_stride = rows.stride(0) if rows.dim() == 3 else 0
    width = rows.shape[-1]
    out = torch.empty(T, width, dtype=torch.float32, device=rows.device) if out is None else out
    if T:
        kernel_module(__package__).combine_kernel[(T, -(-width // COMBINE_BLOCK))](
            rows, rows.stride(-2), split_stride, position.contiguous(), route_weights.contiguous(), out, out.stride(0),
            width, TOP_K=top_k, SPLITS=splits, BLOCK=COMBINE_BLOCK, **pdl_options(), num_warps=4)
    return out


GATHER_BLOCK = 512  # operand columns per program


def _gather_shape(x: torch.Tensor, perm: torch.Tensor) -> tuple[int, int]:
    """(K, the permutation's period) of a token gather's x [T, K], after refusing what the kernels cannot read."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x: needs [T, K] with contiguous columns, got shape {tuple(x.shape)} stride {x.stride()}")
    K, period = x.shape[1], perm.numel()
    if K % period:
        raise ValueError(f"x: last dimension {K} is not a multiple of the permutation's period {period}")
    return K, period


def gather_tokens(x: torch.Tensor, slot_tokens: torch.Tensor, perm: torch.Tensor, scale_log2: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The expert kernels' B operand in one launch (expert_layout.tokens_for_kernel's contract):
    out[s, t, c * P + j] = x[slot_tokens[s, t], c * P + perm[j]] * 2^scale_log2 for x [T, K]
    (rows may be strided), slot_tokens [S, tokens] and a permutation perm of period P dividing K.
    The scale is a power of two, exact in x's dtype. out: an optional contiguous [S, tokens, K]
    output of x's dtype (tests poison it first)."""
    K, period = _gather_shape(x, perm)
    S, tokens = slot_tokens.shape
    out = torch.empty(S, tokens, K, dtype=x.dtype, device=x.device) if out is None else out
    if S * tokens:
        kernel_module(__package__).gather_tokens_kernel[(S * tokens, -(-K // GATHER_BLOCK))](
            x, x.stride(0), slot_tokens.contiguous(), perm.contiguous(), out, K, float(2.0**scale_log2),
            PERIOD=period, BLOCK=GATHER_BLOCK, **pdl_options(), num_warps=4)
    return out


# Shared-activation columns per program. Since the shared gate|up comes as the MoE inputs GEMM's split-K
# partials, a program this wide holds about twice a narrow one's registers and the call grew
# (experiments/notes/rank.md, "Eighth round"); narrower blocks, more programs, are timed with
# step_bench --setting tail_block=256.
TAIL_BLOCK = 1024
TAIL_MAX_LATENT = 16384  # the routed row lives in one program's registers


def moe_tail_inputs(routed: torch.Tensor, latent_norm: torch.Tensor, shared_gate_up: torch.Tensor, start: int,
                    width: int, eps: float, situ_beta: float, situ_linear_beta: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """ops.moe_tail_inputs in one launch: per row, program 0 normalises the routed row and stores
    its window, programs 1.. the shared activation's column blocks (adding gate|up's split-K partials
    first when it comes as them). out: an optional contiguous [M, width + S] buffer (tests poison it first)."""
    check_tail_inputs(routed, latent_norm, shared_gate_up, start, width)
    M, L = routed.shape
    parts = shared_gate_up if shared_gate_up.dim() == 3 else shared_gate_up[None]
    S = parts.shape[2] // 2
    dtype = tail_dtype(latent_norm, shared_gate_up)
    out = torch.empty(M, width + S, dtype=dtype, device=routed.device) if out is None else out
    if tuple(out.shape) != (M, width + S) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous {dtype} [{M}, {width + S}], got {out.dtype} {tuple(out.shape)}")
    if M:
        kernel_module(__package__).tail_inputs_kernel[(M, 1 + -(-S // TAIL_BLOCK))](
            routed, routed.stride(0), latent_norm, parts, parts.stride(0), parts.stride(1), out, out.stride(0),
            L, start, width, S, float(eps), float(situ_beta), float(situ_linear_beta),
            BLOCK_L=1 << (L - 1).bit_length(), BLOCK=TAIL_BLOCK, PARTS=parts.shape[0], **pdl_options(), num_warps=4)
    return out


def supports_tail_inputs(routed, latent_norm, shared_gate_up) -> bool:
    return (routed.dim() == 2 and routed.dtype == torch.float32 and routed.stride(-1) == 1
            and routed.shape[1] <= TAIL_MAX_LATENT
            and latent_norm.is_contiguous() and shared_gate_up.dim() in (2, 3) and shared_gate_up.stride(-1) == 1
            and shared_gate_up.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and tail_dtype(latent_norm, shared_gate_up) in (torch.bfloat16, torch.float16, torch.float32))


register("moe_tail_inputs", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=supports_tail_inputs)(moe_tail_inputs)


DISPATCH_BLOCK = 512  # partial columns per program


def moe_dispatch_inputs(partials: torch.Tensor, router_width: int, dtype: torch.dtype, copies: int,
                        logits: torch.Tensor | None = None, latent: torch.Tensor | None = None):
    """ops.moe_dispatch_inputs in one launch: a program per (row, column block) adds its columns' partials
    and writes them `copies` times. logits / latent: optional contiguous outputs (tests poison them first)."""
    check_dispatch_inputs(partials, router_width, dtype, copies)
    S, M, N = partials.shape
    R, L = router_width, N - router_width
    logits = torch.empty(M, copies * R, dtype=torch.float32, device=partials.device) if logits is None else logits
    latent = torch.empty(M, copies * L, dtype=dtype, device=partials.device) if latent is None else latent
    for name, out, shape, want in (("logits", logits, (M, copies * R), torch.float32),
                                   ("latent", latent, (M, copies * L), dtype)):
        if tuple(out.shape) != shape or out.dtype != want or not out.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous {want} {list(shape)}, got {out.dtype} {tuple(out.shape)}")
    if M:
        kernel_module(__package__).dispatch_inputs_kernel[(M, -(-N // DISPATCH_BLOCK))](
            partials, partials.stride(0), partials.stride(1), logits, latent, N, R, copies, SPLITS=S,
            BLOCK=DISPATCH_BLOCK, **pdl_options(), num_warps=4)
    return logits, latent


def supports_dispatch_inputs(partials) -> bool:
    return partials.dim() == 3 and partials.dtype == torch.float32 and partials.stride(-1) == 1


register("moe_dispatch_inputs", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=supports_dispatch_inputs)(moe_dispatch_inputs)


def lists_and_tokens(x: torch.Tensor, ids: torch.Tensor, num_experts: int, tile_tokens: int, perm: torch.Tensor,
                     scale_log2: int):
    """(expert_layout.ExpertLists, the expert kernels' B operand [S, tile_tokens, K]) in one launch: the
    CuTe list kernel's lists (one slot per expert: T <= tile_tokens) and gather_tokens' operand, every
    program (one an operand row) deriving the lists from the ids itself (lists_gather_kernel). x [T, K]
    (rows may be strided), ids [T, k] distinct per row, perm: the K permutation of period P dividing K;
    2^scale_log2 is exact."""
    K, period = _gather_shape(x, perm)
    check_device_list_ids(ids, tile_tokens, "fused list gather")
    if ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids: {ids.shape[0]} rows for x's {x.shape[0]} tokens")
    lists = empty_device_lists(ids, num_experts, tile_tokens)
    pairs, slots = ids.numel(), lists.slot_expert.numel()
    out = torch.empty(slots, tile_tokens, K, dtype=x.dtype, device=x.device)
    kernel_module(__package__).lists_gather_kernel[(slots * tile_tokens,)](
        ids.contiguous().view(-1), pairs, x, x.stride(0), perm.contiguous(), out, K, float(2.0**scale_log2),
        lists.slot_expert, lists.slot_tokens.view(-1), lists.pair_position.view(-1), slots, TOP_K=ids.shape[1],
        TILE=tile_tokens, PERIOD=period, BLOCK_P=max(16, 1 << (pairs - 1).bit_length()), CHUNK_Q=16,
        BLOCK_S=max(16, 1 << (slots - 1).bit_length()), BLOCK=GATHER_BLOCK, **pdl_options(), num_warps=4)
    return lists, out
