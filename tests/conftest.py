"""Suite-wide settings.

One intra-op thread: the CPU tests run many tiny ops (k3-tiny, per-token reference kernels), for
which OpenMP's thread hand-off costs more than the work, and on a 2-core machine that is also
running pytest's own process a second thread mostly waits (measured: k3-tiny verify of 4 x 8
tokens 2.4 s with 2 threads on a busy machine, 0.25 s with 1)."""
import torch

torch.set_num_threads(1)
