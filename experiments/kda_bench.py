"""KDA verify + commit per layer on the GPU at Kimi K3 dims (H=96, D=128), batch 1, T=8 by default:
the CuTe DSL kernels (kernels/kda/cute_common.py) vs fla's Triton fused_recurrent_kda vs the torch
reference (kernels/kda/reference.py) run on the GPU.

Method (METHOD.md): random inputs; `layers` independent layers (states, inputs, records) rotate so
their fp32 states (6.29 MB each) are >= 1.5x the L2 and every call streams its state from HBM;
CUDA events; warm-up first; median over repeats. Per-layer microseconds two ways:
  graph - one CUDA graph of a pass over all layers, replay time / layers (how a verify step runs);
  eager - the same calls launched from Python (adds host overhead where it exceeds GPU time).
Floor: verify reads the state once (6.29 MB), commit reads and writes it (12.6 MB); the bytes
over the measured read and copy ceilings give the floors printed beside the results.
fla's kernel is timed on pre-conv'd q/k/v (no conv, no gated RMSNorm, no records): it does less
work than our verify, and with output_final_state it writes the final state (a commit of all T).

Usage: python experiments/kda_bench.py [--tokens 8] [--out experiments/results/h200/kda_bench.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from dspark.kernels import cute_common
from dspark.kernels.kda import cute_common as kda_cute
from dspark.kernels.kda import reference

HEADS, HEAD_DIM = 96, 128
LOWER_BOUND, EPS = -5.0, 1e-5


def median_event_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_per_call(calls, repeats: int = 20, graph: bool = True) -> dict:
    """Microseconds per call of a pass over `calls`, eagerly and (if capturable) as a CUDA graph."""

    def run_all():
        for call in calls:
            call()

    for _ in range(3):
        run_all()
    torch.cuda.synchronize()
    result = {"eager_us": median_event_ms(run_all, repeats) * 1e3 / len(calls)}
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run_all()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run_all()
            g.replay()
            torch.cuda.synchronize()
            result["graph_us"] = median_event_ms(g.replay, repeats) * 1e3 / len(calls)
        except Exception as exc:  # report, do not hide: the eager number still stands
            result["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return result


def warm_up_clocks(seconds: float = 1.0) -> dict:
    """Run bf16 matmuls for `seconds` so the SM clock has ramped up before a timed section (the
    H200 idles at 345 MHz and a few-us latency-bound kernel alone does not raise it: run 1
    measured everything at a low clock). Clocks are only read, never set."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = time.time()
    while time.time() - start < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
    return {"sm_clock_mhz_after_warmup": _sm_clock_mhz()}


def _sm_clock_mhz():
    try:
        return torch.cuda.clock_rate()
    except Exception as exc:
        return f"unreadable: {type(exc).__name__}"


def make_layer(batch, tokens, gen):
    width = HEADS * HEAD_DIM

    def randn(*shape, scale=1.0, dt=torch.bfloat16):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dt)

    return dict(
        q_in=randn(batch, tokens, width), k_in=randn(batch, tokens, width), v_in=randn(batch, tokens, width),
        f=randn(batch, tokens, width), beta_in=randn(batch, tokens, HEADS), gate_in=randn(batch, tokens, width),
        conv_weight=randn(3, width, 4, scale=0.5, dt=torch.float32), conv_state=randn(batch, 3, width, 3),
        A_log=randn(HEADS, scale=0.5, dt=torch.float32), dt_bias=randn(width, scale=0.5, dt=torch.float32),
        o_norm_weight=1.0 + randn(HEAD_DIM, scale=0.1, dt=torch.float32),
        state=randn(batch, HEADS, HEAD_DIM, HEAD_DIM, scale=0.1, dt=torch.float32),
        lengths=torch.full((batch,), tokens, device="cuda", dtype=torch.int64),
    )


