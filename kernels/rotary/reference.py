"""The reference of `rotary`: RoPE of x [..., H, D] by cos / sin tables [..., 1, D/2] (one row
per position, shared by the heads), computed in float32 and returned in x's dtype.

Pairs (a, b) rotate by the position's angle: out_a = a cos - b sin, out_b = a sin + b cos, where
the pairs are (x[2j], x[2j+1]) when interleaved (DeepSeek's layout) and (x[j], x[j + D/2])
otherwise (rotate-half). The tables carry any scaling already (YaRN's mscale): the drafter's
Rotary.tables makes them once per pass (drafters/dspark/model.py).
"""
from __future__ import annotations

import torch

from ..registry import register


def check_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(f"rotary: x must be [..., H, D] with an even D, got {tuple(x.shape)}")
    want = (*x.shape[:-2], 1, x.shape[-1] // 2)
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != want:
            raise ValueError(f"rotary: {name} must be {list(want)} for x {tuple(x.shape)}, got {tuple(table.shape)}")


@register("rotary", "reference", priority=0)
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    check_rotary(x, cos, sin)
    xf = x.float()
    if interleaved:
        even, odd = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        first, second = xf[..., :half], xf[..., half:]
        out = torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
    return out.to(x.dtype)
