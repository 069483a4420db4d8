"""Kernel registry: op name -> implementations, chosen by device and availability.

Every op has a plain-torch `reference` implementation that runs anywhere and defines the op.
Faster implementations (Triton, CuTe DSL sm_90a, CuTe DSL sm_100a/sm_103a) register beside it
with the devices and compute capabilities they run on and a priority; `resolve` picks the
highest-priority one that is available for the tensor's device.

Overrides, strongest first:
  1. the context's table (`scoped(pairs)`): what one engine sets around its own step, visible
     only to code running in that context (a contextvars.ContextVar), so two engines in one
     process keep their own kernel choices,
  2. `use(op, impl)` / the process-wide `overrides` mapping (what a config file sets),
  3. the environment: DSPARK_KERNELS="linear=reference,moe_experts=cute_sm90",
  4. the default choice by priority.
An override naming an implementation that does not exist, or cannot run on the device, is an
error that names the op and the implementation: nothing silently falls back.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

import torch



@dataclass
class Implementation:
    op: str
    name: str
    fn: Callable
    devices: tuple[str, ...] = ("cpu", "cuda")
    min_capability: tuple[int, int] | None = None  # e.g. (9, 0) for sm_90a code
    max_capability: tuple[int, int] | None = None  # e.g. (9, 0): Hopper-only instructions
    priority: int = 0  # reference = 0; faster implementations higher
    available: Callable[[], bool] = field(default=lambda: True)
    # Per-call predicate on the op's arguments (shapes, dtypes, strides); None = takes every call.
    # An implementation that is fast only for some shapes says so here, and `select` passes
    # other calls to the next implementation by priority.
    supports: Callable[..., bool] | None = None
    # Reads values of device tensors on the host (lengths, slots, ids): a synchronisation on
    # CUDA, so a step that selects it cannot be captured in a CUDA graph (record_selections).
    reads_device_values: bool = False

    def takes(self, *args) -> bool:
        return self.supports is None or self.supports(*args)

    def runs_on(self, device: torch.device) -> bool:
        if device.type not in self.devices:
            return False
        if device.type == "cuda" and (self.min_capability or self.max_capability):
            cap = torch.cuda.get_device_capability(device)
            if self.min_capability and cap < self.min_capability:
                return False
            if self.max_capability and cap > self.max_capability:
                return False
        return self.available()


_IMPLS: dict[str, dict[str, Implementation]] = {}
overrides: dict[str, str] = {}
# The context's override table: sorted (op, implementation) pairs, hashable so it keys the cache.
_scoped: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar("dspark_kernel_overrides", default=())
_resolved: dict[tuple[str, str, int | None, tuple[tuple[str, str], ...]], Implementation] = {}
# The list record_selections appends every select() of its block to (None outside one).
_recording: contextvars.ContextVar[list | None] = contextvars.ContextVar("dspark_kernel_selections", default=None)
_loaded = False


@dataclass(frozen=True)
class Selection:
    """One select(): the implementation that ran `op` on `device`, the one the device's default
    (or override) would have run, and the argument shapes when they differ (a fallback)."""

    op: str
    device: str
    chosen: Implementation
    preferred: str
    shapes: tuple = ()

    @property
    def fallback(self) -> bool:
        return self.chosen.name != self.preferred

    @property
    def blocks_capture(self) -> bool:
        """Whether this call synchronises the host with the device (see Implementation.reads_device_values)."""
        return self.device.startswith("cuda") and self.chosen.reads_device_values

    def __str__(self) -> str:
        why = f" ({self.preferred!r} does not take arguments {list(self.shapes)})" if self.fallback else ""
        return f"{self.op} on {self.device} ran {self.chosen.name!r}{why}"


def register(op: str, name: str, **kwargs) -> Callable[[Callable], Callable]:
    """Decorator: register `fn` as implementation `name` of `op`."""

    def wrap(fn: Callable) -> Callable:
        impls = _IMPLS.setdefault(op, {})
        if name in impls:
            raise ValueError(f"kernel op {op!r} already has an implementation named {name!r}")
        impls[name] = Implementation(op=op, name=name, fn=fn, **kwargs)
        _resolved.clear()
        return fn

    return wrap


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        # Each op is a subpackage of dspark.kernels whose __init__ registers its implementations.
        # GPU implementations import their toolchain lazily (inside `available` or at first
        # call), so importing every op package is cheap and works on a CPU-only machine.
        import dspark.kernels as package

        for info in pkgutil.iter_modules(package.__path__):
            if info.ispkg:
                importlib.import_module(f"{package.__name__}.{info.name}")


def implementations(op: str) -> dict[str, Implementation]:
    _load()
    if op not in _IMPLS:
        raise KeyError(f"unknown kernel op {op!r}; known ops: {sorted(_IMPLS)}")
    return _IMPLS[op]


def _env_overrides() -> dict[str, str]:
    spec = os.environ.get("DSPARK_KERNELS", "").strip()
    result = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        op, sep, impl = item.partition("=")
        if not sep or not op or not impl:
            raise ValueError(f"DSPARK_KERNELS entry {item!r} is not of the form op=implementation")
        result[op.strip()] = impl.strip()
    return result


def use(op: str, impl: str | None) -> None:
    """Force `op` to `impl` (None removes the override)."""
    implementations(op)  # validates the op name
    if impl is None:
        overrides.pop(op, None)
    else:
        overrides[op] = impl
    _resolved.clear()


def _override(op: str) -> str | None:
    """The implementation forced for `op`: the context's table, then `use`, then DSPARK_KERNELS."""
    return dict(_scoped.get()).get(op) or overrides.get(op) or _env_overrides().get(op)


