"""Suite-wide settings.

One intra-op thread: the CPU tests run many tiny ops (k3-tiny, per-token reference kernels), for
which OpenMP's thread hand-off costs more than the work, and on a 2-core machine that is also
running pytest's own process a second thread mostly waits (measured: k3-tiny verify of 4 x 8
tokens 2.4 s with 2 threads on a busy machine, 0.25 s with 1)."""
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """Tests marked `long` run first: on scripts/test's two workers a minute-long test started last
    keeps one core busy after the other has run out of work (the suite's tail)."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
