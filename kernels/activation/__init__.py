"""situ_glu and sigmoid_gate: K3's fused activations as ops."""
from . import reference  # noqa: F401  (the definitions, registered as "reference")
from . import triton  # noqa: F401  (Triton GPU kernels; imports triton only when first used)
