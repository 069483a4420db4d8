"""draft_loss_terms: the per-position cross-entropy and L1 (total-variation) terms of the DSpark
training loss as an op (docs/dspark-algorithm.md §6.3); draft_head_loss: the same terms from the
draft head's inputs, the logits' GEMM fused in."""
from . import reference  # noqa: F401  (the definition, registered as "reference")
from . import triton  # noqa: F401  (Triton GPU kernels with their backward; imports triton only when first used)
from . import head_reference  # noqa: F401  (draft_head_loss's definition, registered as "reference")
from . import head_triton  # noqa: F401  (its Triton kernels and cuBLAS backward; imports triton only when first used)
