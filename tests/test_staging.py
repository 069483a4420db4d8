"""tools/lab/staging.py: a file cut into parts that travel in separate device calls, kept, and joined
only when every part is the manifest's."""
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "lab"))
import staging  # noqa: E402


def random_file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def test_parts_stay_under_their_limit_and_join_back_from_several_calls(tmp_path):
    size = 1000 + int.from_bytes(os.urandom(2), "little")
    data = random_file(tmp_path / "pack.bin", size)
    stage, keep = tmp_path / "stage", tmp_path / "keep"
    manifest = staging.split(tmp_path / "pack.bin", stage, max_part_bytes=300)
    parts = manifest["parts"]
    assert len(parts) == -(-size // 300) and all(0 < p["bytes"] <= 300 for p in parts)
    assert sum(p["bytes"] for p in parts) == size
    assert b"".join((stage / p["name"]).read_bytes() for p in parts) == data
    # One call carries the first parts only: they are kept, the join names the rest as missing.
    carried = tmp_path / "call1"
    carried.mkdir()
    for name in [parts[0]["name"], parts[1]["name"], staging.manifest_name("pack.bin")]:
        (carried / name).write_bytes((stage / name).read_bytes())
    assert staging.keep(carried, keep) == [parts[0]["name"], parts[1]["name"]]
    with pytest.raises(staging.StagingError, match=parts[2]["name"]):
        staging.join("pack.bin", keep)
    # The next call carries the others.
    assert len(staging.keep(stage, keep)) == len(parts)
    joined = staging.join("pack.bin", keep)
    assert joined == keep / "pack.bin" and joined.read_bytes() == data


def test_a_part_from_another_split_is_refused_and_leaves_no_file(tmp_path):
    random_file(tmp_path / "model.gguf", 1001)
    stage = tmp_path / "stage"
    manifest = staging.split(tmp_path / "model.gguf", stage, name="smollm2.gguf", parts=2)
    assert [p["bytes"] for p in manifest["parts"]] == [500, 501]
    assert json.loads((stage / "smollm2.gguf.manifest.json").read_text()) == manifest
    (stage / "smollm2.gguf.part2").write_bytes(os.urandom(501))
    with pytest.raises(staging.StagingError, match="smollm2.gguf.part2 of this manifest"):
        staging.join("smollm2.gguf", tmp_path / "keep", stage)
    assert list((tmp_path / "keep").iterdir()) == []  # neither a joined file nor a partial one


def test_a_shorter_split_removes_the_parts_of_a_longer_one(tmp_path):
    stage = tmp_path / "stage"
    random_file(tmp_path / "a", 900)
    staging.split(tmp_path / "a", stage, max_part_bytes=100)
    random_file(tmp_path / "a", 250)
    manifest = staging.split(tmp_path / "a", stage, max_part_bytes=100)
    assert sorted(p.name for p in stage.glob("a.part*")) == sorted(p["name"] for p in manifest["parts"])


def test_bad_calls_name_what_is_wrong(tmp_path):
    random_file(tmp_path / "a", 10)
    with pytest.raises(ValueError, match="exactly one of parts= and max_part_bytes="):
        staging.split(tmp_path / "a", tmp_path / "s", parts=2, max_part_bytes=5)
    with pytest.raises(ValueError, match="parts=0"):
        staging.split(tmp_path / "a", tmp_path / "s", parts=0)
    with pytest.raises(staging.StagingError, match="no manifest"):
        staging.keep(tmp_path / "empty", tmp_path / "keep")
    with pytest.raises(staging.StagingError, match="no a.manifest.json"):
        staging.join("a", tmp_path / "keep")
    (tmp_path / "s2").mkdir()
    (tmp_path / "s2" / "a.manifest.json").write_text("{}")
    with pytest.raises(staging.StagingError, match="not a staging manifest"):
        staging.keep(tmp_path / "s2", tmp_path / "keep")
