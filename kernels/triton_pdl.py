"""The prologue of a Triton kernel under programmatic dependent launch (triton_common.PDL).
Imports triton: only the kernel modules, themselves imported on first use, import it."""
import triton
import triton.language as tl


@triton.jit
def prologue(PDL: tl.constexpr):
    """With PDL, wait for the previous kernel (complete and visible), then let the next one launch.
    Must come before the kernel's first global read or write. Without, nothing is compiled in."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
