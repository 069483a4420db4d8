"""Benchmark of the MLA verify attention (absorbed form, H = 96, R = 512, P = 64) on one GPU.

For T in {1, 4, 8, 16} verify tokens and contexts L in {1k, 8k, 32k}, B = 1:
- ours: the CuTe DSL kernel (kernels/mla/cute_sm90.py on Hopper) with the default split-KV
  heuristic, plus a sweep of split counts at every shape,
- torch: what a user writes without a kernel: one request's T*H query rows as a bf16 matmul with
  the 576-wide cache rows, the bottom-right causal mask, softmax, bf16 matmul with the 512-wide
  c_kv (cuBLAS); and F.scaled_dot_product_attention on the same absorbed q/k/v where it runs,
- the bf16 tensor-core peak measured in the same run (8192^3 torch.matmul).
TFLOP/s = 2 * H * T * L * (576 + 512) / time (the causal tail is not subtracted). Timing: CUDA
graph replay of `reps` calls (falls back to a plain loop if capture fails), CUDA events, median of
`repeats` measurements. Output: one JSON with device, versions, commit ($DSPARK_GIT_COMMIT) and
the command.
"""
import argparse
import json
import os
import platform
import statistics
import sys

import torch
import torch.nn.functional as F

HEADS, LATENT, ROPE = 96, 512, 64
SCALE = 192**-0.5


def time_call(fn, reps: int, repeats: int, use_graph: bool = True):
    """Median microseconds per call; (time, 'graph' | 'loop')."""
    fn()
    torch.cuda.synchronize()
    mode = "loop"
    run = None
    if use_graph:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()  # warm up on the capture stream
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    fn()
            run = graph.replay
            mode = "graph"
        except Exception as error:  # noqa: BLE001 - report and fall back
            print(f"graph capture failed ({error!r}); timing a plain loop", file=sys.stderr)
            torch.cuda.synchronize()
    if run is None:
        def run():
            for _ in range(reps):
                fn()
    run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(samples), mode


def matmul_peak(repeats: int) -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    us, _ = time_call(lambda: torch.matmul(a, b, out=c), reps=20, repeats=repeats, use_graph=False)
    return 2 * n**3 / (us * 1e-6) / 1e12


def tflops(tokens: int, context: int, us: float) -> float:
    return 2 * HEADS * tokens * context * (LATENT + ROPE + LATENT) / (us * 1e-6) / 1e12


def make_inputs(tokens: int, context: int):
    kv_cache = torch.randn(1, context, LATENT + ROPE, device="cuda").to(torch.bfloat16)
    q_latent = torch.randn(1, tokens, HEADS, LATENT, device="cuda").to(torch.bfloat16)
    q_pe = torch.randn(1, tokens, HEADS, ROPE, device="cuda").to(torch.bfloat16)
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    cache_lens = torch.tensor([context - tokens], dtype=torch.int64, device="cuda")
    lengths = torch.tensor([tokens], dtype=torch.int64, device="cuda")
    return q_latent, q_pe, kv_cache, slots, cache_lens, lengths


def torch_matmul_path(q_latent, q_pe, kv_cache, cache_len: int):
    """bf16 cuBLAS matmuls + fp32 softmax, the mask precomputed (what a user would write)."""
    tokens = q_latent.shape[1]
    rows = kv_cache[0]  # [L, 576]
    q = torch.cat([q_latent[0], q_pe[0]], dim=-1).reshape(tokens * HEADS, LATENT + ROPE)
    keys = torch.arange(rows.shape[0], device=rows.device)
    visible = keys[None, :] < (cache_len + torch.arange(tokens, device=rows.device) + 1)[:, None]
    bias = torch.zeros(tokens, rows.shape[0], device=rows.device).masked_fill_(~visible, float("-inf"))
    bias = bias.repeat_interleave(HEADS, dim=0)  # [T*H, L]

    def run():
        scores = torch.matmul(q, rows.t()).float() * SCALE + bias
        p = torch.softmax(scores, dim=-1).to(torch.bfloat16)
        return torch.matmul(p, rows[:, :LATENT])

    return run


