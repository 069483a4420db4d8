"""rms_norm and attn_res_mix_norm: K3's norms as ops."""
from . import reference  # noqa: F401  (the definitions, registered as "reference")
from . import triton  # noqa: F401  (Triton GPU kernels; imports triton only when first used)
