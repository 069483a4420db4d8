"""What the Triton kernels that read a GEMM's split-K partials (ops.linear_partials) in place of its
reduced output share: the sum, in the reduction kernel's order. Imports triton: only the kernel
modules, themselves imported on first use, import it."""
import triton
import triton.language as tl


@triton.jit
def split_k_sum(ptr, offs, mask, stride_s, PARTS: tl.constexpr):
    """The values at ptr + offs in fp32; PARTS > 1: a GEMM's split-K partials, stride_s apart, added in
    split order in fp32 as its reduction kernel adds them (one part: the values as they are). The caller
    rounds the sum where the reduction would have stored it."""
    x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, PARTS):
        x += tl.load(ptr + s * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
    return x
