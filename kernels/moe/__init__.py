"""moe: the K3 router (`moe_route`) and the routed MXFP4 experts (`moe_experts`); the latent-MoE
block built on them is dspark/targets/kimi_k3/moe.py.

The CuTe DSL builds import cutlass at the top of their modules, so they are registered here by
module path and imported on their first use (a call, or a `supports` check, which the registry
makes only once the implementation is available on the device): the registry imports this
package on a machine without the CuTe DSL, and a CPU-only run never imports them.
"""
import functools
import importlib

from ..cute_common import register_cute
from . import reference  # noqa: F401  (registers the reference implementations)
from . import triton  # noqa: F401  (the router selection; imports triton only when first used)


@functools.cache
def _module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def _lazy(module: str, attribute: str):
    """A stand-in for `attribute` of the sibling module `module` that imports it on first call."""

    def call(*args, **kwargs):
        return getattr(_module(module), attribute)(*args, **kwargs)

    call.__qualname__ = call.__name__ = f"{module}.{attribute}"
    return call


for _family in ("cute_sm90", "cute_sm100"):  # Hopper; Blackwell (compile-checked, never run)
    register_cute("moe_experts", _family, _lazy(_family, "supports"))(_lazy(_family, "moe_experts"))
