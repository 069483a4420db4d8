"""`dspark sweep`: tokens/s against acceptance length.

A grid over forced acceptance length (synthetic acceptance, vLLM's semantics), k, batch size and
verification policy on one target. Every point runs the real pipeline (draft, full-width verify,
accept, commit); only the acceptance decision is forced. Plain decoding (k = 0) is measured at each
batch size as the baseline for speedups.

Output (in --out, default runs/sweep-<target>): sweep.json, sweep.csv and sweep.png.
sweep.json schema:
  {"schema": "dspark.sweep/1",
   "meta": {"device", "device_name", "torch", "git_commit", "command", "created", "target",
            "context", "max_tokens", "warmup_steps"},
   "points": [{"key", "batch", "k", "policy", "al_target" (null for plain decoding),
               "al_measured", "tokens_per_s", "tpot_ms", "step_ms_p50", "step_ms_p90",
               "step_ms_mean", "split_ms": {"draft", "verify", "accept", "commit"} (mean per step),
               "steps", "output_tokens", "per_position_acceptance",
               for K3 presets also "floor_ms_h200" (bandwidth floor of the step on one H200 at
               4.3 TB/s) and "roofline_fraction" (floor / measured step time)}]}
The CSV has one row per point with the same fields (split_ms flattened to draft_ms, ...) and the
provenance (device, device_name, torch, git_commit, command) repeated on every row.
Points already in an existing sweep.json are skipped, so an interrupted sweep resumes.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .build import build_target, default_device, eos_ids
from .config import SamplingParams, SpecConfig
from .drafters.uniform import UniformDrafter
from .engine import Engine
from .metrics import SpecMetrics
from .sampling import acceptance_length_to_rates, conditional_rates

SCHEMA = "dspark.sweep/1"


def git_commit() -> str:
    """HEAD of the source checkout; DSPARK_GIT_COMMIT names it where the tree was copied without
    its .git (the GPU machine)."""
    if os.environ.get("DSPARK_GIT_COMMIT"):
        return os.environ["DSPARK_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_meta(device: str, **extra) -> dict:
    """Provenance recorded in every result file: device, versions, commit, command line."""
    dev = torch.device(device)
    return {
        "device": dev.type,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "command": " ".join(["dspark", *sys.argv[1:]]) if sys.argv and sys.argv[0].endswith("dspark") else " ".join(sys.argv),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


def point_key(batch: int, k: int, policy: str, al: float | None) -> str:
    return f"b{batch}-k{k}-{policy}-" + ("plain" if al is None else f"al{al:g}")


def measure_point(target, *, batch: int, k: int, al: float | None, policy: str, context: int,
                  max_tokens: int, warmup_steps: int, seed: int) -> dict:
    """Run one grid point on `target` and return its row."""
    if al is None:
        spec = SpecConfig(num_speculative_tokens=0, seed=seed)
    else:
        spec = SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                          synthetic_acceptance_length=al, verify_policy=policy, seed=seed)
    # With a confidence policy the drafter reports the synthetic conditional rates as its
    # confidences: exactly calibrated, so the policy's choices are the ones it would make for a
    # drafter whose acceptance really follows that curve.
    confidence = conditional_rates(acceptance_length_to_rates(al, k)) if al is not None else None
    drafter = UniformDrafter(target.vocab_size, confidence) if spec.max_k else None
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, target.vocab_size, (context,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0.0, ignore_eos=True)

    # One run; its first `warmup_steps` steps (allocation, caches, compilation, clock ramp-up)
    # stay out of the timings. One prefill per point: at long contexts prefill dominates a run.
    engine = Engine(target, drafter, spec, eos_token_ids=eos_ids(target))
    warm_tokens = warmup_steps * (spec.max_k + 1)
    engine.generate(prompts, SamplingParams(**{**params.__dict__, "max_tokens": max_tokens + warm_tokens}))
    m = engine.metrics
    warm = min(warmup_steps, len(m.step_seconds) - 1)
    return _row(m, batch=batch, k=k if al is not None else 0, al=al, policy=policy, warm=warm)


def _row(m: SpecMetrics, *, batch: int, k: int, al: float | None, policy: str, warm: int) -> dict:
    steps = m.step_seconds[warm:]
    decode_s = sum(steps)
    decode_tokens = sum(m.step_tokens[warm:])
    return {
        "key": point_key(batch, k, policy, al),
        "batch": batch,
        "k": k,
        "policy": policy,
        "al_target": al,
        "al_measured": m.acceptance_length,
        "tokens_per_s": decode_tokens / decode_s,
        "tpot_ms": 1e3 * decode_s / (decode_tokens / batch),
        "step_ms_p50": 1e3 * statistics.median(steps),
        "step_ms_p90": 1e3 * sorted(steps)[max(0, int(round(0.9 * len(steps))) - 1)],
        "step_ms_mean": 1e3 * decode_s / len(steps),
        "split_ms": {p: 1e3 * m.phase_seconds[p] / len(m.step_seconds) for p in ("draft", "verify", "accept", "commit")},
        "steps": len(steps),
        "output_tokens": m.num_output_tokens,
        "per_position_acceptance": m.per_position_acceptance,
    }


def measure_phases(target, *, batch: int, k: int, als: list[float], context: int, steps: int,
                   warmup_steps: int, seed: int) -> list[dict]:
    """Every point of one (batch, k) from ONE prefill: the requests stay live and the engine's
    acceptance is switched between phases of `warmup_steps + steps` steps (plain decoding first,
    then each forced AL). For long contexts, where a prefill costs far more than a phase, this is
    the affordable way; the context grows by the phases' few hundred tokens meanwhile."""
    spec = SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                      synthetic_acceptance_length=float(k + 1), seed=seed)
    engine = Engine(target, UniformDrafter(target.vocab_size), spec, eos_token_ids=eos_ids(target))
    gen = torch.Generator().manual_seed(seed)
    budget = target.max_seq_len - context - 1
    for _ in range(batch):
        engine.add_request(torch.randint(0, target.vocab_size, (context,), generator=gen).tolist(),
                           SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=budget))
    engine.step()  # prefill (and one step), outside every phase
    rows = []
    for al in [None, *als]:
        if al is None:
            engine.set_acceptance(SpecConfig(num_speculative_tokens=0, seed=seed))
        else:
            engine.set_acceptance(SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                                             synthetic_acceptance_length=al, seed=seed))
        engine.metrics = SpecMetrics()
        for _ in range(warmup_steps + steps):
            engine.step()
        rows.append(_row(engine.metrics, batch=batch, k=0 if al is None else k, al=al, policy="fixed", warm=warmup_steps))
    return rows


