"""KDA verify + commit per layer on the GPU at Kimi K3 dims (H=96, D=128), batch 1, T=8 by default:
the CuTe DSL kernels (kernels/kda/cute_kernel.py) vs fla's Triton fused_recurrent_kda vs the torch
reference (kernels/kda/reference.py) run on the GPU.

Method (docs/kernels.md §11): random inputs; `layers` independent layers (states, inputs, records) rotate so
their fp32 states (6.29 MB each) are >= 1.5x the L2 and every call streams its state from HBM;
CUDA events; warm-up first; median over repeats. Per-layer microseconds two ways:
  graph - one CUDA graph of a pass over all layers, replay time / layers (how a verify step runs);
  eager - the same calls launched from Python (adds host overhead where it exceeds GPU time).
Floor: verify reads the state once (6.29 MB), commit reads and writes it (12.6 MB); the bytes
over the measured read and copy ceilings give the floors printed beside the results.
fla's kernel is timed on pre-conv'd q/k/v (no conv, no gated RMSNorm, no records): it does less
work than our verify, and with output_final_state it writes the final state (a commit of all T).

Usage: python3 experiments/kda_bench.py [--tokens 8] [--verify-variants bv128_c2_r8_fast,...] [--out experiments/results/h200/kda_bench.json]
"""
import argparse
import json
import statistics
import threading
import time

import torch
from benchlib import module_version, provenance, read_ceiling, time_calls, write_json

from dspark.kernels import cute_common
from dspark.kernels.kda import cute_host as kda_cute
from dspark.kernels.kda import reference

HEADS, HEAD_DIM = 96, 128
LOWER_BOUND, EPS = -5.0, 1e-5


