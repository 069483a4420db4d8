"""kda: Kimi Delta Attention verify (output-only, records) and commit (replay of accepted positions)."""
from . import reference  # noqa: F401  (registers the reference implementation)
from . import cute_sm90  # noqa: F401  (CuTe DSL Hopper build; imports cutlass only when first used)
from . import cute_sm100  # noqa: F401  (the same kernels built for Blackwell sm_100a / sm_103a)
