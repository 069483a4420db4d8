"""DSpark drafter (dspark.drafters.dspark): model, heads, drafter wrapper, training, calibration,
checkpoints. Spec: ../shared/spec/dspark-algorithm.md."""
from .checkpoint import load_checkpoint, save_checkpoint
from .config import K3_DSPARK, K3_TINY_DSPARK, DSparkConfig, get_preset
from .drafter import DSparkDrafter
from .model import DSparkModel

__all__ = [
    "DSparkConfig", "DSparkDrafter", "DSparkModel", "K3_DSPARK", "K3_TINY_DSPARK", "get_preset",
    "load_checkpoint", "save_checkpoint",
]
