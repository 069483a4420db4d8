"""The step's single-program glue kernels alone, per call, at a K3 rank's shapes: the AttnRes mix norm
(kernels/rmsnorm/triton.py; 0-8 checkpoints, the residual add's delta as 0-2 split-K partials, the
checkpoints scored one at a time or in 2-D tiles: MIX_SCORE_TILES) and the router's selection
(kernels/moe/triton.py route_logits; 896 logits, top 16), each beside a one-row
rms_norm (one load, one reduction, one store: what a launch of this shape costs at least) and the torch
reference a user would otherwise run (its chain of small ops, graphed the same way).

Why: on the rank's step the mix takes ~7-7.8 us a call and the selection ~6.6 us at every batch, where a
one-row rms_norm takes ~1.7 us (experiments/notes/rank.md); how their time grows with the checkpoints,
the partials and the rows, with inputs cold (rotated past the L2, as in the step, where ~140 MB of weights
stream between two mixes) or hot, says where it goes. `--profile-only` runs each case a few times
without timing, for Nsight Compute (tools/lab/rounds/glue/).

Method (experiments/benchlib.py): graph replay of `reps` calls, median over repeats, microseconds a call.
No bytes floor is quoted: a one-row mix reads at most ~186 KB (eight checkpoints and the current row in bf16,
two fp32 partials), ~60 ns at HBM bandwidth; a call's latency, not its bytes, is the question.

Usage: python experiments/glue_bench.py [--out experiments/results/h200/glue_bench.json] [--profile-only]
"""
import argparse
import math
import sys
import time

import torch

from benchlib import provenance, time_calls, write_json
from dspark.kernels.moe import reference as moe_ref
from dspark.kernels.moe import triton as moe_triton
from dspark.kernels.rmsnorm import reference as norm_ref
from dspark.kernels.rmsnorm import triton as norm_triton

WIDTH = 7168  # K3's hidden size
EXPERTS, TOP_K, SCALING = 896, 16, 2.827  # K3's router
CHECKPOINTS = (0, 1, 4, 8)  # K3's mixes see 0 to 8 sealed blocks (docs/kimi-k3.md §7)
PARTS = (0, 1, 2)  # no delta; a delta; a rank's output projection's two split-K partials
ROWS = (1, 8)


MAX_COPIES = 2048  # a graph of more calls takes long to capture; the row records the bytes rotated


def copies_for(bytes_per_call: int, l2_bytes: int, cold: bool) -> int:
    """Input copies to rotate: enough that their total is 4x the L2 when cold (at most MAX_COPIES: the
    smallest cases then rotate less than the L2 holds, which their row's rotated_bytes shows), one when hot."""
    return min(MAX_COPIES, max(2, math.ceil(4 * l2_bytes / bytes_per_call))) if cold else 1


def with_tiles(tiles: bool, call):
    """call() with the mix's checkpoints scored one at a time or in 2-D tiles
    (kernels/rmsnorm/triton.py MIX_SCORE_TILES: read at each call, so at a graph's capture too)."""
    def run():
        saved, norm_triton.MIX_SCORE_TILES = norm_triton.MIX_SCORE_TILES, tiles
        try:
            return call()
        finally:
            norm_triton.MIX_SCORE_TILES = saved
    return run


