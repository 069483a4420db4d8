"""mla: absorbed gated-MLA attention of the T verify queries over the latent cache."""
from . import reference  # noqa: F401  (registers the reference implementation)
from . import cute_sm90  # noqa: F401  (CuTe DSL, Hopper; imports cutlass only when compiling)
from . import cute_sm100  # noqa: F401  (CuTe DSL, Blackwell; never run, compile-checked in CI)
