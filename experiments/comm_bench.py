"""Collective latency at the message sizes of a Kimi K3 step at batch 1 (issue 16).

One process per GPU (torch.multiprocessing), NCCL with NVLink multicast (NVLS) off, for each
world size asked (2, 4, 8 by default, as many as there are GPUs). For T in {1, 8} tokens:
- all-reduce of [T, 7168] bf16: tensor parallelism after attention and after the MoE;
- all-gather and reduce-scatter of the same tensor (column-parallel gathers, sequence parallelism);
- all-gather of the vocabulary-parallel logits [T, 163840] bf16;
- EP dispatch and combine as all-to-all: token t lives on rank t mod G and its latent row
  [3584] bf16 goes once to every other rank holding one of its top-16 of 896 experts (rank r owns
  experts [r*N/G, (r+1)*N/G)); the combine sends the same rows back. Routing uniform, or skewed
  (expert popularity Zipf-like, s = 1.2, so the low ranks get most rows).
Each op is timed eagerly and as a CUDA-graph replay (NCCL graph capture): a sample is the mean of
`--calls` back-to-back calls, the sample's time is the slowest rank's, and the row reports the
median and p90 over `--samples` samples, with algorithm and bus bandwidth (nccl-tests
conventions: bus = alg x 2(G-1)/G for all-reduce, x (G-1)/G for all-gather and reduce-scatter;
for all-to-all, bytes = what the busiest rank sends). Every op's result is checked against its
definition before it is timed.

Results: experiments/results/h200x8/comm_bench.json with provenance, rewritten atomically after
each world size. The roofline reads it: `dspark roofline --comm experiments/results/h200x8/comm_bench.json`.

    python experiments/comm_bench.py                       # every GPU count in 2, 4, 8 that fits
    python experiments/comm_bench.py --backend gloo --world-sizes 2 --samples 3 --calls 2 --out /tmp/c.json
The gloo form runs on CPUs (no graph mode): it exercises the code path, its timings mean nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import warm_up_on_side_stream  # noqa: E402

HIDDEN = 7168  # K3 hidden size
LATENT = 3584  # routed experts' latent width (routed_expert_hidden_size)
VOCAB = 163840
NUM_EXPERTS, TOP_K = 896, 16
ZIPF_S = 1.2
DEFAULT_OUT = "experiments/results/h200x8/comm_bench.json"
BUS_FACTOR = {"all_reduce": lambda g: 2 * (g - 1) / g, "all_gather": lambda g: (g - 1) / g,
              "reduce_scatter": lambda g: (g - 1) / g, "all_to_all": lambda g: 1.0}


# ---- routing and the all-to-all plan --------------------------------------------------------------

def route(tokens: int, routing: str, seed: int) -> torch.Tensor:
    """[tokens, TOP_K] expert ids, the same on every rank (one seed)."""
    gen = torch.Generator().manual_seed(seed)
    if routing == "uniform":
        weights = torch.ones(NUM_EXPERTS)
    elif routing == "skewed":
        weights = torch.arange(1, NUM_EXPERTS + 1, dtype=torch.float64) ** -ZIPF_S
    else:
        raise ValueError(f"routing={routing!r}: must be 'uniform' or 'skewed'")
    return torch.stack([torch.multinomial(weights, TOP_K, replacement=False, generator=gen) for _ in range(tokens)])


def dispatch_counts(experts: torch.Tensor, world: int) -> torch.Tensor:
    """[world, world] rows rank src sends rank dst in the dispatch: one per token owned by src
    (token t on rank t mod world) whose experts include one of dst's, dst != src."""
    if NUM_EXPERTS % world:
        raise ValueError(f"world_size={world}: must divide num_experts={NUM_EXPERTS}")
    per_rank = NUM_EXPERTS // world
    counts = torch.zeros(world, world, dtype=torch.long)
    for t, row in enumerate(experts.tolist()):
        owner = t % world
        for dst in sorted({e // per_rank for e in row} - {owner}):
            counts[owner, dst] += 1
    return counts


# ---- one process ---------------------------------------------------------------------------------

class Clock:
    """Seconds of `fn`, on the GPU (events) or the CPU (perf_counter)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, fn) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3


def _ops(rank: int, world: int, tokens: int, device, dtype, seed: int) -> list[dict]:
    """The collectives to time at `tokens` rows: name, callable, bytes, and a check of the result
    against its definition (inputs depend on the rank, so a wrong peer or a wrong sum shows)."""
    g = torch.Generator().manual_seed(seed + 1000 * tokens)
    base = torch.randn(world, tokens, HIDDEN, generator=g).to(dtype)  # every rank's input, known to all
    mine = base[rank].to(device)
    ar_buf = torch.empty_like(mine)
    chunk = tokens * HIDDEN // world
    gathered = torch.empty(world * chunk, dtype=dtype, device=device)
    scattered = torch.empty(chunk, dtype=dtype, device=device)
    logits_mine = torch.randn(tokens, VOCAB // world, generator=g).to(dtype).to(device) + rank
    logits_all = torch.empty(world * tokens * (VOCAB // world), dtype=dtype, device=device)
    # Sums of up to 8 bf16 values: exact to bf16 rounding of the float32 reference.
    tol = dict(atol=0.05 * world, rtol=0.02) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    full_sum = base.float().sum(0)

    ops = [
        # In place, so the timed calls add no copy; the check starts from a fresh copy of the input.
        {"op": "all_reduce", "shape": [tokens, HIDDEN], "bytes": mine.numel() * mine.element_size(),
         "prepare": lambda: ar_buf.copy_(mine), "run": lambda: dist.all_reduce(ar_buf),
         "check": lambda: torch.testing.assert_close(ar_buf.float().cpu(), full_sum, **tol)},
        {"op": "all_gather", "shape": [tokens, HIDDEN], "bytes": gathered.numel() * gathered.element_size(),
         "run": lambda: dist.all_gather_into_tensor(gathered, mine.view(-1)[rank * chunk:(rank + 1) * chunk]),
         "check": lambda: torch.testing.assert_close(
             gathered.cpu(), torch.cat([base[r].reshape(-1)[r * chunk:(r + 1) * chunk] for r in range(world)]),
             atol=0, rtol=0)},
        {"op": "reduce_scatter", "shape": [tokens, HIDDEN], "bytes": mine.numel() * mine.element_size(),
         "run": lambda: dist.reduce_scatter_tensor(scattered, mine.view(-1)),
         "check": lambda: torch.testing.assert_close(scattered.float().cpu(),
                                                     full_sum.reshape(-1)[rank * chunk:(rank + 1) * chunk], **tol)},
        {"op": "all_gather", "shape": [tokens, VOCAB], "what": "logits",
         "bytes": logits_all.numel() * logits_all.element_size(),
         "run": lambda: dist.all_gather_into_tensor(logits_all, logits_mine.view(-1)),
         "check": lambda: torch.testing.assert_close(logits_all.view(world, -1)[rank].cpu(),
                                                     logits_mine.view(-1).cpu(), atol=0, rtol=0)},
    ]
    for routing in ("uniform", "skewed"):
        ops += _all_to_all_ops(rank, world, tokens, device, dtype, routing, seed)
    return ops


def _all_to_all_ops(rank, world, tokens, device, dtype, routing, seed) -> list[dict]:
    counts = dispatch_counts(route(tokens, routing, seed + tokens), world)
    send_rows, recv_rows = counts[rank].tolist(), counts[:, rank].tolist()
    row_bytes = LATENT * torch.empty((), dtype=dtype).element_size()
    busiest = int(counts.sum(1).max()) * row_bytes
    # Row j of the block rank src sends rank dst holds the value src * 1000 + dst * 10 + j, so
    # the receiver can check where every row came from.
    def block(src, dst, n):
        return (src * 1000 + dst * 10 + torch.arange(n, dtype=torch.float32))[:, None].expand(n, LATENT)

    send = torch.cat([block(rank, dst, n) for dst, n in enumerate(send_rows)]).to(dtype).to(device)
    recv = torch.empty(sum(recv_rows), LATENT, dtype=dtype, device=device)
    back = torch.empty(sum(send_rows), LATENT, dtype=dtype, device=device)
    expected = torch.cat([block(src, rank, n) for src, n in enumerate(recv_rows)]).to(dtype)
    common = {"shape": [tokens, LATENT], "routing": routing, "bytes": busiest, "rows_sent": counts.sum(1).tolist()}
    return [
        {"op": "all_to_all", "what": "EP dispatch", **common,
         "run": lambda: dist.all_to_all_single(recv, send, recv_rows, send_rows),
         "check": lambda: torch.testing.assert_close(recv.cpu(), expected, atol=0, rtol=0)},
        {"op": "all_to_all", "what": "EP combine", **common,
         "run": lambda: dist.all_to_all_single(back, recv, send_rows, recv_rows),
         "check": lambda: torch.testing.assert_close(back.cpu(), send.cpu(), atol=0, rtol=0)},
    ]


def _samples(clock: Clock, fn, repeats: int, samples: int) -> list[float]:
    """Seconds of `repeats` back-to-back calls of `fn`, `samples` times, ranks aligned by a barrier."""
    def burst():
        for _ in range(repeats):
            fn()

    out = []
    for _ in range(samples):
        dist.barrier()
        out.append(clock.time(burst))
    return out


def _graph(fn, calls: int):
    """A CUDA graph of `calls` back-to-back calls of `fn` (captured after an eager warm-up)."""
    warm_up_on_side_stream(fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def _measure(op: dict, world: int, clock: Clock, args, modes) -> list[dict]:
    rows = []
    for mode in modes:
        if mode == "graph":  # one replay = args.calls captured calls
            graph = _graph(op["run"], args.calls)
            fn, repeats = graph.replay, 1
            graph.replay()
        else:
            fn, repeats = op["run"], args.calls
        mine = [t / args.calls for t in _samples(clock, fn, repeats, args.samples)]
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        slowest = [max(column) for column in zip(*everyone)]
        median = statistics.median(slowest)
        p90 = sorted(slowest)[min(len(slowest) - 1, math.ceil(0.9 * len(slowest)) - 1)]
        alg = op["bytes"] / median / 1e9
        rows.append({
            "op": op["op"], "what": op.get("what", op["op"]), "world_size": world, "T": op["shape"][0],
            "shape": op["shape"], "dtype": str(args.dtype).replace("torch.", ""), "bytes": op["bytes"],
            "mode": mode, **({"routing": op["routing"], "rows_sent": op["rows_sent"]} if "routing" in op else {}),
            "median_us": median * 1e6, "p90_us": p90 * 1e6,
            "algbw_GBps": alg, "busbw_GBps": alg * BUS_FACTOR[op["op"]](world),
            "samples": args.samples, "calls_per_sample": args.calls,
        })
    return rows


def worker(rank: int, world: int, args, port: int, part_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, rank=rank, world_size=world, device_id=device if args.backend == "nccl" else None)
    try:
        clock = Clock(device)
        modes = ("eager", "graph") if args.backend == "nccl" and not args.eager_only else ("eager",)
        rows = []
        for tokens in args.tokens:
            for op in _ops(rank, world, tokens, device, args.dtype, args.seed):
                op.get("prepare", lambda: None)()
                op["run"]()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                op["check"]()  # raises on a wrong result, naming the elements
                rows += _measure(op, world, clock, args, modes)
        if rank == 0:
            with open(part_file, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


# ---- the driver ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _provenance(args) -> dict:
    def version(cmd):
        try:
            return subprocess.check_output(cmd, text=True, stderr=subprocess.DEVNULL).strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    cuda = torch.cuda.is_available()
    return {
        "schema": "dspark.comm_bench/1",
        "device": torch.cuda.get_device_name(0) if cuda and args.backend == "nccl" else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "backend": args.backend,
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda and args.backend == "nccl" else None,
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "NCCL_ALGO", "NCCL_PROTO")},
        "commit": os.environ.get("DSPARK_GIT_COMMIT") or version(["git", "rev-parse", "HEAD"]),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "started_unix": time.time(),
    }


def write_json_atomic(path: str, payload: dict) -> None:
    """Temp file in the same folder, then rename: a cut-off run never leaves a torn file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".comm_bench.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--world-sizes", type=int, nargs="+", default=None,
                   help="processes per run (default: 2, 4, 8 up to the GPU count)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8], help="T: rows per request (1 plain, 8 verify)")
    p.add_argument("--samples", type=int, default=200, help="timed samples per op and mode")
    p.add_argument("--calls", type=int, default=20, help="back-to-back calls per sample (and per graph)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--eager-only", action="store_true", help="skip the CUDA-graph mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    gpus = torch.cuda.device_count() if args.backend == "nccl" else None
    if args.world_sizes is None:
        args.world_sizes = [g for g in (2, 4, 8) if gpus is None or g <= gpus]
    for name, values in (("--world-sizes", args.world_sizes), ("--tokens", args.tokens)):
        if not values or any(v < 1 for v in values):
            p.error(f"{name} {values}: every value must be >= 1")
    if min(args.world_sizes) < 2:
        p.error(f"--world-sizes {args.world_sizes}: a collective needs at least 2 processes")
    if gpus is not None and max(args.world_sizes) > gpus:
        p.error(f"--world-sizes {args.world_sizes}: only {gpus} GPUs here (NCCL runs one process per GPU)")
    for w in args.world_sizes:
        if NUM_EXPERTS % w or any(t * HIDDEN % w for t in args.tokens) or VOCAB % w:
            p.error(f"--world-sizes {w}: must divide num_experts={NUM_EXPERTS}, vocab={VOCAB} and T x {HIDDEN}")
    if args.samples < 1 or args.calls < 1:
        p.error(f"--samples {args.samples} --calls {args.calls}: each must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # NVLink multicast (NVLS) stays off: a multicast object per communicator is a scarce resource
    # on the lent machines, and the figures here are for plain NVLink collectives.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    result = {**_provenance(args), "rows": []}
    for world in args.world_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            part = os.path.join(tmp, "rows.json")
            mp.spawn(worker, args=(world, args, _free_port(), part), nprocs=world, join=True)
            with open(part) as f:
                result["rows"] += json.load(f)
        write_json_atomic(args.out, result)
        for row in result["rows"]:
            if row["world_size"] == world:
                print(f"G={world} {row['what']:<14}{row.get('routing', ''):<8} T={row['T']} {row['mode']:<5} "
                      f"{row['bytes']:>9} B  median {row['median_us']:8.1f} us  p90 {row['p90_us']:8.1f} us  "
                      f"bus {row['busbw_GBps']:7.1f} GB/s")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
