"""The whole verify step of a K3 target, eager and as one CUDA-graph replay, against its floor.

One step = K3Target.verify of T tokens per request + on-device acceptance (greedy) + commit of
the accepted prefix: what an engine step costs the target at batch B with a committed context.
Targets: k3-slice (the first four layers of K3 whole, on one GPU) or k3-rank (one GPU's share of
K3 served on 16, docs/kimi-k3.md §8: all 93 layers, or with --layers the first N, `auto` = as
many as fit; per-layer figures are then per-layer figures of the rank; the collectives are
omitted, the projection adds them). For every (B, context, T) it reports:

- eager_ms: wall time of the step with a synchronize around it (what a batch-1 user felt
  before graphs); eager_host_us: the host's time to issue it;
- graph_ms: wall time of one graph replay plus the readback of the accepted counts and next
  tokens (the user-visible step); graph_gpu_ms: the replay alone between CUDA events;
  graph_host_us: host time of the replay call and the readback's issue;
- gpu_kernel_ms and launches: the sum of device activity and the number of kernels, copies and
  fills in one eager step (torch profiler; the ranges the op scopes below add to the device
  timeline are not launches), with the largest contributors by name;
  kernels_per_layer = launches / layers; by_class: kernels and device time per op class
  (trunk GEMMs, experts, attention, KDA, routing, norms/glue, sampling, collective stand-ins),
  from the profiler scope of the op that launched each kernel, else from the kernel's name
  (`attribution` counts both); with --op-shapes, ops_by_shape: the torch ops with the most
  device time by their input shapes;
- fallbacks: the op calls whose default implementation did not take their arguments, by op and
  by what ran instead; a graphed point whose step would run an implementation that reads device
  values on the host (a reference: it cannot be captured) stops the bench before anything is
  timed, naming the op (one line, exit 2);
- routed_experts_per_layer: the distinct experts each MoE layer ran, counted on the host after
  an extra eager step (outside every timed region);
- floor_ms: the step's bytes (dspark.roofline.step_cost) with the routed experts as counted, over
  the copy bandwidth measured in the same run; floor_fraction = floor_ms / graph_ms (eager_ms
  where there is no graph); floor_uniform_ms / floor_uniform_fraction: the same with the
  uniform-routing expectation (the busiest rank's, for k3-rank) instead of the count.

The context is laid down directly (random KDA state, conv window and MLA rows, committed length
set), not prefilled: timing does not depend on the values, and it is never zeros.

    python experiments/step_bench.py --target k3-slice --batch 1,4 --context 2048,8192,32768 --tokens 1,8
    python experiments/step_bench.py --target k3-rank --layers auto --batch 1,2 --context 8192,32768 --tokens 1,8
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import math
import re
import statistics
import sys
import time

import torch

from dspark import roofline
from dspark.config import SamplingParams
from dspark.cuda_graphs import StepGraph
from dspark.kernels import ops
from dspark.sampling import SamplingTensors
from dspark.targets.kimi_k3 import PRESETS, RANK_PRESETS, K3Model, K3Target, Shard, first_layers, get_preset
from dspark.targets.kimi_k3.parallel import RankParallel
from dspark.targets.kimi_k3.weights import tensor_dtype, tensor_specs

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from benchlib import largest_by_name, provenance, read_ceiling, switched, write_json  # noqa: E402


def _layers(text: str) -> str | int:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer or 'auto'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer or 'auto'")
    return value


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


# The op classes of a step's kernels: each op of dspark.kernels.ops, and the rank's pieces that
# are not ops, by the class their kernels count in.
COLLECTIVES = "collective stand-ins"
OP_CLASSES = {
    "linear": "trunk GEMMs", "linear_partials": "trunk GEMMs", "linear_heads": "trunk GEMMs",
    "mla_absorb_q": "trunk GEMMs", "mla_absorb_output": "trunk GEMMs", "moe_experts": "experts",
    "mla_verify_attention": "attention", "mla_cache_rows": "attention", "kda_verify": "KDA", "kda_commit": "KDA",
    "kda_commit_layers": "KDA",
    "moe_route": "routing", "moe_route_logits": "routing", "moe_router_logits": "routing",
    "rms_norm": "norms/glue", "attn_res_mix_norm": "norms/glue",
    "add_attn_res_mix_norm": "norms/glue", "situ_glu": "norms/glue", "sigmoid_gate": "norms/glue",
    "moe_tail_inputs": "norms/glue",
    "rejection_sample": "sampling",
    # the router | latent-down GEMM's partials added and gathered (RankParallel.dispatch_inputs): the
    # all-gather's stand-in, which also does the GEMM's reduction
    "moe_dispatch_inputs": COLLECTIVES,
}
CLASSES = ("trunk GEMMs", "experts", "attention", "KDA", "routing", "norms/glue", "sampling", COLLECTIVES)
SCOPE = "dspark:"
# A kernel the profiler did not link to a launching op is classed by its name (first match).
NAME_CLASSES = (
    (re.compile(r"expert_kernel|lists_kernel|gather_tokens_kernel|^combine_kernel"), "experts"),
    (re.compile(r"Kda"), "KDA"),
    (re.compile(r"MlaVerify|cutlass_combine_kernel"), "attention"),
    (re.compile(r"route_kernel|router_logits_kernel"), "routing"),
    (re.compile(r"SkinnyGemm|gemm|nvjet|splitKreduce|cutlass_reduce_kernel", re.IGNORECASE), "trunk GEMMs"),
    (re.compile(r"^accept|row_partials|sample"), "sampling"),
    (re.compile(r"dispatch_inputs_kernel"), COLLECTIVES),
)


def class_of_kernel(name: str) -> str:
    return next((cls for pattern, cls in NAME_CLASSES if pattern.search(name)), "norms/glue")


@contextlib.contextmanager
def op_scopes():
    """While profiling: every op of dspark.kernels.ops, the rank's router GEMM and pair choice
    (routing) and its collective stand-ins run inside a profiler scope named after their class,
    so each kernel is classed by the op that launched it (the outermost scope: the reference MoE
    op's own linear calls count as experts). Restored afterwards: timed runs are untouched."""
    from torch.profiler import record_function

    patches = [(ops, name, cls) for name, cls in OP_CLASSES.items()]
    patches += [(RankParallel, "local_pairs", "routing"),
                (RankParallel, "all_gather", COLLECTIVES), (RankParallel, "all_reduce", COLLECTIVES),
                (RankParallel, "dispatch_inputs", COLLECTIVES)]
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]

    def scoped(fn, cls):
        def run(*args, **kwargs):
            with record_function(SCOPE + cls):
                return fn(*args, **kwargs)
        return run

    try:
        for (owner, name, cls), (_, _, fn) in zip(patches, originals):
            setattr(owner, name, scoped(fn, cls))
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def scope_class(event) -> str | None:
    """The class of the outermost op scope around a profiler CPU event (None outside every one)."""
    found = None
    while event is not None:
        if event.name.startswith(SCOPE):
            found = event.name[len(SCOPE):]
        event = event.cpu_parent
    return found


