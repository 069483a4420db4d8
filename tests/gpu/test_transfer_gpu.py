"""dspark.transfer.LongStaging on the GPU: an upload whose copy is still queued behind a long
kernel keeps its values when the next upload rewrites the pinned buffer (the staging waits for
the pending copy), and an upload after a finished one does not synchronise."""
import pytest
import torch

from dspark.transfer import LongStaging

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_queued_copy_keeps_its_values():
    staging = LongStaging(8, torch.device("cuda"))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    first, second = (torch.randint(0, 2**40, (6,), generator=gen).tolist() for _ in range(2))
    torch.cuda._sleep(50_000_000)  # tens of ms of busy stream: the first copy waits behind it
    a = staging.upload(first)
    b = staging.upload(second)
    assert a.tolist() == first and b.tolist() == second


def test_steady_uploads_do_not_synchronise():
    staging = LongStaging(8, torch.device("cuda"))
    staging.upload([1, 2, 3])
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = staging.upload([4, 5, 6])
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert out.tolist() == [4, 5, 6]
