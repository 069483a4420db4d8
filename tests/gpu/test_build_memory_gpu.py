"""The K3 memory check on a CUDA device (dspark.build.check_target_fits): memory torch's allocator
holds unused counts as available, so a target built and dropped earlier in the process does not
make the next one look too big; the full K3 is refused with its size."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from dspark.build import available_memory, build_target  # noqa: E402


def test_cached_blocks_count_as_available():
    torch.cuda.synchronize()
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, then cached when dropped
    del block
    free, _ = torch.cuda.mem_get_info()
    have, text = available_memory("cuda")
    assert have >= free + (1 << 30) and "GB free of" in text


def test_k3_is_refused_on_one_gpu_and_k3_tiny_builds():
    with pytest.raises(ValueError, match=r"target='k3': needs about [\d,.]+ GB on cuda .*this machine has"):
        build_target("k3", max_slots=1, max_seq_len=1024, device="cuda")
    target = build_target("k3-tiny", max_slots=2, max_seq_len=64, device="cuda")
    assert "cuda" in str(target.device)
