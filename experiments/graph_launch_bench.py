"""What the host pays to launch a CUDA graph on this machine, per node, and why the k3-slice step's
graph costs it ~1.2 us per node (step_bench: 186-443 us of host time for replay + readback of
graphs of 152-237 kernels).

Graphs of known make-up are replayed next to the step's own, to separate the candidates:
cudaGraphLaunch's per-node cost here as such (N trivial torch or Triton kernels in a straight
line), the shape of a graph (memcpy nodes; two streams, so not a straight line), the step graph's
own make-up (its node census) and torch's replay wrapper (the same executable graph launched by
cuda.bindings' cudaGraphLaunch). Per graph, medians over --replays replays after --warmup:

- host_us_idle: perf_counter time of graph.replay() alone, the GPU idle before it;
- host_us_busy: the same behind a torch.cuda._sleep of --busy-ms on the stream, so that nothing
  the call does can be waiting for the GPU; busy_held is the fraction of these calls that
  returned before the sleep ended (1.0: every one was timed behind a busy GPU);
- gpu_us: device time of the replay between CUDA events, behind the sleep (no submission
  latency); gpu_us_idle: the same from an idle GPU, which includes waiting for the host;
- direct_host_us_idle, direct_host_us_busy: the same host times for cudaGraphLaunch of
  graph.raw_cuda_graph_exec() (direct_launch says why where they could not be measured);
- census (graph.raw_cuda_graph() read with cuda.bindings; {"error": ...} where it cannot be):
  nodes, by_type, edges, programmatic_edges, roots, max_in_degree, max_out_degree,
  straight_line, and kernel_params (the kernel nodes' parameter bytes, largest by name);
- nodes (the census's, else the number built) and host_us_per_node = host_us_idle / nodes.

Cases (--cases), the synthetic ones for each N in --nodes: torch_add (x.add_(1.0) on 256
floats), triton_add (a 256-element Triton kernel), torch_copy (1 KiB device-to-device copies:
memcpy nodes), torch_add_fork (the adds split over two streams); step: K3Target verify + greedy
acceptance + commit at --batch, --context and each T in --tokens, built as step_bench builds it
and captured by StepGraph. StepGraph keeps no cudaGraph_t, so the step's census reads a second
capture of the same step with keep_graph=True; `recapture` holds that graph's timings, to show it
replays like StepGraph's; `step_bench` holds step_bench.time_graph's numbers (replay + pinned
readback) from this run.

    python experiments/graph_launch_bench.py --out experiments/results/h200/graph_launch_bench.json
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from dspark.cuda_graphs import StepGraph
from dspark.targets.kimi_k3 import K3Model, K3Target, get_preset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import provenance, warm_up_on_side_stream, write_json  # noqa: E402
from step_bench import VerifyStep, _ints, lay_context, time_graph  # noqa: E402

try:
    import cuda.bindings
    from cuda.bindings import driver as cuda_driver
    from cuda.bindings import runtime as cuda_runtime
    BINDINGS_ERROR = None
except Exception as error:  # the timings need none of it: the census and the direct launch say why they are missing
    cuda_driver = cuda_runtime = None
    BINDINGS_ERROR = f"{type(error).__name__}: {error}"

SMALL = 256  # elements per synthetic kernel or copy: each node is as short as the GPU allows
CASES = ("torch_add", "triton_add", "torch_copy", "torch_add_fork", "step")


@triton.jit
def _add_one(ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(ptr + offsets, tl.load(ptr + offsets, mask=mask) + 1.0, mask=mask)


def torch_adds(n: int):
    x = torch.zeros(SMALL, device="cuda")

    def fn():
        for _ in range(n):
            x.add_(1.0)
    return fn


def triton_adds(n: int):
    x = torch.zeros(SMALL, device="cuda")

    def fn():
        for _ in range(n):
            _add_one[(1,)](x, SMALL, BLOCK=SMALL)
    return fn


def copies(n: int):
    src, dst = torch.ones(SMALL, device="cuda"), torch.empty(SMALL, device="cuda")

    def fn():
        for _ in range(n):
            dst.copy_(src)  # same device, dtype and layout: a cudaMemcpyAsync, captured as a memcpy node
    return fn


def forked_adds(n: int):
    x, y = torch.zeros(SMALL, device="cuda"), torch.zeros(SMALL, device="cuda")
    side = torch.cuda.Stream()

    def fn():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(n // 2):
                y.add_(1.0)
        for _ in range(n - n // 2):
            x.add_(1.0)
        torch.cuda.current_stream().wait_stream(side)
    return fn


SYNTHETIC = {"torch_add": torch_adds, "triton_add": triton_adds, "torch_copy": copies, "torch_add_fork": forked_adds}


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn as a graph, after one eager run on a side stream (compiles, allocates), keeping its
    cudaGraph_t for the census where this torch can (keep_graph only defers instantiation)."""
    warm_up_on_side_stream(fn)
    try:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:  # a torch without keep_graph: the census reports that it has no graph to read
        graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def sleep_cycles_per_ms() -> float:
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    return 1e7 / start.elapsed_time(end)


