"""MXFP4 as stored by K3's routed experts (compressed-tensors format `mxfp4-pack-quantized`).

Design notes: docs/kimi-k3.md §1.2 (quantization_config) and §1.3 (tensor shapes).

- Element: FP4 E2M1, one 4-bit code per weight: bits 0-2 index the magnitude table
  [0, 0.5, 1, 1.5, 2, 3, 4, 6], bit 3 is the sign.
- Packing: two codes per uint8 along K (the input dimension, the last axis of a [N, K] weight).
  The LOW nibble holds the EVEN index: compressed-tensors
  `compressors/quantized_compressors/fp4_quantized.py::pack_fp4_to_uint8` packs
  `indices[:, 0] | (indices[:, 1] << 4)` and its `unpack_fp4_from_uint8` stacks (low, high).
  llama.cpp's GGUF MXFP4 block is laid out differently (ggml-quants.c dequantize_row_mxfp4:
  byte j holds element j in its low nibble and element j + 16 in its high nibble, with the
  E8M0 byte in front of each 32-block), so a GGUF conversion must repack; this module is the
  safetensors (compressed-tensors) layout only.
- Scale: one E8M0 uint8 per 32 consecutive values along K, value 2^(s - 127)
  (s = 255 is NaN in OCP MX and is rejected here).

So a [N, K] weight is stored as weight_packed uint8 [N, K/2] and weight_scale uint8 [N, K/32].
"""
from __future__ import annotations

import functools

import torch

GROUP_SIZE = 32
E8M0_BIAS = 127
# E2M1 magnitudes by 3-bit code (sign is bit 3).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


@functools.lru_cache(maxsize=None)
def _byte_table(device: torch.device) -> torch.Tensor:
    """[256, 2]: the two E2M1 values of a packed byte, the low nibble's (even index) first. Made once
    per device (read only): building it was a quarter of a CPU reference's dequantisation."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    codes = torch.cat([magnitudes, -magnitudes])  # codes 0-7 positive, 8-15 negative
    byte = torch.arange(256, device=device)
    return torch.stack([codes[byte & 0x0F], codes[byte >> 4]], dim=-1)


def dequantise(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [..., N, K/2], scale uint8 [..., N, K/32] -> weight [..., N, K] in `dtype`.

    Exact: every E2M1 value times a power of two is representable in float32 (and in bf16
    unless the scale pushes it out of range)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed: dtype must be uint8, got {packed.dtype}")
    if scale.dtype != torch.uint8:
        raise ValueError(f"scale: dtype must be uint8, got {scale.dtype}")
    k = packed.shape[-1] * 2
    if k % GROUP_SIZE or scale.shape != packed.shape[:-1] + (k // GROUP_SIZE,):
        raise ValueError(
            f"scale: shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)} "
            f"(expected {tuple(packed.shape[:-1]) + (k // GROUP_SIZE,)} for groups of {GROUP_SIZE})"
        )
    if bool((scale == 255).any()):
        raise ValueError("scale: E8M0 value 255 (NaN) found")
    # One lookup per byte, not one per nibble: the CPU references dequantise whole experts, and
    # unpacking nibbles into int64 codes made that the slowest step of a K3 MoE block on the CPU.
    values = _byte_table(packed.device)[packed.int()].flatten(-2)
    factors = torch.exp2(scale.float() - E8M0_BIAS)
    values = values.unflatten(-1, (k // GROUP_SIZE, GROUP_SIZE)) * factors.unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their group scale) to the nearest E2M1 code.

    Magnitudes above 6 saturate to 6; a tie goes to the smaller magnitude (argmin picks the
    first). Returns uint8 codes 0-15 of the same shape."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=values.device)
    magnitude = values.float().abs().clamp(max=E2M1_MAX)
    index = (magnitude.unsqueeze(-1) - table).abs().argmin(dim=-1)
    sign = (values.float() < 0).long() << 3
    return (index | sign).to(torch.uint8)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (0-15) -> bytes [..., K/2], even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: last dimension must be even, got {codes.shape[-1]}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] float -> (packed uint8 [..., N, K/2], scale uint8 [..., N, K/32]).

    Shared scale per group of 32: the smallest power of two 2^e with amax / 2^e <= 6, so the
    largest value is never clipped; each value is then rounded to the nearest E2M1 code."""
    k = weight.shape[-1]
    if k % GROUP_SIZE:
        raise ValueError(f"weight: last dimension {k} is not a multiple of {GROUP_SIZE}")
    groups = weight.float().unflatten(-1, (k // GROUP_SIZE, GROUP_SIZE))
    amax = groups.abs().amax(dim=-1)
    # ceil(log2(amax / 6)); an all-zero group gets the smallest scale (any scale encodes zeros).
    exponent = torch.ceil(torch.log2(amax / E2M1_MAX)).nan_to_num(0.0, neginf=-E8M0_BIAS)
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)
    scaled = groups / torch.exp2(exponent.float()).unsqueeze(-1)
    codes = encode_e2m1(scaled).flatten(-2)
    return pack_codes(codes), (exponent + E8M0_BIAS).to(torch.uint8)