def active_overrides() -> dict[str, str]:
    """The overrides in force here: the context's table over the process-wide `overrides`
    (DSPARK_KERNELS not included)."""
    return {**overrides, **dict(_scoped.get())}


def resolve(op: str, device: torch.device | str) -> Implementation:
    device = torch.device(device)
    key = (op, device.type, device.index, _scoped.get())
    if key in _resolved:
        return _resolved[key]
    impls = implementations(op)
    chosen_name = _override(op)
    if chosen_name is not None:
        if chosen_name not in impls:
            raise ValueError(f"kernel override {op}={chosen_name!r}: no such implementation; have {sorted(impls)}")
        impl = impls[chosen_name]
        if not impl.runs_on(device):
            raise ValueError(f"kernel override {op}={chosen_name!r} cannot run on device {device}")
    else:
        candidates = [i for i in impls.values() if i.runs_on(device)]
        if not candidates:
            raise RuntimeError(f"kernel op {op!r} has no implementation for device {device}")
        impl = max(candidates, key=lambda i: i.priority)
    _resolved[key] = impl
    return impl


def select(op: str, *args: torch.Tensor) -> Implementation:
    """The implementation for one call of `op` on `args` (dispatched on the first one's device).

    Like `resolve`, but an implementation whose `supports` rejects these arguments is skipped for
    the best one that takes them. An override is never skipped: forcing an implementation on
    arguments it does not support is an error naming the op, the implementation and the shapes.
    """
    device = args[0].device
    impl = resolve(op, device)
    if impl.takes(*args):
        chosen, shapes = impl, ()
    else:
        shapes = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args)
        if _override(op) is not None:
            raise ValueError(f"kernel override {op}={impl.name!r} does not support arguments {list(shapes)}")
        candidates = [i for i in implementations(op).values() if i.runs_on(device) and i.takes(*args)]
        if not candidates:
            raise RuntimeError(f"kernel op {op!r} has no implementation on {device} for arguments {list(shapes)}")
        chosen = max(candidates, key=lambda i: i.priority)
    recording = _recording.get()
    if recording is not None:
        recording.append(Selection(op, str(device), chosen, impl.name, shapes))
    return chosen


@contextlib.contextmanager
def record_selections():
    """Yields a list that every select() in this block (this context only) appends its
    Selection to: which implementation each op call ran, and which calls fell back from the
    device's default. A benchmark checks a step with it before capturing it in a CUDA graph."""
    selections: list[Selection] = []
    token = _recording.set(selections)
    try:
        yield selections
    finally:
        _recording.reset(token)


@contextlib.contextmanager
def scoped(pairs: tuple[tuple[str, str], ...]):
    """Apply (op, implementation) overrides to the code this block runs (a profile's kernels),
    over any outer scope's; the process-wide `overrides` stay as they are."""
    for op, _ in pairs:
        implementations(op)  # validates the op name
    table = tuple(sorted({**dict(_scoped.get()), **dict(pairs)}.items()))
    token = _scoped.set(table)
    try:
        yield
    finally:
        _scoped.reset(token)