# The H200's measured read bandwidth (../shared/gpu/README.md: a 163840 x 7168 GEMV reads at
# 4.33 TB/s, a device copy moves 4.25 TB/s), the yardstick of the floors written beside results.
H200_READ_TBS = 4.3


def add_floor(point: dict, target_name: str, context: int) -> dict:
    """For K3-shaped targets: the bandwidth floor of the same step on one H200 (dspark.roofline,
    replay-style KDA state, no draft cost: the sweep's drafter costs nothing) and the measured
    step's fraction of it."""
    from .roofline import get_gpu, step_cost, step_time
    from .targets.kimi_k3.config import PRESETS

    cfg = PRESETS.get(target_name)
    if cfg is None:
        return point
    cost = step_cost(cfg, batch=point["batch"], tokens_per_request=point["k"] + 1, context=context, kda_state="replay")
    floor_ms = 1e3 * step_time(cost, get_gpu("h200", H200_READ_TBS))
    return {**point, "floor_ms_h200": floor_ms, "roofline_fraction": floor_ms / point["step_ms_mean"]}


def grid(ks, batches, als, policies) -> list[tuple[int, int, float | None, str]]:
    points = []
    for batch in batches:
        points.append((batch, 0, None, "fixed"))
        for k in ks:
            for policy in policies:
                points += [(batch, k, al, policy) for al in als if al <= k + 1]
    return points


