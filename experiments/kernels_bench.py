"""Skinny-GEMM bandwidth on the GPU: a pure-read ceiling, cuBLAS (torch.mm) and the CuTe DSL
Hopper kernel (kernels/linear/cute_sm90.py) at every Kimi K3 trunk shape and M in {1,2,4,8,16}.

Method (docs/kernels.md §11, §7 row 1): weights are bf16 random normal; enough weight copies
rotate that their total is >= 4x the L2, so every call streams its weight from HBM; CUDA events;
warm-up first; median over repeats. Two timings per implementation:
  graph  - `reps` calls captured in one CUDA graph, time per call = replay time / reps
           (the verify step runs as a graph, so this is the number that matters);
  eager  - the same calls launched from Python (adds host overhead where it exceeds GPU time).
GB/s counts the weight bytes read once (N*K*2); x, y and split-K partials are ignored.
Our kernel is timed in several variants (VARIANTS below), the defaults first.

Usage: python experiments/kernels_bench.py [--out experiments/results/h200/kernels_bench.json]
"""
import argparse
import json
import math
import sys
import time

import torch

from benchlib import provenance, read_ceiling, time_calls, write_json
from dspark.kernels import cute_common
from dspark.kernels.linear import cute_host, cute_sm90

TOKEN_COUNTS = (1, 2, 4, 8, 16)
# Kernel variants timed side by side (compile_skinny_gemm options); the first is the default.
# Run 2 (commit d522655) timed: cute_sm90 = fused reduction + 4 stages, cute_sm90_5st = fused + 5,
# cute_sm90_2pass = two-pass + 5 stages, cute_sm90_nosplit = no split-K + 4 stages; the defaults
# were then set from those numbers (cute_sm90.choose_splits / choose_stages, two-pass reduction).
VARIANTS = {
    "cute_sm90": dict(),  # the defaults
    "cute_sm90_fused": dict(stages=4, fused_reduce=True),
    "cute_sm90_nosplit": dict(stages=4, splits=1),  # what split-K buys
}


def bench_shape(name, n, k, l2_bytes, arch, ceiling):
    weight_bytes = n * k * 2
    copies = max(3, math.ceil(4 * l2_bytes / weight_bytes))
    weights = [(torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(copies)]
    rows = []
    for m in TOKEN_COUNTS:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        reps = max(30, copies)
        reps = math.ceil(reps / copies) * copies
        outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        row = {"shape": name, "N": n, "K": k, "M": m, "weight_copies": copies}
        # cuBLAS
        cublas_calls = [lambda w=w, o=o: torch.mm(x, w.t(), out=o) for w, o in zip(weights, outs)]
        row["cublas"] = time_calls(cublas_calls, reps)
        # ours: the default (fused split-K reduction, 4 stages) and the variants it is compared with
        for label, options in VARIANTS.items():
            try:
                compiled, splits = cute_sm90.compile_skinny_gemm(
                    n, k, cute_host.token_tile(m), torch.bfloat16, arch, **options
                )
                workspace = torch.empty((splits, m, n), dtype=torch.float32, device="cuda")
                counters = cute_host.split_counters(x.device, n)
                ours_calls = [
                    lambda w=w, o=o: compiled(x, w, o, workspace, counters) for w, o in zip(weights, outs)
                ]
                row.setdefault("splits", splits)  # the default variant's (first in VARIANTS)
                row[label] = time_calls(ours_calls, reps)
                # spot-check the result of the last call against cuBLAS
                ref = torch.mm(x, weights[0].t()).float()
                outs[0].fill_(float("nan"))  # poison: an unwritten element must show
                compiled(x, weights[0], outs[0], workspace, counters)
                torch.cuda.synchronize()
                row[label]["rel_err_vs_cublas"] = ((outs[0].float() - ref).norm() / ref.norm()).item()
            except Exception as exc:
                row[label] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"  {name} M={m} {label} failed: {row[label]['error']}", file=sys.stderr)
        for impl in ("cublas", *VARIANTS):
            r = row.get(impl, {})
            for mode in ("graph", "eager"):
                us = r.get(f"{mode}_us")
                if us:
                    r[f"{mode}_GBps"] = weight_bytes / us / 1e3
                    r[f"{mode}_frac_of_ceiling"] = r[f"{mode}_GBps"] / ceiling
        rows.append(row)
        print(json.dumps(row), flush=True)
    del weights
    torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/h200/kernels_bench.json")
    parser.add_argument("--commit", default=None, help="git commit of the tree (if git is not available here)")
    parser.add_argument("--shapes", default=None, help="comma-separated subset of shape names")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 * 2**20)
    arch = cute_common.target_arch()
    started = time.time()
    ceiling = read_ceiling()
    print(json.dumps(ceiling), flush=True)
    shapes = cute_host.K3_TRUNK_SHAPES
    if args.shapes:
        shapes = {s: shapes[s] for s in args.shapes.split(",")}
    rows = []
    result = {**provenance(args.commit), "seconds": 0.0, "ceiling": ceiling, "rows": rows}
    for name, (n, k) in shapes.items():
        rows += bench_shape(name, n, k, l2_bytes, arch, ceiling["read_ceiling_GBps"])
        result["seconds"] = time.time() - started
        write_json(args.out, result)  # after every shape, so a cut-off run keeps what it measured

    c = ceiling["read_ceiling_GBps"]
    print(f"\nread ceiling {c:.0f} GB/s (sum {ceiling['sum_bf16_GBps']:.0f}, amax {ceiling['amax_bf16_GBps']:.0f}, "
          f"gemv {ceiling['gemv_bf16_GBps']:.0f}); "
          f"d2d copy {ceiling['d2d_copy_rw_GBps']:.0f} GB/s r+w. Graph-replay GB/s of weights (eager in brackets):")
    print(f"{'shape':20s} {'N x K':>12s} {'M':>2s} {'sp':>2s} {'cuBLAS':>11s} {'cute_sm90':>11s} {'fused':>5s} {'nospl':>5s} {'ours/ceil':>9s} {'ours/cuBLAS':>11s}")

    def gbps(r, mode):
        v = r.get(f"{mode}_GBps") if isinstance(r, dict) else None
        return v or 0.0

    for row in rows:
        cb, ours = row["cublas"], row.get("cute_sm90", {})
        fused, nosplit = row.get("cute_sm90_fused", {}), row.get("cute_sm90_nosplit", {})
        print(
            f"{row['shape'][:20]:20s} {row['N']:>6d}x{row['K']:<5d} {row['M']:>2d} {row.get('splits', 0):>2d} "
            f"{gbps(cb, 'graph'):4.0f} ({gbps(cb, 'eager'):4.0f}) {gbps(ours, 'graph'):4.0f} ({gbps(ours, 'eager'):4.0f}) "
            f"{gbps(fused, 'graph'):5.0f} {gbps(nosplit, 'graph'):5.0f} {gbps(ours, 'graph') / c:9.2f} "
            f"{gbps(ours, 'graph') / max(gbps(cb, 'graph'), 1e-9):11.2f}"
        )


if __name__ == "__main__":
    main()