def torch_sdpa_path(q_latent, q_pe, kv_cache, cache_len: int):
    tokens = q_latent.shape[1]
    rows = kv_cache[0]
    q = torch.cat([q_latent[0], q_pe[0]], dim=-1).transpose(0, 1).unsqueeze(0)  # [1, H, T, 576]
    k = rows.view(1, 1, -1, LATENT + ROPE).expand(1, HEADS, -1, -1)
    v = rows[:, :LATENT].view(1, 1, -1, LATENT).expand(1, HEADS, -1, -1)
    keys = torch.arange(rows.shape[0], device=rows.device)
    mask = keys[None, :] < (cache_len + torch.arange(tokens, device=rows.device) + 1)[:, None]

    def run():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE)

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--split-sweep", type=int, nargs="*", default=[1, 2, 4, 8, 11, 16, 22, 32, 44, 64])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import cutlass  # noqa: F401  (version for the record)
    from dspark.kernels import cute_common
    from dspark.kernels.mla import cute_common as mla_common

    capability = torch.cuda.get_device_capability()
    if capability == (9, 0):
        from dspark.kernels.mla import cute_sm90 as kernel
    else:
        from dspark.kernels.mla import cute_sm100 as kernel
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    peak = matmul_peak(args.repeats)
    print(f"bf16 8192^3 matmul: {peak:.0f} TFLOP/s")
    results = []
    for context in args.contexts:
        for tokens in args.tokens:
            inputs = make_inputs(tokens, context)
            q_latent = inputs[0]
            out = torch.empty_like(q_latent)
            default_splits = mla_common.choose_splits(1, tokens, HEADS, context, num_sms)
            entry = {"T": tokens, "L": context, "B": 1, "H": HEADS, "default_splits": default_splits, "splits": {}}
            for splits in sorted({default_splits, *args.split_sweep}):
                if splits > mla_common.MAX_SPLITS:
                    continue
                partials = mla_common.workspace(1, tokens, HEADS, splits, "cuda")
                fn = lambda s=splits, p=partials: kernel.mla_verify_into(*inputs, SCALE, out, splits=s, partials=p)  # noqa: E731
                us, mode = time_call(fn, args.reps, args.repeats)
                entry["splits"][str(splits)] = {"us": round(us, 2), "tflops": round(tflops(tokens, context, us), 1)}
                entry["timing"] = mode
            if capability == (9, 0):  # every kernel variant at the default split count
                for producer_warpgroup in (False, True):
                    for defer in (False, True):
                        partials = mla_common.workspace(1, tokens, HEADS, default_splits, "cuda")
                        fn = lambda v=producer_warpgroup, d=defer, p=partials: kernel.mla_verify_into(  # noqa: E731
                            *inputs, SCALE, out, splits=default_splits, partials=p, producer_warpgroup=v, defer_pv_wait=d)
                        us, _ = time_call(fn, args.reps, args.repeats)
                        entry[f"variant_pwg{int(producer_warpgroup)}_defer{int(defer)}_us"] = round(us, 2)
            best = min(entry["splits"].items(), key=lambda kv: kv[1]["us"])
            ours = entry["splits"][str(default_splits)]
            entry.update(
                ours_us=ours["us"], ours_tflops=ours["tflops"], ours_pct_peak=round(100 * ours["tflops"] / peak, 1),
                best_splits=int(best[0]), best_us=best[1]["us"], best_pct_peak=round(100 * best[1]["tflops"] / peak, 1),
            )
            cache_len = context - tokens
            for name, builder in (("torch_matmul", torch_matmul_path), ("torch_sdpa", torch_sdpa_path)):
                try:
                    us, _ = time_call(builder(*inputs[:3], cache_len), args.reps, args.repeats)
                    entry[f"{name}_us"] = round(us, 2)
                    entry[f"{name}_tflops"] = round(tflops(tokens, context, us), 1)
                except Exception as error:  # noqa: BLE001 - a baseline that does not run is recorded as such
                    entry[f"{name}_error"] = repr(error)[:200]
            results.append(entry)
            print(json.dumps({k: v for k, v in entry.items() if k != "splits"}))
    record = {
        "bench": "mla_verify_attention",
        "device": torch.cuda.get_device_name(),
        "capability": list(capability),
        "num_sms": num_sms,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cutlass_dsl": getattr(__import__("cutlass"), "__version__", "unknown"),
        "python": platform.python_version(),
        "commit": os.environ.get("DSPARK_GIT_COMMIT", "unknown"),
        "command": " ".join([sys.executable, *sys.argv]),
        "arch": cute_common.target_arch(),
        "bf16_matmul_peak_tflops": round(peak, 1),
        "flop_formula": "2*H*T*L*(576+512)",
        "results": results,
    }
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(record, handle, indent=1)
    return record


if __name__ == "__main__":
    main()
