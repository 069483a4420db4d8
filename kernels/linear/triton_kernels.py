"""Triton kernel of the fp32 skinny GEMM (imported on first use)."""
import triton
import triton.language as tl


@triton.jit
def skinny_f32_kernel(x_ptr, w_ptr, y_ptr, M, N, stride_x, stride_w, stride_y, K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[:, block of N] = x @ w[block]^T in fp32 FMAs (no TF32): every row of x against BLOCK_N
    weight rows, streaming K (a compile-time constant: one build per weight shape, and Triton's
    interpreter, which CI runs, cannot loop to a run-time bound)."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + depth
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_w + k[None, :], mask=(cols[:, None] < N) & (k[None, :] < K),
                    other=0.0)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc, mask=(rows[:, None] < M) & (cols[None, :] < N))
