"""Sweep results: atomic writes, torn files set aside, reuse only of points measured with the same
settings, grid errors refused before anything runs, the vLLM-named result keys."""
import json
import math
import os
import subprocess
import sys

import pytest

from dspark import files
from dspark.cli import main
from dspark.sweep import not_monotonic

BASE = ["sweep", "--target", "toy", "--batch", "1", "--k", "3", "--al", "1,4", "--context", "8",
        "--phase-steps", "3", "--warmup-steps", "1", "--repeats", "2"]


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    i = args.index(flag)
    return args[:i + 1] + [value] + args[i + 2:]


def run_cli(*args):
    """The CLI in a fresh interpreter, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "dspark.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def assert_one_line_error(result, command: str, *needles: str):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dspark {command}: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_points_carry_settings_spread_and_vllm_keys(tmp_path, capsys):
    assert main(BASE + ["--out", str(tmp_path)]) == 0
    assert "measuring 3 points" in capsys.readouterr().out
    data = json.loads((tmp_path / "sweep.json").read_text())
    points = {p["key"]: p for p in data["points"]}
    assert set(points) == {"b1-k0-fixed-plain", "b1-k3-fixed-al1", "b1-k3-fixed-al4"}
    for p in points.values():
        assert p["settings"] == data["meta"]["settings"] and p["settings"]["context"] == 8
        assert p["repeats"] == 2 and len(p["tokens_per_s_repeats"]) == 2
        assert math.isclose(p["tokens_per_s_std"], abs(p["tokens_per_s_repeats"][0] - p["tokens_per_s_repeats"][1]) / 2**0.5)
        assert p["p50_tpot_ms"] <= p["p90_tpot_ms"] <= p["p99_tpot_ms"]
        assert p["spec_decode_acceptance_length"] == p["al_measured"]
    # Forced AL 4 at k = 3: every draft accepted (100 %); AL 1: none (0 %).
    assert points["b1-k3-fixed-al4"]["spec_decode_acceptance_rate"] == 100.0
    assert points["b1-k3-fixed-al1"]["spec_decode_acceptance_rate"] == 0.0
    header = (tmp_path / "sweep.csv").read_text().splitlines()[0].split(",")
    assert {"tokens_per_s_std", "p99_tpot_ms", "spec_decode_acceptance_rate", "git_commit"} <= set(header)
    assert not list(tmp_path.glob(".*.tmp")), "temporary files left behind"


def test_rerun_reuses_matching_points_and_refuses_changed_settings(tmp_path, capsys):
    out = ["--out", str(tmp_path)]
    assert main(BASE + out) == 0
    first = json.loads((tmp_path / "sweep.json").read_text())["points"]
    capsys.readouterr()
    assert main(BASE + out) == 0
    assert "reused 3 of 3 points" in capsys.readouterr().out
    assert json.loads((tmp_path / "sweep.json").read_text())["points"] == first

    before = (tmp_path / "sweep.json").read_bytes()
    assert main(with_flag(BASE, "--context", "12") + out) == 2
    assert "holds points measured with context=8, this run has context=12: pass --resume" in capsys.readouterr().err
    assert (tmp_path / "sweep.json").read_bytes() == before  # refused before anything was written

    assert main(with_flag(BASE, "--repeats", "3") + out + ["--resume"]) == 0
    assert "reused 0 of 3 points" in capsys.readouterr().out
    points = json.loads((tmp_path / "sweep.json").read_text())["points"]
    assert len(points) == 3 and all(p["repeats"] == 3 for p in points)

    assert main(BASE + out + ["--fresh"]) == 0
    assert all(p["repeats"] == 2 for p in json.loads((tmp_path / "sweep.json").read_text())["points"])


def test_changed_settings_through_the_cli(tmp_path):
    assert main(BASE + ["--out", str(tmp_path)]) == 0
    result = run_cli(*with_flag(BASE, "--repeats", "1"), "--out", str(tmp_path))
    assert_one_line_error(result, "sweep", "repeats=2", "repeats=1", "--resume", "--fresh")


def test_old_points_without_settings_are_not_reused_silently(tmp_path, capsys):
    assert main(BASE + ["--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "sweep.json").read_text())
    for p in data["points"]:
        del p["settings"]
    (tmp_path / "sweep.json").write_text(json.dumps(data))
    assert main(BASE + ["--out", str(tmp_path)]) == 2
    assert "target='not recorded', this run has target='toy'" in capsys.readouterr().err


@pytest.mark.parametrize("torn", [b"", b'{"schema": "dspark.sweep/1", "meta": {}, "poi', b"\xff\xfe garbage", b"[1, 2]"])
def test_torn_file_is_set_aside_and_reported(tmp_path, capsys, torn):
    (tmp_path / "sweep.json").write_bytes(torn)
    assert main(BASE + ["--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    aside = list(tmp_path.glob("sweep.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == torn
    assert f"{tmp_path / 'sweep.json'} is not a readable sweep result" in err and aside[0].name in err
    assert len(json.loads((tmp_path / "sweep.json").read_text())["points"]) == 3


@pytest.mark.parametrize("victim", ["sweep.json", "sweep.csv", "sweep.png"])
def test_kill_between_write_and_rename_keeps_the_previous_files(tmp_path, monkeypatch, victim):
    assert main(BASE + ["--out", str(tmp_path)]) == 0
    before = {name: (tmp_path / name).read_bytes() for name in ("sweep.json", "sweep.csv", "sweep.png")}
    real_replace = os.replace

    def killed(src, dst):
        if os.path.basename(dst) == victim:
            assert os.path.getsize(src) > 0  # the new content was written ...
            raise KeyboardInterrupt  # ... and the process dies before the rename
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", killed)
    assert main(BASE + ["--out", str(tmp_path), "--fresh"]) == 130  # the CLI reports the interruption
    assert (tmp_path / victim).read_bytes() == before[victim]
    assert not list(tmp_path.glob(".*.tmp")), "the temporary file must not stay behind"
    monkeypatch.setattr(files.os, "replace", real_replace)
    if victim == "sweep.json":  # the next run reads the intact previous file
        assert main(BASE + ["--out", str(tmp_path)]) == 0


@pytest.mark.parametrize("args,needles", [
    (["--k", "7", "--al", "1,9"], ["--al 9", "[1, 8]", "--k 7"]),
    (["--k", "3,7", "--al", "5"], ["--al 5", "--k 3"]),
    (["--k", "1000000"], ["--k 1000000", "[1, 64]"]),
    (["--k", "0"], ["--k 0"]),
    (["--k", "x"], ["--k 'x'"]),
    (["--al", "1,y"], ["--al '1,y'"]),
    (["--batch", "0"], ["--batch 0"]),
    (["--repeats", "0"], ["--repeats 0"]),
    (["--fresh", "--resume"], ["--fresh and --resume"]),
])
def test_bad_grid_refused_before_anything_runs(tmp_path, args, needles):
    result = run_cli("sweep", "--target", "toy", *args, "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "sweep", *needles)
    assert not (tmp_path / "out").exists()


def test_monotonic_check_uses_the_error_bars():
    def pt(al, tps, std):
        return {"key": f"al{al}", "batch": 1, "k": 3, "al_target": al, "tokens_per_s": tps, "tokens_per_s_std": std}

    assert not_monotonic([pt(1, 100, 5), pt(2, 95, 5), pt(3, 200, 1)]) == []  # a dip within the error
    assert not_monotonic([pt(1, 100, 2), pt(2, 90, 2), pt(3, 200, 1)]) == ["al2"]


def test_grid_longer_than_the_targets_context_names_the_flags(tmp_path):
    result = run_cli("sweep", "--target", "k3-tiny", "--context", "1000", "--k", "3", "--al", "1,2",
                     "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "sweep", "--context 1000", "more than --target k3-tiny takes", "1024")
