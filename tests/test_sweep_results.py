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
def test_bad_grid_refused_before_anything_runs(tmp_path, capsys, args, needles):
    # In-process (the one-line errors of a fresh interpreter: tests/test_cli.py)
    assert main(["sweep", "--target", "toy", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert_one_line_error(subprocess.CompletedProcess([], 2, "", err), "sweep", *needles)
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


def _points_with_floor(fraction: float) -> list[dict]:
    pts = [{"key": "plain", "batch": 1, "k": 0, "al_target": None, "al_measured": 1.0, "tokens_per_s": 100.0,
            "tokens_per_s_std": 1.0, "roofline_fraction": fraction}]
    for al in (1.0, 2.0, 4.0):
        pts.append({"key": f"al{al}", "batch": 1, "k": 3, "al_target": al, "al_measured": al, "tokens_per_s": 90.0 * al,
                    "tokens_per_s_std": 2.0, "roofline_fraction": fraction * (1 + al / 10),
                    "floor_device": "a GPU at 4000 GB/s"})
    return pts


@pytest.mark.parametrize("fraction", [0.8, 0.0005])
def test_the_floor_is_its_own_line_where_it_shares_the_scale_and_a_note_elsewhere(fraction):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dspark.sweep import draw_tokens_vs_al

    meta = {"target": "k3-slice", "device_name": "NVIDIA H200", "git_commit": "3a29e22abcdef",
            "created": "2026-12-04T21:32:20+00:00"}
    pts = _points_with_floor(fraction)
    fig = draw_tokens_vs_al([(meta, pts)])
    ax = fig.axes[0]
    assert ax.get_title().startswith("k3-slice on NVIDIA H200, 3a29e22, 2026-12-04")
    floors = [line for line in ax.get_lines() if line.get_label() == "k=3 bandwidth floor"]
    notes = [t.get_text() for t in ax.texts if "off this scale" in t.get_text()]
    twins = [other for other in fig.axes if other is not ax and other.bbox.bounds == ax.bbox.bounds]
    if fraction >= 0.25:
        (floor,) = floors
        want = [p["tokens_per_s"] / p["roofline_fraction"] for p in pts[1:]]
        assert list(floor.get_ydata()) == pytest.approx(want) and floor.get_linestyle() == "--"
        assert len(twins) == 1 and twins[0].get_ylabel().startswith("% of bandwidth floor") and not notes
    else:  # the floor, ~2000x the curve, would flatten it: a note instead, and no % axis saying 0.05%
        assert not floors and not twins and len(notes) == 1
    legend = next(a.get_legend() for a in fig.axes if a.get_legend() is not None)
    assert legend.get_bbox_to_anchor().x0 > ax.get_position().x1 * fig.bbox.width  # right of the panel, off the data
    plt.close(fig)


def test_percentiles_are_nearest_rank_like_before():
    """numpy's inverted_cdf is the nearest-rank percentile the sweep used: always a measured value."""
    import random

    from dspark.sweep import _percentile

    values = [random.random() for _ in range(37)]
    ordered = sorted(values)
    for q in (50, 90, 99):
        assert _percentile(values, q) == ordered[math.ceil(len(values) * q / 100) - 1]


def test_sweep_ticks_once_per_phase(tmp_path, monkeypatch, capsys):
    """2 batch sizes x (plain + 2 ALs) x 2 repeats = 12 phases: 12 ticks (it ticked once per
    (batch, k) before, 2 for the whole sweep)."""
    monkeypatch.setenv("DSPARK_PROGRESS_SECONDS", "1e-9")
    assert main(["sweep", "--target", "toy", "--device", "cpu", "--batch", "1,2", "--k", "3", "--al", "1,4",
                 "--context", "8", "--phase-steps", "2", "--warmup-steps", "1", "--repeats", "2",
                 "--out", str(tmp_path)]) == 0
    ticks = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sweep toy")]
    assert [t.split(": ")[1].split()[0] for t in ticks][:12] == [f"{n}/12" for n in range(1, 13)]
    assert len(json.loads((tmp_path / "sweep.json").read_text())["points"]) == 6
