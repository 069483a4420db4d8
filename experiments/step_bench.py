"""The whole verify step of a K3 target, eager and as one CUDA-graph replay, against its floor.

One step = K3Target.verify of T tokens per request + on-device acceptance (greedy) + commit of
the accepted prefix: what an engine step costs the target at batch B with a committed context.
For every (B, context, T) it reports:

- eager_ms: wall time of the step with a synchronize around it (what a batch-1 user felt
  before graphs); eager_host_us: the host's time to issue it;
- graph_ms: wall time of one graph replay plus the readback of the accepted counts and next
  tokens (the user-visible step); graph_gpu_ms: the replay alone between CUDA events;
  graph_host_us: host time of the replay call and the readback's issue;
- gpu_kernel_ms and launches: the sum of device activity and the number of kernels, copies and
  fills in one eager step (torch profiler), with the largest contributors by name; with
  --op-shapes, ops_by_shape: the torch ops with the most device time by their input shapes;
- floor_ms: the step's bytes (dspark.roofline.step_cost) over the copy bandwidth measured in
  the same run; floor_fraction = floor_ms / graph_ms (eager_ms where there is no graph).

The context is laid down directly (random KDA state, conv window and MLA rows, committed length
set), not prefilled: timing does not depend on the values, and it is never zeros.

    python experiments/step_bench.py --target k3-slice --batch 1,4 --context 2048,8192,32768 --tokens 1,8
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time

import torch

from dspark import roofline
from dspark.config import SamplingParams
from dspark.cuda_graphs import StepGraph
from dspark.kernels import ops
from dspark.sampling import SamplingTensors
from dspark.targets.kimi_k3 import K3Model, K3Target, get_preset

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import provenance, read_ceiling, write_json  # noqa: E402


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


class VerifyStep:
    """verify + greedy acceptance + commit on static buffers, so it can be replayed as a graph."""

    def __init__(self, target: K3Target, batch: int, tokens: int, seed: int):
        dev = target.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.target, self.slots = target, list(range(batch))
        self.tokens = torch.randint(0, target.vocab_size, (batch, tokens), device=dev, generator=gen)
        self.lengths = torch.full((batch,), tokens, dtype=torch.long, device=dev)
        self.num_drafts = torch.full((batch,), tokens - 1, dtype=torch.long, device=dev)
        self.sampling = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * batch, dev)
        self.uniforms = torch.zeros(batch, tokens - 1, device=dev)
        self.noise = torch.ones(batch, target.vocab_size, device=dev)

    def __call__(self):
        out = self.target.verify(self.slots, self.tokens, self.lengths)
        num_accepted, next_token = ops.rejection_sample(
            out.logits, self.tokens[:, 1:], self.num_drafts, None, self.sampling, self.uniforms, self.noise)
        self.target.commit(self.slots, num_accepted + 1)
        return num_accepted, next_token


def lay_context(target: K3Target, batch: int, context: int, seed: int) -> None:
    """Committed state of `context` tokens in slots 0..batch-1 (random values, never zeros)."""
    gen = torch.Generator(device=target.device).manual_seed(seed)
    target.kda_state[:batch].normal_(0.0, 0.02, generator=gen)
    target.conv_state[:batch].normal_(0.0, 1.0, generator=gen)
    target.mla_cache[:batch, :, :context].normal_(0.0, 1.0, generator=gen)
    target.lengths[:batch] = context


def profile_step(step) -> dict:
    """Device activity of one eager step: count, total ms and the largest contributors."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals, counts = collections.Counter(), collections.Counter()
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        totals[evt.name] += evt.time_range.elapsed_us()
        counts[evt.name] += 1
    top = [{"name": name[:160], "calls": counts[name], "us": round(us, 1)} for name, us in totals.most_common(40)]
    return {"launches": sum(counts.values()), "gpu_kernel_ms": sum(totals.values()) / 1e3, "top": top}


