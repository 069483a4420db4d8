"""Host-side pieces of the CuTe DSL MXFP4 expert kernels shared by the Hopper and Blackwell builds:
the expert-major pair lists built on the device (no host sync) and the K permutation that lets
every thread dequantise one contiguous 16-byte run of packed codes (docs/kernels.md §4.3).

Plain torch, so it runs (and is tested) on the CPU as well.

Expert lists (docs/kernels.md §4.3 "routing prologue"): the T*k (token, expert) pairs of a step are
sorted by expert; each distinct expert gets a "slot" (in sorted order) holding up to `tile_tokens`
token rows, padded. A token appears at most once per expert (top-k ids are distinct), so with
T <= tile_tokens an expert fits one slot; with more tokens an expert chosen by n of them takes
ceil(n / tile_tokens) consecutive slots, each read by its own CTAs (the expert's weights are read
once per slot). The slot count is fixed by the shapes alone (`slot_count`), so every shape is
static (CUDA-graph friendly): slots past those used have expert id -1 and the kernel's CTAs for
them exit at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

K_CHUNK = 128  # K elements one thread-quad covers per main-loop step: 4 threads x 32 (one MX group each)
# The WGMMA fragment scale trick (cute_sm90.py): A is dequantised to W * 2^-B_SCALE_LOG2 and B is
# multiplied by 2^B_SCALE_LOG2, so each E8M0 scale is applied with one bf16x2 multiply.
B_SCALE_LOG2 = 63
# The dequantisers place a packed word's codes s|e1 e0|m as bf16 bits (s << 15) | (e1 e0 m << 6)
# of both halves of a bf16x2 pair (cute_sm90.py docstring): these masks keep those bits.
MAGNITUDE_BITS = 0x01C001C0  # e1 e0 m at bf16 bits 8..6
SIGN_BITS = 0x80008000


def chunk_permutation() -> torch.Tensor:
    """perm[L] = the physical K index (0..127 within a 128-chunk) that WGMMA's logical K index L
    reads, for the register-A fragment of wgmma m64nNk16 (PTX ISA "Register fragment for matrix
    A": thread lane%4 = c holds logical columns 2c, 2c+1 (values v0) and 2c+8, 2c+9 (v2) of each
    k16 block ki). A dot product does not care about K order, so the weight may be read in any
    order as long as the tokens (B) are permuted the same way; this one makes thread c's 32
    values of a row the contiguous physical run [32c, 32c+32) = 16 bytes of codes = one MX group.
    Within the run, fragment register rho = 2*ki + v2 holds the bf16 pair (v0 = 0, 1) made of
    nibbles i and i+4 of packed word q, rho = 4q + i (how the dequantiser splits a 32-bit word)."""
    perm = torch.empty(K_CHUNK, dtype=torch.long)
    for logical in range(K_CHUNK):
        ki, within = divmod(logical, 16)
        v2, rest = divmod(within, 8)
        c, v0 = divmod(rest, 2)
        q, i = divmod(2 * ki + v2, 4)
        perm[logical] = 32 * c + 8 * q + i + 4 * v0
    return perm


def octet_permutation() -> torch.Tensor:
    """The Blackwell kernel's K order (cute_sm100.py), period 8: a 32-bit word of codes holds
    elements 0..7 and is dequantised into the bf16 pairs (i, i+4), i = 0..3, stored in that order,
    so shared-memory position L holds element perm[L] = L // 2 + 4 * (L % 2)."""
    return torch.tensor([position // 2 + 4 * (position % 2) for position in range(8)])


_permutations: dict[tuple[str, torch.device], torch.Tensor] = {}


def permute_k(x: torch.Tensor, order: str = "sm90") -> torch.Tensor:
    """x [..., K] -> x with K permuted within every period: the 128-chunk order of the Hopper
    kernel (`chunk_permutation`, order "sm90") or the octet order of the Blackwell one ("sm100")."""
    k = x.shape[-1]
    index = permutation(order, x.device)
    period = index.numel()
    if k % period:
        raise ValueError(f"x: last dimension {k} is not a multiple of {period}")
    return x.unflatten(-1, (k // period, period))[..., index].flatten(-2)


def permutation(order: str, device: torch.device) -> torch.Tensor:
    """permute_k's index within one period, on `device`: one copy per device, made outside any
    CUDA-graph capture (a host copy cannot be captured)."""
    perm_of = {"sm90": chunk_permutation, "sm100": octet_permutation}
    if order not in perm_of:
        raise ValueError(f"order={order!r}: expected one of {sorted(perm_of)}")
    index = _permutations.get((order, device))
    if index is None:
        index = _permutations[(order, device)] = perm_of[order]().to(device)
    return index


def tokens_for_kernel(x: torch.Tensor, lists: "ExpertLists", order: str) -> torch.Tensor:
    """x [T, K] bf16 -> the expert kernels' B operand [S, tokens, K]: each slot's token rows,
    K-permuted (permute_k's `order`) and times 2^B_SCALE_LOG2. On CUDA one Triton launch
    (kernels/moe/triton.py:gather_tokens) where TOKEN_GATHER says so; else permute and scale the T
    rows (tiny), then one gather writes the operand (three launches)."""
    if TOKEN_GATHER == "triton" and x.is_cuda:
        from . import triton as moe_triton

        return moe_triton.gather_tokens(x, lists.slot_tokens, permutation(order, x.device), B_SCALE_LOG2)
    return (permute_k(x, order) * 2.0**B_SCALE_LOG2)[lists.slot_tokens]


# How tokens_for_kernel builds the B operand on CUDA: "triton" = one launch, "torch" = three.
# experiments/step_bench.py --setting token_gather=torch|triton times either.
TOKEN_GATHER = "triton"


@dataclass
class ExpertLists:
    """Expert-major view of one step's routing; every tensor lives on the routing's device."""

    slot_expert: torch.Tensor  # [S] int32: expert id of slot s, -1 for unused slots
    slot_tokens: torch.Tensor  # [S, tile_tokens] int64: token rows of slot s (padding: token 0)
    pair_position: torch.Tensor  # [T, k] int64: flat index s * tile_tokens + rank of pair (t, j)


def slot_count(tokens: int, top_k: int, num_experts: int, tile_tokens: int) -> int:
    """Slots for any routing of `tokens` x `top_k` pairs: at most min(E, pairs) experts are touched,
    and an expert of n tokens takes ceil(n / tile) <= 1 + floor(n / tile) slots, whose floors sum
    to at most floor(pairs / tile) (zero when tokens <= tile)."""
    pairs = tokens * top_k
    return min(num_experts, pairs) + (pairs // tile_tokens if tokens > tile_tokens else 0)


# The most (token, expert) pairs the one-launch list builders take (cute_sm90's list kernel: one thread a
# pair; triton.lists_and_tokens: the same bound, so either builds the same routings): T * k <= 16 * 16.
DEVICE_LIST_PAIRS = 256


def check_device_list_ids(ids: torch.Tensor, tile_tokens: int, builder: str) -> None:
    """The ids a one-launch list builder takes: [T, k] int64, T <= tile_tokens (one slot per expert) and
    at most DEVICE_LIST_PAIRS pairs; `builder` names it in the error."""
    if ids.dim() != 2 or ids.dtype != torch.long:
        raise ValueError(f"ids: expected a [T, k] int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    tokens, top_k = ids.shape
    if not 1 <= tokens <= tile_tokens or tokens * top_k > DEVICE_LIST_PAIRS:
        raise ValueError(f"ids: {tokens} tokens x {top_k} experts exceeds the {builder} ({DEVICE_LIST_PAIRS} pairs, "
                         f"<= {tile_tokens} tokens)")


def empty_device_lists(ids: torch.Tensor, num_experts: int, tile_tokens: int) -> ExpertLists:
    """Unfilled lists for ids [T, k] with one slot per expert (a one-launch builder's outputs, after
    check_device_list_ids): min(E, T * k) slots of tile_tokens rows; a builder writes them flat (view(-1))."""
    tokens, top_k = ids.shape
    slots = min(num_experts, tokens * top_k)
    return ExpertLists(torch.empty(slots, dtype=torch.int32, device=ids.device),
                       torch.empty(slots, tile_tokens, dtype=torch.long, device=ids.device),
                       torch.empty(tokens, top_k, dtype=torch.long, device=ids.device))


def build_expert_lists(ids: torch.Tensor, num_experts: int, tile_tokens: int) -> ExpertLists:
    """ids [T, k] (distinct per row) -> slots; fixed shapes, no host synchronisation."""
    if ids.dim() != 2 or ids.shape[0] < 1:
        raise ValueError(f"ids: expected [T, k] with T >= 1, got shape {tuple(ids.shape)}")
    tokens, top_k = ids.shape
    device = ids.device
    pairs = tokens * top_k
    slots = slot_count(tokens, top_k, num_experts, tile_tokens)
    flat = ids.reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)  # stable: tokens ascend within an expert
    position = torch.arange(pairs, device=device)
    starts_group = torch.ones(pairs, dtype=torch.bool, device=device)
    starts_group[1:] = sorted_experts[1:] != sorted_experts[:-1]
    group_start = torch.cummax(torch.where(starts_group, position, 0), 0).values
    rank_in_expert = position - group_start
    rank = rank_in_expert % tile_tokens  # the pair's row within its slot
    slot_of_pair = torch.cumsum((rank == 0).long(), 0) - 1  # a new slot every tile_tokens pairs of an expert
    token_of_pair = order // top_k
    slot_expert = torch.full((slots,), -1, dtype=torch.int32, device=device)
    slot_expert.scatter_(0, slot_of_pair, sorted_experts.to(torch.int32))  # equal values per slot
    slot_tokens = torch.zeros(slots * tile_tokens, dtype=torch.long, device=device)
    flat_position = slot_of_pair * tile_tokens + rank
    slot_tokens.scatter_(0, flat_position, token_of_pair)
    pair_position = torch.empty(pairs, dtype=torch.long, device=device)
    pair_position.scatter_(0, order, flat_position)
    return ExpertLists(slot_expert, slot_tokens.view(slots, tile_tokens), pair_position.view(tokens, top_k))


def run_expert_passes(latent: torch.Tensor, lists: ExpertLists, experts: tuple, tokens_for_kernel, expert_pass,
                      situ_beta: float, situ_linear_beta: float) -> torch.Tensor:
    """The two passes of an expert kernel over `lists` -> per-pair outputs [T, k, latent] fp32
    (unweighted, in top-k order). `experts` = (w1_packed, w1_scale, w3_packed, w3_scale,
    w2_packed, w2_scale); tokens_for_kernel / expert_pass are the kernel module's."""
    out = slot_outputs(latent, lists, experts, tokens_for_kernel, expert_pass, situ_beta, situ_linear_beta)
    return out[0][lists.pair_position]


def slot_outputs(latent: torch.Tensor, lists: ExpertLists, experts: tuple, tokens_for_kernel, expert_pass,
                 situ_beta: float, situ_linear_beta: float, splits: int = 1, xb: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """The two passes' output rows as pass 2 writes them, [splits, slots * tile_tokens, latent] fp32:
    the pair (t, j) is row lists.pair_position[t, j] of every split, and its output the sum over the
    splits (pass 2's K split in `splits` parts; 1: the whole output in split 0). xb: the B operand when
    the caller built it with the lists (else tokens_for_kernel builds it)."""
    w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale = experts
    slots, tile = lists.slot_tokens.shape
    xb = tokens_for_kernel(latent, lists) if xb is None else xb
    act = torch.empty((slots, tile, w1_packed.shape[1]), dtype=torch.bfloat16, device=latent.device)
    expert_pass(w1_packed, w1_scale, w3_packed, w3_scale, lists, xb, act, True, situ_beta, situ_linear_beta)
    latent_dim = w2_packed.shape[1]
    y = torch.empty((splits * slots, tile, latent_dim), dtype=torch.float32, device=latent.device)
    if splits == 1:
        expert_pass(w2_packed, w2_scale, w2_packed, w2_scale, lists, act, y, False)
    else:
        expert_pass(w2_packed, w2_scale, w2_packed, w2_scale, lists, act, y, False, splits=splits)
    return y.view(splits, slots * tile, latent_dim)


def weighted_sum(route_weights: torch.Tensor, expert_out: torch.Tensor) -> torch.Tensor:
    """sum_j route_weights[:, j] * expert_out[:, j] in fp32: one reduction kernel instead of the
    reference's k multiply-adds (equal up to fp32 summation order)."""
    return (route_weights.unsqueeze(-1) * expert_out).sum(dim=1)


def experts_contiguous(experts: tuple) -> bool:
    return all(t.is_contiguous() for t in experts)
