"""Skinny-GEMM bandwidth on the GPU: a pure-read ceiling, cuBLAS (torch.mm) and the CuTe DSL
Hopper kernel (kernels/linear/cute_sm90.py) at every Kimi K3 trunk shape and M in {1,2,4,8,16}.

Method (METHOD.md / spec kernels.md §7 row 1): weights are bf16 random normal; enough weight copies
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
import os
import statistics
import subprocess
import sys
import time

import torch

from dspark.kernels import cute_common
from dspark.kernels.linear import cute_sm90

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


def median_event_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_calls(calls, reps: int, repeats: int = 15) -> dict:
    """Per-call microseconds of `calls` (rotated), as a CUDA-graph replay and eagerly."""

    def run_all():
        for i in range(reps):
            calls[i % len(calls)]()

    for _ in range(3):  # warm-up: compiles, cuBLAS heuristics, allocator
        run_all()
    torch.cuda.synchronize()
    eager_us = median_event_ms(run_all, repeats) * 1e3 / reps
    graph_us = None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_all()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_all()
        graph.replay()
        torch.cuda.synchronize()
        graph_us = median_event_ms(graph.replay, repeats) * 1e3 / reps
    except Exception as exc:  # record, keep the eager number
        print(f"  graph capture failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return {"graph_us": graph_us, "eager_us": eager_us}


def read_ceiling(gib: float = 4.0) -> dict:
    """Pure-read bandwidth: torch reductions and a cuBLAS GEMV over a large bf16 buffer (read once,
    tiny output), and a device-to-device copy (bytes read + written) for comparison."""
    numel = int(gib * 2**30) // 2
    buf = torch.randn(numel, device="cuda").to(torch.bfloat16)
    vec = torch.randn(8192, device="cuda").to(torch.bfloat16)
    result = {}
    for name, fn in {
        "sum_bf16": lambda: buf.sum(dtype=torch.float32),
        "amax_bf16": lambda: buf.amax(),
        "gemv_bf16": lambda: torch.mv(buf.view(-1, 8192), vec),
    }.items():
        fn()
        torch.cuda.synchronize()
        ms = median_event_ms(fn, 20)
        result[name + "_GBps"] = numel * 2 / ms / 1e6
    dst = torch.empty_like(buf)
    ms = median_event_ms(lambda: dst.copy_(buf), 20)
    result["d2d_copy_rw_GBps"] = 2 * numel * 2 / ms / 1e6
    result["read_ceiling_GBps"] = max(result[f"{k}_bf16_GBps"] for k in ("sum", "amax", "gemv"))
    del buf, dst
    torch.cuda.empty_cache()
    return result


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
                    n, k, cute_sm90.token_tile(m), torch.bfloat16, arch, **options
                )
                workspace = torch.empty((splits, m, n), dtype=torch.float32, device="cuda")
                counters = cute_sm90.split_counters(x.device, n)
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
    commit = args.commit
    if commit is None:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
        except Exception:
            commit = "unknown"
    import cutlass

    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 * 2**20)
    arch = cute_common.target_arch()
    started = time.time()
    ceiling = read_ceiling()
    print(json.dumps(ceiling), flush=True)
    shapes = cute_sm90.K3_TRUNK_SHAPES
    if args.shapes:
        shapes = {s: shapes[s] for s in args.shapes.split(",")}
    rows = []
    result = {
        "device": torch.cuda.get_device_name(0),
        "sms": props.multi_processor_count,
        "l2_bytes": l2_bytes,
        "torch": torch.__version__,
        "cutlass_dsl": getattr(cutlass, "__version__", "unknown"),
        "commit": commit,
        "command": " ".join(sys.argv),
        "seconds": time.time() - started,
        "ceiling": ceiling,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for name, (n, k) in shapes.items():
        rows += bench_shape(name, n, k, l2_bytes, arch, ceiling["read_ceiling_GBps"])
        result["seconds"] = time.time() - started
        with open(args.out, "w") as f:  # after every shape, so a cut-off run keeps what it measured
            json.dump(result, f, indent=1)

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
