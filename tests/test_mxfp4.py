"""MXFP4 (compressed-tensors mxfp4-pack-quantized) codec of kernels/mxfp4.py."""
import pytest
import torch

from dspark.kernels.mxfp4 import E2M1_MAGNITUDES, dequantise, pack


def test_hand_packed_bytes_dequantise_to_the_expected_values():
    # Row 0: group of 32 with scale 2^(128-127) = 2. Byte 0x3A = high nibble 3 (+1.5),
    # low nibble 0xA (sign + code 2 = -1.0): element 0 (low) = -2.0, element 1 (high) = +3.0.
    # Row 1: scale 2^(125-127) = 1/4; byte 0x7F: low 0xF = -6 -> -1.5, high 7 = +6 -> +1.5.
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    packed[0, 0] = 0x3A
    packed[0, 15] = 0x81  # low 1 (+0.5) -> +1.0 at index 30; high 8 (-0) -> 0 at index 31
    packed[1, 0] = 0x7F
    scale = torch.tensor([[128], [125]], dtype=torch.uint8)
    expected = torch.zeros(2, 32)
    expected[0, 0], expected[0, 1], expected[0, 30] = -2.0, 3.0, 1.0
    expected[1, 0], expected[1, 1] = -1.5, 1.5
    out = dequantise(packed, scale, torch.float32)
    assert torch.equal(out, expected)


def test_round_trip_is_exact_on_representable_values():
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31 - 1, ()).item())
    table = torch.tensor(E2M1_MAGNITUDES)
    codes = torch.randint(0, 16, (3, 6, 64), generator=gen)
    values = table[codes % 8] * torch.where(codes >= 8, -1.0, 1.0)
    values[..., ::32] = 6.0 * torch.where(torch.rand(3, 6, 2, generator=gen) < 0.5, -1.0, 1.0)  # amax 6 per group
    exponents = torch.randint(-8, 8, (3, 6, 2), generator=gen).float()
    weight = values * torch.exp2(exponents).repeat_interleave(32, dim=-1)
    packed, scale = pack(weight)
    assert packed.shape == (3, 6, 32) and scale.shape == (3, 6, 2)
    assert torch.equal(scale.long() - 127, exponents.long())
    assert torch.equal(dequantise(packed, scale, torch.float32), weight)
    assert torch.equal(dequantise(packed, scale, torch.bfloat16), weight.bfloat16())


def test_pack_rounds_to_nearest_with_a_non_clipping_power_of_two_scale():
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31 - 1, ()).item())
    weight = torch.randn(4, 96, generator=gen)
    packed, scale = pack(weight)
    out = dequantise(packed, scale)
    step = torch.exp2(scale.float() - 127).repeat_interleave(32, dim=-1)
    # error at most half the widest E2M1 gap (2, between 4 and 6) times the group scale
    assert ((out - weight).abs() <= step).all()
    groups = weight.abs().unflatten(-1, (3, 32)).amax(-1)
    assert (groups <= 6 * torch.exp2(scale.float() - 127)).all()
    assert (groups > 3 * torch.exp2(scale.float() - 127)).all()  # the smallest such scale


def test_bad_scale_shape_raises():
    with pytest.raises(ValueError, match="scale"):
        dequantise(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
