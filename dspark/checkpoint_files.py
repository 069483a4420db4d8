"""Reading checkpoint files with errors that name the file and what is wrong with it.

The target (targets/kimi_k3/weights.py), the DSpark drafter (drafters/dspark/checkpoint.py) and the
GGUF reader (targets/gguf_assets.py) go through these helpers, so a missing directory, a missing or
malformed config.json and a truncated or corrupted weights file each surface as one
CheckpointError (a ValueError: the CLI prints it as one line and exits 2) instead of a
FileNotFoundError, JSONDecodeError, KeyError or the safetensors library's own error.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or inconsistent; the message names the file."""


def require_directory(path, what: str) -> Path:
    """`path` as a Path, or CheckpointError when it is not an existing directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{what} {str(path)!r}: no such directory")
    if not path.is_dir():
        raise CheckpointError(f"{what} {str(path)!r}: not a directory (expected config.json + *.safetensors in it)")
    return path


def read_json(file: Path, what: str) -> dict:
    """The JSON object in `file`; CheckpointError when the file is missing, unreadable or not a
    JSON object."""
    if not file.is_file():
        raise CheckpointError(f"{what} {str(file.parent)!r}: no {file.name}")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{str(file)!r}: cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{str(file)!r}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(file)!r}: expected a JSON object, found {type(data).__name__}")
    return data


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when its data starts on a 64-byte boundary, else an owned copy (which the
    allocator aligns). get_tensor can hand back memory at the file's 8-byte data alignment, and CPU
    GEMMs pick their kernel by pointer alignment: such a weight multiplies to different last bits
    than the same values allocated in memory, so a loaded model would not reproduce the model it
    was saved from bit for bit."""
    return tensor if tensor.data_ptr() % 64 == 0 else tensor.clone()


def iter_safetensors(file: Path, keep=lambda name: True):
    """(name, tensor) on the CPU for each tensor of one safetensors file whose name passes `keep`,
    one at a time (a shard is never held whole); CheckpointError naming the file when it is
    missing, truncated or its header is corrupt."""
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        raise CheckpointError(f"{str(file)!r}: no such file")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if keep(name):
                    yield name, _aligned(f.get_tensor(name))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{str(file)!r}: not a readable safetensors file ({e})") from None


def load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (see iter_safetensors)."""
    return dict(iter_safetensors(file))
