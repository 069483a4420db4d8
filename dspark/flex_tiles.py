"""FlexAttention BlockMasks made from their 128 x 128 tiles on the host (a few small tensors,
uploaded through pinned memory) instead of evaluating the mask over the whole [B, Q, KV] grid
(`create_block_mask`): the drafter's block-sparse training pass (drafters/dspark/flex.py) and the
target's causal capture (dspark/targets/llama.py) both know their tiles from a handful of numbers."""
from __future__ import annotations

import torch

from dspark.transfer import tensor_on

TILE = 128  # FlexAttention's default sparse block size, for queries and keys alike


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Qt, Kt] bool -> (count [B, 1, Qt], indices [B, 1, Qt, Kt]) int32, the True tiles first."""
    count = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def block_mask_from_tiles(partial: torch.Tensor, full: torch.Tensor, mask_mod, seq_lengths: tuple[int, int], device):
    """FlexAttention's BlockMask from host tile masks [B, Qt, Kt] bool: `partial` tiles are read under
    `mask_mod`, `full` ones whole (no mask evaluated), the rest skipped; seq_lengths (Q, KV)."""
    from torch.nn.attention.flex_attention import BlockMask

    count, indices, full_count, full_indices = (tensor_on(t, device) for t in (*_ordered(partial), *_ordered(full)))
    return BlockMask.from_kv_blocks(count, indices, full_count, full_indices, BLOCK_SIZE=TILE, mask_mod=mask_mod,
                                    seq_lengths=seq_lengths)
