"""The MLA layer's cache write in one Triton launch (contract: reference.mla_cache_rows).

Why: the reference normalises c_kv, concatenates k_pe, and builds the rows' positions (an arange, a
compare, an add, a where) before its scatter: seven launches per MLA layer of a verify step, each a
few microseconds on a handful of rows (docs/kimi-k3.md §8.5). Here one program per token normalises
its row, reads its request's slot, length and committed length on the device, and stores the row.
"""
import torch

from ..registry import register
from ..triton_common import kernel_module, pdl_options, triton_available
from .reference import check_cache_rows

MAX_WIDTH = 4096  # R and P each live in one program's registers


def mla_cache_rows(kv, norm_weight, eps: float, cache, slots, cache_lens, lengths) -> None:
    T = check_cache_rows(kv, norm_weight, cache, slots, cache_lens, lengths)
    R, P = norm_weight.shape[0], kv.shape[1] - norm_weight.shape[0]
    if kv.shape[0]:
        kernel_module(__package__).cache_rows_kernel[(kv.shape[0],)](
            kv, kv.stride(0), norm_weight, cache, cache.stride(0), cache.stride(1), slots, cache_lens, lengths,
            T, R, P, cache.shape[1] - 1, float(eps), BLOCK_R=1 << (R - 1).bit_length(),
            BLOCK_P=1 << (P - 1).bit_length(), **pdl_options(), num_warps=4)


def supports(kv, norm_weight, cache, slots, cache_lens, lengths) -> bool:
    return (kv.dim() == 2 and kv.stride(-1) == 1 and cache.dim() == 3 and cache.stride(-1) == 1
            and norm_weight.dim() == 1 and norm_weight.is_contiguous()
            and norm_weight.shape[0] <= MAX_WIDTH and kv.shape[1] - norm_weight.shape[0] <= MAX_WIDTH
            and kv.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(t.is_contiguous() for t in (slots, cache_lens, lengths)))


register("mla_cache_rows", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=supports)(mla_cache_rows)
