"""markov_greedy_draft and draft_confidence: the sequential stage of a greedy DSpark draft, the Markov head's
argmax chain and the confidence head over the block, as one op each (docs/kernels.md §10.12)."""
from . import reference  # noqa: F401  (the loop that defines the op)
from . import triton  # noqa: F401  (Triton GPU kernels; imports triton only when first used)
