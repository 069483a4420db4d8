"""dspark and vLLM: our SpecConfig as vLLM's `speculative_config` (the drop-in: no plugin, our
config becomes theirs), checked against the installed vLLM, and vLLM as a sweep backend.

Released vLLM (0.25 and later) ships `method: "dspark"`, synthetic acceptance (0.20+), block
verification (0.25+) and adaptive verification (0.28+). vLLM 0.34 adds a registry for outside
speculative methods (`register_speculative_method`, configured through `speculator_options`) and
drops `method="custom_class"`; dspark needs neither, because vLLM's own "dspark" method runs our
drafters (docs/vllm-integration.md "Key takeaways").

  versions   the vLLM release table (which release has which field and value; the supported range)
  convert    SpecConfig <-> speculative_config dict, with what vLLM cannot express or reads differently
  validate   the dict against the installed vLLM's SpeculativeConfig / VllmConfig
  cli        `dspark vllm-config`
  sweep      `dspark sweep --backend vllm`
  export     drafter checkpoints in the layouts vLLM's DSpark loaders read (`dspark export-drafter`)

vLLM is imported lazily, inside the functions that need it, so `import dspark.vllm` works without it.
"""
from .cli import configure_parser, main
from .convert import (
    OUR_FIELD,
    NotCarriedOverWarning,
    VllmDiffersWarning,
    VllmSpeculativeConfig,
    convert,
    from_vllm_config,
    read_drafter_block_size,
    sampling_params_not_carried,
    speculative_config,
)
from .validate import VllmValidation, check_vllm_version, validate_with_vllm, vllm_importable, write_tiny_target
from .versions import (
    FIELDS,
    SUPPORTED_VLLM,
    VALUES,
    format_version,
    minimum_vllm_version,
    parse_version,
    required_versions,
)

__all__ = [
    "FIELDS", "OUR_FIELD", "SUPPORTED_VLLM", "VALUES", "NotCarriedOverWarning", "VllmDiffersWarning",
    "VllmSpeculativeConfig", "VllmValidation", "check_vllm_version", "configure_parser", "convert",
    "format_version", "from_vllm_config", "main", "minimum_vllm_version", "parse_version",
    "read_drafter_block_size", "required_versions", "sampling_params_not_carried", "speculative_config",
    "validate_with_vllm", "vllm_importable", "write_tiny_target",
]
