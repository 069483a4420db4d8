"""The DSpark drafter's step on the GPU at K3 dims (issue 12): one greedy propose and one commit
at batch 1, eager (every op launched from Python) against CUDA graphs (drafters/dspark/graphs.py).

The K3 drafter preset (5 MLA layers, hidden 7168, vocab 163,840, block 7; random weights in
bf16, the target's embedding and lm_head random too) with one request of --contexts committed
tokens. Per mode and context, medians over --repeats of:
- propose_ms / commit_ms: wall time of one call with a synchronize around it (what a step waits);
- propose_host_us / commit_host_us: the time the call takes to return, the GPU busy behind a
  sleep (what the host spends issuing it);
- kernels per call, from the profiler (a graph replay counts its kernels too), and the largest of
  them by name with their calls and time (propose_top, commit_top);
- floor_ms: the bytes a propose must read (dspark.roofline.draft_pass_bytes: the five layers'
  weights, the lm_head once, the Markov head's W2 once per block slot, the context rows; not the
  context projection, which only commits use) over the copy bandwidth measured on this GPU at the
  start (benchlib.read_ceiling, as step_bench does), or --bandwidth-gbps.
After each commit the request is cropped back to its context, so every call sees the same one.

--world N times one tensor-parallel rank's share of the drafter instead (config.rank_share,
docs/kimi-k3.md §8.6): 1/N of the heads, FFN and vocabulary, the q_a / kv_a projections and the
latent cache whole; the collectives between the ranks are left out, as the k3-rank step's are.

--setting (repeatable, as step_bench's) measures every point under each: comma-separated
op=implementation, draft_output_partials=0|1 (drafters/dspark/model.py OUTPUTS_AS_PARTIALS_ON:
o_proj's and down's split-K partials added by the GEMM's reduction kernel or by the norm after them),
draft_input_partials=0|1 (INPUTS_AS_PARTIALS_ON: a layer's q_a | kv_a and gate | up GEMMs as cuBLAS's or
as the skinny GEMM's partials, added by the cache rows' and the activation's launches), or triton_pdl=0|1 (kernels/triton_common.py PDL: the Triton kernels launched plainly or dependently).
A row measured under a setting names it; `dspark roofline --measured-draft` reads the default rows.

    python experiments/drafter_bench.py --out experiments/results/h200/drafter_bench.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from benchlib import largest_by_name, provenance, read_ceiling, switched, write_json

from dspark.config import SamplingParams
from dspark.drafters.dspark.config import K3_DSPARK, rank_share
from dspark.drafters.dspark.drafter import DSparkDrafter
from dspark.drafters.dspark.model import DSparkModel
from dspark.roofline import draft_pass_bytes

GREEDY = SamplingParams(temperature=0.0)
# Module switches a setting may flip (name -> (module, attribute, allowed values)): benchlib.switched.
SWITCHES = {
    "draft_output_partials": ("dspark.drafters.dspark.model", "OUTPUTS_AS_PARTIALS_ON", {"0": (), "1": ("cuda",)}),
    "draft_input_partials": ("dspark.drafters.dspark.model", "INPUTS_AS_PARTIALS_ON", {"0": (), "1": ("cuda",)}),
    "triton_pdl": ("dspark.kernels.triton_common", "PDL", {"0": False, "1": True}),
}


def timed(fn, repeats: int) -> tuple[float, float]:
    """(median wall ms with a synchronize around each call, median host us of the call with the
    GPU busy behind a sleep)."""
    walls, hosts = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append(1e3 * (time.perf_counter() - t0))
    for _ in range(repeats):
        torch.cuda._sleep(50_000_000)  # ~tens of ms: the call is issued while the GPU is busy
        t0 = time.perf_counter()
        fn()
        hosts.append(1e6 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
    return statistics.median(walls), statistics.median(hosts)


def kernels_in(fn, top: int = 30) -> tuple[int, list[dict]]:
    """(device activities of one call, the `top` largest by name: calls and microseconds), which
    says where a propose's time goes (a graph replay's kernels are traced too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(events), largest_by_name(events, top)