def write_results(out: Path, meta: dict, points: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"schema": SCHEMA, "meta": meta, "points": points}, indent=1))
    provenance = {k: meta[k] for k in ("device", "device_name", "torch", "git_commit", "command")}
    fields = [f for f in points[0] if f not in ("split_ms", "per_position_acceptance")] + [
        f"{p}_ms" for p in ("draft", "verify", "accept", "commit")] + list(provenance)
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for p in points:
            row = {k: v for k, v in p.items() if k in fields}
            row.update({f"{ph}_ms": v for ph, v in p["split_ms"].items()}, **provenance)
            w.writerow(row)


def plot(out: Path, meta: dict, points: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for batch in sorted({p["batch"] for p in points}):
        plain = [p for p in points if p["batch"] == batch and p["al_target"] is None]
        for k in sorted({p["k"] for p in points if p["batch"] == batch and p["k"] > 0}):
            series = sorted((p for p in points if p["batch"] == batch and p["k"] == k and p["al_target"] is not None),
                            key=lambda p: p["al_measured"])
            ax.plot([p["al_measured"] for p in series], [p["tokens_per_s"] for p in series], "o-", label=f"batch {batch}, k={k}")
        if plain:
            ax.axhline(plain[0]["tokens_per_s"], ls="--", lw=1, color="gray")
            ax.annotate(f"plain decoding, batch {batch}", (1.0, plain[0]["tokens_per_s"]), fontsize=8, color="gray")
    ax.set_xlabel("acceptance length (tokens per verify step)")
    ax.set_ylabel("tokens/s (all requests)")
    ax.set_title(f"{meta['target']} on {meta['device_name']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = out / "sweep.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> list[int]:
    return [int(x) for x in _floats(text)]


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="default: k3-slice when CUDA is present, else k3-tiny")
    p.add_argument("--k", default="7", help="comma-separated k values")
    p.add_argument("--batch", default="1,4", help="comma-separated batch sizes")
    p.add_argument("--al", default="1,2,3,4,5,6,7,8", help="comma-separated forced acceptance lengths")
    p.add_argument("--policy", default="fixed", help="comma-separated verification policies")
    p.add_argument("--context", type=int, default=None, help="prompt length (default 32 on CPU, 8192 on CUDA)")
    p.add_argument("--max-tokens", type=int, default=None, help="--per-point: tokens per request (default 32 CPU / 64 CUDA)")
    p.add_argument("--warmup-steps", type=int, default=2, help="first steps of each point left out of the timings")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default runs/sweep-<target>)")
    p.add_argument("--per-point", action="store_true",
                   help="a fresh engine and prefill for every point (needed for policies other than "
                        "fixed); the default measures all ALs of a (batch, k) on one prefilled context, "
                        "in phases of --warmup-steps + --phase-steps steps")
    p.add_argument("--phase-steps", type=int, default=6)


