"""DSpark's vocabulary-wide loss terms (CE and L1 with their backward) on the GPU at a SmolLM2
training step, in one run (docs/kernels.md §12):

  fused    ops.draft_head_loss (kernels/draft_loss/head_triton.py): bf16 operands, float32 logits
           recomputed in tiles and never stored; bf16 target rows;
  today    float32 logits from torch matmuls under TF32 (hidden lm_head^T + prev_embedding
           markov_w2^T), draft_loss_terms' Triton kernels and their backward, autograd through the
           matmuls; float32 target rows (what draft_loss_terms takes);
  fused_float32_rows  the fused op reading float32 target rows, as the recipe's teacher gives them;
  ceiling  FLOPs at the bf16 matmul rate measured in the same run (a large square cuBLAS GEMM):
           the fused op's own (3 recomputations of the logits' GEMM, d[hidden ; prev] = dz
           [lm_head ; markov_w2], d markov_w2 = dz^T prev) and the algorithmic minimum (3 GEMMs:
           the logits, then those two).

Sizes (defaults): N = 32,768 slots (16 sequences x ~293 anchors x block 7), d = 576, r = 256,
V = 49,152, M = 12,288 target rows. Operands in float32 as the drafter trains them (the fused op's
bf16 copies are part of its time). Every call is forward + backward with random upstream weights
(loss = sum(w_ce ce) + sum(w_l1 l1), as training weighs the slots).

Method (experiments/benchlib.py): warm-up calls first (the Triton autotuner picks its tiles there),
then CUDA events around each call, median of --repeats; eager (the op checks its indices with one
synchronisation, so it is not graph-captured). The weights are larger than L2 and every pass
streams them, so no input rotation is needed. Peak memory: the allocator's peak during one call
above what was allocated before it. The fused op's kernels are also timed one by one with the
torch profiler (one call).

Usage: python experiments/draft_loss_bench.py --out experiments/results/h200/draft_loss_bench.json
"""
import argparse
import sys

import torch

from benchlib import median_event_ms, provenance, write_json
from dspark.kernels import ops
from dspark.kernels.draft_loss import head_kernels, head_triton
from dspark.kernels.draft_loss import triton as terms_triton


