"""rejection_sample / synthetic_sample: the acceptance of a verified block as ops."""
from . import reference  # noqa: F401  (the samplers that define the ops)
from . import triton  # noqa: F401  (Triton GPU kernels; imports triton only when first used)