def mix_cases(rows: int, checkpoints: int, parts: int, copies: int, gen: torch.Generator, tiles: bool = False):
    """(triton calls, reference calls) over `copies` input sets of one mix-norm shape; tiles: ours with
    the checkpoints scored in 2-D tiles."""
    def bf16(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    mix_norm, out_norm = (torch.rand(WIDTH, device="cuda", generator=gen) + 0.5).bfloat16(), bf16(WIDTH)
    mix_proj = bf16(WIDTH, scale=WIDTH**-0.5)  # scores of order 1, as a trained pseudo-query gives
    ours, reference = [], []
    for _ in range(copies):
        current, ckpts = bf16(rows, WIDTH, scale=3.0), bf16(checkpoints, rows, WIDTH, scale=2.0)
        out, total = torch.empty_like(current), torch.empty_like(current)
        if parts == 0:
            ours.append(with_tiles(tiles, lambda c=current, k=ckpts, o=out: norm_triton.attn_res_mix_norm(
                c, k, mix_norm, mix_proj, out_norm, 1e-6, out=o)))
            reference.append(lambda c=current, k=ckpts: norm_ref.attn_res_mix_norm(
                c, k, mix_norm, mix_proj, out_norm, 1e-6))
        else:
            delta = torch.randn(parts, rows, WIDTH, device="cuda", generator=gen)  # fp32 partials
            ours.append(with_tiles(tiles, lambda c=current, dl=delta, k=ckpts, o=out, t=total:
                                   norm_triton.add_attn_res_mix_norm(c, dl, k, mix_norm, mix_proj, out_norm, 1e-6,
                                                                     out=o, total=t)))
            reference.append(lambda c=current, dl=delta, k=ckpts: norm_ref.add_attn_res_mix_norm(
                c, dl, k, mix_norm, mix_proj, out_norm, 1e-6))
    return ours, reference


def route_cases(rows: int, copies: int, gen: torch.Generator):
    bias = torch.randn(EXPERTS, device="cuda", generator=gen) * 0.1
    ours, reference = [], []
    for _ in range(copies):
        logits = torch.randn(rows, EXPERTS, device="cuda", generator=gen)
        ids = torch.empty(rows, TOP_K, dtype=torch.long, device="cuda")
        weights = torch.empty(rows, TOP_K, dtype=torch.float32, device="cuda")
        ours.append(lambda x=logits, i=ids, w=weights: moe_triton.route_logits(x, bias, TOP_K, SCALING, i, w))
        reference.append(lambda x=logits: moe_ref.route_logits(x, bias, TOP_K, SCALING))
    return ours, reference


def norm_cases(rows: int, copies: int, gen: torch.Generator):
    weight = (torch.rand(WIDTH, device="cuda", generator=gen) + 0.5).bfloat16()
    calls = []
    for _ in range(copies):
        x = torch.randn(rows, WIDTH, device="cuda", generator=gen).bfloat16()
        out = torch.empty_like(x)
        calls.append(lambda x=x, o=out: norm_triton.rms_norm(x, weight, 1e-6, out=o))
    return calls


def cases(l2_bytes: int, gen: torch.Generator):
    """(name, settings, our calls, the reference's calls or None) of every case, cold and hot; the torch
    reference is timed hot only (its chain of ~40 launches a call over thousands of copies makes a graph
    too large to capture quickly)."""
    for cold in (True, False):
        for rows in ROWS:
            per_call = rows * WIDTH * 2
            yield "rms_norm", {"rows": rows, "cold": cold, "bytes": per_call}, \
                norm_cases(rows, copies_for(per_call, l2_bytes, cold), gen), None
            for checkpoints in CHECKPOINTS:
                for parts in PARTS:
                    for tiles in (False, True) if checkpoints else (False,):
                        per_call = (checkpoints + 1) * rows * WIDTH * 2 + parts * rows * WIDTH * 4
                        ours, reference = mix_cases(rows, checkpoints, parts, copies_for(per_call, l2_bytes, cold), gen,
                                                    tiles)
                        yield "mix_norm", {"rows": rows, "cold": cold, "checkpoints": checkpoints, "parts": parts,
                                           "tiles": tiles, "bytes": per_call}, ours, \
                            None if cold or tiles else reference
            per_call = rows * EXPERTS * 4
            ours, reference = route_cases(rows, copies_for(per_call, l2_bytes, cold), gen)
            yield "route", {"rows": rows, "cold": cold, "bytes": per_call}, ours, None if cold else reference


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="experiments/results/h200/glue_bench.json")
    parser.add_argument("--commit", default=None, help="git commit of the tree (if git is not available here)")
    parser.add_argument("--repeats", type=int, default=15, help="timings per case (median)")
    parser.add_argument("--profile-only", action="store_true",
                        help="run every case's kernel three times, untimed and unwritten (under ncu)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be >= 1")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    gen = torch.Generator(device="cuda").manual_seed(0)
    started = time.time()
    rows = []
    result = {**provenance(args.commit), "seconds": 0.0, "width": WIDTH, "experts": EXPERTS, "top_k": TOP_K,
              "rows": rows}
    for name, settings, ours, reference in cases(l2_bytes, gen):
        if args.profile_only:
            for call in ours[:3]:
                call()
            torch.cuda.synchronize()
            continue
        reps = math.ceil(max(60, len(ours)) / len(ours)) * len(ours)
        row = {"kernel": name, **settings, "copies": len(ours), "rotated_bytes": settings["bytes"] * len(ours),
               "ours": time_calls(ours, reps, args.repeats)}
        if reference is not None:
            row["reference"] = time_calls(reference, reps, args.repeats)
        rows.append(row)
        result["seconds"] = time.time() - started
        write_json(args.out, result)  # after every case, so a cut-off run keeps what it measured
    if args.profile_only:
        return 0

    floor = {(r["rows"], r["cold"]): r["ours"]["graph_us"] for r in rows if r["kernel"] == "rms_norm"}
    print("graph-replay us a call; 'x rms' = ours over an rms_norm of the same rows and cache state")
    print(f"{'kernel':9s} {'rows':>4s} {'cache':>5s} {'ckpt':>4s} {'parts':>5s} {'tiles':>5s} {'ours':>7s} "
          f"{'x rms':>6s} {'torch':>7s} {'torch/ours':>10s}")
    for r in rows:
        ours_us, ref = r["ours"]["graph_us"], (r.get("reference") or {}).get("graph_us")
        base = floor.get((r["rows"], r["cold"]))
        print(f"{r['kernel']:9s} {r['rows']:4d} {'cold' if r['cold'] else 'hot':>5s} {r.get('checkpoints', ''):>4} "
              f"{r.get('parts', ''):>5} {'yes' if r.get('tiles') else '':>5} {ours_us or float('nan'):7.2f} "
              f"{(ours_us / base) if ours_us and base else float('nan'):6.2f} {ref or float('nan'):7.2f} "
              f"{(ref / ours_us) if ref and ours_us else float('nan'):10.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
