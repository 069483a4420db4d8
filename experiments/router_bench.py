"""K3's MoE router (moe_route: fp32 logits of a bf16 [896, 7168] weight, sigmoid, top-16) on the
GPU, per call, for the row counts of a verify step (docs/kernels.md §10.6):

- reference: kernels/moe/reference.py (the weight widened to fp32 per call, cuBLAS fp32 GEMM,
  torch selection);
- cublas_fp32+select: the same logits, the selection in one Triton program per token;
- ours: kernels/moe/triton.py, the default on CUDA: bf16 tokens and weight in a cuBLAS bf16 GEMM
  with fp32 output (no widened copy), the same selection;
- floor: the weight's bytes at the pure-read rate measured in the same run.

Method (experiments/benchlib.py): ROUTERS distinct weights rotate so that L2 does not serve them;
CUDA-graph replay, median of repeats. Every variant's experts are checked against the reference
first (the same sets, random logits having no near tie).

Usage: python experiments/router_bench.py --out experiments/results/h200/router_bench.json
"""
import argparse

import torch

from benchlib import provenance, read_ceiling, time_calls, write_json
from dspark.kernels.moe import reference
from dspark.kernels.moe import triton as moe_triton

EXPERTS, WIDTH, TOP_K, SCALING = 896, 7168, 16, 2.827
ROUTERS = 8  # 8 x 12.8 MB of weights: more than the H200's 50 MB L2


def variants() -> dict:
    def fp32_select(x, gate, bias):
        return moe_triton.route_logits(torch.nn.functional.linear(x.float(), gate.float()), bias, TOP_K, SCALING)

    return {"reference": lambda x, gate, bias: reference.moe_route(x, gate, bias, TOP_K, SCALING),
            "cublas_fp32+select": fp32_select,
            "ours": lambda x, gate, bias: moe_triton.moe_route(x, gate, bias, TOP_K, SCALING)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="experiments/results/h200/router_bench.json")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--reps", type=int, default=48, help="calls per timing")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ceiling = read_ceiling()
    rate = ceiling["read_ceiling_GBps"] * 1e9
    gates = [(torch.randn(EXPERTS, WIDTH, device="cuda", generator=gen) / WIDTH**0.5).bfloat16() for _ in range(ROUTERS)]
    biases = [torch.randn(EXPERTS, device="cuda", generator=gen) * 0.1 for _ in range(ROUTERS)]
    found = variants()
    result = {**provenance(), "ceiling": ceiling, "experts": EXPERTS, "width": WIDTH, "top_k": TOP_K,
              "routers_rotated": ROUTERS, "variants": list(found), "rows": []}
    floor_us = gates[0].numel() * gates[0].element_size() / rate * 1e6
    for rows in args.rows:
        xs = [torch.randn(rows, WIDTH, device="cuda", generator=gen).bfloat16() for _ in range(ROUTERS)]
        want = [reference.moe_route(x, g, b, TOP_K, SCALING)[0].sort(-1).values for x, g, b in zip(xs, gates, biases)]
        entry = {"rows": rows, "floor_us": floor_us}
        for name, fn in found.items():
            same = all(torch.equal(fn(x, g, b)[0].sort(-1).values, w) for x, g, b, w in zip(xs, gates, biases, want))
            calls = [lambda x=x, g=g, b=b, fn=fn: fn(x, g, b) for x, g, b in zip(xs, gates, biases)]
            timing = time_calls(calls, args.reps)
            entry[name] = {**timing, "same_experts_as_reference": same}
        best = entry["ours"]["graph_us"]
        entry["floor_over_ours"] = floor_us / best if best else None
        result["rows"].append(entry)
        write_json(args.out, result)
    print(f"{'rows':>5} {'floor us':>9} " + " ".join(f"{name:>28}" for name in found))
    for entry in result["rows"]:
        cells = []
        for name in found:
            t = entry[name]
            us = t["graph_us"] if t["graph_us"] is not None else t["eager_us"]  # a failed capture: eager
            cells.append(f"{us:9.1f} us{'' if t['same_experts_as_reference'] else ' DIFF':5} ({entry['floor_us'] / us:4.0%})")
        print(f"{entry['rows']:5d} {entry['floor_us']:9.1f} " + " ".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    main()
