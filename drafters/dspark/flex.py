"""Block-sparse training attention through FlexAttention (docs/dspark-algorithm.md §6.2).

A training pass runs every block of a sequence at once: queries are the A * G block slots, keys the
S context rows followed by the A * G block rows. Slot q (block q // G, anchor a) sees the context
rows j < a and the rows of its own block, nothing else (§2.3). The dense form of that mask
(`model._block_mask`, used with SDPA) makes the attention cost S + A * G keys per slot; most of them
are masked. FlexAttention skips whole 128 x 128 tiles that a mask leaves empty and skips the mask
itself on tiles it leaves full, so a slot pays for about (its anchor + G) keys.

The tile structure is computed here from the anchors on the host (dspark/flex_tiles.py) instead of
evaluating the mask over the [B, Q, KV] grid: the anchors are sorted within a sequence, so the tiles a
query tile touches follow from the smallest and largest anchor in it.
"""
from __future__ import annotations

import functools

import torch

from dspark.flex_tiles import TILE, block_mask_from_tiles
from dspark.transfer import tensor_on


def slot_mask(anchors: torch.Tensor, context: int, block_size: int):
    """The element mask as FlexAttention's mask_mod: slot q sees context row kv < its anchor, and
    block row kv >= context of its own block. anchors [B, A] on the attention's device; a padding
    block has anchor 0 and sees its own block only."""

    last = anchors.shape[1] - 1

    def mask_mod(b, h, q, kv):
        # A tile's rows past the last slot are evaluated too (and then dropped): clamp their block
        # so the anchor lookup stays in bounds.
        block = (q // block_size).clamp(max=last)
        return torch.where(kv < context, kv < anchors[b, block], (kv - context) // block_size == block)

    return mask_mod


def tile_masks(anchors: torch.Tensor, context: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial [B, Qt, Kt], full [B, Qt, Kt]) bool over 128 x 128 tiles: a tile is full when every
    slot in it sees every key in it, partial when some (not all) pairs may be visible, and skipped
    when neither. anchors [B, A] (valid ones sorted; padding blocks anchored at 0)."""
    B, A = anchors.shape
    q_len, kv_len = A * block_size, context + A * block_size
    q_tiles, kv_tiles = -(-q_len // TILE), -(-kv_len // TILE)
    per_slot = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]: each slot's anchor
    pad = q_tiles * TILE - q_len
    # Rows past the last slot do not exist: neutral for the max (0) and the min (a key past every row).
    highest = torch.nn.functional.pad(per_slot, (0, pad), value=0).view(B, q_tiles, TILE).amax(-1)
    lowest = torch.nn.functional.pad(per_slot, (0, pad), value=kv_len).view(B, q_tiles, TILE).amin(-1)
    kv_start = torch.arange(kv_tiles) * TILE
    kv_end = (kv_start + TILE).clamp(max=kv_len)
    context_any = (kv_start < context) & (kv_start < highest[..., None])  # some slot sees some row
    context_full = (kv_end <= context) & (kv_end <= lowest[..., None])  # every slot sees every row
    q_start = torch.arange(q_tiles) * TILE
    q_end = (q_start + TILE).clamp(max=q_len)
    own_first = context + (q_start // block_size) * block_size  # the block rows of the tile's slots
    own_last = context + ((q_end - 1) // block_size + 1) * block_size
    own_any = (kv_start < own_last[:, None]) & (kv_end > own_first[:, None])  # [Qt, Kt]
    return (context_any | own_any) & ~context_full, context_full


def block_mask(anchors: torch.Tensor, context: int, block_size: int, device):
    """FlexAttention's BlockMask of one training pass (anchors [B, A] on the host)."""
    partial, full = tile_masks(anchors, context, block_size)
    mask_mod = slot_mask(tensor_on(anchors, device), context, block_size)
    q_len = anchors.shape[1] * block_size
    return block_mask_from_tiles(partial, full, mask_mod, (q_len, context + q_len), device)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Uncompiled, FlexAttention evaluates the whole score matrix (its reference path); compiled,
    # it generates the tile-skipping kernels.
    return torch.compile(flex_attention)


# The GPU kernels torch generates for FlexAttention need head dimensions of at least 16 (its
# inductor lowering refuses smaller ones); the SDPA path has no such limit.
MIN_GPU_HEAD_DIM = 16


def flex_attend(queries, keys, values, mask, scale: float) -> torch.Tensor:
    """flex_attention([B, H, Q, dk], [B, H, KV, dk], [B, H, KV, dv]) under `mask`, compiled on a GPU
    (its eager form on the CPU computes the same function densely, forward only)."""
    from torch.nn.attention.flex_attention import flex_attention

    if queries.is_cuda and min(queries.shape[-1], values.shape[-1]) < MIN_GPU_HEAD_DIM:
        raise ValueError(f"attention='flex': head dimensions {queries.shape[-1]} (keys) and {values.shape[-1]} "
                         f"(values) on the GPU must be >= {MIN_GPU_HEAD_DIM}; train this drafter with "
                         f"attention='sdpa'")
    if queries.is_cuda and not torch.compiler.is_compiling():
        return _compiled_flex()(queries, keys, values, block_mask=mask, scale=scale)
    return flex_attention(queries, keys, values, block_mask=mask, scale=scale)
