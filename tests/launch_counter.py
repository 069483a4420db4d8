"""Counting on the CPU what a K3 forward launches on the GPU (docs/kimi-k3.md §8.5).

`count_launches(fn)` runs fn with every op of dspark.kernels.ops wrapped and a TorchDispatchMode
underneath, and returns a `Launches`:
- ops: the calls of each op (outermost only: a reference that calls another op counts once).
  What an op launches on the GPU is its implementation's business (the CuTe and Triton kernels
  are one or a few launches each; the GPU bench counts them);
- glue: the aten ops that ran outside every op call and that launch a kernel on the GPU, by
  name. On the GPU these map to kernels one to one (an add, a copy, an index_put, a cat, a fill):
  views and allocations launch nothing and are not counted;
- syncs: the aten ops that read a device value on the host (item, ...), outside every op call.

The model code under test must reach the ops through the `ops` module (`ops.linear(...)`), as
dspark/targets/kimi_k3 does: a function imported by name before the wrap is not seen.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import inspect
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dspark.kernels import ops

aten = torch.ops.aten
# Not views by their schema, but no kernel either: allocations, reshapes of a fresh copy, the
# wrapped Python scalars of `where(x, y, 0.0)`.
LAUNCH_FREE = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten._unsafe_view.default, aten.scalar_tensor.default, aten.lift_fresh.default,
}
HOST_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}


@dataclass
class Launches:
    ops: collections.Counter = field(default_factory=collections.Counter)
    glue: collections.Counter = field(default_factory=collections.Counter)
    syncs: collections.Counter = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        """Op calls + glue launches: a lower bound of the GPU's launches (an op is at least one)."""
        return sum(self.ops.values()) + sum(self.glue.values())

    def __str__(self) -> str:
        return (f"{self.total} ({sum(self.ops.values())} op calls {dict(sorted(self.ops.items()))}, "
                f"{sum(self.glue.values())} glue {dict(sorted(self.glue.items()))}, syncs {dict(self.syncs)})")


class _GlueCounter(TorchDispatchMode):
    def __init__(self, launches: Launches, depth: list[int]):
        super().__init__()
        self.launches, self.depth = launches, depth

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.depth[0]:
            name = func.overloadpacket.__name__
            if func in HOST_READS:
                self.launches.syncs[name] += 1
            elif not func.is_view and func not in LAUNCH_FREE:
                self.launches.glue[name] += 1
        return func(*args, **(kwargs or {}))


def _op_names() -> list[str]:
    return [name for name, fn in vars(ops).items()
            if inspect.isfunction(fn) and fn.__module__ == ops.__name__ and not name.startswith("_")]


@contextlib.contextmanager
def counting():
    """Yields a Launches that fills while the block runs (see the module docstring)."""
    launches, depth = Launches(), [0]
    originals = {name: getattr(ops, name) for name in _op_names()}

    def wrapped(name, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not depth[0]:
                launches.ops[name] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    try:
        for name, fn in originals.items():
            setattr(ops, name, wrapped(name, fn))
        with _GlueCounter(launches, depth):
            yield launches
    finally:
        for name, fn in originals.items():
            setattr(ops, name, fn)


def count_launches(fn, *args, **kwargs) -> Launches:
    with counting() as launches:
        fn(*args, **kwargs)
    return launches