def ops_by_shape(step, top: int = 30) -> list[dict]:
    """The torch ops of one eager step with the most device time, by op and input shapes: what
    launched the copies and the glue kernels (a kernel name alone does not say)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    rows = [{"op": evt.key, "shapes": str(evt.input_shapes)[:200], "calls": evt.count,
             "self_device_us": round(evt.self_device_time_total, 1)}
            for evt in prof.key_averages(group_by_input_shape=True)
            if evt.key.startswith("aten::") and evt.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r["self_device_us"])[:top]


def time_eager(step, reset, steps: int) -> dict:
    walls, hosts = [], []
    for _ in range(steps):
        reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        hosts.append(t1 - t0)
    return {"eager_ms": 1e3 * statistics.median(walls), "eager_host_us": 1e6 * statistics.median(hosts)}


def time_graph(graph: StepGraph, reset, steps: int) -> dict:
    """Replay + one asynchronous readback into pinned memory, as the engine does per step."""
    num_accepted, next_token = graph.outputs
    host_acc = torch.empty(num_accepted.shape, dtype=num_accepted.dtype, pin_memory=True)
    host_next = torch.empty(next_token.shape, dtype=next_token.dtype, pin_memory=True)
    done = torch.cuda.Event()
    walls, hosts, gpus = [], [], []
    for _ in range(steps):
        reset()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        graph.replay()
        end.record()
        host_acc.copy_(num_accepted, non_blocking=True)
        host_next.copy_(next_token, non_blocking=True)
        done.record()
        t1 = time.perf_counter()
        done.synchronize()
        walls.append(time.perf_counter() - t0)
        hosts.append(t1 - t0)
        gpus.append(start.elapsed_time(end))
    return {"graph_ms": 1e3 * statistics.median(walls), "graph_gpu_ms": statistics.median(gpus),
            "graph_host_us": 1e6 * statistics.median(hosts)}


def run(args) -> dict:
    cfg = get_preset(args.target)
    ceiling = read_ceiling()
    bandwidth = ceiling["d2d_copy_rw_GBps"] * 1e9
    result = {**provenance(), "target": args.target, "bandwidth_GBps": bandwidth / 1e9, "ceiling": ceiling,
              "rows": []}
    model = K3Model.random(cfg, seed=args.seed, dtype=torch.bfloat16, device="cuda")
    longest = max(args.context) + (args.steps + 4) * max(args.tokens)
    for batch in args.batch:
        target = K3Target(model, max_slots=batch, max_seq_len=longest)
        for context in args.context:
            for T in args.tokens:
                lay_context(target, batch, context, args.seed)
                step = VerifyStep(target, batch, T, args.seed)

                def reset():
                    target.lengths[:batch] = context

                for setting in args.setting:
                    row = {"target": args.target, "batch": batch, "context": context, "T": T}
                    if setting:
                        row["setting"] = setting
                    try:
                        with applied(setting):
                            measure(row, step, reset, args)
                    except Exception as error:  # an A/B variant that fails is recorded; the defaults must work
                        if not setting:
                            raise
                        row["error"] = f"{type(error).__name__}: {error}"[:500]
                        result["rows"].append(row)
                        print(f"B={batch} ctx={context} T={T} [{setting}]: failed: {row['error']}", flush=True)
                        continue
                    cost = roofline.step_cost(cfg, batch=batch, tokens_per_request=T, context=context)
                    row["floor_bytes"] = cost.total_bytes
                    row["floor_ms"] = 1e3 * cost.total_bytes / bandwidth
                    measured = row.get("graph_ms", row["eager_ms"])
                    row["mode"] = "graph" if "graph_ms" in row else "eager"
                    row["ms"] = measured
                    row["floor_fraction"] = row["floor_ms"] / measured
                    result["rows"].append(row)
                    write_json(args.out, result)
                    print(f"B={batch} ctx={context} T={T}{' [' + setting + ']' if setting else ''}: "
                          f"eager {row['eager_ms']:.2f} ms, graph {row.get('graph_ms', float('nan')):.2f} ms "
                          f"(gpu {row.get('graph_gpu_ms', float('nan')):.2f}), kernels {row['gpu_kernel_ms']:.2f} ms in "
                          f"{row['launches']} launches, floor {row['floor_ms']:.2f} ms ({100 * row['floor_fraction']:.0f}%)",
                          flush=True)
        del target
        torch.cuda.empty_cache()
    return result


def measure(row: dict, step, reset, args) -> None:
    step()  # compile every kernel this shape uses
    row.update(profile_step(step))
    if args.op_shapes:
        row["ops_by_shape"] = ops_by_shape(step)
    row.update(time_eager(step, reset, args.steps))
    if not args.no_graph:
        graph = StepGraph(step, f"{args.target} B={row['batch']} T={row['T']} step")
        row.update(time_graph(graph, reset, args.steps))
        del graph


# Module switches a setting may flip (name -> (module, attribute, allowed values)).
SWITCHES = {
    "moe_lists": ("dspark.kernels.moe.cute_sm90", "DEFAULT_LISTS", {"torch": "torch", "device": "device"}),
    "router_low_precision_gemm": ("dspark.kernels.moe.triton", "LOW_PRECISION_GEMM", {"0": False, "1": True}),
    "kda_strided_inputs": ("dspark.kernels.kda.cute_host", "STRIDED_INPUTS", {"0": False, "1": True}),
    "moe_combine": ("dspark.kernels.moe.cute_sm90", "COMBINE", {"torch": "torch", "triton": "triton"}),
    "token_gather": ("dspark.kernels.moe.expert_layout", "TOKEN_GATHER", {"torch": "torch", "triton": "triton"}),
}


@contextlib.contextmanager
def applied(setting: str):
    """Run under one comma-separated setting ('' = the defaults): `op=implementation` forces a
    kernel (registry.use); `moe_lists=torch|device` picks how the MXFP4 expert kernel's lists are
    built; `router_low_precision_gemm=0|1` multiplies the router's bf16 tokens and weight as they
    are (fp32 output) or widened to fp32 first; `kda_strided_inputs=0|1` passes the KDA inputs to
    the kernel as strided slices or as contiguous copies; `moe_combine=torch|triton` adds up each
    token's expert outputs in three torch launches or one Triton launch; `token_gather=torch|triton`
    builds the expert kernels' token operand in three torch launches or one Triton launch."""
    import importlib

    from dspark.kernels import registry

    restore, forced = [], []
    try:
        for item in filter(None, (part.strip() for part in setting.split(","))):
            key, _, value = item.partition("=")
            if key in SWITCHES:
                module_name, attribute, allowed = SWITCHES[key]
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="k3-slice")
    parser.add_argument("--batch", type=_ints, default=[1, 4])
    parser.add_argument("--context", type=_ints, default=[2048, 8192, 32768])
    parser.add_argument("--tokens", type=_ints, default=[1, 8], help="T: tokens verified per request")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per point (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-graph", action="store_true", help="eager only")
    parser.add_argument("--setting", action="append",
                        help="measure every point under this setting (repeatable; '' = the defaults, also when none is given): "
                             "comma-separated op=implementation, moe_lists=torch|device, router_low_precision_gemm=0|1, "
                             "kda_strided_inputs=0|1, moe_combine=torch|triton")
    parser.add_argument("--op-shapes", action="store_true",
                        help="also list the torch ops with the most device time by input shapes (ops_by_shape)")
    parser.add_argument("--out", default="experiments/results/h200/step_bench.json")
    args = parser.parse_args(argv)
    args.setting = args.setting or [""]
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
