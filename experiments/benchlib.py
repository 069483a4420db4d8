"""What every GPU benchmark here shares: CUDA-event timing (eager and CUDA-graph replay), the
pure-read ceiling measured in the same run, and the provenance block of a result JSON.

Method (docs/kernels.md §7): warm up first (compiles, cuBLAS
heuristics, the allocator), rotate enough input copies that L2 does not serve them, take the
median over repeats. A verify step runs as a CUDA graph, so `graph_us` is the number that
matters; `eager_us` adds whatever host overhead exceeds the GPU time.
"""
import collections
import contextlib
import json
import os
import statistics
import sys

import torch

from dspark.files import write_atomic
from dspark.provenance import module_version
from dspark.provenance import provenance as common_provenance


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


def warm_up_on_side_stream(fn) -> None:
    """One eager run of fn on a side stream, then a device synchronise: what CUDA-graph capture
    needs first (kernels compiled, workspaces allocated, the capture stream not the default one)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def time_calls(calls, reps: int, repeats: int = 15, graph: bool = True) -> dict:
    """Per-call microseconds of `calls` (run in rotation, `reps` calls per timing), as a
    CUDA-graph replay and eagerly. A failed capture is reported and leaves graph_us None."""

    def run_all():
        for i in range(reps):
            calls[i % len(calls)]()

    for _ in range(3):
        run_all()
    torch.cuda.synchronize()
    eager_us = median_event_ms(run_all, repeats) * 1e3 / reps
    graph_us = None
    if graph:
        try:
            warm_up_on_side_stream(run_all)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                run_all()
            cuda_graph.replay()
            torch.cuda.synchronize()
            graph_us = median_event_ms(cuda_graph.replay, repeats) * 1e3 / reps
        except Exception as exc:
            print(f"  graph capture failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return {"graph_us": graph_us, "eager_us": eager_us}


def read_ceiling(gib: float = 4.0) -> dict:
    """Pure-read bandwidth over a large bf16 buffer (torch reductions and a cuBLAS GEMV: read
    once, tiny output), and a device-to-device copy (bytes read + written) for comparison."""
    result = _measure_reads(int(gib * 2**30) // 2)
    result["read_ceiling_GBps"] = max(result[f"{k}_bf16_GBps"] for k in ("sum", "amax", "gemv"))
    torch.cuda.empty_cache()  # the buffers died with _measure_reads
    return result


def _measure_reads(numel: int) -> dict:
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
        result[name + "_GBps"] = numel * 2 / median_event_ms(fn, 20) / 1e6
    dst = torch.empty_like(buf)
    result["d2d_copy_rw_GBps"] = 2 * numel * 2 / median_event_ms(lambda: dst.copy_(buf), 20) / 1e6
    return result


def provenance(commit: str | None = None) -> dict:
    """dspark.provenance's block (device, versions, commit, command, time) for the first GPU,
    plus what a kernel benchmark also depends on: SM count, L2 size, CuTe DSL and Triton."""
    props = torch.cuda.get_device_properties(0)
    return common_provenance("cuda:0", commit, sms=props.multi_processor_count,
                             l2_bytes=getattr(props, "L2_cache_size", None),
                             cutlass_dsl=module_version("cutlass"), triton=module_version("triton"))


def write_json(path: str, result: dict) -> None:
    """Write (and rewrite, after each part, so a cut-off run keeps what it measured); atomically,
    so a run killed mid-write leaves the previous version, never a torn file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, json.dumps(result, indent=1))


def largest_by_name(launches, top: int) -> list[dict]:
    """The `top` largest of a profile's device launches by kernel name: calls and microseconds (what
    a step's or a call's time goes to)."""
    totals, counts = collections.Counter(), collections.Counter()
    for event in launches:
        totals[event.name] += event.time_range.elapsed_us()
        counts[event.name] += 1
    return [{"name": name[:160], "calls": counts[name], "us": round(us, 1)} for name, us in totals.most_common(top)]


@contextlib.contextmanager
def switched(setting: str, switches: dict):
    """Run under one comma-separated setting ('' = the defaults): `key=value` with key in `switches`
    (name -> (module, attribute, {value: what the attribute is set to})) sets that module attribute
    for the block; any other `op=implementation` forces a kernel (registry.use). Everything is
    restored after. An unknown value of a switch is a SystemExit naming it."""
    import importlib

    from dspark.kernels import registry

    restore, forced = [], []
    try:
        for item in filter(None, (part.strip() for part in setting.split(","))):
            key, _, value = item.partition("=")
            if key in switches:
                module_name, attribute, allowed = switches[key]
                if value not in allowed:
                    raise SystemExit(f"--setting {setting!r}: {key}={value!r} is not a valid value")
                module = importlib.import_module(module_name)
                restore.append((module, attribute, getattr(module, attribute)))
                setattr(module, attribute, allowed[value])
            else:
                registry.use(key, value)
                forced.append(key)
        yield
    finally:
        for module, attribute, value in reversed(restore):
            setattr(module, attribute, value)
        for op in forced:
            registry.use(op, None)
