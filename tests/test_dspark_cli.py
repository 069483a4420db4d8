"""CLI hooks of `dspark train-drafter` and `dspark calibrate` on k3-tiny (random weights)."""
import argparse
import json

from dspark.drafters.dspark import calibrate, train
from dspark.drafters.dspark.config import DSparkConfig
from dspark_fixtures import one_thread  # noqa: F401 (autouse fixture)


def parse(module, argv):
    parser = argparse.ArgumentParser()
    module.configure_parser(parser)
    return parser.parse_args(argv)


def test_train_then_calibrate_through_the_cli_hooks(tmp_path, capsys):
    out = tmp_path / "drafter"
    args = parse(train, ["--target", "k3-tiny", "--drafter", "k3-tiny_dspark", "--out", str(out), "--steps", "3",
                         "--batch-size", "2", "--num-anchors", "4", "--num-prompts", "4", "--prompt-len", "4",
                         "--gen-len", "8", "--max-seq-len", "64", "--device", "cpu", "--no-progress"])
    assert train.main(args) == 0
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 3
    assert DSparkConfig.load(out).confidence_temperatures is None
    report_path = tmp_path / "report.json"
    args = parse(calibrate, ["--target", "k3-tiny", "--drafter", str(out), "--num-prompts", "2", "--prompt-len", "4",
                             "--max-new-tokens", "16", "--max-seq-len", "64", "--device", "cpu", "--report", str(report_path)])
    assert calibrate.main(args) == 0
    report = json.loads(report_path.read_text())
    temps = DSparkConfig.load(out).confidence_temperatures
    assert temps is not None and list(temps) == report["temperatures"] and len(temps) == 7
    assert {"ece", "auc", "brier"} <= set(report["fit"]["before"]) and report["fit"]["before"]["rounds"] > 0
