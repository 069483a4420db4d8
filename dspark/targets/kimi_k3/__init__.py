"""Kimi K3 target: config presets, the plain-torch model, the Target and checkpoint I/O."""
from .config import K3, K3_SLICE, K3_TINY, PRESETS, RANK_PRESETS, K3Config, first_layers, get_preset
from .model import DecodeState, K3Model
from .sharding import Shard
from .target import K3Target, load_target
from .weights import load_checkpoint, save_checkpoint

__all__ = [
    "K3", "K3_SLICE", "K3_TINY", "PRESETS", "RANK_PRESETS", "K3Config", "first_layers", "get_preset", "Shard",
    "K3Model", "DecodeState", "K3Target",
    "load_target", "save_checkpoint", "load_checkpoint",
]
