"""`dspark sweep --backend vllm`: tokens/s against synthetic acceptance length, measured by vLLM.

One vllm.LLM per (k, AL) with synthetic acceptance (rejection_sample_method="synthetic",
docs/vllm-integration.md §1.3), each batch size measured by one generate() call. Speed is
decode-only, like the dspark backend: tokens after each request's first one, over the time from the
first request's first token to the last token (vLLM's per-request timestamps), so prefill and time to
first token stay out; TPOT per request is vLLM bench's (last token - first token) / (tokens - 1).
Acceptance comes from vLLM's spec-decode counters (llm.get_metrics()).

Output in --out: sweep-vllm.json and .csv, and sweep.png drawn by dspark.sweep.plot (the same
figure as the dspark backend). Besides dspark's keys every point carries the names
`vllm bench serve` users know: spec_decode_acceptance_length, spec_decode_acceptance_rate (%),
mean/p50/p90/p99_tpot_ms.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from dspark.config import SpecConfig
from dspark.files import write_atomic

from .convert import convert, from_vllm_config, speculative_config_json, vllm_only_fields
from .validate import vllm_importable

SCHEMA = "dspark.sweep-vllm/2"

# vLLM's spec-decode counters as LLM.get_metrics() names them (docs/vllm-integration.md §4.1;
# "_total" is only added at Prometheus scrape time).
SPEC_DECODE_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                        "vllm:spec_decode_num_accepted_tokens")
SPEC_DECODE_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
# Engine settings the sweep sets itself (per point, or from its own flags).
_SWEEP_OWNS = ("model", "speculative_config", "seed")


def spec_decode_counts(metrics) -> dict:
    """Sum vLLM's spec-decode counters over their labels (engines): {"num_drafts", "num_draft_tokens",
    "num_accepted_tokens", "accepted_per_pos": [..]} from an LLM.get_metrics() snapshot."""
    counts = {name.removeprefix("vllm:spec_decode_"): 0 for name in SPEC_DECODE_COUNTERS}
    per_pos: list[int] = []
    for metric in metrics:
        if metric.name in SPEC_DECODE_COUNTERS:
            counts[metric.name.removeprefix("vllm:spec_decode_")] += int(metric.value)
        elif metric.name == SPEC_DECODE_PER_POSITION:
            values = list(metric.values)
            per_pos = [a + b for a, b in zip(per_pos + [0] * (len(values) - len(per_pos)), values)]
    counts["accepted_per_pos"] = per_pos
    return counts


def count_difference(after: dict, before: dict) -> dict:
    """Counters of one measurement: vLLM's counters are cumulative over the LLM's lifetime."""
    out = {name: after[name] - before[name] for name in after if name != "accepted_per_pos"}
    pos_before = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], pos_before)]
    return out


def acceptance_summary(counts: dict) -> dict:
    """Mean acceptance length (bonus token included: 1 + accepted / drafts), acceptance rate and
    per-position acceptance (accepted at position i / drafts), as vLLM's own logger computes them
    (docs/vllm-integration.md §4.1), under dspark's names and under `vllm bench serve`'s."""
    drafts = counts["num_drafts"]
    if drafts == 0:
        return {"al_measured": None, "draft_tokens_per_draft": None, "acceptance_rate": None,
                "per_position_acceptance": [], "spec_decode_acceptance_length": None,
                "spec_decode_acceptance_rate": None}
    length = 1.0 + counts["num_accepted_tokens"] / drafts
    rate = counts["num_accepted_tokens"] / max(counts["num_draft_tokens"], 1)
    return {
        "al_measured": length,
        # below k when the drafter proposed short drafts (n-gram without a long enough match)
        "draft_tokens_per_draft": counts["num_draft_tokens"] / drafts,
        "acceptance_rate": rate,
        "per_position_acceptance": [a / drafts for a in counts["accepted_per_pos"]],
        "spec_decode_acceptance_length": length,
        "spec_decode_acceptance_rate": 100.0 * rate,
    }


def decode_timing(requests: list[tuple[float, float, int]], batch: int) -> dict:
    """Decode-only speed from per-request (first_token_ts, last_token_ts, output tokens).

    tokens_per_s: tokens after each request's first, over first first-token to last last-token.
    tpot_ms: the dspark backend's definition (decode time / decode tokens per request);
    mean/p50/p90/p99_tpot_ms: vLLM bench's per-request TPOT statistics."""
    decode_tokens = sum(n - 1 for _, _, n in requests)
    window = max(last for _, last, _ in requests) - min(first for first, _, _ in requests)
    if decode_tokens <= 0 or window <= 0:
        raise ValueError(f"max_tokens: each request needs at least 2 output tokens to time decoding (got {requests})")
    tpots = sorted(1e3 * (last - first) / (n - 1) for first, last, n in requests if n > 1)
    return {
        "tokens_per_s": decode_tokens / window,
        "decode_s": window,
        "tpot_ms": 1e3 * window / (decode_tokens / batch),
        "mean_tpot_ms": statistics.fmean(tpots),
        # numpy's default (linear) percentile, which vLLM bench uses
        **{f"p{q}_tpot_ms": float(np.percentile(tpots, q)) for q in (50, 90, 99)},
    }


