"""Checks every command makes of its flags before any work (a model load, data generation, a
measurement): each bad value is one ValueError naming the flag and the value."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch


def device(value: str | None, flag: str = "--device") -> str:
    """The device a command runs on: `value` checked against this machine, or cuda when a GPU is
    present and cpu otherwise."""
    if value is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(f"{flag} {value!r}: not a device; use cpu or cuda (cuda:N for the N-th GPU)") from None
    if parsed.type == "cpu":
        return value
    if parsed.type != "cuda":
        raise ValueError(f"{flag} {value!r}: dspark runs on cpu or cuda")
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no CUDA GPU"
        raise ValueError(f"{flag} {value!r}: no CUDA device on this machine ({why}); use --device cpu")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"{flag} {value!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return value


def at_least(flag: str, value, minimum: int | float = 1):
    """`value` when it is >= minimum (None passes: the flag's default applies)."""
    if value is not None and value < minimum:
        raise ValueError(f"{flag} {value}: must be >= {minimum}")
    return value


def writable_folder(flag: str, path: str | os.PathLike) -> Path:
    """`path` as a folder results can be written to, checked without creating anything: an
    existing writable folder, or a new one whose nearest existing parent is a writable folder."""
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        where = "is" if probe == path else f"would be inside {str(probe)!r}, which is"
        raise ValueError(f"{flag} {str(path)!r}: {where} a file, not a folder")
    try:  # a file made and removed: access() would let root pass where a write still fails (/proc)
        tempfile.TemporaryFile(dir=probe).close()
    except OSError as exc:
        where = "" if probe == path else f" (in {str(probe)!r})"
        raise ValueError(f"{flag} {str(path)!r}: cannot write there{where}: {exc.strerror or exc}") from None
    return path


def readable_file(flag: str, path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{flag} {str(path)!r}: no such file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{flag} {str(path)!r}: not readable")
    return path
