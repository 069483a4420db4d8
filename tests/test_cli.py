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
