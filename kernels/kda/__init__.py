"""kda: Kimi Delta Attention verify (output-only, records) and commit (replay of accepted positions)."""
from . import reference  # noqa: F401  (registers the reference implementation)
