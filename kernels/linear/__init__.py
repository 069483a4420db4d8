"""linear: y[M, N] = x[M, K] @ W[N, K]^T, the skinny GEMM of a verify step (M = tokens <= 16 per request)."""
from ..cute_common import register_cute_module
from . import reference  # noqa: F401  (registers the reference implementation)
from .cute_host import supports

# CuTe DSL kernels, imported (with cutlass) on their first call: Hopper, and Blackwell tcgen05
# (compile-checked only)
register_cute_module("linear", "cute_sm90", supports, "dspark.kernels.linear.cute_sm90", "linear")
register_cute_module("linear", "cute_sm100", supports, "dspark.kernels.linear.cute_sm100", "linear")