def ceilings(nbytes: int, copies: int) -> dict:
    """Read (sum) and copy bandwidth on fp32 buffers of the state's size, rotated past the L2."""
    bufs = [torch.randn(nbytes // 4, device="cuda") for _ in range(copies)]
    outs = [torch.empty_like(b) for b in bufs]
    read = time_per_call([lambda b=b: b.sum() for b in bufs], graph=False)["eager_us"]
    copy = time_per_call([lambda b=b, o=o: o.copy_(b) for b, o in zip(bufs, outs)], graph=False)["eager_us"]
    big = torch.randn(2**28, device="cuda")  # 1 GiB: launch overhead negligible
    read_big = median_event_ms(big.sum, 10)
    return {"state_read_us": read, "state_copy_us": copy, "read_GBps_1GiB": big.numel() * 4 / read_big / 1e6}


def bench_ours(layers, accepted, arch, block_v):
    """Our verify, commit and the all-layers commit for one block_v (per-layer us)."""
    L = len(layers)
    records = []
    for x in layers:
        _, rec = kda_cute.verify(*x.values(), lower_bound=LOWER_BOUND, eps=EPS, arch=arch, block_v=block_v)
        records.append(rec)
    outs = [torch.empty_like(x["q_in"]) for x in layers]
    verify_calls = [
        (lambda x=x, r=r, o=o: kda_cute.verify(*x.values(), lower_bound=LOWER_BOUND, eps=EPS, arch=arch,
                                               block_v=block_v, records=r, out=o))
        for x, r, o in zip(layers, records, outs)
    ]
    # commit replays into scratch copies so every repeat starts from the same state
    scratch = [(x["state"].clone(), x["conv_state"].clone()) for x in layers]
    commit_calls = [
        (lambda s=s, r=r: kda_cute.commit(s[0], s[1], r, accepted, arch=arch, block_v=block_v))
        for s, r in zip(scratch, records)
    ]
    both = [c for pair in zip(verify_calls, commit_calls) for c in pair]
    stacked_states = torch.stack([s[0] for s in scratch])
    stacked_conv = torch.stack([s[1] for s in scratch])
    stacked_records = reference.KDARecords(
        *(torch.stack([getattr(r, n) for r in records]) for n in ("keys", "updates", "decays", "conv_inputs")),
        records[0].lengths)
    all_layers = [lambda: kda_cute.commit_layers(stacked_states, stacked_conv, stacked_records, accepted,
                                                 arch=arch, block_v=block_v)]
    row = {
        "verify": time_per_call(verify_calls),
        "commit": time_per_call(commit_calls),
        "verify_then_commit_pair": time_per_call(both),  # per call; x2 for per layer
        "commit_all_layers_one_launch": time_per_call(all_layers),
    }
    row["commit_all_layers_one_launch"] = {k: (v / L if isinstance(v, float) else v)
                                           for k, v in row["commit_all_layers_one_launch"].items()}
    row["verify_plus_commit_per_layer_graph_us"] = 2 * row["verify_then_commit_pair"].get("graph_us", float("nan"))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--out", default="experiments/results/h200/kda_bench.json")
    parser.add_argument("--commit", default=None, help="git commit of the tree (if git is not available here)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    commit = args.commit
    if commit is None:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
        except Exception:
            commit = "unknown"
    started = time.time()
    arch = cute_common.target_arch()
    B, T, L = args.batch, args.tokens, args.layers
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [make_layer(B, T, gen) for _ in range(L)]
    state_bytes = B * HEADS * HEAD_DIM * HEAD_DIM * 4
    rows = {"clock_before_warmup_mhz": _sm_clock_mhz(), "warmup": warm_up_clocks(2.0)}
    rows["ceilings"] = ceilings(state_bytes, L)
    accepted = torch.full((B,), T, device="cuda", dtype=torch.int64)  # worst case: replay all T

    # ours, block_v = 32 (4 CTAs per head, cluster of 4) and 128 (1 CTA per head, no cluster)
    for block_v in (32, 64, 128):
        try:
            warm = warm_up_clocks()
            rows[f"cute_block_v{block_v}"] = bench_ours(layers, accepted, arch, block_v)
            rows[f"cute_block_v{block_v}"].update(warm, sm_clock_mhz_after=_sm_clock_mhz())
        except Exception as exc:  # one failing variant must not hide the others
            rows[f"cute_block_v{block_v}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(json.dumps({f"cute_block_v{block_v}": rows[f"cute_block_v{block_v}"]}), flush=True)

    # fla's Triton recurrence on already-conv'd q/k/v (less work than ours, see the docstring)
    try:
        from fla.ops.kda import fused_recurrent_kda

        fla_inputs = []
        for x in layers:
            split = lambda t: t.reshape(B, T, HEADS, HEAD_DIM).contiguous()  # noqa: E731
            fla_inputs.append(dict(q=split(x["q_in"]), k=split(x["k_in"]), v=split(x["v_in"]), g=split(x["f"]),
                                   beta=x["beta_in"], A_log=x["A_log"][:HEADS].contiguous(), dt_bias=x["dt_bias"],
                                   initial_state=x["state"].clone()))

        def fla_call(y, final_state):
            return fused_recurrent_kda(y["q"], y["k"], y["v"], y["g"], y["beta"], A_log=y["A_log"], dt_bias=y["dt_bias"],
                                       initial_state=y["initial_state"], output_final_state=final_state,
                                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)

        warm = warm_up_clocks()
        rows["fla_fused_recurrent_kda"] = {
            **warm,
            "output_only": time_per_call([lambda y=y: fla_call(y, False) for y in fla_inputs]),
            "with_final_state": time_per_call([lambda y=y: fla_call(y, True) for y in fla_inputs]),
        }
    except Exception as exc:
        rows["fla_fused_recurrent_kda"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    print(json.dumps({"fla": rows["fla_fused_recurrent_kda"]}), flush=True)

    # the torch reference on the GPU (fp32 state, eager: it is many small kernels)
    try:
        def ref_pair(x):
            _, rec = reference.kda_verify(*x.values(), lower_bound=LOWER_BOUND, eps=EPS)
            reference.kda_commit(x["state"].clone(), x["conv_state"].clone(), rec, accepted)

        rows["torch_reference"] = time_per_call([lambda x=x: ref_pair(x) for x in layers[:4]], repeats=5, graph=False)
    except Exception as exc:
        rows["torch_reference"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    print(json.dumps({"torch_reference": rows["torch_reference"]}), flush=True)

    import cutlass

    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "fla": _version("fla"),
        "cutlass_dsl": getattr(cutlass, "__version__", "unknown"),
        "arch": arch,
        "commit": commit,
        "command": " ".join(sys.argv),
        "shape": {"batch": B, "tokens": T, "heads": HEADS, "head_dim": HEAD_DIM, "layers_rotated": L},
        "seconds": time.time() - started,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    c = rows["ceilings"]
    print(f"\nK3 KDA layer, B={B} T={T}: state read {c['state_read_us']:.1f} us, copy {c['state_copy_us']:.1f} us "
          f"(1 GiB read {c['read_GBps_1GiB']:.0f} GB/s). Per layer, us (graph / eager):")
    for name, row in rows.items():
        if name.startswith("cute") and "error" in row:
            print(f"{name:18s} {row['error']}")
        elif name.startswith("cute"):
            v, m, a = row["verify"], row["commit"], row["commit_all_layers_one_launch"]
            print(f"{name:18s} verify {v.get('graph_us', float('nan')):6.1f} / {v['eager_us']:6.1f}   "
                  f"commit {m.get('graph_us', float('nan')):6.1f} / {m['eager_us']:6.1f}   "
                  f"commit(all layers, 1 launch) {a.get('graph_us', float('nan')):6.1f}   "
                  f"verify+commit {row['verify_plus_commit_per_layer_graph_us']:6.1f}")
    print("fla", json.dumps(rows["fla_fused_recurrent_kda"]))
    print("torch reference", json.dumps(rows["torch_reference"]))


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:
        return "not importable"


if __name__ == "__main__":
    main()