def measure(model, c, args, prompt, taps, step_taps, anchor, kept, graphs: bool) -> dict:
    """One drafter's propose and commit timed, eager or graphed (the module docstring's figures)."""
    drafter = DSparkDrafter(model, 1, max_seq_len=prompt.shape[0] + 64, cuda_graphs=graphs)
    drafter.start(0, prompt, taps)
    tokens = torch.zeros(1, args.tokens, dtype=torch.long, device=prompt.device)

    def propose():
        return drafter.propose([0], anchor, c.block_size, [GREEDY], [None])

    def commit():
        drafter.commit([0], tokens, kept, step_taps)
        drafter.crop(0, prompt.shape[0])

    for _ in range(3):  # compiles, captures, warms up
        propose()
        commit()
    propose_ms, propose_host = timed(propose, args.repeats)
    commit_ms, commit_host = timed(commit, args.repeats)
    propose_kernels, propose_top = kernels_in(propose)
    commit_kernels, commit_top = kernels_in(commit)
    del drafter
    torch.cuda.empty_cache()
    return {"propose_ms": propose_ms, "propose_host_us": propose_host, "propose_kernels": propose_kernels,
            "commit_ms": commit_ms, "commit_host_us": commit_host, "commit_kernels": commit_kernels,
            "propose_top": propose_top, "commit_top": commit_top}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--tokens", type=int, default=8, help="T verified per step: the commit's rows")
    ap.add_argument("--kept", type=int, default=4, help="rows each commit keeps")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--world", type=int, default=1, help="time one rank's share of a drafter split this many ways")
    ap.add_argument("--bandwidth-gbps", type=float, default=None,
                    help="the read ceiling in GB/s (default: measured on this GPU first)")
    ap.add_argument("--setting", action="append",
                    help="measure every point under this setting (repeatable; '' = the defaults, also when none is "
                         "given): comma-separated op=implementation, draft_output_partials=0|1, "
                         "draft_input_partials=0|1, triton_pdl=0|1")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.setting = args.setting or [""]
    if not torch.cuda.is_available():
        print("drafter_bench: needs CUDA", file=sys.stderr)
        return 2
    try:
        c = rank_share(K3_DSPARK, args.world)
    except ValueError as e:
        print(f"drafter_bench: --world: {e}", file=sys.stderr)
        return 2
    dev, dtype = torch.device("cuda"), torch.bfloat16
    ceiling = read_ceiling() if args.bandwidth_gbps is None else None
    bandwidth_gbps = ceiling["d2d_copy_rw_GBps"] if ceiling else args.bandwidth_gbps  # as step_bench
    torch.manual_seed(0)
    with torch.device(dev):
        embed = torch.randn(c.vocab_size, c.hidden_size, dtype=dtype) * 0.02
        lm_head = torch.randn(c.vocab_size, c.hidden_size, dtype=dtype) * 0.02
        model = DSparkModel(c, embed, lm_head).to(dtype)
    model.pair_projections()  # as load_drafter serves it on a GPU
    result = {**provenance(), "settings": vars(args), "drafter": c.name, "bandwidth_GBps": bandwidth_gbps,
              "ceiling": ceiling, "rows": []}
    for context in args.contexts:
        floor_ms = draft_pass_bytes(c, context) / (bandwidth_gbps * 1e6)
        g = torch.Generator(device=dev).manual_seed(context)
        prompt = torch.randint(0, c.vocab_size, (context,), generator=g, device=dev)
        taps = {layer: torch.randn(context, c.target_hidden_size, generator=g, device=dev, dtype=dtype)
                for layer in c.target_layer_ids}
        step_taps = {layer: torch.randn(1, args.tokens, c.target_hidden_size, generator=g, device=dev, dtype=dtype)
                     for layer in c.target_layer_ids}
        anchor = torch.randint(0, c.vocab_size, (1,), generator=g, device=dev)
        kept = torch.tensor([args.kept], device=dev)
        for setting in args.setting:
            for graphs in (False, True):
                with switched(setting, SWITCHES):
                    row = measure(model, c, args, prompt, taps, step_taps, anchor, kept, graphs)
                row = {"context": context, **({"setting": setting} if setting else {}), "cuda_graphs": graphs, **row,
                       "propose_floor_ms": floor_ms, "propose_floor_fraction": floor_ms / row["propose_ms"]}
                result["rows"].append(row)
                write_json(args.out, result)
    print(f"{'context':>8} {'graphs':>6} {'propose ms':>10} {'host us':>8} {'kernels':>7} {'floor':>6} "
          f"{'commit ms':>9} {'host us':>8} {'kernels':>7}  setting")
    for r in result["rows"]:
        print(f"{r['context']:8d} {str(r['cuda_graphs']):>6} {r['propose_ms']:10.3f} {r['propose_host_us']:8.0f} "
              f"{r['propose_kernels']:7d} {r['propose_floor_fraction']:6.0%} {r['commit_ms']:9.3f} "
              f"{r['commit_host_us']:8.0f} {r['commit_kernels']:7d}  {r.get('setting', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
