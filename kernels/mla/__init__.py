"""mla: absorbed gated-MLA attention of the T verify queries over the latent cache, and the
write of the new tokens' latent rows into it."""
from ..cute_common import register_cute_module
from . import reference  # noqa: F401  (registers the reference implementations)
from . import triton  # noqa: F401  (the cache write; imports triton only when first used)
from .cute_host import supports

# CuTe DSL kernels, imported (with cutlass) on their first call: Hopper, and Blackwell (never
# run, compile-checked in CI)
register_cute_module("mla_verify_attention", "cute_sm90", supports, "dspark.kernels.mla.cute_sm90",
                     "mla_verify_attention")
register_cute_module("mla_verify_attention", "cute_sm100", supports, "dspark.kernels.mla.cute_sm100",
                     "mla_verify_attention")
