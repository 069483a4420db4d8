"""What every Triton implementation shares: whether triton is installed (checked without
importing it: importing triton takes seconds, and CPU-only machines may not have it), the
import of an op's kernel module on its first launch, and the programmatic-dependent-launch switch."""
import functools
import importlib
import importlib.util


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernel_module(package: str):
    """`<package>.triton_kernels`, imported (with triton) on first use."""
    return importlib.import_module(f"{package}.triton_kernels")


# Split-K partials a kernel sums in one unrolled loop (triton_partials.split_k_sum): the skinny GEMM splits
# K = 7168 at most ~14 ways, and linear_partials never more than 32.
MAX_PARTS = 32

# Programmatic dependent launch of the step's Triton kernels (docs/kernels.md §5). On, each kernel
# is launched with `launch_pdl` and begins with griddepcontrol.wait (so every read and write it
# makes comes after the previous kernel has completed and is visible) and
# griddepcontrol.launch_dependents (the next kernel may be launched now, to wait in its own
# prologue): inside a CUDA graph, a kernel's launch then overlaps its predecessor's tail, as the
# CuTe kernels' already do. Off until the slice and the GPU tests have run under it, though it is
# faster on the rank at batch 1 (docs/kimi-k3.md §8.5; experiments/step_bench.py --setting triton_pdl=1
# times it).
PDL = False


def pdl_options() -> dict:
    """The launch keyword arguments of a kernel with a `PDL: tl.constexpr` parameter that starts
    with triton_pdl.prologue(PDL)."""
    return {"PDL": True, "launch_pdl": True} if PDL else {"PDL": False}
