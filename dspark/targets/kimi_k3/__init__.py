"""Kimi K3 target: config presets, the plain-torch model, the Target and checkpoint I/O.

Exports resolve lazily: the op references import `mxfp4` and `numerics` from this package, and
the model imports the ops, so importing the package must not import the model eagerly.
"""
from .config import K3, K3_SLICE, K3_TINY, PRESETS, K3Config, get_preset

_LAZY = {
    "K3Model": "model", "DecodeState": "model", "K3Target": "target", "load_target": "target",
    "save_checkpoint": "weights", "load_checkpoint": "weights",
}

__all__ = ["K3", "K3_SLICE", "K3_TINY", "PRESETS", "K3Config", "get_preset", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
