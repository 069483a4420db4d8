"""moe: K3 latent MoE FFN (router, MXFP4 routed experts in latent space, shared experts)."""
from . import reference  # noqa: F401  (registers the reference implementation)
from . import cute_sm90  # noqa: F401  (registers the Hopper implementation; imports cutlass lazily)
