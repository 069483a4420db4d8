"""K3 latent-MoE block (dspark/targets/kimi_k3/moe.py) on the GPU: the torch reference ops, the CuTe DSL
MXFP4 expert kernels (kernels/moe/cute_sm90.py) and the byte floor, per T in {1, 2, 4, 8, 16} (docs/kernels.md §4, §6).

Method (experiments/benchlib.py): a full-size bank of 896 random MXFP4 experts (15.7 GB) so every
call streams its experts from HBM; several routings (different random experts) rotate; CUDA
graph replay (ours) and eager calls (the reference, which syncs to the host per expert); median
of repeats. The byte floor is the bytes a call must read at the pure-read rate measured in the
same run: distinct experts x 17.55 MB, plus for the whole block the dense bf16 weights (router,
latent down/up, shared gate/up/down).

Usage: python experiments/moe_bench.py --out experiments/results/h200/moe_bench.json [--tokens 1 8]
"""
import argparse
import time

import torch

from benchlib import provenance, read_ceiling, time_calls, write_json
from dspark.kernels import registry
from dspark.kernels.moe import expert_layout
from dspark.kernels.moe import cute_sm90, reference
from dspark.targets.kimi_k3 import moe as k3_moe
from dspark.targets.kimi_k3.config import K3

ROUTINGS = 6  # distinct routings rotated per measurement


