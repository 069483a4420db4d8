"""Host values onto the device without a synchronising copy: a copy from pageable memory makes
the host wait for the stream; one from pinned memory with non_blocking=True does not, so a step
that uploads a few indices can still run without host synchronisation (and inside a capture)."""
from __future__ import annotations

import torch


def long_tensor_on(values: list[int], device: torch.device) -> torch.Tensor:
    """A long tensor of `values` on `device` (pinned staging and an asynchronous copy on CUDA)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