def main(args) -> int:
    device = args.device or default_device()
    on_cuda = torch.device(device).type == "cuda"
    if not on_cuda:
        # The CPU targets run many tiny ops; OpenMP hand-offs between threads cost more than they
        # save (k3-tiny verify of 4 x 8 tokens: 2.4 s with 2 threads on a busy 2-core machine,
        # 0.25 s with 1).
        torch.set_num_threads(1)
    target_name = args.target or ("k3-slice" if on_cuda else "k3-tiny")
    context = args.context or (8192 if on_cuda else 32)
    max_tokens = args.max_tokens or (64 if on_cuda else 32)
    ks, batches, als, policies = _ints(args.k), _ints(args.batch), _floats(args.al), [s for s in args.policy.split(",") if s]
    for bad in [k for k in ks if k < 1]:
        raise ValueError(f"--k {bad}: each k must be >= 1 (plain decoding is always measured)")
    out = Path(args.out or f"runs/sweep-{target_name}")
    done: dict[str, dict] = {}
    if (out / "sweep.json").exists():
        previous = json.loads((out / "sweep.json").read_text())
        done = {p["key"]: p for p in previous["points"]}
    meta = run_meta(device, target=target_name, context=context, max_tokens=max_tokens, warmup_steps=args.warmup_steps)
    if args.per_point:
        seq_len = context + max_tokens + (max(ks) + 1) * (args.warmup_steps + 1) + 2
    else:
        if policies != ["fixed"]:
            raise ValueError(f"--policy {args.policy}: policies other than fixed need --per-point")
        seq_len = context + (len(als) + 1) * (args.warmup_steps + args.phase_steps) * (max(ks) + 1) + (max(ks) + 1) + 2
    target = build_target(target_name, max_slots=max(batches), max_seq_len=seq_len, device=device, seed=args.seed)

    def save(points: list[dict]) -> None:  # after every measurement, so an interruption loses little
        write_results(out, meta, points)

    if args.per_point:
        points = _sweep_points(target, target_name, grid(ks, batches, als, policies), done, save, args, context, max_tokens)
    else:
        points = _sweep_phases(target, target_name, batches, ks, als, done, save, args, context)
    save(points)
    png = plot(out, meta, points)
    _print_table(points)
    print(f"wrote {out / 'sweep.json'}, {out / 'sweep.csv'}, {png}")
    return 0


def _sweep_points(target, target_name, points_todo, done, save, args, context, max_tokens) -> list[dict]:
    """--per-point: a fresh engine and prefill for each grid point not already done."""
    points = [done[point_key(b, k, pol, al)] for b, k, al, pol in points_todo if point_key(b, k, pol, al) in done]
    todo = [pt for pt in points_todo if point_key(pt[0], pt[1], pt[3], pt[2]) not in done]
    for batch, k, al, policy in tqdm(todo, desc=f"sweep {target_name}", unit="point", disable=None):
        point = measure_point(target, batch=batch, k=k, al=al, policy=policy, context=context,
                              max_tokens=max_tokens, warmup_steps=args.warmup_steps, seed=args.seed)
        points.append(add_floor(point, target_name, context))
        save(points)
    return points


def _sweep_phases(target, target_name, batches, ks, als, done, save, args, context) -> list[dict]:
    """Default: every AL of a (batch, k) in phases on one prefill, for each pair not fully done."""
    points = list(done.values())
    pending = [(b, k) for b in batches for k in ks
               if any(point_key(b, k, "fixed", al) not in done for al in als if al <= k + 1)]
    for batch, k in tqdm(pending, desc=f"sweep {target_name} (one prefill per batch and k)", disable=None):
        rows = measure_phases(target, batch=batch, k=k, als=[a for a in als if a <= k + 1], context=context,
                              steps=args.phase_steps, warmup_steps=args.warmup_steps, seed=args.seed)
        fresh = [add_floor(r, target_name, context) for r in rows]
        points = [p for p in points if p["key"] not in {r["key"] for r in fresh}] + fresh
        save(points)
    return points


def _print_table(points: list[dict]) -> None:
    print(f"{'batch':>5} {'k':>3} {'AL set':>7} {'AL got':>7} {'tok/s':>9} {'TPOT ms':>8} {'p50 ms':>7} {'p90 ms':>7}")
    for p in sorted(points, key=lambda p: (p["batch"], p["k"], p["al_target"] or 0)):
        al = "plain" if p["al_target"] is None else f"{p['al_target']:g}"
        print(f"{p['batch']:>5} {p['k']:>3} {al:>7} {p['al_measured']:>7.2f} {p['tokens_per_s']:>9.1f} "
              f"{p['tpot_ms']:>8.2f} {p['step_ms_p50']:>7.2f} {p['step_ms_p90']:>7.2f}")


if __name__ == "__main__":  # pragma: no cover
    from .cli import main as cli_main

    raise SystemExit(cli_main(["sweep", *sys.argv[1:]]))
