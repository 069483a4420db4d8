"""experiments/engine_host_profile.py on the CPU (k3-tiny, eager: no graph parts): both phases are
timed and profiled, the parts it can see add up to no more than the step, and a bad option is one
line on stderr. The timings mean nothing here; the code path is what is tested."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "engine_host_profile.py"


def _load_module():
    spec = importlib.util.spec_from_file_location("engine_host_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("drafter", ["uniform", "dspark"])
def test_both_phases_are_timed_and_profiled(tmp_path, drafter):
    out = tmp_path / "profile.json"
    assert _load_module().main(["--target", "k3-tiny", "--device", "cpu", "--context", "12", "--steps", "3",
                                "--warmup", "1", "--al", "3.5", "--k", "3", "--drafter", drafter, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["graphs"] is False and [p["phase"] for p in result["phases"]] == ["plain", "al3.5"]
    assert result["drafter"] == drafter
    for phase in result["phases"]:
        assert phase["steps"] == 3 and phase["step_us"] > 0 and phase["host_us"] == phase["step_us"]
        # eager: no replay, so none of the parts around it, and no step launched ahead
        assert phase["replay_call_us"] is None and phase["launch_us"] is None and "graph_gpu_us" not in phase
        assert phase["launch_ahead"] is False and phase["steps_launched_ahead"] == 0
        assert phase["light"]["step_us"] > 0 and phase["light"]["launch_us"] is None
        top = phase["python_top"]
        own = [r["own_us"] for r in top]
        assert len(top) == 25 and own == sorted(own, reverse=True) and min(own) >= 0
        assert all(r["cumulative_us"] >= r["own_us"] and r["calls_per_step"] > 0 for r in top)


def test_a_bad_option_is_one_line(tmp_path, capsys):
    assert _load_module().main(["--al", "9", "--k", "7", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--al=9.0" in err
    assert not (tmp_path / "x.json").exists()


def test_a_dspark_drafter_for_a_target_without_a_preset_is_one_line(tmp_path, capsys):
    assert _load_module().main(["--target", "toy", "--device", "cpu", "--context", "4", "--drafter", "dspark",
                                "--k", "3", "--al", "2", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--drafter=dspark" in err and "vocabulary 64" in err


def test_only_waits_inside_the_readback_count_against_it():
    """A wait outside PendingStep.result (a staging buffer's) is the step's but not the readback's:
    readback_host_us = readback less the waits inside it. With both waits counted against the
    readback it went negative (experiments/notes/step.md)."""
    import time

    clock = _load_module().StepClock()
    wait = clock.timed("wait", lambda seconds: time.sleep(seconds))
    readback = clock.timed("readback", lambda: wait(0.02))
    for _ in range(3):
        clock.current = {"start": time.perf_counter()}
        wait(0.03)
        readback()
        clock.current["end"] = time.perf_counter()
        clock.steps.append(clock.current)
    summary = clock.summary()
    assert summary["wait_us"] >= 50_000 and 20_000 <= summary["readback_wait_us"] < 30_000
    assert 0 <= summary["readback_host_us"] < 5_000
    assert summary["host_us"] < 5_000
