"""The `dspark` command line: generate end to end, clear errors, the sweep main job's plumbing."""
import json

from dspark.cli import main


def test_generate_plain_and_speculative_agree(capsys):
    args = ["generate", "--target", "k3-tiny", "--prompt-ids", "5,9,5,9,5,9", "--max-tokens", "10", "--max-seq-len", "64", "--json"]
    assert main(args + ["-k", "0"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["-k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert plain["outputs"][0]["token_ids"] == spec["outputs"][0]["token_ids"]
    assert len(spec["outputs"][0]["token_ids"]) == 10 and spec["metrics"]["acceptance_length"] >= 1.0


def test_generate_text_output(capsys):
    assert main(["generate", "--target", "toy", "--prompt-ids", "1,2,3", "--max-tokens", "5", "-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "acceptance length" in out and "tokens/s" in out


def test_bad_input_is_one_clear_line(capsys):
    assert main(["generate", "--target", "k3-huge", "--prompt-ids", "1"]) == 2
    assert "target='k3-huge'" in capsys.readouterr().err
    assert main(["generate", "--target", "toy", "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids '1,x'" in capsys.readouterr().err
    assert main(["generate", "--target", "toy", "--prompt-ids", "1", "--top-p", "0"]) == 2
    assert "dspark generate: error: SamplingParams.top_p=0.0" in capsys.readouterr().err
    assert main(["nonsense"]) == 2


def test_sweep_writes_resumable_results(tmp_path, capsys):
    args = ["sweep", "--target", "toy", "--batch", "1", "--k", "3", "--al", "1,2.5,4", "--context", "8",
            "--max-tokens", "12", "--warmup-steps", "1", "--per-point", "--out", str(tmp_path)]
    assert main(args) == 0
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["schema"] == "dspark.sweep/1" and {"device", "torch", "git_commit", "command"} <= set(data["meta"])
    assert [p["al_target"] for p in data["points"]] == [None, 1.0, 2.5, 4.0]
    assert (tmp_path / "sweep.csv").exists() and (tmp_path / "sweep.png").stat().st_size > 0
    first = data["points"]
    assert main(args) == 0  # everything done: resumes by skipping every point
    assert json.loads((tmp_path / "sweep.json").read_text())["points"] == first


def test_default_sweep_measures_phases_on_one_prefill(tmp_path):
    args = ["sweep", "--target", "toy", "--batch", "1,2", "--k", "3", "--al", "1,4", "--context", "8",
            "--phase-steps", "3", "--out", str(tmp_path)]
    assert main(args) == 0
    points = json.loads((tmp_path / "sweep.json").read_text())["points"]
    assert sorted(p["key"] for p in points) == sorted(
        f"b{b}-k{k}-fixed-{al}" for b in (1, 2) for k, al in ((0, "plain"), (3, "al1"), (3, "al4")))
    assert all(p["steps"] == 3 for p in points)
    assert {p["key"]: p["al_measured"] for p in points}["b2-k3-fixed-al4"] == 4.0


def test_policy_sweep_with_calibrated_synthetic_confidences(tmp_path):
    import csv

    args = ["sweep", "--target", "toy", "--batch", "2", "--k", "4", "--al", "2.5", "--context", "8", "--max-tokens", "16",
            "--warmup-steps", "1", "--per-point", "--policy", "fixed,threshold,scheduler", "--out", str(tmp_path)]
    assert main(args) == 0
    points = {p["key"]: p for p in json.loads((tmp_path / "sweep.json").read_text())["points"]}
    assert {"b2-k4-fixed-al2.5", "b2-k4-threshold-al2.5", "b2-k4-scheduler-al2.5"} <= set(points)
    # AL 2.5 at k=4 has conditional rates [1, 0.5, 0, 0]: the threshold policy (default 0) keeps
    # every draft, the scheduler never admits the positions that cannot be accepted.
    assert len(points["b2-k4-scheduler-al2.5"]["per_position_acceptance"]) <= 2
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert rows and all(r["git_commit"] and r["torch"] and r["command"] for r in rows)


def test_k_is_spelled_both_ways_on_every_command_that_takes_it():
    """-k and --k on generate, sweep, roofline and vllm-config, parsed to the same value."""
    from dspark import cli

    dests = {"generate": "num_speculative_tokens", "vllm-config": "num_speculative_tokens", "sweep": "k", "roofline": "k"}
    for name, dest in dests.items():
        parser = cli.build_parser(name)
        for spelling in ("-k", "--k"):
            assert str(getattr(parser.parse_args([name, spelling, "5"]), dest)) == "5", (name, spelling)


def test_k_flags_through_the_command_line(tmp_path, capsys):
    assert main(["vllm-config", "--k", "4", "--no-validate"]) == 0
    assert json.loads(capsys.readouterr().out)["num_speculative_tokens"] == 4
    args = ["sweep", "--target", "toy", "--batch", "1", "--al", "1,3", "--context", "8", "--phase-steps", "2",
            "--out", str(tmp_path)]
    assert main(args + ["-k", "2"]) == 0
    assert {p["k"] for p in json.loads((tmp_path / "sweep.json").read_text())["points"]} == {0, 2}


def test_generate_takes_a_vllm_speculative_config(capsys):
    base = ["generate", "--target", "k3-tiny", "--prompt-ids", "5,9,5,9,5,9", "--max-tokens", "8", "--max-seq-len", "64",
            "--json"]
    assert main(base + ["-k", "3", "--prompt-lookup-min", "1", "--prompt-lookup-max", "4"]) == 0
    by_flags = json.loads(capsys.readouterr().out)
    vllm_json = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}'
    assert main(base + ["--speculative-config", vllm_json]) == 0
    by_config = json.loads(capsys.readouterr().out)
    assert by_config["outputs"][0]["token_ids"] == by_flags["outputs"][0]["token_ids"]
    assert by_config["metrics"]["steps"] == by_flags["metrics"]["steps"]
    assert main(base + ["-k", "3", "--speculative-config", vllm_json]) == 2
    err = capsys.readouterr().err
    assert "--speculative-config and --num-speculative-tokens: give the settings one way" in err
    assert main(base + ["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}']) == 2
    assert "method='eagle3'" in capsys.readouterr().err
    assert main(base + ["-k", "3", "--rejection-sample-method", "block"]) == 2
    assert "block verification is vLLM-only" in capsys.readouterr().err


def test_sweep_takes_a_vllm_speculative_config(tmp_path, capsys):
    args = ["sweep", "--target", "toy", "--batch", "1", "--context", "8", "--phase-steps", "2", "--out", str(tmp_path)]
    config = ('{"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic", '
              '"synthetic_acceptance_length": 2.5}')
    assert main(args + ["--speculative-config", config]) == 0
    points = json.loads((tmp_path / "sweep.json").read_text())["points"]
    assert sorted((p["k"], p["al_target"]) for p in points if p["k"]) == [(3, 2.5)]
    assert main(args + ["--k", "4", "--speculative-config", config]) == 2
    assert "--k 4 and --speculative-config (which sets it to 3)" in capsys.readouterr().err
    assert main(args + ["--drafter-path", "/some/drafter"]) == 2
    assert "only --backend vllm uses it" in capsys.readouterr().err


# ---- errors as a user sees them: one line on stderr, exit 2, no traceback --------------------


def _run_cli(*args):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "dspark.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _assert_one_line_error(args, code, stderr, command, *needles):
    """`dspark args` exited 2 with one line on stderr, `dspark <command>: error: ...` naming every needle."""
    lines = stderr.strip().splitlines()
    assert code == 2 and "Traceback" not in stderr, (args, stderr)
    assert len(lines) == 1 and lines[0].startswith(f"dspark {command}: error: "), (args, stderr)
    assert all(n in lines[0] for n in needles), (args, lines[0])


def test_cli_errors_are_one_line_on_stderr(tmp_path, capsys):
    """A refused value is one line on stderr, exit 2, no traceback. Three cases run as a real process (one
    through the target's build, with every import's own stderr; one argparse's; an unknown command); the
    others through main() in this process, where a subprocess would add ~5 s of imports each."""
    in_process = [
        (["generate", "--target", "toy", "--max-seq-len", "8", "-k", "7"], "generate",
         ["num_speculative_tokens=7", "at most 6", "max_seq_len=8"]),
        (["generate", "--target", "toy", "--temperature", "1e-31"], "generate", ["temperature=1e-31"]),
        (["generate", "--target", "toy", "--drafter", "dspark", "--drafter-path", str(tmp_path / "missing")],
         "generate", [str(tmp_path / "missing")]),
        (["sweep", "--target", "toy", "--k", "7", "--al", "9"], "sweep", ["--al 9"]),
    ]
    for args, command, needles in in_process:
        code = main(args)
        _assert_one_line_error(args, code, capsys.readouterr().err, command, *needles)
    processes = [
        (["generate", "--target", "toy", "-k", "1000000"], "generate", ["num_speculative_tokens=1000000", "[0, 64]"]),
        (["generate", "--target", "toy", "--max-tokens", "x"], "generate", ["--max-tokens", "'x'"]),
        (["nonsense"], None, ["unknown command 'nonsense'"]),
    ]
    for args, command, needles in processes:
        result = _run_cli(*args)
        if command is None:
            assert result.returncode == 2 and result.stderr.startswith("dspark: error: unknown command 'nonsense'")
            continue
        _assert_one_line_error(args, result.returncode, result.stderr, command, *needles)


def test_per_request_errors_go_to_stderr():
    # The toy target's vocabulary is 64: the second prompt fails alone, the first is decoded.
    result = _run_cli("generate", "--target", "toy", "--prompt-ids", "1,2,3", "--prompt-ids", "1,99", "--max-tokens", "4")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == ("dspark generate: error: request 1: prompt token id 99 is outside the "
                                     "vocabulary [0, 64)")
    assert "[0] [" in result.stdout and "99" not in result.stdout and "acceptance length" in result.stdout
    alone = _run_cli("generate", "--target", "toy", "--prompt-ids", "1,99")
    assert alone.returncode == 2 and "tokens/s" not in alone.stdout
    assert alone.stderr.startswith("dspark generate: error: request 0: prompt token id 99")


def test_handler_turns_file_errors_into_one_line(monkeypatch, capsys):
    import types

    from dspark import cli

    def missing(args):
        open("/nonexistent/dspark/config.json")

    fake = types.SimpleNamespace(configure_parser=lambda p: None, main=missing)
    monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_module", "a test command"))
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: fake)
    assert cli.main(["fake"]) == 2
    assert capsys.readouterr().err == "dspark fake: error: /nonexistent/dspark/config.json: No such file or directory\n"


def test_train_drafter_defaults_to_the_targets_context(monkeypatch, tmp_path):
    """k3-tiny's limit is 1024 tokens: the default --max-seq-len must not ask for more."""
    import pytest

    import dspark.build

    seen = {}

    class Stop(Exception):
        pass

    def record(name, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(dspark.build, "build_target", record)
    out = str(tmp_path / "drafter")
    for target, want in (("k3-tiny", 1024), ("toy", 4096)):
        with pytest.raises(Stop):
            main(["train-drafter", "--target", target, "--drafter", "k3-tiny_dspark", "--out", out])
        assert seen["max_seq_len"] == want
    with pytest.raises(Stop):
        main(["train-drafter", "--target", "k3-tiny", "--drafter", "k3-tiny_dspark", "--out", out, "--max-seq-len", "512"])
    assert seen["max_seq_len"] == 512


def test_the_dispatcher_lists_every_command_and_imports_only_the_one_run(capsys):
    import sys

    from dspark import cli

    assert main(["--help"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in cli.COMMANDS)
    sys.modules.pop("dspark.vllm.export", None)
    cli.build_parser("generate")
    assert "dspark.vllm.export" not in sys.modules  # export-drafter's module stays unimported