def make_weights(cfg, gen):
    E, D, L, I, S = cfg.num_experts, cfg.hidden_size, cfg.latent_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size

    def codes(rows, k):
        packed = torch.randint(0, 256, (E, rows, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        scale = torch.randint(119, 121, (E, rows, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
        return packed, scale

    def dense(n, k):
        return (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)

    w1, s1 = codes(I, L)
    w3, s3 = codes(I, L)
    w2, s2 = codes(L, I)
    return k3_moe.LatentMoEWeights.from_parts(
        gate=dense(E, D), score_bias=torch.zeros(E, device="cuda"), latent_down=dense(L, D),
        latent_norm=torch.ones(L, dtype=torch.bfloat16, device="cuda"), latent_up=dense(D, L),
        shared_gate=dense(S, D), shared_up=dense(S, D), shared_down=dense(D, S),
        w1_packed=w1, w1_scale=s1, w3_packed=w3, w3_scale=s3, w2_packed=w2, w2_scale=s2,
    )


def expert_bytes(weights) -> int:
    return sum(t[0].numel() for t in (weights.w1_packed, weights.w1_scale, weights.w3_packed,
                                       weights.w3_scale, weights.w2_packed, weights.w2_scale))


def dense_bytes(weights) -> int:
    return sum(t.numel() * t.element_size() for t in (weights.gate, weights.latent_down, weights.latent_up,
                                                      weights.shared_gate, weights.shared_up, weights.shared_down))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="experiments/results/h200/moe_bench.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--no-reference", action="store_true", help="skip the torch reference block")
    parser.add_argument("--variants", nargs="+", default=["registers+torch", "tma+torch", "tma+device"],
                        help="loader+lists (cute_sm90.DEFAULT_LOADER, DEFAULT_LISTS); "
                        "the first is the reference for the cross-check")
    args = parser.parse_args()
    cfg = K3
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"provenance": provenance(), "rows": []}
    result["ceiling"] = read_ceiling()
    rate = result["ceiling"]["read_ceiling_GBps"]
    weights = make_weights(cfg, gen)
    per_expert, dense = expert_bytes(weights), dense_bytes(weights)
    result["bytes_per_expert"], result["dense_bytes"] = per_expert, dense
    write_json(args.out, result)

    for tokens in args.tokens:
        t0 = time.time()
        row = {"T": tokens}
        # Random routing: distinct experts per token, independent across tokens (docs/kernels.md §4.1).
        ids_sets = [torch.stack([torch.randperm(cfg.num_experts, device="cuda", generator=gen)[: cfg.num_experts_per_token]
                                 for _ in range(tokens)]) for _ in range(ROUTINGS)]
        latents = [torch.randn(tokens, cfg.latent_size, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(ROUTINGS)]
        distinct = sum(len(ids.unique()) for ids in ids_sets) / ROUTINGS
        row["distinct_experts"] = distinct
        routed_floor_us = distinct * per_expert / rate / 1e3
        row["routed_floor_us"] = routed_floor_us
        xs = [torch.randn(tokens, cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(ROUTINGS)]
        routed_ids = [reference.moe_route(x, weights.gate, weights.score_bias, cfg.num_experts_per_token,
                                          cfg.routed_scaling_factor)[0] for x in xs]
        block_distinct = sum(len(ids.unique()) for ids in routed_ids) / ROUTINGS
        block_floor_us = (block_distinct * per_expert + dense) / rate / 1e3
        row["block_distinct_experts"], row["block_floor_us"] = block_distinct, block_floor_us
        reps = 2 * ROUTINGS
        outputs = {}
        for variant in args.variants:
            loader, lists = variant.split("+")
            # what routed_experts / the block use
            cute_sm90.DEFAULT_LOADER, cute_sm90.DEFAULT_LISTS = loader, lists
            passes_done = any(v.split("+")[0] == loader for v in row.get("variants_done", []))
            try:
                timings = measure_variant(weights, cfg, tokens, ids_sets, latents, xs, reps, rate, distinct,
                                          passes=not passes_done)
                outputs[variant] = k3_moe.latent_moe(xs[0], weights, cfg).double()
            except Exception as exc:  # keep the other variants' numbers
                row[variant] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                continue
            timings["routed_GBps"] = distinct * per_expert / best_us(timings["routed"]) / 1e3
            timings["routed_pct_floor"] = 100 * routed_floor_us / best_us(timings["routed"])
            timings["block_pct_floor"] = 100 * block_floor_us / best_us(timings["block"])
            row[variant] = timings
            row.setdefault("variants_done", []).append(variant)
        # the variants compute the same math: their block outputs must agree (a cheap correctness
        # check of whatever the GPU tests did not cover in this run)
        first = outputs[next(iter(outputs))]
        row["variants_rel_diff"] = {v: ((out - first).norm() / first.norm()).item() for v, out in outputs.items()}
        cute_sm90.DEFAULT_LOADER, cute_sm90.DEFAULT_LISTS = args.variants[0].split("+")
        if not args.no_reference:
            with registry.scoped((("linear", "reference"), ("moe_route", "reference"), ("moe_experts", "reference"))):
                # eager only (it syncs to the host per expert), 3 routings x 2 repeats after warm-up
                ref_calls = [lambda x=x: k3_moe.latent_moe(x, weights, cfg) for x in xs[:3]]
                timing = time_calls(ref_calls, 3, repeats=2, graph=False)
                reference_out = k3_moe.latent_moe(xs[0], weights, cfg).double()
            row["block_reference_torch"] = timing
            row["block_reference_pct_floor"] = 100 * block_floor_us / timing["eager_us"]
            row["ours_vs_reference_rel_diff"] = {
                v: ((out - reference_out).norm() / reference_out.norm()).item() for v, out in outputs.items()
            }
        row["seconds"] = time.time() - t0
        print(row, flush=True)
        result["rows"].append(row)
        write_json(args.out, result)


def best_us(timing: dict) -> float:
    return timing["graph_us"] or timing["eager_us"]


def measure_variant(weights, cfg, tokens, ids_sets, latents, xs, reps, rate, distinct, passes: bool) -> dict:
    """Graph/eager us of: the two expert passes alone if `passes` (lists, gathered tokens and act
    precomputed: separates the kernels from the torch glue), the routed half (lists + passes +
    gathers) and the whole block (router + down + experts + norm + up + shared), for
    cute_sm90.DEFAULT_LOADER and DEFAULT_LISTS."""
    out = {}
    if passes:
        out.update(measure_passes(weights, cfg, tokens, ids_sets, latents, reps, rate, distinct))
    routed = [lambda h=h, ids=ids: cute_sm90.routed_experts(h, ids, weights.experts, cfg.situ_beta, cfg.situ_linear_beta)
              for h, ids in zip(latents, ids_sets)]
    out["routed"] = time_calls(routed, reps, repeats=3)
    block = [lambda x=x: k3_moe.latent_moe(x, weights, cfg) for x in xs]
    out["block"] = time_calls(block, reps, repeats=3)
    return out


def measure_passes(weights, cfg, tokens, ids_sets, latents, reps, rate, distinct) -> dict:
    out = {}
    tile = cute_sm90.token_tile(tokens)
    lists = [expert_layout.build_expert_lists(ids, cfg.num_experts, tile) for ids in ids_sets]
    xbs = [cute_sm90.tokens_for_kernel(h, lst) for h, lst in zip(latents, lists)]
    acts = [torch.empty((lst.slot_expert.shape[0], tile, cfg.moe_intermediate_size), dtype=torch.bfloat16,
                        device="cuda") for lst in lists]
    ys = [torch.empty((lst.slot_expert.shape[0], tile, cfg.latent_size), dtype=torch.float32, device="cuda")
          for lst in lists]
    pass1 = [lambda lst=lst, xb=xb, act=act: cute_sm90.expert_pass(
        weights.w1_packed, weights.w1_scale, weights.w3_packed, weights.w3_scale, lst, xb, act, True,
        cfg.situ_beta, cfg.situ_linear_beta) for lst, xb, act in zip(lists, xbs, acts)]
    pass2 = [lambda lst=lst, act=act, y=y: cute_sm90.expert_pass(
        weights.w2_packed, weights.w2_scale, weights.w2_packed, weights.w2_scale, lst, act, y, False)
        for lst, act, y in zip(lists, acts, ys)]
    w13_bytes = 2 * (weights.w1_packed[0].numel() + weights.w1_scale[0].numel())
    w2_bytes = weights.w2_packed[0].numel() + weights.w2_scale[0].numel()
    for name, pass_calls, nbytes in (("pass1_w13", pass1, w13_bytes), ("pass2_w2", pass2, w2_bytes)):
        timing = time_calls(pass_calls, reps, repeats=3)
        out[name] = timing
        out[name + "_GBps"] = distinct * nbytes / best_us(timing) / 1e3
        out[name + "_pct_floor"] = 100 * distinct * nbytes / rate / 1e3 / best_us(timing)
    return out


if __name__ == "__main__":
    main()
