"""experiments/comm_bench.py on the CPU: the gloo backend with 2 processes runs every collective
of the benchmark, checks each result against its definition (inside the benchmark: a wrong sum,
a wrong peer or a misrouted row fails the run), and writes a JSON the roofline reads. The
timings mean nothing here; the code path is what is tested."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark import roofline as rf
from dspark.targets.kimi_k3.config import K3

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "comm_bench.py"


def _load_module():
    spec = importlib.util.spec_from_file_location("comm_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.long
@pytest.mark.timeout(180)
def test_gloo_run_covers_every_collective_and_feeds_the_roofline(tmp_path):
    out = tmp_path / "results" / "comm_bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "gloo", "--world-sizes", "2", "--tokens", "8",
         "--samples", "2", "--calls", "1", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=170, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["schema"] == "dspark.comm_bench/1" and data["backend"] == "gloo"
    assert data["env"]["NCCL_NVLS_ENABLE"] == "0" and {"torch", "commit", "command"} <= set(data)
    assert [p.name for p in out.parent.iterdir()] == ["comm_bench.json"]  # no temp file left behind
    rows = {(r["what"], r.get("routing")): r for r in data["rows"]}
    assert set(rows) == {("all_reduce", None), ("all_gather", None), ("reduce_scatter", None), ("logits", None),
                         ("EP dispatch", "uniform"), ("EP combine", "uniform"),
                         ("EP dispatch", "skewed"), ("EP combine", "skewed")}
    assert rows[("all_reduce", None)]["bytes"] == 8 * 7168 * 2
    assert rows[("logits", None)]["bytes"] == 8 * 163840 * 2
    dispatch = rows[("EP dispatch", "uniform")]
    assert dispatch["bytes"] == max(dispatch["rows_sent"]) * 3584 * 2
    for r in data["rows"]:
        assert r["world_size"] == 2 and r["mode"] == "eager" and r["T"] == 8
        assert 0 < r["median_us"] <= r["p90_us"] and r["busbw_GBps"] > 0
    table = rf.MeasuredComm(str(out))
    assert table.latency("all_reduce", 8 * 7168 * 2, 2) == pytest.approx(rows[("all_reduce", None)]["median_us"] * 1e-6)
    assert str(out) in table.describe(2)


def test_dispatch_plan_matches_a_direct_count_and_the_roofline():
    bench = _load_module()
    seed = int(torch.randint(0, 2**31 - 1, ()))
    world, tokens = 4, 8
    experts = bench.route(tokens, "uniform", seed)
    assert experts.shape == (tokens, 16) and all(len(set(row)) == 16 for row in experts.tolist())
    counts = bench.dispatch_counts(experts, world)
    per_rank = 896 // world
    for src in range(world):
        for dst in range(world):
            direct = sum(1 for t in range(tokens) if t % world == src and dst != src
                         and any(e // per_rank == dst for e in experts[t].tolist()))
            assert counts[src, dst] == direct
    # Averaged over many routings, the rows a rank sends match the roofline's expectation. With 8
    # ranks each owns one of the 8 tokens and reaches 7 x (1 - (7/8)^16) ~ 6.2 others; the
    # standard error over 300 x 8 tokens is ~0.02, so 0.1 is a 5-sigma bound.
    world = 8
    sent = [bench.dispatch_counts(bench.route(tokens, "uniform", seed + i), world).sum(1).float().mean()
            for i in range(300)]
    expected = rf.dispatch_bytes(K3, tokens, world, 1.0)
    assert abs(float(torch.stack(sent).mean()) - expected) < 0.1, expected


def test_skewed_routing_loads_the_low_ranks():
    bench = _load_module()
    counts = bench.dispatch_counts(bench.route(64, "skewed", int(torch.randint(0, 2**31 - 1, ()))), 8)
    received = counts.sum(0)
    assert received[:2].sum() > received[-2:].sum()
    with pytest.raises(ValueError, match="routing"):
        bench.route(1, "zipf", 0)
