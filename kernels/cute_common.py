"""Shared plumbing for the CuTe DSL kernels: registration by module path, target-arch detection and
a compile cache (docs/kernels.md §1.2, §1.4).

Nothing here imports cutlass at module import time, and neither do the op packages: each CuTe DSL
implementation is registered by module path (`register_cute_module`), and its module, which
imports cutlass at the top, is imported on the first call. So the registry imports every op
package on a machine without the CuTe DSL. Kernels are compiled once per key (shape, dtype, arch, variant) with
`cute.compile` and kept in a dict: the steady state never re-traces or recompiles. Compiles use the
TVM-FFI calling convention (`--enable-tvm-ffi`), so a compiled kernel is called with plain torch
tensors on torch's current stream (about 5 us of host overhead instead of ~50 us via from_dlpack).
"""
# No `from __future__ import annotations`: CuTe DSL evaluates the device functions' annotations.

import functools
import importlib
import importlib.util
import os
import threading
from typing import Callable, Hashable

import torch

from .registry import register

# Targets we build for; the "a" suffix enables the arch-specific instructions (wgmma, tcgen05).
SUPPORTED_ARCHS = ("sm_90a", "sm_100a", "sm_103a")


@functools.cache
def cutlass_available() -> bool:
    """True when the CuTe DSL (nvidia-cutlass-dsl) and tvm-ffi can be imported."""
    if importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("tvm_ffi") is None:
        return False
    try:
        import cutlass.cute  # noqa: F401
    except Exception:  # a broken install (e.g. missing runtime library) counts as unavailable
        return False
    return True


# The compute capabilities each family of CuTe DSL builds runs on: sm_90a code (wgmma, Hopper TMA)
# on 9.0 alone; the Blackwell builds on 10.0 (B200) through 10.3 (GB300).
FAMILY_CAPABILITIES = {"cute_sm90": ((9, 0), (9, 0)), "cute_sm100": ((10, 0), (10, 3))}


def register_cute(op: str, family: str, supports: Callable[..., bool]) -> Callable[[Callable], Callable]:
    """Register a CuTe DSL implementation of `op` named `family` ("cute_sm90" or "cute_sm100"):
    CUDA on that family's capabilities, above the torch reference, when the CuTe DSL imports."""
    low, high = FAMILY_CAPABILITIES[family]
    return register(op, family, devices=("cuda",), min_capability=low, max_capability=high, priority=10,
                    available=cutlass_available, supports=supports)


def register_cute_module(op: str, family: str, supports: Callable[..., bool], module: str, fn: str) -> None:
    """Register function `fn` of `module` as the CuTe DSL implementation `family` of `op` (as
    `register_cute` does) without importing `module`: the registered trampoline imports it on its
    first call. `supports` must come from a module that does not import cutlass."""
    target = None

    def call(*args, **kwargs):
        nonlocal target
        if target is None:
            target = getattr(importlib.import_module(module), fn)
        return target(*args, **kwargs)

    call.__name__ = call.__qualname__ = fn
    call.__module__ = module
    call.__doc__ = f"{module}.{fn}, imported on the first call."
    register_cute(op, family, supports)(call)


def arch_of_capability(capability: tuple[int, int]) -> str | None:
    """The CuTe DSL target for a CUDA compute capability, or None if we have no kernels for it."""
    return {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}.get(tuple(capability))


def target_arch(device: torch.device | None = None) -> str:
    """Arch to compile for: CUTE_DSL_ARCH if set (CPU-only compile checks), else the device's."""
    forced = os.environ.get("CUTE_DSL_ARCH")
    if forced:
        if forced not in SUPPORTED_ARCHS:
            raise ValueError(f"CUTE_DSL_ARCH={forced!r} is not one of {SUPPORTED_ARCHS}")
        return forced
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device and CUTE_DSL_ARCH is not set: cannot pick a CuTe DSL target")
    capability = torch.cuda.get_device_capability(device)
    arch = arch_of_capability(capability)
    if arch is None:
        raise ValueError(f"compute capability {capability} has no CuTe DSL kernels here")
    return arch


def torch_to_cutlass_dtype(dtype: torch.dtype):
    import cutlass

    table = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}
    if dtype not in table:
        raise ValueError(f"dtype={dtype} has no CuTe DSL mapping here")
    return table[dtype]


def compile_options(arch: str, *extra: str) -> str:
    """cute.compile options: explicit target (so one process can build for several archs) and TVM-FFI."""
    return " ".join(("--enable-tvm-ffi", f"--gpu-arch {arch}", *extra))


class CompileCache:
    """Compiled kernels keyed by a hashable key; `get` builds on a miss, exactly once per key."""

    def __init__(self) -> None:
        self._compiled: dict[Hashable, object] = {}
        self._lock = threading.Lock()
        self.compiles = 0  # how many times `build` ran; tests check the steady state adds none

    def get(self, key: Hashable, build: Callable[[], object]) -> object:
        compiled = self._compiled.get(key)
        if compiled is None:
            with self._lock:
                compiled = self._compiled.get(key)
                if compiled is None:
                    compiled = build()
                    self._compiled[key] = compiled
                    self.compiles += 1
        return compiled

    def __len__(self) -> int:
        return len(self._compiled)
