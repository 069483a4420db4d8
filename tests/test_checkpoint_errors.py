"""Broken checkpoints give one clear error naming the file, through the API and the CLI.

For the K3 target and the DSpark drafter: a missing directory, a missing config.json, a config
that is not JSON, a config missing a key, and a truncated, header-corrupted or garbage
model.safetensors. Each is a CheckpointError (a ValueError) whose message names the file; the
CLI prints it as one `dspark <command>: error:` line on stderr and exits 2, never a traceback.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from dspark.checkpoint_files import CheckpointError
from dspark.cli import main as cli_main
from dspark.drafters.dspark import DSparkModel, load_checkpoint as load_drafter_checkpoint
from dspark.drafters.dspark import save_checkpoint as save_drafter_checkpoint
from dspark.drafters.dspark.config import K3_TINY_DSPARK
from dspark.targets.gguf_assets import GGUFFile
from dspark.targets.kimi_k3 import K3_TINY, K3Model, K3Target, save_checkpoint
from dspark.targets.kimi_k3.weights import load_checkpoint as load_target_checkpoint
from dspark_fixtures import one_thread  # noqa: F401 (autouse fixture)


def _seed():
    return int(torch.randint(0, 2**31 - 1, ()))


@pytest.fixture(scope="module")
def target_model():
    return K3Model.random(K3_TINY, seed=_seed(), dtype=torch.float32)


@pytest.fixture
def target_dir(tmp_path, target_model):
    directory = tmp_path / "k3-tiny-ckpt"
    save_checkpoint(target_model, directory, shard_bytes=1 << 40)  # one shard, renamed to the usual name
    (shard,) = directory.glob("*.safetensors")
    shard.rename(directory / "model.safetensors")
    return directory


@pytest.fixture
def drafter_dir(tmp_path, target_model):
    target = K3Target(target_model, max_slots=1, max_seq_len=32)
    model = DSparkModel(K3_TINY_DSPARK, *target.embedding_weights())
    directory = tmp_path / "drafter-ckpt"
    save_drafter_checkpoint(model, directory)
    return directory


def _truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _corrupt_header(file):
    data = bytearray(file.read_bytes())
    data[8:16] = b"{garbage"  # the header is JSON right after its 8-byte length
    file.write_bytes(bytes(data))


def _garbage(file):
    file.write_bytes(os.urandom(256))


def _drop_key(key):
    """Remove `key` from config.json (at the top level or under text_config)."""
    def damage(directory):
        file = directory / "config.json"
        data = json.loads(file.read_text())
        (data["text_config"] if "text_config" in data else data).pop(key)
        file.write_text(json.dumps(data))
    return damage


# (case, damage(directory) -> the path the error must name, words the error must contain)
def _cases(missing_key):
    return {
        "missing_directory": (lambda d: d.parent / "no-such-checkpoint", "no such directory"),
        "missing_config": (lambda d: (d / "config.json").unlink() or d, "no config.json"),
        "config_not_json": (lambda d: (d / "config.json").write_text("{'not': json") and d / "config.json",
                            "not valid JSON"),
        "config_missing_key": (lambda d: _drop_key(missing_key)(d) or d / "config.json", "missing"),
        "truncated_weights": (lambda d: _truncate(d / "model.safetensors") or d / "model.safetensors",
                              "not a readable safetensors file"),
        "corrupt_header": (lambda d: _corrupt_header(d / "model.safetensors") or d / "model.safetensors",
                           "not a readable safetensors file"),
        "garbage_weights": (lambda d: _garbage(d / "model.safetensors") or d / "model.safetensors",
                            "not a readable safetensors file"),
    }


TARGET_CASES = _cases("linear_attn_config")
DRAFTER_CASES = _cases("markov_rank")


def _load_target(path):
    return load_target_checkpoint(path, torch.float32, "cpu")


def _load_drafter(path, target_model):
    target = K3Target(target_model, max_slots=1, max_seq_len=32)
    return load_drafter_checkpoint(path, *target.embedding_weights())


@pytest.mark.parametrize("case", TARGET_CASES)
def test_broken_target_checkpoint_names_the_file(target_dir, case):
    damage, words = TARGET_CASES[case]
    named = damage(target_dir)
    with pytest.raises(CheckpointError) as info:
        _load_target(named if case == "missing_directory" else target_dir)
    message = str(info.value)
    assert str(named) in message and words in message, message
    assert isinstance(info.value, ValueError) and "\n" not in message
    if case == "config_missing_key":
        assert "text_config.linear_attn_config" in message


@pytest.mark.parametrize("case", DRAFTER_CASES)
def test_broken_drafter_checkpoint_names_the_file(drafter_dir, target_model, case):
    damage, words = DRAFTER_CASES[case]
    named = damage(drafter_dir)
    with pytest.raises(CheckpointError) as info:
        _load_drafter(named if case == "missing_directory" else drafter_dir, target_model)
    message = str(info.value)
    assert str(named) in message and words in message, message
    if case == "config_missing_key":
        assert "markov_rank" in message


def test_intact_checkpoints_still_load(target_dir, drafter_dir, target_model):
    # The fixtures themselves load, so each failure above comes from its damage alone.
    cfg, tensors = _load_target(target_dir)
    assert cfg.mla_layers == K3_TINY.mla_layers
    assert torch.equal(tensors["language_model.lm_head.weight"], target_model.tensors["language_model.lm_head.weight"])
    assert _load_drafter(drafter_dir, target_model).config.num_layers == K3_TINY_DSPARK.num_layers


@pytest.mark.parametrize("key, value", [("hidden_size", "64"), ("num_hidden_layers", 0), ("rms_norm_eps", None)])
def test_target_config_with_a_bad_value_names_key_and_value(target_dir, key, value):
    file = target_dir / "config.json"
    data = json.loads(file.read_text())
    data["text_config"][key] = value
    file.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as info:
        _load_target(target_dir)
    assert str(file) in str(info.value) and repr(value) in str(info.value), str(info.value)


def test_drafter_config_with_a_wrong_type_names_the_file(drafter_dir, target_model):
    file = drafter_dir / "config.json"
    data = json.loads(file.read_text())
    data["target_layer_ids"] = "not a list of ints"
    file.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="config.json"):
        _load_drafter(drafter_dir, target_model)


def test_tensor_errors_name_the_checkpoint(target_dir):
    from safetensors.torch import load_file, save_file

    file = target_dir / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["language_model.model.layers.3.self_attn.q_b_proj.weight"]
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError) as info:
        _load_target(target_dir)
    assert str(target_dir) in str(info.value) and "q_b_proj" in str(info.value)


@pytest.mark.parametrize("content", [b"not a gguf at all", b"GGUF\x03\x00\x00\x00" + b"\x07" * 21])
def test_broken_gguf_names_the_file(tmp_path, content):
    pytest.importorskip("gguf")
    file = tmp_path / "model.gguf"
    file.write_bytes(content)
    with pytest.raises(CheckpointError, match="not a readable GGUF file") as info:
        GGUFFile(file)
    assert str(file) in str(info.value)


# ---- CLI -----------------------------------------------------------------------------------------

def _target_argv(path):
    return ["generate", "--target", str(path), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--max-seq-len", "32"]


def _drafter_argv(path):
    return ["generate", "--target", "k3-tiny", "--drafter", "dspark", "--drafter-path", str(path), "-k", "3",
            "--prompt-ids", "1,2,3", "--max-tokens", "2", "--max-seq-len", "32"]


CLI_CASES = [("target", case) for case in TARGET_CASES] + [("drafter", case) for case in DRAFTER_CASES]


def _broken_cli_argv(request, kind, case):
    """Damage the `kind` checkpoint as `case` says: (the CLI arguments, the path the error names)."""
    directory = request.getfixturevalue(f"{kind}_dir")
    named = (TARGET_CASES if kind == "target" else DRAFTER_CASES)[case][0](directory)
    path = named if case == "missing_directory" else directory
    return (_target_argv if kind == "target" else _drafter_argv)(path), named


# Every case in-process through the CLI's handler (cheap); a few as real subprocesses below.
@pytest.mark.parametrize("kind, case", CLI_CASES)
def test_cli_broken_checkpoint_is_one_line_exit_2(request, capsys, kind, case):
    argv, named = _broken_cli_argv(request, kind, case)
    assert cli_main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dspark generate: error: ") and str(named) in lines[0], captured.err


def _run_cli(argv):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "dspark.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("kind, case", [("target", "config_missing_key"), ("target", "corrupt_header"),
                                        ("drafter", "missing_config"), ("drafter", "truncated_weights")])
def test_cli_subprocess_broken_checkpoint(request, kind, case):
    argv, named = _broken_cli_argv(request, kind, case)
    result = _run_cli(argv)
    assert result.returncode == 2, result.stderr
    assert str(named) in result.stderr and "Traceback" not in result.stderr + result.stdout, result.stderr
    assert result.stderr.startswith("dspark generate: error: ") and result.stderr.count("\n") == 1
