"""Shared plumbing for the CuTe DSL kernels: lazy import of cutlass, target-arch detection and a
compile cache (spec: kernels.md §1.2, §1.4).

Nothing here imports cutlass at module import time, so the registry can import every op package on
a machine without the CuTe DSL. Kernels are compiled once per key (shape, dtype, arch, variant) with
`cute.compile` and kept in a dict: the steady state never re-traces or recompiles. Compiles use the
TVM-FFI calling convention (`--enable-tvm-ffi`), so a compiled kernel is called with plain torch
tensors on torch's current stream (about 5 us of host overhead instead of ~50 us via from_dlpack).
"""
# No `from __future__ import annotations`: CuTe DSL evaluates the device functions' annotations.

import functools
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


@functools.cache
def split_k_fixup():
    """The fused split-K reduction shared by the GEMM kernels, as a @cute.jit device function.

    Serial fixup (the CUDA threadFenceReduction pattern; spec kernels.md §7 row 1, split-K): every
    split of a weight tile has stored its fp32 partial; a gpu-scope fence publishes it, one thread
    counts the arrival on the tile's counter, and the last split to arrive sums all partials of the
    tile in split order (deterministic) and writes y, then re-arms the counter to zero for the next
    call. Each of the tile's threads owns one weight row (= one y column), so loads are coalesced.

    partials: (N, M, splits) fp32 view; y: (N, M, 1) view of y[M, N]; counters: (tiles,) int32;
    arrival_ptr: one int32 of shared memory; the CTA has `tile_rows` threads.
    """
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def fixup(
        partials: cute.Tensor,
        y: cute.Tensor,
        counters: cute.Tensor,
        arrival_ptr: cute.Pointer,
        tile_idx: cutlass.Int32,
        tidx: cutlass.Int32,
        tile_rows: cutlass.Constexpr,
        tokens: cutlass.Constexpr,
        splits: cutlass.Constexpr,
    ):
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        arrival = cute.make_tensor(arrival_ptr, cute.make_layout(1))
        if tidx == 0:
            arrival[0] = cute.arch.atomic_add(
                counters.iterator + tile_idx, cutlass.Int32(1), sem="acq_rel", scope="gpu"
            )
        cute.arch.sync_threads()
        if arrival[0] == splits - 1:
            cute.arch.fence_acq_rel_gpu()
            row = tile_idx * tile_rows + tidx
            for token in cutlass.range_constexpr(tokens):
                if row < y.shape[0] and token < y.shape[1]:
                    total = cutlass.Float32(0.0)
                    for split in cutlass.range_constexpr(splits):
                        total += partials[row, token, split]
                    y[row, token, 0] = total.to(y.element_type)
            if tidx == 0:
                counters[tile_idx] = cutlass.Int32(0)

    return fixup


REDUCE_THREADS = 256


@functools.cache
def split_k_reduce():
    """The two-pass split-K reduction as a @cute.jit launcher: a second small kernel, launched
    right after the GEMM on the same stream (PDL), sums the fp32 partials workspace[splits, M, N]
    in split order (deterministic) and writes y[M, N] in y's dtype. One thread per element of y,
    so loads and stores are coalesced and every split's partial is read once."""
    import cutlass
    import cutlass.cute as cute

    @cute.kernel
    def reduce_kernel(partials: cute.Tensor, y: cute.Tensor, total: cutlass.Int32, splits: cutlass.Constexpr):
        cute.arch.griddepcontrol_wait()  # the partials come from the previous kernel
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * REDUCE_THREADS + tidx
        if i < total:
            acc = cutlass.Float32(0.0)
            for split in cutlass.range_constexpr(splits):
                acc += partials[i, split]
            y[i] = acc.to(y.element_type)

    @cute.jit
    def launch(
        workspace: cute.Tensor,
        y: cute.Tensor,
        total: cutlass.Int32,
        splits: cutlass.Constexpr,
        use_pdl: cutlass.Constexpr,
        stream,
    ):
        """workspace: fp32 [splits, M, N] (compact), y: [M, N] (compact), total = M * N."""
        partials = cute.make_tensor(workspace.iterator, cute.make_layout((total, splits), stride=(1, total)))
        y_flat = cute.make_tensor(y.iterator, cute.make_layout(total))
        reduce_kernel(partials, y_flat, total, splits).launch(
            grid=(cute.ceil_div(total, REDUCE_THREADS), 1, 1),
            block=[REDUCE_THREADS, 1, 1],
            stream=stream,
            use_pdl=use_pdl,
        )

    return launch
