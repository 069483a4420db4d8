"""On-device acceptance at Kimi K3's vocabulary: the Triton kernels (kernels/acceptance/triton.py)
vs the torch sampler (dspark.sampling.rejection_sample on the same GPU tensors), B = 1,
T = 8 (k = 7 drafts), V = 163,840.

Cases: greedy; standard at temperature 1 with one-hot drafts and with dense draft probabilities;
standard + top-p 0.9; standard + top-k 50. Method as experiments/benchlib.py: enough input copies
rotate that L2 (50 MB) does not serve them (each call streams its logits, noise and q from HBM),
CUDA events, median of repeats; `graph_us` = per call in a CUDA-graph replay (ours only: the
torch sampler synchronises with the host, `rejected.any()`, and cannot be captured), `eager_us` =
launched from Python. The pure-read floor of a case is its input bytes at the read ceiling
measured in the same run, a measured torch.amax over the same bytes (one kernel per input,
graph), and `read_kernel`: one Triton launch with our split that only reads the same bytes (the
floor of any one-launch design: launch latency plus the read).
Goal: <= 20 us for T = 8 (docs/kernels.md §7 row 9).

Usage: python experiments/acceptance_bench.py [--out experiments/results/h200/acceptance_bench.json]
"""
import argparse
import json
import math
import sys
import time

import torch

import triton
import triton.language as tl

from benchlib import provenance, read_ceiling, time_calls, write_json
from dspark import sampling
from dspark.kernels.acceptance import triton as acceptance

V = 163_840
K = 7
CASES = {  # name: (temperature, top_k, top_p, dense draft probs)
    "greedy": (0.0, 0, 1.0, False),
    "standard_t1": (1.0, 0, 1.0, False),
    "standard_t1_dense_q": (1.0, 0, 1.0, True),
    "top_p_0.9": (1.0, 0, 0.9, False),
    "top_k_50": (1.0, 50, 1.0, False),
}
# options timed for the fp32 no-filter cases (programmatic dependent launch, warps of the combine,
# the split: chunk_size arguments); the first is the default
TUNINGS = {
    "default": dict(block=acceptance.BLOCK, target_programs=acceptance.TARGET_PROGRAMS),
    "pdl": dict(block=acceptance.BLOCK, target_programs=acceptance.TARGET_PROGRAMS, pdl=True),
    "combine_1warp": dict(block=acceptance.BLOCK, target_programs=acceptance.TARGET_PROGRAMS, combine_warps=1),
    # round 1b also timed 160 x 1024 and 80 x 2048 splits: within 1 us of the default
    "block512_p1024": dict(block=512, target_programs=1024),
}


@triton.jit
def read_kernel(logits_ptr, noise_ptr, out_ptr, vocab, steps, BLOCK: tl.constexpr):
    """Reads one chunk of one logits row and of the noise row (as row_partials does) and writes
    one number per program: the read floor of a one-launch acceptance with the same split."""
    split = tl.program_id(0)
    t = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for step in range(steps):
        idx = split * steps * BLOCK + step * BLOCK + lanes
        in_row = idx < vocab
        acc += tl.load(logits_ptr + t * vocab + idx, mask=in_row, other=0.0).to(tl.float32)
        acc += tl.load(noise_ptr + idx, mask=in_row, other=0.0)
    tl.store(out_ptr + t * tl.num_programs(0) + split, tl.sum(acc, 0))