def make_inputs(args, gen):
    def normal(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    N, V, d, r, M = args.slots, args.vocab, args.hidden, args.rank, args.target_rows
    leaves = [(normal(N, d) * 2).requires_grad_(), normal(N, r).requires_grad_(),
              (normal(V, r) / r**0.5).requires_grad_()]
    lm_head = normal(V, d) * (1.5 / d**0.5)
    target = torch.softmax(normal(M, V) * 2.5, dim=-1)
    rows = torch.randint(0, M, (N,), generator=gen, device="cuda")
    labels = torch.randint(0, V, (N,), generator=gen, device="cuda")
    weights = torch.rand(2, N, generator=gen, device="cuda")
    return leaves, lm_head, target, rows, labels, weights


def fused_call(leaves, lm_head, target_bf16, rows, labels, weights, backward=True):
    hidden, prev, w2 = leaves
    ce, l1 = ops.draft_head_loss(hidden, prev, lm_head, w2, target_bf16, rows, labels)
    if backward:
        torch.autograd.grad((weights[0] * ce).sum() + (weights[1] * l1).sum(), leaves)
    return ce, l1


def today_call(leaves, lm_head, target, rows, labels, weights, backward=True):
    hidden, prev, w2 = leaves
    logits = hidden @ lm_head.t() + prev @ w2.t()
    ce, l1 = terms_triton.draft_loss_terms(logits, target, rows, labels)
    if backward:
        torch.autograd.grad((weights[0] * ce).sum() + (weights[1] * l1).sum(), leaves)
    return ce, l1


def measure(call, repeats: int, warmups: int) -> dict:
    """Median ms of forward alone and of forward + backward, and the peak memory of one call."""
    for _ in range(warmups):
        call(backward=True)
    torch.cuda.synchronize()
    result = {"forward_ms": median_event_ms(lambda: call(backward=False), repeats),
              "forward_backward_ms": median_event_ms(lambda: call(backward=True), repeats)}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call(backward=True)
    torch.cuda.synchronize()
    result["peak_extra_GB"] = (torch.cuda.max_memory_allocated() - before) / 1e9
    return result


def bf16_matmul_tflops(size: int = 8192, repeats: int = 20) -> float:
    a, b = (torch.randn(size, size, device="cuda").bfloat16() for _ in range(2))
    torch.mm(a, b)
    torch.cuda.synchronize()
    return 2 * size**3 / (median_event_ms(lambda: torch.mm(a, b), repeats) * 1e-3) / 1e12


def kernel_breakdown(call) -> list[dict]:
    """GPU time per kernel name over one forward + backward (torch profiler), largest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call(backward=True)
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": event.key[:90], "calls": event.count, "ms": us / 1e3})
    return sorted(rows, key=lambda row: -row["ms"])


def autotuned_configs() -> dict:
    return {name: str(getattr(getattr(head_kernels, name), "best_config", None))
            for name in ("head_lse_kernel", "head_l1_kernel", "head_grad_kernel")}


def fail(message: str) -> None:
    print(f"draft_loss_bench: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="experiments/results/h200/draft_loss_bench.json")
    parser.add_argument("--slots", type=int, default=32768, help="N, supervised block slots per step")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576, help="d")
    parser.add_argument("--rank", type=int, default=256, help="r, the Markov head's rank")
    parser.add_argument("--target-rows", type=int, default=12288, help="M")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmups", type=int, default=3, help="calls before timing (the autotuner runs in the first)")
    args = parser.parse_args()
    for name in ("slots", "vocab", "hidden", "rank", "target_rows", "repeats", "warmups"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not torch.cuda.is_available():
        fail("needs a CUDA device")
    torch.set_float32_matmul_precision("high")  # today's path runs its float32 matmuls as TF32
    gen = torch.Generator(device="cuda").manual_seed(0)
    leaves, lm_head, target, rows, labels, weights = make_inputs(args, gen)
    target_bf16 = target.bfloat16()
    N, V, d, r = args.slots, args.vocab, args.hidden, args.rank
    result = {**provenance(), "sizes": {"N": N, "V": V, "d": d, "r": r, "M": args.target_rows},
              "grad_buffer_bytes": head_triton.GRAD_BUFFER_BYTES,
              "grad_chunk_rows": head_triton.grad_chunk_rows(N, V)}

    peak = bf16_matmul_tflops()
    gemm = 2 * N * V * (d + r)
    flops = {"fused": 4 * gemm + 2 * N * V * r, "minimum": 2 * gemm + 2 * N * V * r}
    result["ceiling"] = {"bf16_matmul_TFLOPs": peak, "flops": flops,
                         **{f"{k}_ms": f / (peak * 1e12) * 1e3 for k, f in flops.items()}}
    write_json(args.out, result)

    def fused(backward=True):
        return fused_call(leaves, lm_head, target_bf16, rows, labels, weights, backward)

    def today(backward=True):
        return today_call(leaves, lm_head, target, rows, labels, weights, backward)

    result["fused"] = measure(fused, args.repeats, args.warmups)
    result["fused"]["autotuned"] = autotuned_configs()
    result["fused"]["kernels"] = kernel_breakdown(fused)
    write_json(args.out, result)
    # The recipe's teacher rows are float32 (the softmax of the LM head's logits): the fused op reading them.
    call = lambda backward=True: fused_call(leaves, lm_head, target, rows, labels, weights, backward)  # noqa: E731
    result["fused_float32_rows"] = {**measure(call, args.repeats, args.warmups), "kernels": kernel_breakdown(call)[:4]}
    write_json(args.out, result)
    result["today"] = measure(today, args.repeats, args.warmups)
    result["today"]["kernels"] = kernel_breakdown(today)
    with torch.no_grad():
        got, ref = fused(backward=False), today(backward=False)
    result["fused_vs_today_max_abs"] = {name: (g - w).abs().max().item() for name, g, w in zip(("ce", "l1"), got, ref)}
    fused_ms, today_ms = result["fused"]["forward_backward_ms"], result["today"]["forward_backward_ms"]
    result["ratios"] = {"today_over_fused": today_ms / fused_ms,
                        "fused_over_ceiling_of_its_flops": fused_ms / result["ceiling"]["fused_ms"],
                        "fused_over_ceiling_of_3_gemms": fused_ms / result["ceiling"]["minimum_ms"],
                        "fused_TFLOPs": flops["fused"] / (fused_ms * 1e-3) / 1e12}
    write_json(args.out, result)
    print_tables(result)


def print_tables(result: dict) -> None:
    print("fused op, GPU time per kernel (one forward + backward):")
    for row in result["fused"]["kernels"][:8]:
        print(f"  {row['ms']:8.2f} ms  x{row['calls']:<3d} {row['kernel']}")
    print(f"autotuned: {result['fused']['autotuned']}")
    print(f"fused vs today, max |difference|: {result['fused_vs_today_max_abs']}")
    sizes = result["sizes"]
    print(f"\nN={sizes['N']} V={sizes['V']} d={sizes['d']} r={sizes['r']} M={sizes['M']}, "
          f"bf16 matmul {result['ceiling']['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    print(f"{'':28s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'peak GB':>8s}")
    for name in ("fused", "fused_float32_rows", "today"):
        r = result[name]
        print(f"{name:28s} {r['forward_ms']:8.2f} {r['forward_backward_ms']:11.2f} {r['peak_extra_GB']:8.2f}")
    print(f"{'ceiling, fused FLOPs':28s} {'':8s} {result['ceiling']['fused_ms']:11.2f}")
    print(f"{'ceiling, 3 GEMMs':28s} {'':8s} {result['ceiling']['minimum_ms']:11.2f}")
    ratios = result["ratios"]
    print(f"today / fused {ratios['today_over_fused']:.2f}x; fused / its ceiling "
          f"{ratios['fused_over_ceiling_of_its_flops']:.2f}x; fused / 3-GEMM ceiling "
          f"{ratios['fused_over_ceiling_of_3_gemms']:.2f}x; fused at {ratios['fused_TFLOPs']:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
