"""experiments/step_bench.py on k3-rank (docs/kimi-k3.md §8), its first four layers at a short
context, batch 1 and 2: the JSON row of every point carries the step's time, both floors, the
kernels per layer, the ops that fell back (never the MLA verify) and a split by op class that
accounts for every kernel of the profiled step exactly once; the routed-expert count is the
busiest rank's (3 at one token, 12 at eight)."""
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
    # layers 0-3: the MLA layer (3) and a MoE layer; B = 2 graphs the MLA verify on a pool of two
    # slots (it fell back to the host-reading reference before the cache became layer-major)
    assert bench.main(["--target", "k3-rank", "--layers", "4", "--batch", "1,2", "--context", "1024",
                       "--tokens", "1,8", "--steps", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["layers"] == 4 and result["shard"] == {"rank": 0, "world": 16} and "collectives omitted" in result["note"]
    rows = {(row["batch"], row["T"]): row for row in result["rows"]}
    assert set(rows) == {(1, 1), (1, 8), (2, 1), (2, 8)}
    for (B, T), row in rows.items():
        assert not any(key.startswith("mla_verify_attention") for key in row["fallbacks"]), row["fallbacks"]
        if B == 1:  # the busiest rank's expert count at 1 and 8 routed tokens, on each of the 3 MoE layers
            assert row["routed_experts_per_layer"] == [{1: 3, 8: 12}[T]] * 3
        assert row["mode"] == "graph" and row["ms"] == row["graph_ms"] > 0
        assert 0 < row["floor_fraction"] and 0 < row["floor_uniform_fraction"]
        assert row["kernels_per_layer"] == row["launches"] / 4
        assert sum(c["kernels"] for c in row["by_class"].values()) == row["launches"]
        assert row["by_class"]["experts"]["kernels"] > 0 and row["by_class"]["KDA"]["kernels"] > 0
        assert row["by_class"]["attention"]["kernels"] > 0
        print(B, T, row["attribution"], row["fallbacks"], {k: v["kernels"] for k, v in row["by_class"].items()})