def read_only_call(block):
    chunk = acceptance.chunk_size(1, K + 1, V)
    splits = -(-V // chunk)
    out = torch.empty(K + 1, splits, device="cuda")
    return lambda: read_kernel[(splits, K + 1)](block["target_logits"], block["race_noise"], out, V,
                                                 chunk // acceptance.BLOCK, BLOCK=acceptance.BLOCK,
                                                 num_warps=acceptance.NUM_WARPS)


def make_inputs(case, dtype, copies):
    temperature, top_k, top_p, dense = CASES[case]
    params = sampling.SamplingTensors(
        torch.tensor([temperature], device="cuda"), torch.tensor([top_k], device="cuda"),
        torch.tensor([top_p], device="cuda"), all_greedy=temperature == 0, filters=top_k > 0 or top_p < 1)
    blocks = []
    for _ in range(copies):
        logits = (torch.randn(1, K + 1, V, device="cuda") * 4).to(dtype)
        q = (logits[:, :K].float() + torch.randn(1, K, V, device="cuda")).softmax(-1) if dense else None
        drafts = logits[:, :K].float().argmax(-1)  # mostly right drafts: acceptance runs deep
        blocks.append(dict(target_logits=logits, draft_tokens=drafts, num_drafts=torch.tensor([K], device="cuda"),
                           draft_probs=q, sampling=params, uniforms=torch.rand(1, K, device="cuda"),
                           race_noise=torch.empty(1, V, device="cuda").exponential_()))
    return blocks


def input_bytes(block) -> int:
    tensors = [block["target_logits"], block["race_noise"]] + ([block["draft_probs"]] if block["draft_probs"] is not None else [])
    return sum(t.numel() * t.element_size() for t in tensors)


def bench_case(case, dtype, l2_bytes, ceiling_gbps):
    probe = make_inputs(case, dtype, 1)[0]
    nbytes = input_bytes(probe)
    copies = max(4, math.ceil(4 * l2_bytes / nbytes))
    blocks = make_inputs(case, dtype, copies)
    reps = copies * max(1, math.ceil(40 / copies))
    row = {"case": case, "dtype": str(dtype).replace("torch.", ""), "B": 1, "T": K + 1, "V": V,
           "input_bytes": nbytes, "input_copies": copies,
           "pure_read_at_ceiling_us": nbytes / ceiling_gbps / 1e3}
    # one kernel reading the same bytes (a floor that includes one launch)
    readers = [lambda b=b: [t.amax() for t in (b["target_logits"], b["race_noise"], b["draft_probs"]) if t is not None]
               for b in blocks]
    row["torch_amax_read"] = time_calls(readers, reps)
    try:
        row["triton_read_kernel"] = time_calls([read_only_call(b) for b in blocks], reps)
    except Exception as exc:
        row["triton_read_kernel"] = {"error": f"{type(exc).__name__}: {exc}", "graph_us": None, "eager_us": None}
        print(f"  {case} read_kernel failed: {row['triton_read_kernel']['error']}", file=sys.stderr)
    row["torch_sampler"] = time_calls([lambda b=b: sampling.rejection_sample(**b) for b in blocks], reps, graph=False)
    no_filter = CASES[case][1] == 0 and CASES[case][2] == 1.0
    tunings = TUNINGS if no_filter and dtype == torch.float32 else {"default": TUNINGS["default"]}
    for label, tuning in tunings.items():
        outs = [(torch.empty(1, dtype=torch.long, device="cuda"), torch.empty(1, dtype=torch.long, device="cuda"))
                for _ in blocks]
        calls = [lambda b=b, o=o: acceptance.rejection_sample(**b, out=o, **tuning) for b, o in zip(blocks, outs)]
        try:
            row[f"triton_{label}"] = time_calls(calls, reps)
            # the decisions of the timed configuration equal the sampler's on the first copies
            agree = all([int(x) for x in acceptance.rejection_sample(**b, **tuning)]
                        == [int(x) for x in sampling.rejection_sample(**b)] for b in blocks[:4])
        except Exception as exc:  # a failing option is recorded, the others still get timed
            row[f"triton_{label}"] = {"error": f"{type(exc).__name__}: {exc}", "graph_us": None, "eager_us": None}
            print(f"  {case} {label} failed: {row[f'triton_{label}']['error']}", file=sys.stderr)
            continue
        row[f"triton_{label}"]["decisions_equal_sampler"] = agree
        split_args = {n: tuning[n] for n in ("block", "target_programs")}
        row[f"triton_{label}"]["splits"] = -(-V // acceptance.chunk_size(1, K + 1, V, **split_args))
    print(json.dumps(row), flush=True)
    del blocks
    torch.cuda.empty_cache()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/h200/acceptance_bench.json")
    parser.add_argument("--commit", default=None, help="git commit of the tree (if git is not available here)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    parser.add_argument("--bf16", action="store_true", help="also time bf16 logits for the no-filter cases")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    started = time.time()
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    ceiling = read_ceiling(gib=1.0)
    rows = []
    result = {**provenance(args.commit), "seconds": 0.0, "ceiling": ceiling, "rows": rows}
    jobs = [(c, torch.float32) for c in args.cases.split(",")]
    if args.bf16:
        jobs += [(c, torch.bfloat16) for c in ("greedy", "standard_t1") if c in args.cases.split(",")]
    for case, dtype in jobs:
        rows.append(bench_case(case, dtype, l2_bytes, ceiling["read_ceiling_GBps"]))
        result["seconds"] = time.time() - started
        write_json(args.out, result)  # after every case, so a cut-off run keeps what it measured

    print(f"\nread ceiling {ceiling['read_ceiling_GBps']:.0f} GB/s. us per call, B=1 T={K + 1} V={V}:")
    print(f"{'case':22s} {'dtype':8s} {'read@ceil':>9s} {'amax':>6s} {'readk':>6s} {'torch(eager)':>12s} {'ours graph':>10s} {'ours eager':>10s} same")
    for row in rows:
        ours = row["triton_default"]
        print(f"{row['case']:22s} {row['dtype']:8s} {row['pure_read_at_ceiling_us']:9.2f} "
              f"{row['torch_amax_read']['graph_us'] or 0:6.1f} {row['triton_read_kernel']['graph_us'] or 0:6.1f} "
              f"{row['torch_sampler']['eager_us']:12.1f} "
              f"{ours['graph_us'] or 0:10.1f} {ours['eager_us'] or 0:10.1f} {ours.get('decisions_equal_sampler', ours.get('error'))}")
        for label in TUNINGS:
            if label != "default" and f"triton_{label}" in row:
                r = row[f"triton_{label}"]
                print(f"{'':22s} {label:>30s}: graph {r['graph_us'] or 0:.1f} us, {r.get('splits', r.get('error'))} splits, "
                      f"same {r.get('decisions_equal_sampler')}")


if __name__ == "__main__":
    main()
