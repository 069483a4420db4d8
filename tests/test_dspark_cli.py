"""`dspark train-drafter` and `dspark calibrate` on k3-tiny (random weights), through the command
line: a smoke run of each, the defaults that follow the target, the data and flags kept for a
resumed run, and a real run stopped by signals mid-training that resumes to the same weights."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from dspark.cli import main
from dspark.files import file_mode
from dspark.drafters.dspark.config import DSparkConfig
from dspark_fixtures import one_thread  # noqa: F401 (autouse fixture)

SMOKE = ["--target", "k3-tiny", "--drafter", "k3-tiny_dspark", "--batch-size", "2", "--num-anchors", "4",
         "--num-prompts", "4", "--prompt-len", "4", "--gen-len", "8", "--max-seq-len", "64", "--device", "cpu"]


def test_train_then_calibrate_through_the_cli(tmp_path, capsys):
    out = tmp_path / "drafter"
    assert main(["train-drafter", *SMOKE, "--out", str(out), "--steps", "3", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["final"]["step"] == 3
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 3
    assert DSparkConfig.load(out).confidence_temperatures is None
    kept = [json.loads(line) for line in (out / "train_data.jsonl").read_text().splitlines()]
    assert len(kept) == 4 and all(len(row["tokens"]) == len(row["loss_mask"]) for row in kept)
    report_path = tmp_path / "report.json"
    # no --max-seq-len: k3-tiny's own limit (1024), not 4096, which k3-tiny refuses
    assert main(["calibrate", "--target", "k3-tiny", "--drafter", str(out), "--num-prompts", "2", "--prompt-len", "4",
                 "--max-new-tokens", "16", "--device", "cpu", "--report", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    temps = DSparkConfig.load(out).confidence_temperatures
    assert temps is not None and list(temps) == report["temperatures"] and len(temps) == 7
    assert {"ece", "auc", "brier"} <= set(report["fit"]["before"]) and report["fit"]["before"]["rounds"] > 0
    # a second run into the same folder continues it only when asked to
    assert main(["train-drafter", *SMOKE, "--out", str(out), "--steps", "3", "--no-progress"]) == 2
    assert "holds a checkpoint: pass --resume" in capsys.readouterr().err
    assert main(["train-drafter", *SMOKE, "--out", str(out), "--steps", "4", "--resume", "--no-progress"]) == 2
    assert "--steps 4 differs from the run" in capsys.readouterr().err


def _train(out, *flags, env=None):
    """train-drafter in a fresh interpreter, as a user runs it (stderr to a file, as in a log)."""
    return subprocess.Popen([sys.executable, "-m", "dspark.cli", "train-drafter", *SMOKE, "--out", str(out), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _steps_logged(out) -> int:
    log = out / "train_log.jsonl"
    return len(log.read_text().splitlines()) if log.exists() else 0


def _kill_after(out, process, steps: int, signum: int) -> tuple[int, str]:
    """Send `signum` once the run has logged `steps` training steps; its exit status and stderr."""
    deadline = time.monotonic() + 240
    while _steps_logged(out) < steps:
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "the run logged no steps"
        time.sleep(0.02)
    process.send_signal(signum)
    _, err = process.communicate(timeout=240)
    return process.returncode, err


def _state_step(out) -> int:
    return torch.load(out / "trainer_state.pt", weights_only=False)["step"]


@pytest.mark.long
def test_a_killed_run_resumes_to_the_weights_of_an_unbroken_one(tmp_path, capsys):
    """Ctrl-C mid-training saves a checkpoint after the current step; SIGKILL (nothing to catch)
    loses only the steps since the last save; each time --resume continues, and the final weights
    equal, bit for bit, those of the same run never interrupted (data order and anchors depend
    only on the seed and the step, and the optimizer state is saved with the weights)."""
    steps = ["--steps", "12", "--save-every", "3"]
    whole = tmp_path / "whole"
    assert main(["train-drafter", *SMOKE, "--out", str(whole), *steps, "--no-progress"]) == 0

    broken = tmp_path / "broken"
    code, err = _kill_after(broken, _train(broken, *steps), 2, signal.SIGINT)
    stopped = _state_step(broken)
    assert code == 128 + signal.SIGINT, err
    assert "SIGINT: stopping after this step with a checkpoint" in err and f"stopped at step {stopped} of 12" in err
    assert 2 <= stopped <= 6 and _steps_logged(broken) == stopped
    assert "\r" not in err  # a log file gets progress lines, never a bar's redraws

    # Killed once the step after the next periodic save is logged (its save precedes that step).
    next_save = (stopped // 3 + 1) * 3
    code, err = _kill_after(broken, _train(broken, *steps, "--resume"), next_save + 1, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert "training on the 4 sequences generated before" in err  # not generated again
    assert _state_step(broken) == next_save and _steps_logged(broken) > next_save  # the log runs past the save

    resumed = _train(broken, *steps, "--resume")
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    assert json.loads(out)["final"]["step"] == 12
    log = [json.loads(line)["step"] for line in (broken / "train_log.jsonl").read_text().splitlines()]
    assert log == list(range(1, 13))  # the steps a kill cut off before their save are logged once
    a, b = load_file(whole / "model.safetensors"), load_file(broken / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (broken / "model.safetensors").stat().st_mode & 0o777 == file_mode()  # not safetensors' 0600


def test_a_signal_during_training_asks_for_a_stop_and_a_second_one_stops_at_once():
    from dspark.commands.train_drafter import StopOnSignal

    with StopOnSignal() as stop:
        with pytest.raises(KeyboardInterrupt):  # before training: nothing to save, stop now
            os.kill(os.getpid(), signal.SIGTERM)
        stop.training = True
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested() and stop.received == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