def synthetic_prompts(batch: int, context: int, vocab_size: int, seed: int) -> list[dict]:
    """Token-id prompts of a short repeated pattern per request: the n-gram drafter then always
    finds a continuation, so it proposes k tokens every step and synthetic acceptance decides the rest."""
    import random

    rng = random.Random(seed)
    prompts = []
    for _ in range(batch):
        period = [rng.randrange(100, max(101, vocab_size - 100)) for _ in range(8)]
        prompts.append({"prompt_token_ids": (period * (context // len(period) + 1))[:context]})
    return prompts


def sweep_points(ks: list[int], als: list[float]) -> list[tuple[int, float | None]]:
    """(k, AL) engine configurations: plain decoding (k = 0) and every AL reachable with k (<= k + 1)."""
    return [(0, None)] + [(k, al) for k in ks for al in als if 1 <= al <= k + 1]


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """The `dspark sweep` flags of the vLLM backend, and `--speculative-config` for both backends."""
    parser.add_argument("--backend", choices=("dspark", "vllm"), default="dspark",
                        help="dspark: our engine; vllm: drive vllm.LLM with synthetic acceptance (needs a GPU; "
                             "--target is then a model vLLM loads)")
    parser.add_argument("--drafter-path", default=None,
                        help="--backend vllm: a DSpark drafter for the target (vLLM method dspark); "
                             "default: vLLM's n-gram drafter on repetitive prompts")
    parser.add_argument("--engine-args", default="",
                        help="--backend vllm: vLLM engine flags, parsed by vLLM's own EngineArgs parser, e.g. --engine-args="
                             "'--tensor-parallel-size 8 --trust-remote-code --kv-cache-dtype fp8 "
                             "--gpu-memory-utilization 0.9' (the sweep sets the model, speculative config and seed)")
    parser.add_argument("--speculative-config", default=None,
                        help="a vLLM speculative_config JSON: its num_speculative_tokens is the k, its "
                             "synthetic_acceptance_length the AL, enable_adaptive_verification the scheduler "
                             "policy, its model the drafter (instead of --k/--al/--policy/--drafter-path)")


# What each backend takes from a --speculative-config; a forced-AL sweep ignores the rest (and says
# so): the dspark backend drafts zero-cost uniform tokens, and both force synthetic acceptance.
_SWEEP_READS = ("num_speculative_tokens", "synthetic_acceptance_length", "enable_adaptive_verification")
_VLLM_BACKEND_ALSO_READS = ("method", "model", "draft_sample_method", "prompt_lookup_min", "prompt_lookup_max")


def apply_speculative_config(args: argparse.Namespace, defaults: dict) -> None:
    """Fold `--speculative-config` into the sweep's own flags (k, AL, policy; the drafter path for
    the vLLM backend), and say on one stderr line which of its fields the sweep ignores. A
    production config (`dspark vllm-config`'s output, `--extra` fields included) is taken as it
    is; a flag given both ways and a field vLLM has never had are refused."""
    if args.speculative_config is None:
        return
    config = speculative_config_json(args.speculative_config)
    vllm_only = vllm_only_fields(config)
    spec, _ = from_vllm_config({name: value for name, value in config.items() if name not in vllm_only})
    reads = _SWEEP_READS + (_VLLM_BACKEND_ALSO_READS + tuple(vllm_only) if args.backend == "vllm" else ())
    if spec.rejection_sample_method == "synthetic":
        reads += ("rejection_sample_method",)
    ignored = [f"{name}={json.dumps(value)}" for name, value in config.items() if name not in reads]
    if ignored:
        why = ("it forces synthetic acceptance at each --al" if args.backend == "vllm" else
               "it drafts zero-cost uniform tokens and forces synthetic acceptance at each --al")
        print(f"dspark sweep: note: --speculative-config: a forced-AL sweep ignores {', '.join(ignored)} ({why})",
              file=sys.stderr)
    folded = {"k": str(spec.num_speculative_tokens), "policy": spec.verify_policy}
    if args.backend == "vllm":
        folded["drafter_path"] = spec.drafter_path
    if spec.synthetic_acceptance_length is not None:
        folded["al"] = f"{spec.synthetic_acceptance_length:g}"
    for name, value in folded.items():
        given = getattr(args, name)
        if given != defaults[name] and given != value:
            raise ValueError(f"--{name.replace('_', '-')} {given} and --speculative-config (which sets it to "
                             f"{value}): give it one way")
        setattr(args, name, value)


def engine_kwargs(target: str, flags: str) -> dict:
    """The EngineArgs fields that `flags` (vLLM CLI syntax) set away from vLLM's defaults, parsed
    by vLLM's own parser (so every engine flag of the installed vLLM works and bad ones fail there)."""
    from vllm.engine.arg_utils import EngineArgs
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older releases keep it in vllm.utils
        from vllm.utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="dspark sweep --engine-args"))
    argv = shlex.split(flags)
    owned = [arg for arg in argv if arg.split("=")[0].lstrip("-").replace("-", "_") in _SWEEP_OWNS]
    if owned:
        raise ValueError(f"--engine-args {flags!r}: {owned} are set by the sweep itself (use --target, "
                         "--speculative-config or --drafter-path, --seed)")
    try:
        parsed = EngineArgs.from_cli_args(parser.parse_args(["--model", target, *argv]))
    except SystemExit:
        raise ValueError(f"--engine-args {flags!r}: vLLM's EngineArgs parser rejects it (message above)") from None
    # the parser's own defaults, which differ from the dataclass's for a few fields
    default = EngineArgs.from_cli_args(parser.parse_args(["--model", target]))
    return {f.name: getattr(parsed, f.name) for f in dataclasses.fields(EngineArgs)
            if f.name != "model" and getattr(parsed, f.name) != getattr(default, f.name)}


def _check_ready(args) -> str | None:
    """Why the vLLM sweep cannot run here, before anything loads; None when it can."""
    import torch

    if not torch.cuda.is_available():
        return ("dspark sweep --backend vllm needs a CUDA GPU: the vLLM engine cannot run on this machine "
                "(the PyPI vLLM wheel has no CPU kernels; docs/vllm-integration.md §5.3). No model was loaded. "
                "Use --backend dspark here, or run on a GPU machine.")
    if not vllm_importable():
        return "dspark sweep --backend vllm needs the vllm package (pip install vllm); no model was loaded"
    if args.target is None:
        return ("--target: the vLLM backend needs a model vLLM can load (a Hugging Face name or local directory), "
                "e.g. --target Qwen/Qwen3-8B")
    return None


def _point_configs(args, ks: list[int], als: list[float]) -> dict:
    """Every speculative config of the grid, checked by our own rules before the first model loads.
    The settings of a --speculative-config that the grid does not vary (draft_sample_method, the
    n-gram window, ...) are kept."""
    config = speculative_config_json(args.speculative_config) if args.speculative_config else {}
    extra = vllm_only_fields(config)  # vLLM's own fields, passed on as they came
    base = from_vllm_config({n: v for n, v in config.items() if n not in extra})[0] if config else SpecConfig()
    configs = {}
    for k, al in sweep_points(ks, als):
        if k == 0:
            continue
        spec = dataclasses.replace(base, num_speculative_tokens=k, drafter="dspark" if args.drafter_path else "ngram",
                                   drafter_path=args.drafter_path, rejection_sample_method="synthetic",
                                   synthetic_acceptance_length=al, synthetic_acceptance_rates=None,
                                   verify_policy=args.policy or "fixed", seed=args.seed)
        configs[(k, al)] = convert(spec, extra=extra).config
    return configs


def main(args) -> int:
    """Run the grid; results in --out/sweep-vllm.json, .csv and sweep.png. Stops with one line
    before anything loads when there is no GPU, no vLLM or no target."""
    why = _check_ready(args)
    if why:
        raise ValueError(why)
    ks = [int(x) for x in args.k.split(",") if x]
    batches = [int(x) for x in args.batch.split(",") if x]
    als = [float(x) for x in args.al.split(",") if x]
    for bad in [k for k in ks if k < 1]:
        raise ValueError(f"--k {bad}: each k must be >= 1 (plain decoding is always measured)")
    spec_configs = _point_configs(args, ks, als)
    engine = engine_kwargs(args.target, args.engine_args)
    context = args.context or 1024
    max_tokens = args.max_tokens or 256
    out = Path(args.out or f"runs/sweep-vllm-{Path(args.target).name}")
    out.mkdir(parents=True, exist_ok=True)

    from dspark.sweep import plot, run_meta

    import vllm

    meta = run_meta("cuda", target=args.target, backend="vllm", vllm=vllm.__version__, context=context,
                    max_tokens=max_tokens, drafter_path=args.drafter_path, engine_args=args.engine_args)
    points: list[dict] = []

    def record(point: dict) -> None:  # saved after every point, so an interruption loses little
        points.append(point)
        write_results(out, meta, points)

    for k, al in sweep_points(ks, als):
        _measure_engine(args, engine, spec_configs.get((k, al)), k, al, batches, context, max_tokens, record)
    png = plot(out, meta, points)
    print(f"wrote {out / 'sweep-vllm.json'}, {out / 'sweep-vllm.csv'}, {png}")
    return 0


def _measure_engine(args, engine: dict, spec_config: dict | None, k: int, al: float | None, batches: list[int],
                    context: int, max_tokens: int, record) -> None:
    """Every batch size on one vllm.LLM (one speculative config), each point given to `record`."""
    import gc

    import torch
    from vllm import LLM, SamplingParams as VllmSamplingParams

    settings = {"disable_log_stats": False, "max_num_seqs": max(batches),
                "max_model_len": context + max_tokens + 16, **engine}
    llm = LLM(model=args.target, speculative_config=spec_config, seed=args.seed, **settings)
    vocab = llm.model_config.get_vocab_size()
    sampling = VllmSamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for batch in batches:
        prompts = synthetic_prompts(batch, context, vocab, args.seed + batch)
        llm.generate(prompts[:1], VllmSamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
        before = spec_decode_counts(llm.get_metrics())
        start = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        elapsed = time.perf_counter() - start
        counts = count_difference(spec_decode_counts(llm.get_metrics()), before)
        if any(o.metrics is None for o in outputs):
            raise ValueError("vLLM returned no per-request timestamps (RequestOutput.metrics), so decode-only "
                             "speed cannot be told apart from prefill; keep disable_log_stats off in --engine-args")
        timing = decode_timing([(o.metrics.first_token_ts, o.metrics.last_token_ts, len(o.outputs[0].token_ids))
                                for o in outputs], batch)
        point = {"key": f"b{batch}-k{k}-fixed-" + ("plain" if al is None else f"al{al:g}"), "batch": batch, "k": k,
                 "policy": "fixed", "al_target": al, **timing, "elapsed_s": elapsed,
                 "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                 **counts, **acceptance_summary(counts)}
        if point["al_measured"] is None:  # plain decoding: one token per step
            point["al_measured"] = 1.0
        record(point)
        print(f"batch {batch:>3} k {k} AL set {'plain' if al is None else f'{al:g}':>5} got {point['al_measured']:.2f}  "
              f"{point['tokens_per_s']:.1f} tok/s decode  TPOT p50 {point['p50_tpot_ms']:.2f} ms", flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def write_results(out: Path, meta: dict, points: list[dict]) -> None:
    if not points:
        return
    write_atomic(out / "sweep-vllm.json", json.dumps({"schema": SCHEMA, "meta": meta, "points": points},
                                                            indent=1))
    fields = [f for f in points[0] if f not in ("accepted_per_pos", "per_position_acceptance")]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields + ["per_position_acceptance"])
    writer.writeheader()
    for p in points:
        writer.writerow({**{name: p.get(name) for name in fields},
                         "per_position_acceptance": " ".join(f"{a:.4f}" for a in p["per_position_acceptance"])})
    write_atomic(out / "sweep-vllm.csv", buffer.getvalue())
