"""rotary: rotary position embedding of per-head features from precomputed cos / sin tables."""
from . import reference  # noqa: F401  (the torch formula that defines the op)
from . import triton  # noqa: F401  (Triton GPU kernel; imports triton only when first used)