def time_per_call(calls, repeats: int = 20, graph: bool = True) -> dict:
    """Microseconds per call of a pass over `calls`, eagerly and as a CUDA graph (benchlib)."""
    return time_calls(calls, reps=len(calls), repeats=repeats, graph=graph)


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
    """Read (sum) and copy time of fp32 buffers of the state's size, rotated past the L2, and the
    pure-read ceiling of a large buffer (benchlib.read_ceiling)."""
    bufs = [torch.randn(nbytes // 4, device="cuda") for _ in range(copies)]
    outs = [torch.empty_like(b) for b in bufs]
    read = time_per_call([lambda b=b: b.sum() for b in bufs], graph=False)["eager_us"]
    copy = time_per_call([lambda b=b, o=o: o.copy_(b) for b, o in zip(bufs, outs)], graph=False)["eager_us"]
    return {"state_read_us": read, "state_copy_us": copy, **read_ceiling(1.0)}


def parse_variant(text: str, op: str) -> dict:
    """'bv128_c2_r8_fast_bulk' -> dict(block_v=128, cols=2, row_chunks=8, fast_math=True,
    bulk_state=True); flags fast, bulk, group (group_sync), pdl; commit has only bulk and pdl.
    Options not named are off."""
    fields = {"bv": "block_v", "c": "cols", "r": "row_chunks"}
    flags = {"bulk": "bulk_state", "pdl": "pdl"}
    if op == "verify":
        flags.update(fast="fast_math", group="group_sync")
    variant = {flag: False for flag in flags.values()}
    for part in text.split("_"):
        if part in flags:
            variant[flags[part]] = True
            continue
        name = next((n for n in sorted(fields, key=len, reverse=True) if part.startswith(n)), None)
        if name is None or not part[len(name):].isdigit():
            raise ValueError(f"variant={text!r}: cannot read {part!r} (bvN_cN_rN[_fast][_bulk][_group][_pdl])")
        variant[fields[name]] = int(part[len(name):])
    return variant


def verify_calls(layers, arch, variant, probes=None):
    """One verify call per layer into its own records/out (probe build if probes are given)."""
    calls = []
    records = []
    for i, x in enumerate(layers):
        _, rec = kda_cute.verify(*x.values(), lower_bound=LOWER_BOUND, eps=EPS, arch=arch, experimental_variant=True,
                                 **variant)
        out = torch.empty_like(x["q_in"])
        probe = None if probes is None else probes[i]
        calls.append(lambda x=x, r=rec, o=out, p=probe: kda_cute.verify(
            *x.values(), lower_bound=LOWER_BOUND, eps=EPS, arch=arch, records=r, out=o, probe=p,
            experimental_variant=True, **variant))
        records.append(rec)
    return calls, records


def check_against_reference(x, arch, variant) -> dict:
    """Relative errors of one layer's verify vs the float64 reference (a variant that is fast but
    wrong must show here, beside its time)."""
    out, rec = kda_cute.verify(*x.values(), lower_bound=LOWER_BOUND, eps=EPS, arch=arch, experimental_variant=True,
                               **variant)
    ref_in = {k: (v.double() if v.is_floating_point() and k != "state" else v) for k, v in x.items()}
    ref_out, ref_rec = reference.kda_verify(*ref_in.values(), lower_bound=LOWER_BOUND, eps=EPS)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    return {"out": rel(out, ref_out), "keys": rel(rec.keys, ref_rec.keys), "updates": rel(rec.updates, ref_rec.updates),
            "decays": rel(rec.decays, ref_rec.decays)}


PHASES = ("loads_conv_decay", "l2_norms", "recurrence", "rmsnorm_output")


def probe_phases(layers, arch, variant) -> dict:
    """Where a verify's time goes: the probe build (clock64 + %globaltimer at 5 points per CTA)
    replayed in a CUDA graph over all layers; medians over CTAs and layers of each phase's
    cycles, the SM clock inside the kernel (cycles / ns over the whole CTA), the CTA spread, and
    the gap between one layer's last CTA end and the next layer's first CTA start."""
    B, H = layers[0]["q_in"].shape[0], HEADS
    nv = HEAD_DIM // variant["block_v"]
    probes = [torch.zeros((B, H, nv, 10), device="cuda", dtype=torch.int64) for _ in layers]
    calls, _ = verify_calls(layers, arch, variant, probes)
    timing = time_per_call(calls)
    marks = torch.stack(probes).reshape(len(layers), -1, 10).double()  # [L, CTAs, 10]
    cycles, ns = marks[..., :5], marks[..., 5:]
    result = {"probe_build_time_us": timing}
    for i, name in enumerate(PHASES):
        result[f"{name}_cycles"] = (cycles[..., i + 1] - cycles[..., i]).median().item()
    result["cta_total_cycles"] = (cycles[..., 4] - cycles[..., 0]).median().item()
    result["cta_total_ns"] = (ns[..., 4] - ns[..., 0]).median().item()
    result["sm_clock_mhz_in_kernel"] = ((cycles[..., 4] - cycles[..., 0]) / (ns[..., 4] - ns[..., 0])).median().item() * 1e3
    result["cta_start_spread_ns"] = (ns[..., 0].max(1).values - ns[..., 0].min(1).values).median().item()
    result["kernel_span_ns"] = (ns[..., 4].max(1).values - ns[..., 0].min(1).values).median().item()
    result["gap_between_layers_ns"] = (ns[1:, :, 0].min(1).values - ns[:-1, :, 4].max(1).values).median().item()
    return result


def sample_clock_during(fn, seconds: float) -> dict:
    """SM clock (NVML via torch.cuda.clock_rate) read every ~5 ms while fn() runs back to back."""
    samples = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            samples.append(_sm_clock_mhz())
            time.sleep(0.005)

    thread = threading.Thread(target=poll)
    thread.start()
    start = time.time()
    while time.time() - start < seconds:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    stop.set()
    thread.join()
    numbers = [x for x in samples if isinstance(x, (int, float))]
    if not numbers:
        return {"sm_clock_mhz_during": samples[:1]}
    return {"sm_clock_mhz_during_median": statistics.median(numbers), "min": min(numbers), "max": max(numbers),
            "samples": len(numbers)}


def bench_commit(layers, records, accepted, arch, variant) -> dict:
    """Commit per layer: one launch for all layers (the intended use) and one launch per layer."""
    L = len(layers)
    scratch = [(x["state"].clone(), x["conv_state"].clone()) for x in layers]
    per_layer = [(lambda s=s, r=r: kda_cute.commit(s[0], s[1], r, accepted, arch=arch, **variant))
                 for s, r in zip(scratch, records)]
    stacked_states = torch.stack([s[0] for s in scratch])
    stacked_conv = torch.stack([s[1] for s in scratch])
    stacked_records = reference.KDARecords(
        *(torch.stack([getattr(r, n) for r in records]) for n in ("keys", "updates", "decays", "conv_inputs")),
        records[0].lengths)
    all_layers = time_per_call([lambda: kda_cute.commit_layers(stacked_states, stacked_conv, stacked_records,
                                                               accepted, arch=arch, **variant)])
    # the committed states of one launch from the initial states: every layout must give the same bits
    fresh = torch.stack([x["state"] for x in layers])
    fresh_conv = torch.stack([x["conv_state"] for x in layers])
    kda_cute.commit_layers(fresh, fresh_conv, stacked_records, accepted, arch=arch, **variant)
    return {"commit": time_per_call(per_layer),
            "commit_all_layers_one_launch": {k: (v / L if v is not None else v) for k, v in all_layers.items()},
            "committed": (fresh, fresh_conv)}


def fla_baseline(layers, B, T) -> dict:
    """fla's Triton recurrence on already-conv'd q/k/v (less work than ours, see the docstring)."""
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

        return {
            "output_only": time_per_call([lambda y=y: fla_call(y, False) for y in fla_inputs]),
            "with_final_state": time_per_call([lambda y=y: fla_call(y, True) for y in fla_inputs]),
        }
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def print_summary(rows: dict, B: int, T: int) -> None:
    """One line per measured row, after the JSON."""
    c = rows["ceilings"]
    print(f"\nK3 KDA layer, B={B} T={T}: state read {c['state_read_us']:.1f} us, copy {c['state_copy_us']:.1f} us "
          f"(read ceiling {c['read_ceiling_GBps']:.0f} GB/s). Per layer, us (graph / eager):")
    for name, row in rows.items():
        if not isinstance(row, dict):
            continue
        if "error" in row:
            print(f"{name:28s} {row['error']}")
        elif name.startswith("verify_"):
            t, e = row["time_us"], row["rel_error_vs_float64"]
            print(f"{name:28s} {t['graph_us'] or float('nan'):6.1f} / {t['eager_us']:6.1f}   "
                  f"err out {e['out']:.1e} u {e['updates']:.1e}")
        elif name.startswith("probe_"):
            print(f"{name:28s} " + " ".join(f"{p} {row[p + '_cycles']:.0f}" for p in PHASES)
                  + f" cyc; {row['sm_clock_mhz_in_kernel']:.0f} MHz, CTA {row['cta_total_ns']:.0f} ns, "
                  f"span {row['kernel_span_ns']:.0f} ns, gap {row['gap_between_layers_ns']:.0f} ns")
        elif name.startswith("commit_"):
            m, a = row["commit"], row["commit_all_layers_one_launch"]
            same = [v for k, v in row.items() if k.startswith("bitwise_equal")]
            print(f"{name:28s} per layer {m['graph_us'] or float('nan'):6.1f}   all layers in 1 launch "
                  f"{a['graph_us'] or float('nan'):6.1f}   same bits {same}")
        elif name.startswith("pair_"):
            print(f"{name:28s} verify+commit per layer {row['verify_plus_commit_per_layer_graph_us']:6.1f} "
                  f"(graph of verify, commit pairs; SM clock {row.get('sm_clock_mhz_during_median')} MHz)")
    print("fla", json.dumps(rows["fla_fused_recurrent_kda"]))
    print("torch reference", json.dumps(rows["torch_reference"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--verify-variants", default="bv128_c1_r4_fast,bv128_c1_r4_fast_bulk,bv128_c1_r4_fast_group,"
                        "bv128_c1_r4_fast_bulk_group,bv128_c1_r4_fast_bulk_group_pdl,bv128_c2_r8_fast_bulk_group",
                        help="comma-separated bvN_cN_rN[_fast][_bulk]: block_v, columns per thread, row chunks, fast "
                        "math, state copied by the TMA unit")
    parser.add_argument("--probe-variants", default="bv128_c1_r4_fast_bulk,bv128_c1_r4_fast_bulk_group",
                        help="verify variants also run as the probe build (phase breakdown)")
    parser.add_argument("--commit-variants", default="bv32_c1_r4,bv32_c1_r4_bulk,bv64_c1_r4_bulk,bv128_c1_r4_bulk")
    parser.add_argument("--pairs", default="default+default,bv128_c1_r4_fast_bulk_group_pdl+bv32_c1_r4_bulk_pdl",
                        help="verify+commit variants timed together (verify, commit, verify, ... over the layers)")
    parser.add_argument("--no-baselines", action="store_true",
                        help="skip fla and the torch reference (a second run for new variants only)")
    parser.add_argument("--out", default="experiments/results/h200/kda_bench.json")
    parser.add_argument("--commit", default=None, help="git commit of the tree (if git is not available here)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    started = time.time()
    arch = cute_common.target_arch()
    B, T, L = args.batch, args.tokens, args.layers
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [make_layer(B, T, gen) for _ in range(L)]
    state_bytes = B * HEADS * HEAD_DIM * HEAD_DIM * 4
    rows = {}
    result = {
        **provenance(args.commit), "fla": module_version("fla"), "arch": arch,
        "shape": {"batch": B, "tokens": T, "heads": HEADS, "head_dim": HEAD_DIM, "layers_rotated": L},
        "defaults": {"verify": kda_cute.default_variant(HEAD_DIM, "verify"),
                     "commit": kda_cute.default_variant(HEAD_DIM, "commit")},
        "rows": rows,
    }

    def save(section):
        print(json.dumps({section: rows[section]}), flush=True)
        result["seconds"] = time.time() - started
        write_json(args.out, result)

    rows["clock_before_warmup_mhz"] = _sm_clock_mhz()
    rows["warmup"] = warm_up_clocks(2.0)
    rows["ceilings"] = ceilings(state_bytes, L)
    save("ceilings")
    accepted = torch.full((B,), T, device="cuda", dtype=torch.int64)  # worst case: replay all T

    # verify variants: time per layer (graph / eager) and errors vs the float64 reference
    for name in args.verify_variants.split(","):
        key = f"verify_{name}"
        try:
            variant = parse_variant(name, "verify")
            calls, _ = verify_calls(layers, arch, variant)
            rows[key] = {"variant": variant, "time_us": time_per_call(calls),
                         "rel_error_vs_float64": check_against_reference(layers[0], arch, variant)}
        except Exception as exc:  # one failing variant must not hide the others
            rows[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        save(key)
    # commit variants replay the default verify's records
    _, records = verify_calls(layers, arch, {})
    first_committed = None
    for name in args.commit_variants.split(","):
        key = f"commit_{name}"
        try:
            variant = parse_variant(name, "commit")
            rows[key] = {"variant": variant, **bench_commit(layers, records, accepted, arch, variant)}
            committed = rows[key].pop("committed")
            first_committed = first_committed or (name, committed)
            rows[key][f"bitwise_equal_to_{first_committed[0]}"] = all(
                torch.equal(a, b) for a, b in zip(committed, first_committed[1]))
        except Exception as exc:
            rows[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        save(key)

    # verify then commit per layer in one graph (the default pair first), and the clock meanwhile
    for pair in args.pairs.split(","):
        key = f"pair_{pair}"
        try:
            verify_name, commit_name = pair.split("+")
            verify_variant = {} if verify_name == "default" else parse_variant(verify_name, "verify")
            commit_variant = {} if commit_name == "default" else parse_variant(commit_name, "commit")
            verifies, pair_records = verify_calls(layers, arch, verify_variant)
            scratch = [(x["state"].clone(), x["conv_state"].clone()) for x in layers]
            commits = [(lambda s=s, r=r: kda_cute.commit(s[0], s[1], r, accepted, arch=arch, **commit_variant))
                       for s, r in zip(scratch, pair_records)]
            timing = time_per_call([c for calls in zip(verifies, commits) for c in calls])
            rows[key] = {"verify": kda_cute.resolve_variant(HEAD_DIM, "verify", **verify_variant),
                         "commit": kda_cute.resolve_variant(HEAD_DIM, "commit", **commit_variant),
                         "per_call_us": timing,
                         "verify_plus_commit_per_layer_graph_us": 2 * (timing["graph_us"] or float("nan")),
                         **sample_clock_during(lambda: [c() for c in verifies], 0.2)}
        except Exception as exc:
            rows[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        save(key)

    if args.no_baselines:
        rows["fla_fused_recurrent_kda"] = {"error": "RuntimeError: skipped (--no-baselines)"}
    else:
        rows["fla_fused_recurrent_kda"] = fla_baseline(layers, B, T)
    save("fla_fused_recurrent_kda")

    # where verify's time goes (diagnostic builds, after the numbers that are reported)
    for name in args.probe_variants.split(","):
        key = f"probe_{name}"
        try:
            rows[key] = probe_phases(layers, arch, parse_variant(name, "verify"))
        except Exception as exc:
            rows[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        save(key)

    # the torch reference on the GPU (fp32 state, eager: it is many small kernels)
    try:
        if args.no_baselines:
            raise RuntimeError("skipped (--no-baselines)")
        def ref_pair(x):
            _, rec = reference.kda_verify(*x.values(), lower_bound=LOWER_BOUND, eps=EPS)
            reference.kda_commit(x["state"].clone(), x["conv_state"].clone(), rec, accepted)

        rows["torch_reference"] = time_per_call([lambda x=x: ref_pair(x) for x in layers[:4]], repeats=5, graph=False)
    except Exception as exc:
        rows["torch_reference"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    save("torch_reference")

    print_summary(rows, B, T)

if __name__ == "__main__":
    main()
