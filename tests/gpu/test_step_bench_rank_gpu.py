"""experiments/step_bench.py on k3-rank (docs/kimi-k3.md §8), its first two layers at a short
context: the JSON row of every point carries the step's time, both floors, the kernels per layer
and a split by op class that accounts for every kernel of the profiled step; the routed-expert
count is the busiest rank's (3 at one token, 12 at eight)."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "step_bench.py"


def test_rank_bench_rows(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("step_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rank.json"
    assert bench.main(["--target", "k3-rank", "--layers", "2", "--batch", "1", "--context", "1024",
                       "--tokens", "1,8", "--steps", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["layers"] == 2 and result["shard"] == {"rank": 0, "world": 16} and "collectives omitted" in result["note"]
    rows = {row["T"]: row for row in result["rows"]}
    assert set(rows) == {1, 8}
    for T, experts in ((1, 3), (8, 12)):
        row = rows[T]
        assert row["routed_experts_per_layer"] == [experts]
        assert row["mode"] == "graph" and row["ms"] == row["graph_ms"] > 0
        assert 0 < row["floor_fraction"] and 0 < row["floor_uniform_fraction"]
        assert row["kernels_per_layer"] == row["launches"] / 2
        assert sum(c["kernels"] for c in row["by_class"].values()) == row["launches"]
        assert row["by_class"]["experts"]["kernels"] > 0 and row["by_class"]["KDA"]["kernels"] > 0
        print(T, row["attribution"], {k: v["kernels"] for k, v in row["by_class"].items()})
