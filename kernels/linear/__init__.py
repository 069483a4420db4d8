"""linear: y[M, N] = x[M, K] @ W[N, K]^T, the skinny GEMM of a verify step (M = tokens <= 16 per request)."""
from . import reference  # noqa: F401  (registers the reference implementation)
from . import cute_sm90  # noqa: F401  (CuTe DSL Hopper kernel; imports cutlass only when first used)
from . import cute_sm100  # noqa: F401  (CuTe DSL Blackwell tcgen05 kernel; compile-checked only)
from . import triton  # noqa: F401  (fp32 operands, e.g. the K3 router; imports triton only when first used)
