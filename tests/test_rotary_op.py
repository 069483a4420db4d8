"""rotary, RoPE from precomputed tables as an op (kernels/rotary/): the reference against float64,
the drafter's use of it, and the errors. The Triton kernel: tests/test_triton_interpreter.py on
the CPU, tests/gpu/test_triton_kernels_gpu.py on the GPU."""
import pytest
import torch

from dspark.kernels import ops
from dspark.kernels.rotary import reference
from triton_interpret_checks import check_rotary


def reference_into(x, cos, sin, interleaved, out):
    out.copy_(reference.rotary(x, cos, sin, interleaved))
    return out


def test_the_reference_rotates_pairs_as_float64_does():
    check_rotary(torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()))), rotate=reference_into)


def test_the_check_fails_on_the_wrong_pair_layout():
    def swapped(x, cos, sin, interleaved, out):
        return reference_into(x, cos, sin, not interleaved, out)

    with pytest.raises(SystemExit, match="rotary heads 6 dim 64 interleaved=True"):
        check_rotary(torch.Generator().manual_seed(3), rotate=swapped)


@pytest.mark.parametrize("x, table, message", [
    ((4, 7), (4, 1, 3), r"x must be \[\.\.\., H, D\] with an even D, got \(4, 7\)"),
    ((2, 4, 8), (2, 4, 4), r"cos must be \[2, 1, 4\] for x \(2, 4, 8\), got \(2, 4, 4\)"),
])
def test_bad_shapes_are_named(x, table, message):
    with pytest.raises(ValueError, match=message):
        ops.rotary(torch.randn(x), torch.randn(table), torch.randn(table), True)
