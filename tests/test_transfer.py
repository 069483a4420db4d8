"""dspark.transfer on the CPU: LongStaging uploads what it is given, each upload a tensor of its
own, and refuses more values than it holds, naming the count and the capacity. The pinned path
and its wait for a pending copy are tested on the GPU (tests/gpu/test_transfer_gpu.py)."""
import pytest
import torch

from dspark.transfer import LongStaging


def test_uploads_are_independent_tensors():
    staging = LongStaging(4, torch.device("cpu"))
    a = staging.upload([7, 1, 9])
    b = staging.upload([3, 5])
    assert a.dtype == torch.long and a.tolist() == [7, 1, 9] and b.tolist() == [3, 5]


def test_more_values_than_capacity_is_refused():
    with pytest.raises(ValueError, match="5 values, capacity 4"):
        LongStaging(4, torch.device("cpu")).upload([1, 2, 3, 4, 5])
