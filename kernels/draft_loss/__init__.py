"""draft_loss_terms: the per-position cross-entropy and L1 (total-variation) terms of the DSpark
training loss as an op (docs/dspark-algorithm.md §6.3)."""
from . import reference  # noqa: F401  (the definition, registered as "reference")
from . import triton  # noqa: F401  (Triton GPU kernels with their backward; imports triton only when first used)
