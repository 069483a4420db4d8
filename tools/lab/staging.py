"""Files larger than one GPU call moves, staged in parts (experiments/notes/smollm2.md, "How the calls are made").

A device call carries at most 64 MiB of tree and brings back at most 8 files of 16 MiB each (64 MiB in all),
and its machine keeps /tmp only ~30 s after a call ends. So a large file goes in parts: `split` cuts it into
NAME.part1 .. NAME.partN plus NAME.manifest.json (its size and sha256, and each part's); each call that
carries some parts runs `keep` to copy them into a folder that outlives the call; the call that has them all
runs `join`, which checks every part against the manifest and the joined file against its sha256. A missing
or foreign part is a StagingError naming it, never a silently short file.
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

MiB = 1 << 20
# Below the 16 MiB a file may have to come back from a call, so parts written on the GPU return as they are.
RETURNABLE_PART_BYTES = 15 * MiB + MiB // 2


class StagingError(Exception):
    """A part or a manifest missing, or from another split: one line naming it and what to carry."""


def manifest_name(name: str) -> str:
    return f"{name}.manifest.json"


def part_name(name: str, index: int) -> str:
    return f"{name}.part{index}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split(source: Path, stage: Path, *, name: str | None = None, parts: int | None = None,
          max_part_bytes: int | None = None) -> dict:
    """Cut `source` into `parts` parts of near-equal size, or into as few as keep each at most
    `max_part_bytes`, under stage/NAME.partI (NAME = `name` or the source's own); returns the manifest."""
    if (parts is None) == (max_part_bytes is None):
        raise ValueError("split: give exactly one of parts= and max_part_bytes=")
    data = Path(source).read_bytes()
    if parts is None:
        if max_part_bytes < 1:
            raise ValueError(f"split: max_part_bytes={max_part_bytes!r} must be at least 1")
        parts = max(1, math.ceil(len(data) / max_part_bytes))
    if parts < 1:
        raise ValueError(f"split: parts={parts!r} must be at least 1")
    name = name or Path(source).name
    stage.mkdir(parents=True, exist_ok=True)
    for stale in stage.glob(f"{name}.part*"):  # a part left by an earlier, longer split
        stale.unlink()
    bounds = [len(data) * i // parts for i in range(parts + 1)]
    listed = []
    for i in range(parts):
        chunk = data[bounds[i]:bounds[i + 1]]
        (stage / part_name(name, i + 1)).write_bytes(chunk)
        listed.append({"name": part_name(name, i + 1), "bytes": len(chunk), "sha256": _sha256(chunk)})
    manifest = {"file": name, "bytes": len(data), "sha256": _sha256(data), "parts": listed}
    tmp = stage / (manifest_name(name) + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(stage / manifest_name(name))
    return manifest


def keep(stage: Path, keep_dir: Path) -> list[str]:
    """Copy every manifest in `stage` and each of its parts that this call carried into `keep_dir`;
    returns the names copied."""
    manifests = sorted(stage.glob(manifest_name("*"))) if stage.is_dir() else []
    if not manifests:
        raise StagingError(f"no manifest in {stage}; carry the staged parts with their NAME.manifest.json")
    keep_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in manifests:
        manifest = _read_manifest(path)
        for part in manifest["parts"]:
            if (stage / part["name"]).is_file():
                shutil.copyfile(stage / part["name"], keep_dir / part["name"])
                copied.append(part["name"])
        shutil.copyfile(path, keep_dir / path.name)
    if not copied:
        raise StagingError(f"{stage} holds manifests but none of their parts; carry the parts into this call")
    return copied


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
        _ = [(p["name"], p["bytes"], p["sha256"]) for p in manifest["parts"]], manifest["sha256"], manifest["file"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise StagingError(f"{path}: not a staging manifest ({error})") from None
    return manifest


def join(name: str, keep_dir: Path, stage: Path | None = None) -> Path:
    """Join NAME's parts (each from `keep_dir`, or from `stage` where this call carries it) into
    keep_dir/NAME after checking each against the manifest and the whole against its sha256."""
    folders = [keep_dir] + ([stage] if stage is not None else [])
    found = [f / manifest_name(name) for f in folders if (f / manifest_name(name)).is_file()]
    if not found:
        raise StagingError(f"no {manifest_name(name)} in {' or '.join(map(str, folders))}; "
                           "run keep in a call that carries it")
    manifest = _read_manifest(found[0])
    paths, missing = [], []
    for part in manifest["parts"]:
        where = next((f / part["name"] for f in folders if (f / part["name"]).is_file()), None)
        if where is None:
            missing.append(part["name"])
        paths.append(where)
    if missing:
        raise StagingError(f"{', '.join(missing)} of {name} gone or never kept (the machine was replaced "
                           f"or cleaned since); carry {'them' if len(missing) > 1 else 'it'} and run keep again")
    keep_dir.mkdir(parents=True, exist_ok=True)
    out, joining = keep_dir / name, keep_dir / (name + ".joining")
    digest = hashlib.sha256()
    try:
        with open(joining, "wb") as f:
            for part, path in zip(manifest["parts"], paths):
                chunk = path.read_bytes()
                if len(chunk) != part["bytes"] or _sha256(chunk) != part["sha256"]:
                    raise StagingError(f"{path} is not the {part['name']} of this manifest (another split's?); "
                                       "split again and restage every part")
                digest.update(chunk)
                f.write(chunk)
        if digest.hexdigest() != manifest["sha256"]:
            raise StagingError(f"the joined {name} has sha256 {digest.hexdigest()}, "
                               f"the manifest {manifest['sha256']}")
    except BaseException:
        joining.unlink(missing_ok=True)
        raise
    joining.replace(out)
    return out
