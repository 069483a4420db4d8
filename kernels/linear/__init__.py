"""linear: y[M, N] = x[M, K] @ W[N, K]^T, the skinny GEMM of a verify step (M = a step's tokens: <= 16, or
up to 64 on Hopper when kernels/linear/cute_host.py HOPPER_MAX_TOKENS allows)."""
from ..cute_common import register_cute_module
from . import reference  # noqa: F401  (registers the reference implementation)
from .cute_host import supports, supports_hopper

# CuTe DSL kernels, imported (with cutlass) on their first call: Hopper, and Blackwell tcgen05
# (compile-checked only)
register_cute_module("linear", "cute_sm90", supports_hopper, "dspark.kernels.linear.cute_sm90", "linear")
register_cute_module("linear_partials", "cute_sm90", supports_hopper, "dspark.kernels.linear.cute_sm90",
                     "linear_partials")
register_cute_module("linear", "cute_sm100", supports, "dspark.kernels.linear.cute_sm100", "linear")
