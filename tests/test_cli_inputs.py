"""Plausible mistakes a new user makes, each refused before any work (no model built, no data
generated, nothing measured or written) with one line on stderr that names the flag and the
value, and exit 2: no traceback, no silent kill, no value changed behind the user's back."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import dspark.build
import dspark.commands.generate
import dspark.sweep
from dspark.cli import main


@pytest.fixture
def no_work(monkeypatch):
    """Every way into real work fails the test loudly (an AssertionError keeps its traceback), so
    a refusal that comes after the work started cannot pass. CUDA reads as absent, as on the CPU
    machines these tests run on."""
    def tripwire(*args, **kwargs):
        raise AssertionError("work started before the input was refused")

    for module in (dspark.build, dspark.commands.generate, dspark.sweep):
        monkeypatch.setattr(module, "build_target", tripwire)
    from dspark.drafters.dspark import train

    monkeypatch.setattr(train, "generate_sequences", tripwire)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def assert_one_line_error(capsys, argv, *needles):
    command = argv[0]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dspark {command}: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


DEVICE_CASES = [
    (["generate", "--device", "cuda"], ("--device 'cuda'", "no CUDA device")),
    (["generate", "--device", "gpu"], ("--device 'gpu'", "use cpu or cuda")),
    (["sweep", "--device", "cuda"], ("--device 'cuda'", "no CUDA device")),
    (["sweep", "--device", "gpu"], ("--device 'gpu'", "use cpu or cuda")),
    (["calibrate", "--target", "k3-tiny", "--drafter", "x", "--device", "cuda"], ("--device 'cuda'", "no CUDA device")),
]


@pytest.mark.parametrize("argv, needles", DEVICE_CASES, ids=[" ".join(c[0]) for c in DEVICE_CASES])
def test_a_device_this_machine_lacks_is_one_line(no_work, capsys, tmp_path, argv, needles):
    assert_one_line_error(capsys, argv, *needles)


def test_train_drafter_checks_its_device_before_generating(no_work, capsys, tmp_path):
    assert_one_line_error(capsys, ["train-drafter", "--target", "k3-tiny", "--drafter", "k3-tiny_dspark", "--out",
                                   str(tmp_path / "d"), "--device", "gpu"], "--device 'gpu'")


SWEEP_CASES = [
    (["--context", "-5"], ("--context -5: must be >= 1")),
    (["--context", "0"], ("--context 0: must be >= 1")),  # once silently the default, 32
    (["--max-tokens", "0", "--per-point"], ("--max-tokens 0: must be >= 1")),
    (["--policy", "bogus", "--per-point"], ("--policy 'bogus'", "fixed, threshold, scheduler")),
    (["--out", "/proc/dspark-sweep"], ("--out '/proc/dspark-sweep'", "cannot write there")),
]


@pytest.mark.parametrize("flags, needles", SWEEP_CASES, ids=[" ".join(c[0]) for c in SWEEP_CASES])
def test_sweep_refuses_before_measuring(no_work, capsys, tmp_path, monkeypatch, flags, needles):
    monkeypatch.chdir(tmp_path)  # the default --out, runs/sweep-k3-tiny, would land here
    assert_one_line_error(capsys, ["sweep", "--device", "cpu", *flags], *needles)
    assert not list(tmp_path.rglob("sweep.json"))  # nothing written that would block the folder


def test_sweep_out_inside_a_file_is_refused(no_work, capsys, tmp_path):
    (tmp_path / "file").write_text("")
    assert_one_line_error(capsys, ["sweep", "--device", "cpu", "--out", str(tmp_path / "file" / "sweep")],
                          "is a file, not a folder")


TRAIN_CASES = [
    (["--steps", "0"], ("--steps 0: must be an integer >= 1")),
    (["--batch-size", "0"], ("--batch-size 0")),
    (["--resume"], ("--resume:", "holds no checkpoint")),
    (["--max-seq-len", "4096"], ("--max-seq-len 4096", "at most 1024")),
    (["--gen-len", "2000"], ("--gen-len 2000", "--max-seq-len 1024")),
    (["--num-prompts", "0"], ("--num-prompts 0")),
    (["--gen-temperature", "-1"], ("--gen-temperature -1.0")),
    (["--data", "/nonexistent/data.jsonl"], ("--data '/nonexistent/data.jsonl'")),
]


@pytest.mark.parametrize("flags, needles", TRAIN_CASES, ids=[" ".join(c[0]) for c in TRAIN_CASES])
def test_train_drafter_refuses_before_generating_data(no_work, capsys, tmp_path, flags, needles):
    assert_one_line_error(capsys, ["train-drafter", "--target", "k3-tiny", "--drafter", "k3-tiny_dspark", "--out",
                                   str(tmp_path / "drafter"), *flags], *needles)


def test_train_drafter_refuses_a_drafter_for_another_target(no_work, capsys, tmp_path):
    assert_one_line_error(capsys, ["train-drafter", "--target", "k3-tiny", "--drafter", "k3_dspark", "--out",
                                   str(tmp_path / "d")], "--drafter k3_dspark", "(256, 64, 9)")
    assert_one_line_error(capsys, ["train-drafter", "--target", "k3-tiny", "--drafter", "k3-nope", "--out",
                                   str(tmp_path / "d")], "--drafter 'k3-nope'")


def test_vllm_config_refuses_a_misspelt_extra_field_without_vllm(capsys):
    line = assert_one_line_error(capsys, ["vllm-config", "-k", "7", "--extra", '{"draft_tensor_paralel_size": 1}'],
                                 "--extra 'draft_tensor_paralel_size'", "did you mean 'draft_tensor_parallel_size'")
    assert "vLLM" in line
    assert capsys.readouterr().out == ""  # no JSON for `vllm serve` to start with
    assert main(["vllm-config", "-k", "7", "--no-validate", "--extra", '{"draft_tensor_parallel_size": 1}']) == 0
    assert json.loads(capsys.readouterr().out)["draft_tensor_parallel_size"] == 1


def test_a_k3_preset_that_cannot_fit_is_refused_with_the_figure(monkeypatch):
    """The estimate runs before any allocation: against a machine said to have 1 MB, even k3-tiny
    is refused, with the bytes it needs and what the machine has."""
    monkeypatch.setattr(dspark.build, "available_memory", lambda device: (1e6, "0.0 GB of RAM available (test)"))
    with pytest.raises(ValueError, match=r"target='k3-tiny': needs about .* GB on cpu .*this machine has 0.0 GB"):
        dspark.build.build_target("k3-tiny", max_slots=1, max_seq_len=64, device="cpu")


def test_k3_estimate_counts_weights_experts_and_caches():
    """K3's routed experts in MXFP4 are 17,547,264 B each (docs/kimi-k3.md §1.3), 896 of them in
    each of its 92 MoE layers; the caches grow with slots and context."""
    from dspark.targets.kimi_k3.config import PRESETS

    k3 = PRESETS["k3"]
    parts = dspark.build.k3_target_bytes(k3, max_slots=1, max_seq_len=1024, dtype=torch.bfloat16)
    assert parts["experts"] == 92 * 896 * 17_547_264
    more = dspark.build.k3_target_bytes(k3, max_slots=2, max_seq_len=1024, dtype=torch.bfloat16)
    assert more["caches"] == 2 * parts["caches"] and more["weights"] == parts["weights"]
    wider = dspark.build.k3_target_bytes(k3, max_slots=1, max_seq_len=1024, dtype=torch.float32)
    assert wider["weights"] > 1.9 * parts["weights"]


def run_cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "dspark.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_k3_on_this_machine_is_refused_at_once_not_killed():
    """The full K3 needs about 1.7 TB: the command says so instead of allocating until the
    machine kills it."""
    start = time.monotonic()
    result = run_cli("generate", "--target", "k3", "--device", "cpu")
    assert time.monotonic() - start < 60
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("dspark generate: error: target='k3': needs about") and "this machine has" in lines[0]


def test_an_offline_hub_id_is_one_quick_line_naming_block_size():
    """A hub that cannot be reached (here: a closed local port) is found with one connection
    attempt: no retries, no retry log, and the line says what to pass instead."""
    start = time.monotonic()
    result = run_cli("vllm-config", "--drafter", "dspark", "--drafter-path", "Inferact/Kimi-K3-DSpark", "-k", "7",
                     env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"})
    assert time.monotonic() - start < 20
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and result.stdout == "" and len(lines) == 1, result.stderr
    assert "drafter_path='Inferact/Kimi-K3-DSpark'" in lines[0] and "cannot be reached" in lines[0]
    assert "--block-size" in lines[0]


def test_result_files_follow_the_umask(tmp_path):
    from dspark.files import write_atomic

    previous = os.umask(0o027)
    try:
        write_atomic(tmp_path / "result.json", "{}")
    finally:
        os.umask(previous)
    assert (tmp_path / "result.json").stat().st_mode & 0o777 == 0o640
