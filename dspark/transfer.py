"""Host values onto the device without a synchronising copy: a copy from pageable memory makes
the host wait for the stream; one from pinned memory with non_blocking=True does not, so a step
that uploads a few indices can still run without host synchronisation (and inside a capture)."""
from __future__ import annotations

import torch

from .cuda_graphs import current_stream


def tensor_on(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor's copy on `device`: on CUDA through a pinned copy and an asynchronous upload,
    which the host does not wait for (the caching host allocator keeps the pinned block until the
    upload has run)."""
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def long_tensor_on(values: list[int], device: torch.device) -> torch.Tensor:
    """A long tensor of `values` on `device` (pinned staging and an asynchronous copy on CUDA)."""
    return tensor_on(torch.tensor(values, dtype=torch.long), device)


class LongStaging:
    """long_tensor_on for a caller that uploads a short list every step: one pinned buffer, written
    through a NumPy view, instead of a new pinned tensor per call (on the H200's host a pin_memory
    call and a torch.tensor each cost tens of microseconds: experiments/notes/step.md).
    Each upload returns a new device tensor, so a consumer may keep it. Before the buffer is written
    again the previous copy out of it must be done: an event recorded after it says so (normally
    long done, as every engine step reads its results back)."""

    def __init__(self, capacity: int, device: torch.device):
        self.device = torch.device(device)
        self.capacity = capacity
        self._pinned = torch.empty(capacity, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._view = self._pinned.numpy()
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        if self._copied is not None:  # the copy runs on the current stream of the buffer's device
            self._device_index = self.device.index if self.device.index is not None else torch.cuda.current_device()

    def upload(self, values: list[int]) -> torch.Tensor:
        n = len(values)
        if n > self.capacity:
            raise ValueError(f"LongStaging.upload: {n} values, capacity {self.capacity}")
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=torch.long, device=self.device)
        if not self._copied.query():  # a query does not synchronise; the wait below is the rare case
            self._copied.synchronize()
        self._view[:n] = values
        out = torch.empty(n, dtype=torch.long, device=self.device)
        out.copy_(self._pinned[:n], non_blocking=True)
        self._copied.record(current_stream(self._device_index))
        return out
