"""kda: Kimi Delta Attention verify (output-only, records) and commit (replay of accepted positions), one
layer's or all layers' in one launch (kda_commit_layers)."""
from ..cute_common import register_cute_module
from . import reference  # noqa: F401  (registers the reference implementation)
from .cute_host import supports_commit, supports_commit_layers, supports_verify

# The CuTe DSL kernels (kda/cute_kernel.py) built for Hopper and for Blackwell sm_100a / sm_103a;
# each module is imported on its first call.
for _family in ("cute_sm90", "cute_sm100"):
    register_cute_module("kda_verify", _family, supports_verify, f"dspark.kernels.kda.{_family}", "kda_verify")
    register_cute_module("kda_commit", _family, supports_commit, f"dspark.kernels.kda.{_family}", "kda_commit")
    register_cute_module("kda_commit_layers", _family, supports_commit_layers, f"dspark.kernels.kda.{_family}",
                         "kda_commit_layers")