def time_launch(launch, reset, args, sleep_cycles: int) -> dict:
    """Host time of launch() from an idle GPU and behind a busy stream, alternated so that drift
    in clocks or load falls on both alike, and its device time between CUDA events."""
    for _ in range(args.warmup):
        reset()
        launch()
    torch.cuda.synchronize()
    host = {False: [], True: []}
    gpu = {False: [], True: []}
    held = 0
    for _ in range(args.replays):
        for busy in (False, True):
            reset()
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(sleep_cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            launch()
            t1 = time.perf_counter()
            if busy:
                held += not start.query()
            end.record()
            end.synchronize()
            host[busy].append(t1 - t0)
            gpu[busy].append(start.elapsed_time(end))
    return {"host_us_idle": 1e6 * statistics.median(host[False]), "host_us_busy": 1e6 * statistics.median(host[True]),
            "busy_held": held / args.replays,
            "gpu_us": 1e3 * statistics.median(gpu[True]), "gpu_us_idle": 1e3 * statistics.median(gpu[False])}


def direct_launch(graph):
    """cudaGraphLaunch of graph's executable graph on the current stream, torch's replay() bypassed;
    a string saying why where this torch or machine cannot."""
    if cuda_runtime is None:
        return f"unavailable: cuda.bindings: {BINDINGS_ERROR}"
    if not hasattr(graph, "raw_cuda_graph_exec"):
        return "unavailable: torch.cuda.CUDAGraph has no raw_cuda_graph_exec"
    graph_exec, stream = graph.raw_cuda_graph_exec(), torch.cuda.current_stream().cuda_stream

    def launch():
        err, = cuda_runtime.cudaGraphLaunch(graph_exec, stream)
        if err:
            raise RuntimeError(f"cudaGraphLaunch: {err!r}")
    return launch


def _checked(result, what: str) -> list:
    err, *values = result
    if err:
        raise RuntimeError(f"{what}: {err!r}")
    return values


def census(graph) -> dict:
    """The graph's nodes by type, its edges and whether it is one chain: since CUDA 12.6 a
    straight-line graph launches in near-constant host time (NVIDIA's "Constant Time Launch for
    Straight-Line CUDA Graphs"), a graph with branches does not."""
    if cuda_runtime is None:
        return {"error": f"cuda.bindings: {BINDINGS_ERROR}"}
    if not hasattr(graph, "raw_cuda_graph"):
        return {"error": "unavailable: torch.cuda.CUDAGraph has no raw_cuda_graph"}
    try:
        raw = graph.raw_cuda_graph()
        count = _checked(cuda_runtime.cudaGraphGetNodes(raw, numNodes=0), "cudaGraphGetNodes")[-1]
        nodes = _checked(cuda_runtime.cudaGraphGetNodes(raw, numNodes=count), "cudaGraphGetNodes")[0]
        by_type, kernels = collections.Counter(), []
        for node in nodes:
            kind = _checked(cuda_runtime.cudaGraphNodeGetType(node), "cudaGraphNodeGetType")[0]
            by_type[getattr(kind, "name", str(kind)).removeprefix("cudaGraphNodeType").lower()] += 1
            if kind == cuda_runtime.cudaGraphNodeType.cudaGraphNodeTypeKernel:
                kernels.append(node)
        sources, targets, edge_data = _edges(raw)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"[:300]}
    into = collections.Counter(int(node) for node in targets)
    out_of = collections.Counter(int(node) for node in sources)
    max_in, max_out = max(into.values(), default=0), max(out_of.values(), default=0)
    return {"nodes": len(nodes), "by_type": dict(by_type), "edges": len(sources),
            "programmatic_edges": None if edge_data is None else sum(int(d.type) != 0 for d in edge_data),
            "roots": len(nodes) - len(into), "max_in_degree": max_in, "max_out_degree": max_out,
            "straight_line": len(sources) == len(nodes) - 1 and max_in <= 1 and max_out <= 1,
            "kernel_params": kernel_params(kernels)}


def _edges(raw) -> tuple[list, list, list | None]:
    """(from, to, edge data or None) of every edge. cuda-bindings 13 returns the edge data (plain
    or programmatic dependency) from cudaGraphGetEdges, 12.x from cudaGraphGetEdges_v2 only."""
    query = getattr(cuda_runtime, "cudaGraphGetEdges_v2", cuda_runtime.cudaGraphGetEdges)
    count = _checked(query(raw, numEdges=0), "cudaGraphGetEdges")[-1]
    if not count:
        return [], [], []
    values = _checked(query(raw, numEdges=count), "cudaGraphGetEdges")
    return values[0], values[1], values[2] if len(values) == 4 else None


def kernel_params(kernels: list) -> dict:
    """Bytes of each kernel node's parameters (what a launch hands the GPU): CuTe DSL kernels take
    large structs, torch's and Triton's take a few pointers and scalars."""
    try:
        by_function, sizes = {}, []
        for node in kernels:
            params = _checked(cuda_driver.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")[0]
            # a kernel loaded context-independently may come back as a CUkernel with no CUfunction
            handle, is_kernel = (params.func, False) if int(params.func) else (params.kern, True)
            key = int(handle)
            if key not in by_function:
                by_function[key] = {"name": _kernel_name(handle, is_kernel)[:160],
                                    "bytes": _param_bytes(handle, is_kernel), "nodes": 0}
            by_function[key]["nodes"] += 1
            sizes.append(by_function[key]["bytes"])
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"[:300]}
    largest = sorted(by_function.values(), key=lambda f: -f["bytes"])[:8]
    return {"total_bytes": sum(sizes), "max_bytes": max(sizes, default=0),
            "median_bytes": statistics.median(sizes) if sizes else 0, "largest": largest}


def _kernel_name(handle, is_kernel: bool) -> str:
    get_name = cuda_driver.cuKernelGetName if is_kernel else cuda_driver.cuFuncGetName
    name = _checked(get_name(handle), "cuFuncGetName")[0]
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def _param_bytes(handle, is_kernel: bool) -> int:
    """End of the last parameter in the device-side layout; the query fails with INVALID_VALUE
    past the last one."""
    get_info = cuda_driver.cuKernelGetParamInfo if is_kernel else cuda_driver.cuFuncGetParamInfo
    end = 0
    for index in range(4096):
        err, offset, size = get_info(handle, index)
        if err == cuda_driver.CUresult.CUDA_ERROR_INVALID_VALUE:
            return end
        if err:
            raise RuntimeError(f"cuFuncGetParamInfo: {err!r}")
        end = max(end, offset + size)
    return end


def measure(graph, reset, args, sleep_cycles: int, *, census_of=None, built_nodes: int | None = None) -> dict:
    row = time_launch(graph.replay, reset, args, sleep_cycles)  # first: its warm-up instantiates a kept graph
    try:
        launch = direct_launch(graph)
        if isinstance(launch, str):
            row["direct_launch"] = launch
        else:
            timed = time_launch(launch, reset, args, sleep_cycles)
            row["direct_host_us_idle"], row["direct_host_us_busy"] = timed["host_us_idle"], timed["host_us_busy"]
    except Exception as error:
        row["direct_launch"] = f"{type(error).__name__}: {error}"[:300]
    row["census"] = census(graph if census_of is None else census_of)
    row["nodes"] = row["census"].get("nodes", built_nodes)
    row["host_us_per_node"] = row["host_us_idle"] / row["nodes"] if row["nodes"] else None
    return row


def synthetic_row(case: str, n: int, args, sleep_cycles: int) -> dict:
    graph = capture(SYNTHETIC[case](n))
    return {"case": case, "N": n, **measure(graph, lambda: None, args, sleep_cycles, built_nodes=n)}


def step_rows(args, sleep_cycles: int):
    model = K3Model.random(get_preset(args.target), seed=args.seed, dtype=torch.bfloat16, device="cuda")
    # every timed replay starts from the reset length; before a reset, the eager runs (compile, StepGraph's
    # two warm-ups) commit three steps and the next writes a fourth
    target = K3Target(model, max_slots=args.batch, max_seq_len=args.context + 8 * max(args.tokens))
    for T in args.tokens:
        lay_context(target, args.batch, args.context, args.seed)
        step = VerifyStep(target, args.batch, T, args.seed)

        def reset():
            target.lengths[:args.batch] = args.context

        step()  # compile every kernel this shape uses
        graph = StepGraph(step, f"{args.target} B={args.batch} T={T} step")
        reset()
        kept = capture(step)
        reset()
        row = {"case": "step", "target": args.target, "batch": args.batch, "context": args.context, "T": T,
               **measure(graph.graph, reset, args, sleep_cycles, census_of=kept)}
        row["recapture"] = time_launch(kept.replay, reset, args, sleep_cycles)
        row["step_bench"] = time_graph(graph, reset, args.replays)
        del graph, kept
        yield row


def _describe(row: dict) -> str:
    return f"{row['case']} {'N' if 'N' in row else 'T'}={row.get('N', row.get('T'))}"


def _cell(value, width: int, digits: int = 1) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, bool):
        return f"{'yes' if value else 'no':>{width}}"
    return f"{value:>{width}.{digits}f}" if isinstance(value, float) else f"{value:>{width}}"


def print_table(rows: list[dict]) -> None:
    print(f"{'graph':<22} {'nodes':>5} {'kern':>5} {'line':>4} {'host idle':>9} {'host busy':>9} "
          f"{'direct':>9} {'gpu us':>9} {'us/node':>7}  (host times in us)")
    for row in rows:
        c = row["census"]
        print(f"{_describe(row):<22} {_cell(row['nodes'], 5)} {_cell(c.get('by_type', {}).get('kernel'), 5)} "
              f"{_cell(c.get('straight_line'), 4)} {_cell(row['host_us_idle'], 9)} {_cell(row['host_us_busy'], 9)} "
              f"{_cell(row.get('direct_host_us_idle'), 9)} {_cell(row['gpu_us'], 9)} "
              f"{_cell(row['host_us_per_node'], 7, 2)}")


def _cases(text: str) -> list[str]:
    cases = [c.strip() for c in text.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if not cases or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {','.join(CASES)}")
    return cases


def driver_version():
    """The driver's CUDA version (13000 = 13.0), or why it could not be read."""
    if cuda_runtime is None:
        return f"unavailable: cuda.bindings: {BINDINGS_ERROR}"
    try:
        return _checked(cuda_runtime.cudaDriverGetVersion(), "cudaDriverGetVersion")[0]
    except Exception as error:
        return f"{type(error).__name__}: {error}"[:300]


def run(args) -> dict:
    cycles_per_ms = sleep_cycles_per_ms()
    sleep_cycles = int(args.busy_ms * cycles_per_ms)
    result = {**provenance(), "replays": args.replays, "warmup": args.warmup, "busy_ms": args.busy_ms,
              "sleep_cycles_per_ms": cycles_per_ms,
              "cuda_bindings": BINDINGS_ERROR or cuda.bindings.__version__,
              "cuda_driver_version": driver_version(),
              "torch_graph_api": {name: hasattr(torch.cuda.CUDAGraph, name)
                                  for name in ("raw_cuda_graph", "raw_cuda_graph_exec")},
              "rows": []}
    for case in args.cases:
        rows = (step_rows(args, sleep_cycles) if case == "step"
                else (synthetic_row(case, n, args, sleep_cycles) for n in args.nodes))
        for row in rows:
            result["rows"].append(row)
            write_json(args.out, result)
            print(f"{_describe(row)}: host {row['host_us_idle']:.1f} us idle, {row['host_us_busy']:.1f} busy, "
                  f"gpu {row['gpu_us']:.1f} us, nodes {row['nodes']}", flush=True)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=_cases, default=list(CASES), help=f"comma-separated, of {','.join(CASES)}")
    parser.add_argument("--nodes", type=_ints, default=[1, 16, 64, 152, 256], help="N for the synthetic graphs")
    parser.add_argument("--target", default="k3-slice")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--tokens", type=_ints, default=[1, 8], help="T: tokens verified per request")
    parser.add_argument("--replays", type=int, default=50, help="timed replays per graph (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed replays first")
    parser.add_argument("--busy-ms", type=float, default=2.0,
                        help="GPU sleep ahead of each host_us_busy replay; longer than any launch's host time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="experiments/results/h200/graph_launch_bench.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_launch_bench: needs a CUDA device", file=sys.stderr)
        return 2
    print_table(run(args)["rows"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
