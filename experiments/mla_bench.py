"""Benchmark of the MLA verify attention (absorbed form, H = 96 or --heads, R = 512, P = 64) on one GPU.

For T in {1, 4, 8, 16} verify tokens and contexts L in {1k, 8k, 32k}, B = 1:
- ours: the CuTe DSL kernel (kernels/mla/cute_sm90.py on Hopper) with the default split-KV
  heuristic, plus a sweep of split counts at every shape (--heads 6: a TP16 rank's share of K3's
  96 heads, where the grid is one row tile and the split combine is a few CTAs),
- torch: what a user writes without a kernel: one request's T*H query rows as a bf16 matmul with
  the 576-wide cache rows, the bottom-right causal mask, softmax, bf16 matmul with the 512-wide
  c_kv (cuBLAS); and F.scaled_dot_product_attention on the same absorbed q/k/v where it runs,
- the bf16 tensor-core peak measured in the same run (8192^3 torch.matmul).
TFLOP/s = 2 * H * T * L * (576 + 512) / time (the causal tail is not subtracted). Timing:
benchlib.time_calls (CUDA-graph replay and eager, CUDA events, median of repeats), calls rotated
over enough cache copies (>= 3, >= 120 MB) that L2 does not serve them. Output: one JSON
(benchlib.provenance: device, versions, commit, command), rewritten after every shape.
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F
from benchlib import median_event_ms, provenance, time_calls, write_json

LATENT, ROPE = 512, 64
# cute_sm90 variants (flags of mla_verify_into), each timed at the default split count
VARIANTS = {
    "split_s+producer_wg": dict(qk_one_warpgroup=False, producer_warpgroup=True),
    "qk_one_wg": dict(qk_one_warpgroup=True, cluster_pairs=False, partial_dtype=torch.float32),
    "qk_one_wg+bf16_partials": dict(qk_one_warpgroup=True, cluster_pairs=False, partial_dtype=torch.bfloat16),
    "qk_one_wg+cluster_pairs": dict(qk_one_warpgroup=True, cluster_pairs=True, partial_dtype=torch.float32),
    "qk_one_wg+cluster_pairs+bf16_partials": dict(qk_one_warpgroup=True, cluster_pairs=True,
                                                  partial_dtype=torch.bfloat16),
}
SCALE = 192**-0.5


def matmul_peak(repeats: int) -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    torch.matmul(a, b, out=c)
    ms = median_event_ms(lambda: torch.matmul(a, b, out=c), repeats)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def tflops(heads: int, tokens: int, context: int, us: float) -> float:
    return 2 * heads * tokens * context * (LATENT + ROPE + LATENT) / (us * 1e-6) / 1e12


def copies_for(context: int) -> int:
    cache_bytes = context * (LATENT + ROPE) * 2
    return max(3, min(8, math.ceil(120e6 / cache_bytes)))


def make_inputs(heads: int, tokens: int, context: int):
    kv_cache = torch.randn(1, context, LATENT + ROPE, device="cuda").to(torch.bfloat16)
    q_latent = torch.randn(1, tokens, heads, LATENT, device="cuda").to(torch.bfloat16)
    q_pe = torch.randn(1, tokens, heads, ROPE, device="cuda").to(torch.bfloat16)
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    cache_lens = torch.tensor([context - tokens], dtype=torch.int64, device="cuda")
    lengths = torch.tensor([tokens], dtype=torch.int64, device="cuda")
    return q_latent, q_pe, kv_cache, slots, cache_lens, lengths


def torch_matmul_path(q_latent, q_pe, kv_cache, cache_len: int):
    """bf16 cuBLAS matmuls + fp32 softmax, the mask precomputed (what a user would write)."""
    tokens, heads = q_latent.shape[1], q_latent.shape[2]
    rows = kv_cache[0]  # [L, 576]
    q = torch.cat([q_latent[0], q_pe[0]], dim=-1).reshape(tokens * heads, LATENT + ROPE)
    keys = torch.arange(rows.shape[0], device=rows.device)
    visible = keys[None, :] < (cache_len + torch.arange(tokens, device=rows.device) + 1)[:, None]
    bias = torch.zeros(tokens, rows.shape[0], device=rows.device).masked_fill_(~visible, float("-inf"))
    bias = bias.repeat_interleave(heads, dim=0)  # [T*H, L]

    def run():
        scores = torch.matmul(q, rows.t()).float() * SCALE + bias
        p = torch.softmax(scores, dim=-1).to(torch.bfloat16)
        return torch.matmul(p, rows[:, :LATENT])

    return run


def torch_sdpa_path(q_latent, q_pe, kv_cache, cache_len: int):
    tokens, heads = q_latent.shape[1], q_latent.shape[2]
    rows = kv_cache[0]
    q = torch.cat([q_latent[0], q_pe[0]], dim=-1).transpose(0, 1).unsqueeze(0)  # [1, H, T, 576]
    k = rows.view(1, 1, -1, LATENT + ROPE).expand(1, heads, -1, -1)
    v = rows[:, :LATENT].view(1, 1, -1, LATENT).expand(1, heads, -1, -1)
    keys = torch.arange(rows.shape[0], device=rows.device)
    mask = keys[None, :] < (cache_len + torch.arange(tokens, device=rows.device) + 1)[:, None]

    def run():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE)

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=96, help="query heads (96: K3's; 6: a TP16 rank's share)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--split-sweep", type=int, nargs="*", default=[1, 2, 4, 8, 11, 16, 22, 32, 44, 64])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--variants", choices=("all", "no_cluster"), default="all",
                        help="no_cluster: skip the cluster-pair variants (when their GPU test failed)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.heads < 1:
        parser.error(f"--heads {args.heads}: must be >= 1")
    heads = args.heads

    from dspark.kernels import cute_common
    from dspark.kernels.mla import cute_host as mla_common

    capability = torch.cuda.get_device_capability()
    if capability == (9, 0):
        from dspark.kernels.mla import cute_sm90 as kernel
    else:
        from dspark.kernels.mla import cute_sm100 as kernel
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    peak = matmul_peak(args.repeats)
    print(f"bf16 8192^3 matmul: {peak:.0f} TFLOP/s")
    record = {
        "bench": "mla_verify_attention",
        **provenance(),
        "capability": list(capability),
        "arch": cute_common.target_arch(),
        "bf16_matmul_peak_tflops": round(peak, 1),
        "heads": heads,
        "flop_formula": "2*H*T*L*(576+512)",
        "timing": "benchlib.time_calls graph_us (eager_us alongside)",
        "results": [],
    }

    def measure(calls):
        timed = time_calls(calls, args.reps, args.repeats)
        us = timed["graph_us"] if timed["graph_us"] is not None else timed["eager_us"]
        return us, timed

    for context in args.contexts:
        for tokens in args.tokens:
            copies = [make_inputs(heads, tokens, context) for _ in range(copies_for(context))]
            out = torch.empty_like(copies[0][0])
            default_splits = mla_common.choose_splits(1, tokens, heads, context, num_sms)
            entry = {"T": tokens, "L": context, "B": 1, "H": heads, "copies": len(copies),
                     "default_splits": default_splits, "splits": {}, "variants": {}}

            def ours(splits, **variant):
                partial_dtype = variant.pop("partial_dtype", getattr(kernel, "DEFAULT_PARTIAL_DTYPE", torch.float32))
                partials = mla_common.workspace(1, tokens, heads, splits, "cuda", partial_dtype)
                return [lambda x=x: kernel.mla_verify_into(*x, SCALE, out, splits=splits, partials=partials, **variant)
                        for x in copies]

            for splits in sorted({default_splits, *args.split_sweep}):
                if splits <= mla_common.MAX_SPLITS:
                    us, timed = measure(ours(splits))
                    entry["splits"][str(splits)] = {"us": round(us, 2), "eager_us": round(timed["eager_us"], 2),
                                                    "tflops": round(tflops(heads, tokens, context, us), 1)}
            if capability == (9, 0):  # every kernel variant at the default split count
                for name, variant in VARIANTS.items():
                    if args.variants == "no_cluster" and variant.get("cluster_pairs"):
                        continue
                    print(f"  T={tokens} L={context} variant {name}", flush=True)  # where a hang would stop
                    us, _ = measure(ours(default_splits, **dict(variant)))
                    entry["variants"][name] = {"us": round(us, 2), "tflops": round(tflops(heads, tokens, context, us), 1),
                                               "pct_peak": round(100 * tflops(heads, tokens, context, us) / peak, 1)}
            best = min(entry["splits"].items(), key=lambda kv: kv[1]["us"])
            default = entry["splits"][str(default_splits)]
            entry.update(
                ours_us=default["us"], ours_tflops=default["tflops"], ours_pct_peak=round(100 * default["tflops"] / peak, 1),
                best_splits=int(best[0]), best_us=best[1]["us"], best_pct_peak=round(100 * best[1]["tflops"] / peak, 1),
            )
            cache_len = context - tokens
            for name, builder in (("torch_matmul", torch_matmul_path), ("torch_sdpa", torch_sdpa_path)):
                try:
                    us, _ = measure([builder(*x[:3], cache_len) for x in copies])
                    entry[f"{name}_us"] = round(us, 2)
                    entry[f"{name}_tflops"] = round(tflops(heads, tokens, context, us), 1)
                except Exception as error:  # noqa: BLE001 - a baseline that does not run is recorded as such
                    entry[f"{name}_error"] = repr(error)[:200]
            record["results"].append(entry)
            print(json.dumps({k: v for k, v in entry.items() if k not in ("splits",)}), flush=True)
            if args.out:
                write_json(args.out, record)
            del copies
            torch.cuda.empty_cache()
    return record


if __name__ == "__main__":
    main()
