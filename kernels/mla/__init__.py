"""mla: absorbed gated-MLA attention of the T verify queries over the latent cache."""
from . import reference  # noqa: F401  (registers the reference implementation)
