"""K3's MoE router (moe_route: fp32 logits of a bf16 [896, 7168] weight, sigmoid, top-16) on the
GPU, per call, for the row counts of a verify step (docs/kernels.md §10.6):

- reference: kernels/moe/reference.py (the weight widened to fp32 per call, cuBLAS fp32 GEMM,
  torch selection);
- cublas_fp32+select: the same logits, the selection in one Triton program per token;
- ours: kernels/moe/triton.py, the default on CUDA: bf16 tokens and weight in a cuBLAS bf16 GEMM
  with fp32 output (no widened copy), the same selection;
- floor: the weight's bytes at the pure-read rate measured in the same run.

Then the two halves apart, as a TP16/EP16 rank runs them (its 56 router rows' logits, gathered, then
the selection over all 896), with the decode-time options of kernels/moe/triton.py:

- logits (`--logits-experts`, default 56 and 896 router rows; rows up to 4): cuBLAS's bf16 GEMM with
  fp32 output (split K plus its reduction kernel at these rows) against router_logits_kernel, one
  launch (GEMV_MAX_ROWS), each beside its weight's read floor;
- selection: route_kernel over 896 logits.

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


def logits_rows(args, gen, rate: float) -> list[dict]:
    """The router's logits alone, cuBLAS against router_logits_kernel, at 1 to GEMV_MAX_ROWS_BUILT rows of
    each --logits-experts count; each one's largest error against float64 recorded and flagged at 1e-4
    (its GPU test's bound). Enough distinct weights rotate that together they are twice the L2 (a rank's
    56 rows are 0.8 MB: 8 of them would be served from L2), so each call reads its weight from HBM."""
    entries = []
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    for experts in args.logits_experts:
        count = max(ROUTERS, -(-2 * l2_bytes // (experts * WIDTH * 2)))
        gates = [(torch.randn(experts, WIDTH, device="cuda", generator=gen) / WIDTH**0.5).bfloat16()
                 for _ in range(count)]
        floor_us = gates[0].numel() * gates[0].element_size() / rate * 1e6
        for rows in range(1, moe_triton.GEMV_MAX_ROWS_BUILT + 1):
            xs = [torch.randn(rows, WIDTH, device="cuda", generator=gen).bfloat16() for _ in range(count)]
            entry = {"experts": experts, "rows": rows, "floor_us": floor_us, "weights_rotated": count}
            for name, fn in (("cublas", lambda x, g: torch.mm(x, g.t(), out_dtype=torch.float32)),
                             ("one_launch", moe_triton.router_logits_gemv)):
                error = max((fn(x, g).double() - x.double() @ g.double().T).abs().max().item() for x, g in zip(xs, gates))
                calls = [lambda x=x, g=g, fn=fn: fn(x, g) for x, g in zip(xs, gates)]
                timing = time_calls(calls, max(args.reps, count))  # every weight once a timing
                entry[name] = {**timing, "max_abs_error": error, "within_1e-4": error < 1e-4}
            ours, theirs = entry["one_launch"]["graph_us"], entry["cublas"]["graph_us"]
            entry["one_launch_over_cublas"] = ours / theirs if ours and theirs else None  # None: a failed capture
            entries.append(entry)
            flags = "".join(f" {name} ERROR {entry[name]['max_abs_error']:.1e}" for name in ("cublas", "one_launch")
                            if not entry[name]["within_1e-4"])
            print(f"logits {experts:4d} x {rows} rows: cublas {theirs} us, one launch {ours} us, floor {floor_us:5.2f} us{flags}")
    return entries


def selection_rows(args, gen) -> list[dict]:
    """route_kernel alone over EXPERTS fp32 logits, at each --rows up to 16."""
    entries = []
    for rows in [r for r in args.rows if r <= 16]:
        logits = [torch.randn(rows, EXPERTS, device="cuda", generator=gen) for _ in range(ROUTERS)]
        bias = torch.randn(EXPERTS, device="cuda", generator=gen) * 0.1
        calls = [lambda x=x: moe_triton.route_logits(x, bias, TOP_K, SCALING) for x in logits]
        entry = {"rows": rows, "selection": time_calls(calls, args.reps)}
        entries.append(entry)
        print(f"selection {rows:2d} rows: {entry['selection']['graph_us']} us")
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="experiments/results/h200/router_bench.json")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--reps", type=int, default=48, help="calls per timing")
    parser.add_argument("--logits-experts", type=int, nargs="+", default=[56, 896],
                        help="router rows of the logits-only comparison (56: a TP16/EP16 rank's)")
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
    result["logits"] = logits_rows(args, gen, rate)
    result["selection"] = selection_rows(args, gen)
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
