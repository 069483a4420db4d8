"""Triton kernels of K3's fused activations (imported on first use)."""
import triton
import triton.language as tl

from ..triton_partials import split_k_sum
from ..triton_pdl import prologue


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): exact limits at both ends (exp overflows to inf -> 1, underflows -> -1)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def situ_glu_kernel(gate_ptr, up_ptr, stride_g, stride_u, out_ptr, stride_o, n, beta, linear_beta,
                    BLOCK: tl.constexpr, PDL: tl.constexpr):
    prologue(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    act = (beta * _tanh(g / beta) * tl.sigmoid(g)) * (linear_beta * _tanh(u / linear_beta))
    tl.store(out_ptr + row * stride_o + offs, act.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sigmoid_gate_kernel(x_ptr, gate_ptr, stride_x, stride_g, out_ptr, stride_o, n, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    prologue(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (x * tl.sigmoid(g)).to(dtype), mask=mask)


@triton.jit
def silu_mul_kernel(gate_ptr, up_ptr, stride_g, stride_u, out_ptr, stride_o, n, stride_gs, stride_us,
                    BLOCK: tl.constexpr, PARTS: tl.constexpr, PDL: tl.constexpr):
    """PARTS > 1: gate and up are a GEMM's split-K partials (stride_gs / stride_us apart), added in split
    order in fp32 and rounded to the output's dtype, as the GEMM's reduction would have rounded them."""
    prologue(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dtype = out_ptr.dtype.element_ty
    g = split_k_sum(gate_ptr + row * stride_g, offs, mask, stride_gs, PARTS)
    u = split_k_sum(up_ptr + row * stride_u, offs, mask, stride_us, PARTS)
    if PARTS > 1:
        g = g.to(dtype).to(tl.float32)
        u = u.to(dtype).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)  # silu rounded to the dtype, as the reference's torch op
    tl.store(out_ptr + row * stride_o + offs, (act * u).to(dtype), mask=mask)
