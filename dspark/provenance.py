"""Provenance of a result file: which code, on which device and software, run how and when.

One block for every result JSON (sweeps, experiments/benchlib.py benchmarks), so a number can be
traced to its commit and command whoever wrote it.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch


def git_commit(explicit: str | None = None) -> str:
    """The source tree's commit: an explicit value, DSPARK_GIT_COMMIT (set where the tree travels
    without its .git, as on the GPU machine), or `git rev-parse HEAD` of this checkout."""
    if explicit:
        return explicit
    if os.environ.get("DSPARK_GIT_COMMIT"):
        return os.environ["DSPARK_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def module_version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or broken on this machine: record that, don't fail the run
        return "not importable"


def command_line() -> str:
    """The command as typed: `dspark <command> ...` for the console script, else python's argv."""
    if sys.argv and os.path.basename(sys.argv[0]) == "dspark":
        return " ".join(["dspark", *sys.argv[1:]])
    return " ".join([os.path.basename(sys.executable), *sys.argv])


def device_name(device: str | torch.device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine()


def provenance(device: str | torch.device, commit: str | None = None, **extra) -> dict:
    """Device, versions, commit, command line and start time, plus `extra` fields."""
    return {
        "device": torch.device(device).type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "git_commit": git_commit(commit),
        "command": command_line(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }
