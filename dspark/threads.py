"""The one-CPU-thread policy.

The CPU paths here (k3-tiny, the toy and synthetic targets, per-token reference kernels) run
thousands of tiny ops, for which OpenMP's thread hand-off costs more than the work; on a shared
2-core machine two threads ran a k3-tiny verify of 4 x 8 tokens in 2.4 s, one thread in 0.25 s.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def one_cpu_thread(device: str | torch.device = "cpu"):
    """Run the block with one intra-op thread when `device` is the CPU (a GPU run is left alone);
    the previous thread count comes back afterwards."""
    if torch.device(device).type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