def is_annotation(event) -> bool:
    """A profiler range, not a launch: op_scopes' record_function ranges, on the CPU and as the
    gpu_user_annotation the profiler adds on the device timeline for each one that launched work."""
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith(SCOPE)


def device_launches(events) -> list:
    """The step's launches: every kernel, copy and fill on the device timeline, once each."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not is_annotation(e)]


def kernels_by_class(events) -> tuple[dict, dict]:
    """({class: {"kernels", "us"}}, {"scope": n, "name": m}) over one profiled step's events,
    each launch (device_launches) classed exactly once: by the outermost op scope of the CPU op
    the profiler linked it to (norms/glue outside every scope: torch's own adds, copies, index
    ops), else by its name. Links are matched to launches by kernel name, so a launch the
    profiler linked twice, a link without its launch, or a range linked to itself cannot count."""
    links = collections.defaultdict(collections.deque)
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU or not event.kernels:
            continue
        cls = scope_class(event) or "norms/glue"  # a scope's own range holds what it launched directly
        for kernel in event.kernels:
            links[kernel.name].append(cls)
    by_class = {cls: {"kernels": 0, "us": 0.0} for cls in CLASSES}
    attribution = {"scope": 0, "name": 0}
    for launch in device_launches(events):
        queue = links.get(launch.name)
        if queue:
            cls, how = queue.popleft(), "scope"
        else:
            cls, how = class_of_kernel(launch.name), "name"
        attribution[how] += 1
        by_class[cls]["kernels"] += 1
        by_class[cls]["us"] += launch.time_range.elapsed_us()
    return by_class, attribution


def summarise_profile(events) -> dict:
    """launches, gpu_kernel_ms, the 40 largest contributors by name (top), by_class and attribution
    of one profiled step; annotations are not launches (is_annotation)."""
    launches = device_launches(events)
    by_class, attribution = kernels_by_class(events)
    return {"launches": len(launches), "gpu_kernel_ms": sum(e.time_range.elapsed_us() for e in launches) / 1e3,
            "top": largest_by_name(launches, 40), "by_class": by_class, "attribution": attribution}


def profile_step(step) -> dict:
    """Device activity of one eager step (summarise_profile)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with op_scopes(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return summarise_profile(prof.events())


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


def layer_bytes(cfg, shard: Shard, dtype=torch.bfloat16) -> tuple[list[float], float]:
    """(bytes of each layer, bytes outside the layers) of the model `shard` holds."""
    per_layer, outside = [0.0] * cfg.num_layers, 0.0
    layer_of = re.compile(r"language_model\.model\.layers\.(\d+)\.")
    for name, (shape, kind) in tensor_specs(cfg, shard).items():
        nbytes = math.prod(shape) * tensor_dtype(kind, dtype).itemsize
        match = layer_of.match(name)
        if match:
            per_layer[int(match.group(1))] += nbytes
        else:
            outside += nbytes
    return per_layer, outside


def state_bytes(cfg, shard: Shard, slots: int, max_seq_len: int, layers: int) -> float:
    """K3Target's state for `slots` requests over the first `layers` layers: KDA state (fp32) and
    conv window of the rank's heads, the whole MLA latent cache (bf16)."""
    kda = sum(1 for i in cfg.kda_layers if i < layers)
    mla = sum(1 for i in cfg.mla_layers if i < layers)
    heads = cfg.kda_num_heads // shard.world
    per_kda = heads * cfg.kda_head_dim**2 * 4 + 3 * heads * cfg.kda_head_dim * (cfg.kda_conv_size - 1) * 2
    return slots * (kda * per_kda + mla * (max_seq_len + 1) * cfg.kv_cache_width * 2)


# Device memory kept free beyond the weights and the state: activations, KDA records, logits,
# kernel workspaces, the step's CUDA graph.
WORKSPACE_BYTES = 6e9


def layers_that_fit(cfg, shard: Shard, free_bytes: float, slots: int, max_seq_len: int) -> int:
    """The most leading layers of `cfg` whose weights and state fit `free_bytes` with
    WORKSPACE_BYTES to spare (at least 1: a build that cannot fit fails loudly)."""
    per_layer, outside = layer_bytes(cfg, shard)
    used, fit = outside + WORKSPACE_BYTES, 0
    for n, nbytes in enumerate(per_layer, start=1):
        used += nbytes
        if used + state_bytes(cfg, shard, slots, max_seq_len, n) > free_bytes:
            break
        fit = n
    return max(fit, 1)


def build_model(args, longest: int):
    """(config, shard, model) of --target: k3-slice whole, or rank 0 of a rank preset with the
    busiest rank's routing, all its layers or --layers (a number, or `auto`: as many as fit)."""
    if args.target not in RANK_PRESETS:
        cfg, shard = get_preset(args.target), Shard()
        return cfg, shard, K3Model.random(cfg, seed=args.seed, dtype=torch.bfloat16, device="cuda")
    cfg, world = RANK_PRESETS[args.target]
    shard = Shard(0, world)
    if args.layers == "auto":
        layers = layers_that_fit(cfg, shard, torch.cuda.mem_get_info()[0], max(args.batch), longest)
    else:
        layers = cfg.num_layers if args.layers is None else int(args.layers)
    cfg = first_layers(cfg, layers) if layers < cfg.num_layers else cfg
    print(f"{args.target}: rank 0 of {world}, {layers} of {RANK_PRESETS[args.target][0].num_layers} layers", flush=True)
    return cfg, shard, K3Model.random(cfg, seed=args.seed, dtype=torch.bfloat16, device="cuda", shard=shard,
                                      routing="busiest")


def routed_experts(model: K3Model, step) -> list[int]:
    """Distinct experts each MoE layer ran in one eager step, counted on the host (not timed)."""
    model.routing_log = []
    try:
        step()
        return [int(ids.unique().numel()) for ids in model.routing_log]
    finally:
        model.routing_log = None


def add_floors(row: dict, cfg, shard: Shard, counts: list[int], bandwidth: float) -> None:
    """The floor from the experts counted (floor_*) and from the uniform-routing expectation
    (floor_uniform_*), as ms at `bandwidth` and as fractions of the measured step."""
    shape = dict(batch=row["batch"], tokens_per_request=row["T"], context=row["context"], shard=shard)
    counted = roofline.step_cost(cfg, routed_experts=statistics.mean(counts), **shape)
    uniform = roofline.step_cost(cfg, **shape)
    measured = row.get("graph_ms", row["eager_ms"])
    row.update(mode="graph" if "graph_ms" in row else "eager", ms=measured, ms_per_layer=measured / cfg.num_layers,
               routed_experts_per_layer=counts, uniform_experts_per_layer=uniform.distinct_experts)
    for key, cost in (("floor", counted), ("floor_uniform", uniform)):
        row[f"{key}_bytes"] = cost.total_bytes
        row[f"{key}_ms"] = 1e3 * cost.total_bytes / bandwidth
        row[f"{key}_fraction"] = row[f"{key}_ms"] / measured


def run(args) -> dict:
    ceiling = read_ceiling()
    bandwidth = ceiling["d2d_copy_rw_GBps"] * 1e9
    longest = max(args.context) + (args.steps + 4) * max(args.tokens)
    cfg, shard, model = build_model(args, longest)
    result = {**provenance(), "target": args.target, "layers": cfg.num_layers,
              "shard": {"rank": shard.rank, "world": shard.world}, "bandwidth_GBps": bandwidth / 1e9,
              "ceiling": ceiling, "rows": []}
    if shard.world > 1:
        result["note"] = ("one rank of the deployment on one GPU: collectives omitted (all-reduce = the partial, "
                          "all-gather = the local part repeated), experts of the busiest rank (docs/kimi-k3.md §8)"
                          + ("" if cfg.num_layers == RANK_PRESETS[args.target][0].num_layers else
                             f"; the first {cfg.num_layers} layers only: ms_per_layer is per layer"))
    for batch in args.batch:
        target = K3Target(model, max_slots=batch, max_seq_len=longest)
        for context in args.context:
            for T in args.tokens:
                lay_context(target, batch, context, args.seed)
                step = VerifyStep(target, batch, T, args.seed)

                def reset():
                    target.lengths[:batch] = context

                for setting in args.setting:
                    row = {"target": args.target, "layers": cfg.num_layers, "batch": batch, "context": context, "T": T}
                    if setting:
                        row["setting"] = setting
                    try:
                        with applied(setting):
                            measure(row, step, reset, args)
                            counts = routed_experts(model, step)
                            reset()
                    except Exception as error:  # an A/B variant that fails is recorded; the defaults must work
                        if not setting:
                            raise
                        row["error"] = f"{type(error).__name__}: {error}"[:500]
                        result["rows"].append(row)
                        print(f"B={batch} ctx={context} T={T} [{setting}]: failed: {row['error']}", flush=True)
                        continue
                    add_floors(row, cfg, shard, counts, bandwidth)
                    row["kernels_per_layer"] = row["launches"] / cfg.num_layers
                    result["rows"].append(row)
                    write_json(args.out, result)
                    print_row(row, setting)
        del target
        torch.cuda.empty_cache()
    return result


def print_row(row: dict, setting: str) -> None:
    classes = ", ".join(f"{cls} {v['kernels']}/{v['us'] / 1e3:.2f}ms" for cls, v in row["by_class"].items()
                        if v["kernels"])
    print(f"B={row['batch']} ctx={row['context']} T={row['T']}{' [' + setting + ']' if setting else ''}: "
          f"eager {row['eager_ms']:.2f} ms (host {row['eager_host_us'] / 1e3:.2f}), graph "
          f"{row.get('graph_ms', float('nan')):.2f} ms (gpu {row.get('graph_gpu_ms', float('nan')):.2f}, host "
          f"{row.get('graph_host_us', float('nan')):.0f} us), {row['launches']} launches "
          f"({row['kernels_per_layer']:.1f} per layer), experts/layer {statistics.mean(row['routed_experts_per_layer']):.2f}, "
          f"floor {row['floor_ms']:.2f} ms ({100 * row['floor_fraction']:.0f}%), uniform-routing floor "
          f"{row['floor_uniform_ms']:.2f} ms ({100 * row['floor_uniform_fraction']:.0f}%)\n    by class: {classes}",
          flush=True)


class StepNotCapturable(Exception):
    """A step that would synchronise the host inside its CUDA-graph capture (main: one line, exit 2)."""


def fallbacks(selections) -> dict[str, int]:
    """{"op: preferred -> chosen": calls} of the op calls that fell back from the device's default."""
    counts = collections.Counter(f"{s.op}: {s.preferred} -> {s.chosen.name}" for s in selections if s.fallback)
    return dict(sorted(counts.items()))


def check_capturable(selections, label: str) -> None:
    """StepNotCapturable naming the first op whose implementation reads device values on the host
    (a reference the fast kernel passed the call to): checked before anything is timed, where a
    capture would otherwise fail mid-run with a synchronisation error."""
    blocking = [s for s in selections if s.blocks_capture]
    if blocking:
        ops = sorted({s.op for s in blocking})
        raise StepNotCapturable(f"{label}: cannot be graphed: {blocking[0]}, which reads device values on the host "
                                f"(ops that do: {', '.join(ops)})")


def measure(row: dict, step, reset, args) -> None:
    from dspark.kernels import registry

    with registry.record_selections() as selections:
        step()  # compile every kernel this shape uses
    row["fallbacks"] = fallbacks(selections)
    if not args.no_graph:
        check_capturable(selections, f"{args.target} B={row['batch']} context={row['context']} T={row['T']}")
    row.update(profile_step(step))
    if args.op_shapes:
        row["ops_by_shape"] = ops_by_shape(step)
    row.update(time_eager(step, reset, args.eager_steps or args.steps))
    if not args.no_graph:
        graph = StepGraph(step, f"{args.target} B={row['batch']} T={row['T']} step")
        row.update(time_graph(graph, reset, args.steps))
        del graph


# Module switches a setting may flip (name -> (module, attribute, allowed values)).
SWITCHES = {
    "moe_lists": ("dspark.kernels.moe.cute_sm90", "DEFAULT_LISTS",
                  {"torch": "torch", "device": "device", "fused": "fused"}),
    "router_low_precision_gemm": ("dspark.kernels.moe.triton", "LOW_PRECISION_GEMM", {"0": False, "1": True}),
    "kda_strided_inputs": ("dspark.kernels.kda.cute_host", "STRIDED_INPUTS", {"0": False, "1": True}),
    "moe_combine": ("dspark.kernels.moe.cute_sm90", "COMBINE", {"torch": "torch", "triton": "triton"}),
    "token_gather": ("dspark.kernels.moe.expert_layout", "TOKEN_GATHER", {"torch": "torch", "triton": "triton"}),
    "linear_fused_reduce": ("dspark.kernels.linear.cute_host", "FUSED_REDUCE", {"0": False, "1": True}),
    "triton_pdl": ("dspark.kernels.triton_common", "PDL", {"0": False, "1": True}),
    "linear_hopper_rows": ("dspark.kernels.linear.cute_host", "HOPPER_MAX_TOKENS", {"16": 16, "64": 64}),
    "moe_pass2_splits": ("dspark.kernels.moe.cute_sm90", "PASS2_SPLITS",
                         {"1": 1, "2": 2, "3": 3, "4": 4, "auto": "auto"}),
    "router_gemv_rows": ("dspark.kernels.moe.triton", "GEMV_MAX_ROWS", {"0": 0, "1": 1, "2": 2, "4": 4}),
    "linear_strided_tokens": ("dspark.kernels.linear.cute_host", "STRIDED_TOKENS", {"0": False, "1": True}),
    "split_k_into_consumers": ("dspark.targets.kimi_k3.model", "SPLIT_K_INTO_CONSUMERS", {"0": False, "1": True}),
    "rank_dispatch_gemm": ("dspark.targets.kimi_k3.moe", "DISPATCH_IN_ONE_GEMM", {"0": False, "1": True}),
    "rank_inputs_gemm": ("dspark.targets.kimi_k3.moe", "INPUTS_IN_ONE_GEMM", {"0": False, "1": True}),
    "mix_tiles": ("dspark.kernels.rmsnorm.triton", "MIX_SCORE_TILES", {"0": False, "1": True}),
    "tail_block": ("dspark.kernels.moe.triton", "TAIL_BLOCK", {"128": 128, "256": 256, "512": 512, "1024": 1024}),
}


def applied(setting: str):
    """Run under one comma-separated setting ('' = the defaults): `op=implementation` forces a
    kernel (registry.use); `moe_lists=torch|device|fused` picks how the MXFP4 expert kernel's lists are
    built (fused: in the token gather's launch); `router_low_precision_gemm=0|1` multiplies the router's bf16 tokens and weight as they
    are (fp32 output) or widened to fp32 first; `kda_strided_inputs=0|1` passes the KDA inputs to
    the kernel as strided slices or as contiguous copies; `moe_combine=torch|triton` adds up each
    token's expert outputs in three torch launches or one Triton launch; `token_gather=torch|triton`
    builds the expert kernels' token operand in three torch launches or one Triton launch;
    `linear_fused_reduce=0|1` sums the CuTe GEMMs' split-K partials in a second kernel or in the
    GEMM kernel itself; `triton_pdl=0|1` launches the step's Triton kernels plainly or with
    programmatic dependent launch (kernels/triton_common.py); `linear_hopper_rows=16|64` sends a step's
    GEMMs of 17-64 rows to cuBLAS or to the Hopper skinny GEMM's 32- and 64-row tiles;
    `moe_pass2_splits=1|2|3|4|auto` splits the MXFP4 expert kernel's second pass along K that many
    ways (auto: kernels/moe/cute_sm90.py pass2_splits), the combine adding the splits;
    `router_gemv_rows=0|1|2|4` computes the router's logits of up to that many rows in one launch of
    router_logits_kernel instead of cuBLAS (kernels/moe/triton.py); `split_k_into_consumers=0|1` sums
    the split-K partials of the output projections and of the MoE's shared gate|up GEMM in their GEMM's
    reduction kernel or in the kernel that reads them next (dspark/targets/kimi_k3/model.py
    SPLIT_K_INTO_CONSUMERS); `linear_strided_tokens=0|1` copies a GEMM's strided token rows first or lets
    the Hopper kernel's TMA read them in place (kernels/linear/cute_host.py STRIDED_TOKENS);
    `rank_dispatch_gemm=0|1` runs a rank's router and latent-down projections as a GEMV, a GEMM, its
    reduction and two gathers, or as one GEMM and one kernel that adds, splits and gathers its partials
    (dspark/targets/kimi_k3/moe.py DISPATCH_IN_ONE_GEMM); `rank_inputs_gemm=0|1` runs the shared experts'
    gate|up as a GEMM of its own or inside that one (INPUTS_IN_ONE_GEMM); `mix_tiles=0|1` scores the AttnRes
    mix's checkpoints one at a time or in 2-D tiles (kernels/rmsnorm/triton.py MIX_SCORE_TILES);
    `tail_block=128|256|512|1024` sets the MoE tail kernel's shared-activation columns per program
    (kernels/moe/triton.py TAIL_BLOCK)."""
    return switched(setting, SWITCHES)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="k3-slice", choices=sorted(PRESETS) + sorted(RANK_PRESETS),
                        help="a K3 preset whole (k3-slice fits one GPU), or a rank preset (one GPU's share)")
    parser.add_argument("--layers", type=_layers, default=None,
                        help="a rank target's first N layers, or `auto`: as many as fit the GPU (default: all)")
    parser.add_argument("--batch", type=_ints, default=[1, 4])
    parser.add_argument("--context", type=_ints, default=[2048, 8192, 32768])
    parser.add_argument("--tokens", type=_ints, default=[1, 8], help="T: tokens verified per request")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per point (median)")
    parser.add_argument("--eager-steps", type=int, default=None,
                        help="timed eager steps per point (default --steps; a 93-layer eager step takes the host long)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-graph", action="store_true", help="eager only")
    parser.add_argument("--setting", action="append",
                        help="measure every point under this setting (repeatable; '' = the defaults, also when none is given): "
                             "comma-separated op=implementation, moe_lists=torch|device|fused, router_low_precision_gemm=0|1, "
                             "kda_strided_inputs=0|1, moe_combine=torch|triton, token_gather=torch|triton, "
                             "linear_fused_reduce=0|1, triton_pdl=0|1, linear_hopper_rows=16|64, "
                             "moe_pass2_splits=1|2|3|4|auto, router_gemv_rows=0|1|2|4, split_k_into_consumers=0|1, "
                             "linear_strided_tokens=0|1, rank_dispatch_gemm=0|1, rank_inputs_gemm=0|1, mix_tiles=0|1, "
                             "tail_block=128|256|512|1024")
    parser.add_argument("--op-shapes", action="store_true",
                        help="also list the torch ops with the most device time by input shapes (ops_by_shape)")
    parser.add_argument("--out", default="experiments/results/h200/step_bench.json")
    args = parser.parse_args(argv)
    args.setting = args.setting or [""]
    if args.layers is not None and args.target not in RANK_PRESETS:
        parser.error(f"--layers {args.layers}: only for a rank target ({', '.join(RANK_PRESETS)})")
    if isinstance(args.layers, int) and args.layers > RANK_PRESETS[args.target][0].num_layers:
        parser.error(f"--layers {args.layers}: {args.target} has {RANK_PRESETS[args.target][0].num_layers} layers")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    try:
        run(args)
    except StepNotCapturable as error:
        print(f"step_bench: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
