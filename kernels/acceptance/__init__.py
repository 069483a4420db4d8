"""rejection_sample / synthetic_sample: the acceptance of a verified block (dspark.sampling) as ops."""
from . import reference  # noqa: F401  (registers dspark.sampling's samplers as the reference)
from . import triton  # noqa: F401  (Triton GPU kernels; imports triton only when first used)
