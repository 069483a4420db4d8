"""DSpark drafter (dspark.drafters.dspark): model, heads, drafter wrapper, training, calibration,
checkpoints. Design notes: docs/dspark-algorithm.md."""
from .checkpoint import load_checkpoint, save_checkpoint
from .config import K3_DSPARK, K3_TINY_DSPARK, DSparkConfig, get_preset
from .drafter import DSparkDrafter, load_drafter, shared_embeddings
from .model import DSparkModel

__all__ = [
    "DSparkConfig", "DSparkDrafter", "DSparkModel", "K3_DSPARK", "K3_TINY_DSPARK", "get_preset",
    "load_checkpoint", "load_drafter", "save_checkpoint", "shared_embeddings",
]
