"""linear: y[M, N] = x[M, K] @ W[N, K]^T, the skinny GEMM of a verify step (M = tokens <= 16 per request)."""
from . import reference  # noqa: F401  (registers the reference implementation)
