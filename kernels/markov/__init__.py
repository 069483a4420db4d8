"""markov_greedy_draft: the Markov head's sequential stage of a greedy DSpark draft as one op."""
from . import reference  # noqa: F401  (the loop that defines the op)
from . import triton  # noqa: F401  (Triton GPU kernels; imports triton only when first used)
